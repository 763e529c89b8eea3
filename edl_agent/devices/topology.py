"""Accelerator topology: how each pair of a node's devices is connected, and which CPUs and NUMA
nodes are near each device. Pure data, assembly and rendering; the facts are read by
`topology_read.py` (sysfs, KFD, npu-smi) and `nvidia_topology.py` (NVML).

A pair of devices has a PCIe path (how far apart they are on the PCIe tree and across NUMA
nodes, nearest first: PIX, PXB, PHB, NODE, SYS) and may have a direct link (NVLink, HCCS, HCCS
through a switch, SIO between the dies of one Ascend NPU, UB, xGMI, XPU Link). The matrix shows
the link where there is one and the path otherwise, as `nvidia-smi topo -m` does; the JSON keeps
both and names where each fact came from. Nothing is made up: a link whose source gives no count
has none, and a path nothing tells is N/A.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from edl_agent.devices.model import Device, LinkKind, Vendor


class PciePath(enum.StrEnum):
    """How far apart two devices are over PCIe, nearest first."""

    PIX = "PIX"
    PXB = "PXB"
    PHB = "PHB"
    NODE = "NODE"
    SYS = "SYS"


class Source(enum.StrEnum):
    """Where a fact came from."""

    NVML = "nvml"
    NPU_SMI = "npu-smi"  # `npu-smi info -t topo`
    KFD = "kfd"  # the kernel's KFD topology, /sys/class/kfd/kfd/topology
    SYSFS_PCI = "sysfs-pci"  # the PCI tree under /sys/devices
    SYSFS_NUMA = "sysfs-numa"  # NUMA nodes only: NODE then means "same NUMA node", maybe nearer
    SYSFS = "sysfs"  # the device's local_cpulist or numa_node, or its NUMA node's cpulist


LEGEND: Mapping[str, str] = {
    "X": "the device itself",
    "SYS": "PCIe, then the interconnect between NUMA nodes (sockets)",
    "NODE": "PCIe, then the interconnect between host bridges of one NUMA node",
    "PHB": "PCIe through a host bridge (the CPU's root complex)",
    "PXB": "PCIe through several bridges or switches, not through a host bridge",
    "PIX": "PCIe through at most one bridge or switch",
    "NV#": "a bond of # NVLinks",
    "HCCS": "an HCCS link (npu-smi gives no link count)",
    "HCCS_SW": "HCCS through an HCCS switch (npu-smi gives no link count)",
    "SIO": "the SIO bus between the two dies of one NPU",
    "UB": "Ascend's unified bus (npu-smi gives no link count)",
    "XGMI": "an xGMI link in the KFD topology (no link count)",
    "XL#": "a bond of # XPU Links",
    "N/A": "not known",
}
_LINK_CODES = {
    LinkKind.NVLINK: "NV",
    LinkKind.HCCS: "HCCS",
    LinkKind.HCCS_SW: "HCCS_SW",
    LinkKind.SIO: "SIO",
    LinkKind.UB: "UB",
    LinkKind.XGMI: "XGMI",
    LinkKind.XPU_LINK: "XL",
}
_LABELS = {Vendor.NVIDIA: "GPU", Vendor.KUNLUNXIN: "XPU", Vendor.HYGON: "DCU", Vendor.ASCEND: "NPU"}
_HOST_BRIDGE = re.compile(r"^pci[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}$")  # pci0000:17
_PCI_ADDRESS = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_CPU_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


@dataclass(frozen=True)
class PciLocation:
    """Where a PCI device hangs: its host bridge (`pci0000:17`) and the bridges between it and the
    device, top down (root port, switch ports), as its directory under /sys/devices shows."""

    host_bridge: str
    bridges: tuple[str, ...] = ()


@dataclass(frozen=True)
class Placement:
    """What sysfs says about one device: its PCI location, NUMA node and nearby CPUs."""

    device: Device
    pci: PciLocation | None = None
    numa_node: int | None = None
    cpus: frozenset[int] | None = None


@dataclass(frozen=True)
class PairFacts:
    """How two devices are connected. `link_count` None with a link: the source does not count."""

    path: PciePath | None = None
    path_source: Source | None = None
    link: LinkKind | None = None
    link_count: int | None = None
    link_source: Source | None = None


@dataclass(frozen=True)
class VendorTopology:
    """What one vendor's library or tool tells about its own devices (by device id); whatever it
    does not tell is taken from sysfs. `known` says in one line what this vendor's source gives."""

    vendor: Vendor
    known: str
    source: Source | None = None  # of `cpus` and `numa`
    pairs: Mapping[frozenset[str], PairFacts] = field(default_factory=dict)
    cpus: Mapping[str, frozenset[int]] = field(default_factory=dict)
    numa: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class TopologyDevice:
    device: Device
    label: str  # GPU0, NPU3: the matrix's row and column name
    cpus: frozenset[int] | None = None
    cpus_source: Source | None = None
    numa: tuple[int, ...] | None = None
    numa_source: Source | None = None


@dataclass(frozen=True)
class Topology:
    node: str
    devices: tuple[TopologyDevice, ...]
    pairs: Mapping[frozenset[str], PairFacts]
    vendors: tuple[VendorTopology, ...] = ()

    def facts(self, a: str, b: str) -> PairFacts:
        return self.pairs.get(frozenset((a, b)), PairFacts())

    def cell(self, a: str, b: str) -> str:
        return "X" if a == b else cell_text(self.facts(a, b))

    def to_json(self) -> dict[str, Any]:
        ids = [d.device.id for d in self.devices]
        return {
            "node": self.node,
            "devices": [_device_json(d) for d in self.devices],
            "pairs": [
                _pair_json(a, b, self.facts(a.device.id, b.device.id))
                for i, a in enumerate(self.devices)
                for b in self.devices[i + 1 :]
            ],
            "matrix": {
                "labels": [d.label for d in self.devices],
                "rows": [[self.cell(a, b) for b in ids] for a in ids],
            },
            "vendors": [
                {"vendor": v.vendor.value, "known": v.known, "error": v.error} for v in self.vendors
            ],
            "legend": dict(LEGEND),
        }


def label_of(device: Device) -> str:
    return f"{_LABELS[device.vendor]}{device.index}"


def cell_text(facts: PairFacts) -> str:
    """The matrix cell: the direct link if any (`NV18`, `HCCS`), else the PCIe path, else N/A."""
    if facts.link is not None:
        return _LINK_CODES[facts.link] + (str(facts.link_count) if facts.link_count else "")
    return facts.path.value if facts.path is not None else "N/A"


def pci_location(sysfs_path: str) -> PciLocation | None:
    """The location of a PCI device from the real path of its sysfs directory
    (`/sys/devices/pci0000:17/0000:17:01.0/0000:18:00.0`); None where the path shows no host
    bridge (a directory that is not in the PCI tree)."""
    parts = [part for part in sysfs_path.split("/") if part]
    starts = [i for i, part in enumerate(parts) if _HOST_BRIDGE.match(part)]
    if not starts or not parts or not _PCI_ADDRESS.match(parts[-1]) or starts[0] >= len(parts) - 1:
        return None
    first = starts[0]
    bridges = tuple(part.lower() for part in parts[first + 1 : -1] if _PCI_ADDRESS.match(part))
    return PciLocation(host_bridge=parts[first].lower(), bridges=bridges)


def pcie_path(a: Placement, b: Placement) -> tuple[PciePath | None, Source | None]:
    """The PCIe path between two devices from what sysfs says: their PCI tree where both are
    in it, else their NUMA nodes alone (then SYS across nodes and NODE within one, although
    the two may sit nearer). None where neither tells."""
    if a.pci is not None and b.pci is not None:
        if a.pci.host_bridge == b.pci.host_bridge:
            return _below_host_bridge(a.pci.bridges, b.pci.bridges), Source.SYSFS_PCI
        if a.numa_node is None or b.numa_node is None:
            return None, None
        return (PciePath.NODE if a.numa_node == b.numa_node else PciePath.SYS), Source.SYSFS_PCI
    if a.numa_node is None or b.numa_node is None:
        return None, None
    return (PciePath.NODE if a.numa_node == b.numa_node else PciePath.SYS), Source.SYSFS_NUMA


def _below_host_bridge(a: tuple[str, ...], b: tuple[str, ...]) -> PciePath:
    common = 0
    for upper_a, upper_b in zip(a, b, strict=False):
        if upper_a != upper_b:
            break
        common += 1
    if common == 0:
        return PciePath.PHB  # different root ports of one host bridge
    # Paths that part at most one level below the shared bridge cross one switch (its upstream
    # port and two downstream ports) or one bridge; deeper partings cross several.
    return PciePath.PIX if max(len(a), len(b)) - common <= 1 else PciePath.PXB


def assemble(
    *, node: str, placements: Sequence[Placement], vendors: Sequence[VendorTopology]
) -> Topology:
    """The node's topology: each vendor's own facts first, sysfs for everything they leave out.
    Pairs of devices of different vendors are known from sysfs only."""
    by_vendor = {v.vendor: v for v in vendors}
    devices = tuple(_topology_device(p, by_vendor.get(p.device.vendor)) for p in placements)
    pairs: dict[frozenset[str], PairFacts] = {}
    for i, a in enumerate(placements):
        for b in placements[i + 1 :]:
            key = frozenset((a.device.id, b.device.id))
            own = by_vendor.get(a.device.vendor) if a.device.vendor is b.device.vendor else None
            facts = own.pairs.get(key, PairFacts()) if own is not None else PairFacts()
            if facts.path is None:
                path, source = pcie_path(a, b)
                facts = dataclasses.replace(facts, path=path, path_source=source)
            pairs[key] = facts
    return Topology(node=node, devices=devices, pairs=pairs, vendors=tuple(vendors))


def _topology_device(placement: Placement, vendor: VendorTopology | None) -> TopologyDevice:
    device = placement.device
    cpus, cpus_source = placement.cpus, Source.SYSFS if placement.cpus else None
    numa: tuple[int, ...] | None = None
    if placement.numa_node is not None:
        numa = (placement.numa_node,)
    numa_source = Source.SYSFS if numa is not None else None
    if vendor is not None and vendor.cpus.get(device.id):
        cpus, cpus_source = vendor.cpus[device.id], vendor.source
    if vendor is not None and vendor.numa.get(device.id):
        numa, numa_source = vendor.numa[device.id], vendor.source
    return TopologyDevice(
        device=device,
        label=label_of(device),
        cpus=cpus,
        cpus_source=cpus_source,
        numa=numa,
        numa_source=numa_source,
    )


def parse_cpulist(text: str) -> frozenset[int]:
    """A cpulist as sysfs and vendor tools print it (`0-23,48-71`); ValueError if malformed."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        match = _CPU_RANGE.match(part.strip())
        if match is None:
            msg = f"bad CPU list {text.strip()!r}"
            raise ValueError(msg)
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            msg = f"bad CPU range {part.strip()!r}"
            raise ValueError(msg)
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """`0-23,48-71`: ascending ranges, the form sysfs, nvidia-smi and npu-smi print."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def render_matrix(topology: Topology) -> str:
    """The matrix as `nvidia-smi topo -m` lays it out, then the legend of the codes it shows and
    what each vendor's source gives."""
    if not topology.devices:
        return f"node {topology.node}: no accelerators"
    ids = [d.device.id for d in topology.devices]
    header = ["", *(d.label for d in topology.devices), "CPU Affinity", "NUMA Affinity"]
    rows = [header]
    for device in topology.devices:
        cpus = format_cpulist(device.cpus) if device.cpus else "N/A"
        numa = format_cpulist(device.numa) if device.numa else "N/A"
        rows.append([device.label, *(topology.cell(device.device.id, b) for b in ids), cpus, numa])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    shown = {_legend_key(topology.facts(a, b)) for a in ids for b in ids if a != b}
    lines += ["", "Legend:", ""]
    listed = [code for code in LEGEND if code in ("X", *PciePath) or code in shown]
    width = max(len(code) for code in listed)
    lines += [f"  {code.ljust(width)} = {LEGEND[code]}" for code in listed]
    lines += ["", "Sources:"]
    lines += [f"  {v.vendor.value}: {v.known}" for v in topology.vendors]
    if any(f.link is None and f.path_source is Source.SYSFS_NUMA for f in topology.pairs.values()):
        lines.append(
            "  sysfs: paths from NUMA nodes alone where no PCI tree is shown; "
            "NODE there may be nearer (PHB, PXB, PIX)"
        )
    lines += [f"error {v.vendor.value}: {v.error}" for v in topology.vendors if v.error]
    return "\n".join(lines)


def _legend_key(facts: PairFacts) -> str:
    if facts.link is not None:
        return _LINK_CODES[facts.link] + ("#" if facts.link_count else "")
    return facts.path.value if facts.path is not None else "N/A"


def _device_json(device: TopologyDevice) -> dict[str, Any]:
    return {
        "label": device.label,
        "id": device.device.id,
        "vendor": device.device.vendor.value,
        "index": device.device.index,
        "pci_bus_id": device.device.pci_bus_id,
        "cpu_affinity": format_cpulist(device.cpus) if device.cpus else None,
        "cpu_affinity_source": device.cpus_source,
        "numa_affinity": list(device.numa) if device.numa else None,
        "numa_affinity_source": device.numa_source,
    }


def _pair_json(a: TopologyDevice, b: TopologyDevice, facts: PairFacts) -> dict[str, Any]:
    link = None
    if facts.link is not None:
        link = {"kind": facts.link.value, "count": facts.link_count, "source": facts.link_source}
    return {
        "devices": [a.label, b.label],
        "ids": [a.device.id, b.device.id],
        "cell": cell_text(facts),
        "pcie": facts.path,
        "pcie_source": facts.path_source,
        "link": link,
    }
