"""Simulated-node profiles: YAML files in `edl_agent/sim/profiles/`, loaded into typed specs.

A profile describes hardware (what a node has), not what the agent should conclude: the tree
builders turn it into device files, sysfs attributes, vendor-tool stand-ins and the fake NVML
library's data, and discovery then reads that tree exactly as it reads a real node.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any, Literal

import yaml

from edl_agent.errors import UsageError
from edl_agent.typed import SchemaError, build

PROFILE_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")


class ProfileError(UsageError):
    """A profile that is unknown or malformed; the message names the profile and the key."""


@dataclass(frozen=True)
class NodeSpec:
    hostname: str
    machine: str = "Simulated Server"
    numa_nodes: int = 1
    # Mixed into the simulated devices' ids (uuids, serials) so that nodes built from one
    # profile differ; empty: the profile's own ids, the same on every build.
    id_scope: str = ""

    def check(self) -> None:
        if self.numa_nodes < 1:
            raise ValueError("numa_nodes: must be at least 1")


@dataclass(frozen=True)
class MigSpec:
    """`count` MIG devices of one profile (e.g. `3g.40gb`) on each GPU of the group."""

    profile: str
    memory_mib: int
    count: int = 1
    slices: int = 1  # compute slices (the `Ng` of the profile)


@dataclass(frozen=True)
class GpuSpec:
    """`count` identical GPUs."""

    name: str
    memory_mib: int
    count: int = 1
    compute_capability: str = "9.0"
    architecture: str = "hopper"
    mig_capable: bool = False
    mig: tuple[MigSpec, ...] = ()
    power_limit_w: int = 700

    def check(self) -> None:
        if self.count < 1:
            raise ValueError("count: must be at least 1")
        if not re.fullmatch(r"\d+\.\d+", self.compute_capability):
            raise ValueError("compute_capability: expected MAJOR.MINOR such as 9.0")
        if self.mig and not self.mig_capable:
            raise ValueError("mig: MIG devices need mig_capable: true")


@dataclass(frozen=True)
class NvidiaSpec:
    driver_version: str
    cuda_driver_version: int  # as NVML reports it: 12040 means CUDA 12.4
    gpus: tuple[GpuSpec, ...]
    nvlink: Literal["none", "all", "pairs"] = "none"
    nvlink_links: int = 1  # NVLink links between each connected pair


@dataclass(frozen=True)
class XpuSpec:
    product: str
    memory_mib: int
    count: int = 1


@dataclass(frozen=True)
class KunlunxinSpec:
    """`minor_numbers`: N of /dev/xpu<N> for each XPU in xpu-smi's (PCI) order, where it is not
    that order; the default numbers them 0, 1, 2, ..."""

    driver_version: str
    xpus: tuple[XpuSpec, ...]
    minor_numbers: tuple[int, ...] = ()

    def check(self) -> None:
        count = sum(group.count for group in self.xpus)
        if self.minor_numbers and sorted(self.minor_numbers) != list(range(count)):
            raise ValueError(f"minor_numbers: a permutation of 0-{count - 1}, one per XPU")


@dataclass(frozen=True)
class DcuSpec:
    product: str
    memory_mib: int
    compute_units: int
    count: int = 1


@dataclass(frozen=True)
class HygonSpec:
    """`tool`: hy-smi, or DTK's rocm-smi on older nodes without hy-smi. `json_style`: `strict` as
    rocm-smi prints it, or `bw` as hy-smi prints it on BW nodes (missing commas, repeated `"": ""`
    keys, `PCI Bus` values carrying serial number and OAM id)."""

    driver_version: str
    dcus: tuple[DcuSpec, ...]
    tool: Literal["hy-smi", "rocm-smi"] = "hy-smi"
    json_style: Literal["strict", "bw"] = "strict"


@dataclass(frozen=True)
class NpuSpec:
    """`count` identical NPUs (cards), each with `chips` chips: 2 for an Atlas A3 NPU (two dies)
    or an Atlas 300I Duo card (two 310P chips)."""

    product: str  # chip name as npu-smi prints it: 910B3, Ascend910 (A3), 310P3
    memory_mib: int
    count: int = 1
    chips: int = 1
    npu_ids: tuple[int, ...] = ()  # NPU ids as npu-smi numbers the cards; default consecutive
    first_npu_id: int = 0
    ddr_mib: int = 0  # the Memory-Usage total npu-smi prints beside HBM (910A)

    def check(self) -> None:
        if self.count < 1 or self.chips < 1:
            raise ValueError("count and chips: must be at least 1")
        if self.npu_ids and len(self.npu_ids) != self.count:
            raise ValueError("npu_ids: one per NPU (count)")


@dataclass(frozen=True)
class AscendSpec:
    driver_version: str
    npus: tuple[NpuSpec, ...]
    hccs: Literal["none", "all"] = "none"  # all: HCCS between every pair (a full mesh)


@dataclass(frozen=True)
class Profile:
    description: str
    node: NodeSpec
    nvidia: NvidiaSpec | None = None
    kunlunxin: KunlunxinSpec | None = None
    hygon: HygonSpec | None = None
    ascend: AscendSpec | None = None
    # Agent settings this profile is meant to be shown with (e.g. cGPU sharing); applied below
    # the config file, environment and flags.
    config: dict[str, Any] = field(default_factory=dict)
    name: str = ""

    @property
    def id_seed(self) -> str:
        """What the simulated devices' ids derive from: the profile's name, and the node's
        `id_scope` when it has one."""
        return f"{self.name}@{self.node.id_scope}" if self.node.id_scope else self.name

    def on_node(self, name: str) -> Profile:
        """This profile as the node `name`: that hostname, and device ids of its own (two nodes
        of one profile then share no GPU uuid)."""
        node = replace(self.node, hostname=name, id_scope=name)
        return replace(self, node=node)


def profile_names() -> list[str]:
    directory = resources.files("edl_agent.sim") / "profiles"
    return sorted(
        p.name.removesuffix(".yaml") for p in directory.iterdir() if p.name.endswith(".yaml")
    )


def load_profile(name: str) -> Profile:
    if not PROFILE_NAME.match(name) or name not in profile_names():
        known = ", ".join(profile_names())
        msg = f"unknown profile {name!r} (known: {known})"
        raise ProfileError(msg)
    text = (resources.files("edl_agent.sim") / "profiles" / f"{name}.yaml").read_text("utf-8")
    return parse_profile(name, text)


def parse_profile(name: str, text: str) -> Profile:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        msg = f"profile {name}:{where}: {problem}"
        raise ProfileError(msg) from None
    if isinstance(data, dict):
        data = {**data, "name": name}
    try:
        return build(Profile, data)
    except SchemaError as exc:
        msg = f"profile {name}: {exc}"
        raise ProfileError(msg) from None


# Deterministic per-device facts, shared by the tree builders so that every run of a profile gives
# the same ids (tests and people can rely on them).


def stable_uuid(*parts: object) -> str:
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return str(uuid.UUID(bytes=digest[:16], version=4))


CPUS_PER_NUMA_NODE = 32


def numa_cpulist(numa: int) -> str:
    """The CPUs of NUMA node `numa` of a simulated node, as sysfs lists them (`32-63`)."""
    first = numa * CPUS_PER_NUMA_NODE
    return f"{first}-{first + CPUS_PER_NUMA_NODE - 1}"


def numa_node_of(index: int, count: int, numa_nodes: int) -> int:
    """Spread `count` devices evenly over the NUMA nodes, lower indexes on lower nodes."""
    return index * numa_nodes // max(count, 1)


def pci_bus_id(vendor_slot: int, index: int) -> str:
    """A sysfs-style PCI address (`0000:18:00.0`), distinct per vendor slot and device index.

    Vendors get separate PCI domains so that a mixed node never shows two devices at one address.
    """
    bus, slot = divmod(0x18 + index * 0x08, 0x100)
    return f"{vendor_slot:04x}:{slot:02x}:{bus:02x}.0"
