"""The NVIDIA part of a simulated node: the fake NVML library and its data, device nodes, sysfs.

The library is copied to `/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1` and reads
`libnvidia-ml.so.1.sim` next to it, and faults from the append-only `libnvidia-ml.so.1.faults`
(see edl_agent/sim/inject.py); both formats are described at the top of fake_nvml.c.
"""

from __future__ import annotations

import hashlib
import itertools
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pynvml

from edl_agent.sim import fake_lib_build
from edl_agent.sim.files import VENDOR_SLOT, write_file
from edl_agent.sim.profile import (
    GpuSpec,
    NvidiaSpec,
    Profile,
    numa_cpulist,
    numa_node_of,
    pci_bus_id,
    stable_uuid,
)

LIBRARY = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
DATA = LIBRARY + ".sim"
FAULTS = LIBRARY + ".faults"
CONTROL_NODES = (
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia-modeset",
)
NVLINK_SLOTS = 18  # links per GPU on Hopper; fewer are used when the profile asks for fewer
MAX_NVLINKS = 36  # NVML_NVLINK_MAX_LINKS, the fake library's table size
MAX_MIG_DEVICES = 7


@dataclass(frozen=True)
class SimMig:
    index: int
    uuid: str
    name: str
    memory_mib: int
    gpu_instance: int


@dataclass(frozen=True)
class SimGpu:
    index: int
    uuid: str
    spec: GpuSpec
    bus_id: str  # sysfs form, 0000:18:00.0
    numa_node: int
    serial: str
    migs: tuple[SimMig, ...]

    @property
    def mig_mode(self) -> str:
        if self.migs:
            return "enabled"
        return "disabled" if self.spec.mig_capable else "unsupported"


def write(spec: NvidiaSpec, profile: Profile, root: Path) -> None:
    gpus = simulated_gpus(spec, profile)
    install_library(root)
    write_file(root, DATA, render_data(spec, gpus))
    (root / FAULTS.lstrip("/")).unlink(missing_ok=True)  # a rebuilt node starts without faults
    for gpu in gpus:
        write_file(root, f"/dev/nvidia{gpu.index}", mode=0o666)
        sysfs = f"/sys/bus/pci/devices/{gpu.bus_id}"
        write_file(root, f"{sysfs}/numa_node", f"{gpu.numa_node}\n")
        write_file(root, f"{sysfs}/vendor", "0x10de\n")
        write_file(root, f"{sysfs}/class", f"0x{PCI_CLASS_3D:06x}\n")
        write_file(root, f"{sysfs}/config").write_bytes(pci_config_header(PCI_CLASS_3D))
    for node in CONTROL_NODES:
        write_file(root, node, mode=0o666)
    write_file(root, SMI, SMI_SCRIPT, mode=0o755)
    write_file(
        root,
        "/proc/driver/nvidia/version",
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {spec.driver_version}  (simulated)\n",
    )


PCI_CLASS_3D = 0x030200  # a 3D controller: a data-centre GPU, or any GPU in compute mode
PCI_CLASS_VGA = 0x030000  # a VGA controller: a GPU in graphics mode
PCI_HEADER_SIZE = 64


def pci_config_header(pci_class: int, *, capabilities: int = 0x60) -> bytes:
    """A GPU's PCI configuration space as sysfs shows it to a reader without CAP_SYS_ADMIN, the
    agent's default: the 64-byte header only (NVIDIA's vendor id, the class code, a status
    saying a capability list starts at `capabilities`), so nothing after it can be read."""
    header = bytearray(PCI_HEADER_SIZE)
    header[0:2] = (0x10DE).to_bytes(2, "little")
    header[6] = 0x10  # status: capability list present
    header[9:12] = pci_class.to_bytes(3, "little")  # programming interface, subclass, class
    header[0x34] = capabilities
    return bytes(header)


SMI = "/usr/bin/nvidia-smi"
# Only the reset the agent's remediation runs: it records the reset in the fake library's fault
# file, and the library decides what it reaches (not a lost GPU, not one that needs a reboot).
SMI_SCRIPT = """#!/bin/sh
# nvidia-smi stand-in for a simulated node: `--gpu-reset -i <index>` (or `-r -i <index>`) only.
here=$(dirname "$0")
faults="$here/../lib/x86_64-linux-gnu/libnvidia-ml.so.1.faults"
data="$here/../lib/x86_64-linux-gnu/libnvidia-ml.so.1.sim"
case "$1 $2" in
  "--gpu-reset -i" | "-r -i") gpu=$3 ;;
  *) echo "nvidia-smi (simulated): only --gpu-reset -i <index> is supported: $*" >&2; exit 2 ;;
esac
case "$gpu" in "" | *[!0-9]*) echo "nvidia-smi (simulated): bad GPU index: $gpu" >&2; exit 2 ;; esac
if ! grep -q "^gpu	index=$gpu	" "$data"; then
  echo "No devices were found with index $gpu" >&2; exit 6
fi
printf 'reset gpu=%s\n' "$gpu" >> "$faults"
echo "GPU 00000000:00:00.0 was successfully reset."
"""


def install_library(root: Path) -> None:
    """Copy the cached library into the tree as a new file (a rename, never an overwrite in
    place: a process that has the old file loaded would see its code change under it)."""
    built = fake_lib_build.library_path()
    local = root / LIBRARY.lstrip("/")
    local.parent.mkdir(parents=True, exist_ok=True)
    staging = local.with_name(f".{local.name}.tmp")
    shutil.copyfile(built, staging)
    staging.chmod(0o755)
    staging.replace(local)


def simulated_gpus(spec: NvidiaSpec, profile: Profile) -> list[SimGpu]:
    specs = [group for group in spec.gpus for _ in range(group.count)]
    return [
        SimGpu(
            index=index,
            uuid="GPU-" + stable_uuid(profile.id_seed, "gpu", index),
            spec=group,
            bus_id=pci_bus_id(VENDOR_SLOT["nvidia"], index),
            numa_node=numa_node_of(index, len(specs), profile.node.numa_nodes),
            serial=_serial(profile.id_seed, index),
            migs=_migs(profile.id_seed, index, group),
        )
        for index, group in enumerate(specs)
    ]


def _serial(seed: str, index: int) -> str:
    digest = hashlib.sha256(f"{seed}/serial/{index}".encode()).hexdigest()
    return "165" + str(int(digest, 16) % 10**10).zfill(10)


def _migs(seed: str, gpu_index: int, group: GpuSpec) -> tuple[SimMig, ...]:
    profiles = [mig for mig in group.mig for _ in range(mig.count)]
    if len(profiles) > MAX_MIG_DEVICES:
        msg = f"GPU {gpu_index}: {len(profiles)} MIG devices, a GPU holds at most {MAX_MIG_DEVICES}"
        raise ValueError(msg)
    return tuple(
        SimMig(
            index=index,
            uuid="MIG-" + stable_uuid(seed, "mig", gpu_index, index),
            name=f"{group.name} MIG {mig.profile}",
            memory_mib=mig.memory_mib,
            gpu_instance=index + 1,  # distinct ids; real placement rules are not simulated
        )
        for index, mig in enumerate(profiles)
    )


def nvlink_pairs(mode: str, count: int) -> list[tuple[int, int]]:
    if mode == "all":
        return list(itertools.combinations(range(count), 2))
    if mode == "pairs":
        return [(i, i + 1) for i in range(0, count - 1, 2)]
    return []


def _nvlinks(spec: NvidiaSpec, gpus: list[SimGpu]) -> dict[int, list[int]]:
    """For each GPU, the peer index at the other end of each of its links, in link order."""
    peers: dict[int, list[int]] = {gpu.index: [] for gpu in gpus}
    for a, b in nvlink_pairs(spec.nvlink, len(gpus)):
        peers[a].extend([b] * spec.nvlink_links)
        peers[b].extend([a] * spec.nvlink_links)
    for index, links in peers.items():
        if len(links) > MAX_NVLINKS:
            msg = f"GPU {index}: {len(links)} NVLinks, NVML reports at most {MAX_NVLINKS}"
            raise ValueError(msg)
    return peers


def render_data(spec: NvidiaSpec, gpus: list[SimGpu]) -> str:
    return "".join(line + "\n" for line in _records(spec, gpus))


def _records(spec: NvidiaSpec, gpus: list[SimGpu]) -> Iterator[str]:
    nvml_version = f"{spec.cuda_driver_version // 1000}.{spec.driver_version}"
    yield "# fake NVML data, written by edl_agent/sim/nvidia_tree.py"
    yield data_record("format", version=1)
    yield data_record(
        "system", driver=spec.driver_version, nvml=nvml_version, cuda=spec.cuda_driver_version
    )
    links = _nvlinks(spec, gpus)
    for gpu in gpus:
        yield data_record(
            "gpu",
            index=gpu.index,
            uuid=gpu.uuid,
            name=gpu.spec.name,
            memory_mib=gpu.spec.memory_mib,
            bus_id=nvml_bus_id(gpu.bus_id),
            minor=gpu.index,
            numa_node=gpu.numa_node,
            compute_capability=gpu.spec.compute_capability,
            architecture=_architecture(gpu.spec.architecture),
            brand=_brand(gpu.spec.name),
            serial=gpu.serial,
            mig=gpu.mig_mode,
            power_limit_w=gpu.spec.power_limit_w,
            nvlinks=max(NVLINK_SLOTS, len(links[gpu.index])) if spec.nvlink != "none" else 0,
            cpus=numa_cpulist(gpu.numa_node),
        )
        for mig in gpu.migs:
            yield data_record(
                "mig",
                gpu=gpu.index,
                index=mig.index,
                uuid=mig.uuid,
                name=mig.name,
                memory_mib=mig.memory_mib,
                gpu_instance=mig.gpu_instance,
                compute_instance=0,
            )
        for link, peer in enumerate(links[gpu.index]):
            yield data_record(
                "nvlink", gpu=gpu.index, link=link, remote=nvml_bus_id(gpus[peer].bus_id)
            )


def data_record(kind: str, **fields: object) -> str:
    for key, value in fields.items():
        if any(c in str(value) for c in "\t\n\r"):
            msg = f"{kind} {key}: tabs and line breaks cannot be stored in the fake NVML data"
            raise ValueError(msg)
    return "\t".join([kind, *(f"{key}={value}" for key, value in fields.items())])


def nvml_bus_id(sysfs_bus_id: str) -> str:
    """`0000:18:00.0` as NVML writes it: `00000000:18:00.0`."""
    domain, rest = sysfs_bus_id.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


def _architecture(name: str) -> int:
    value = getattr(pynvml, f"NVML_DEVICE_ARCH_{name.upper()}", None)
    if not isinstance(value, int):
        msg = f"unknown GPU architecture {name!r} (NVML knows e.g. volta, ampere, hopper)"
        raise ValueError(msg)
    return value


def _brand(name: str) -> int:
    if name.startswith("Tesla"):
        return int(pynvml.NVML_BRAND_TESLA)
    if name.startswith("Quadro"):
        return int(pynvml.NVML_BRAND_QUADRO)
    return int(pynvml.NVML_BRAND_NVIDIA)
