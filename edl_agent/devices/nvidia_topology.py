"""NVIDIA topology through NVML: the PCIe common ancestor of each pair of GPUs, each GPU's CPU and
NUMA affinity, and the NVLink counts that discovery already read into `Device.links`.

Topology is per physical GPU: MIG devices share their GPU's links and placement.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pynvml

from edl_agent.devices import nvidia
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, LinkKind, Vendor
from edl_agent.devices.topology import PairFacts, PciePath, Source, VendorTopology

KNOWN = (
    "NVML: NVLink counts between GPUs, PCIe common ancestor, CPU and NUMA affinity "
    "(links through NVSwitches are not counted)"
)
CPU_SET_WORDS = 64  # 64-bit words: room for 4096 CPUs
NODE_SET_WORDS = 16  # 1024 NUMA nodes
_WORD_BITS = 64
# nvmlGpuTopologyLevel_t; INTERNAL is two GPUs on one board, which share a single bridge.
LEVELS = {
    pynvml.NVML_TOPOLOGY_INTERNAL: PciePath.PIX,
    pynvml.NVML_TOPOLOGY_SINGLE: PciePath.PIX,
    pynvml.NVML_TOPOLOGY_MULTIPLE: PciePath.PXB,
    pynvml.NVML_TOPOLOGY_HOSTBRIDGE: PciePath.PHB,
    pynvml.NVML_TOPOLOGY_NODE: PciePath.NODE,
    pynvml.NVML_TOPOLOGY_SYSTEM: PciePath.SYS,
}
_UNAVAILABLE = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)


def read_topology(root: HostRoot, devices: Sequence[Device]) -> VendorTopology:
    """What NVML tells about the physical GPUs among `devices` (found by UUID)."""
    gpus = [d for d in devices if d.vendor is Vendor.NVIDIA and d.parent is None]
    links = _nvlink_pairs(gpus)
    library = nvidia.find_library(root)
    if library is None:
        return _report(links, error=f"{nvidia.LIBRARY} not found under {root.root}")
    errors: list[str] = []
    try:
        with nvidia.nvml_session(library):
            handles = _handles(gpus, errors)
            cpus = _per_gpu(gpus, handles, _cpu_affinity, "CPU affinity", errors)
            numa = _per_gpu(gpus, handles, _numa_affinity, "NUMA affinity", errors)
            paths = _common_ancestors(gpus, handles, errors)
    except OSError as exc:
        return _report(links, error=f"cannot load {library}: {exc}")
    except pynvml.NVMLError as exc:
        return _report(links, error=f"NVML initialisation failed ({library}): {exc}")
    pairs = {
        key: PairFacts(
            path=paths.get(key),
            path_source=Source.NVML if key in paths else None,
            link=LinkKind.NVLINK if key in links else None,
            link_count=links.get(key),
            link_source=Source.NVML if key in links else None,
        )
        for key in paths.keys() | links.keys()
    }
    return VendorTopology(
        vendor=Vendor.NVIDIA,
        known=KNOWN,
        source=Source.NVML,
        pairs=pairs,
        cpus={gpu: frozenset(found) for gpu, found in cpus.items() if found},
        numa={gpu: tuple(sorted(found)) for gpu, found in numa.items() if found},
        error="; ".join(errors) or None,
    )


def _report(links: dict[frozenset[str], int], *, error: str) -> VendorTopology:
    """Only the NVLink counts discovery read, when NVML cannot be opened again."""
    pairs = {
        key: PairFacts(link=LinkKind.NVLINK, link_count=count, link_source=Source.NVML)
        for key, count in links.items()
    }
    return VendorTopology(vendor=Vendor.NVIDIA, known=KNOWN, pairs=pairs, error=error)


def _nvlink_pairs(gpus: Sequence[Device]) -> dict[frozenset[str], int]:
    """NVLink count per pair of GPUs from discovery's links (each GPU lists its peers)."""
    ids = {gpu.id for gpu in gpus}
    counts: dict[frozenset[str], int] = {}
    for gpu in gpus:
        for link in gpu.links:
            if link.kind is LinkKind.NVLINK and link.peer in ids and link.count > 0:
                counts[frozenset((gpu.id, link.peer))] = link.count
    return counts


def _handles(gpus: Sequence[Device], errors: list[str]) -> dict[str, Any]:
    handles = {}
    for gpu in gpus:
        try:
            handles[gpu.id] = pynvml.nvmlDeviceGetHandleByUUID(gpu.id)
        except pynvml.NVMLError as exc:
            errors.append(f"GPU {gpu.index}: {exc}")
    return handles


def _per_gpu(
    gpus: Sequence[Device],
    handles: dict[str, Any],
    query: Callable[[Any], set[int]],
    what: str,
    errors: list[str],
) -> dict[str, set[int]]:
    found = {}
    for gpu in gpus:
        if gpu.id not in handles:
            continue
        try:
            found[gpu.id] = query(handles[gpu.id])
        except _UNAVAILABLE:
            continue  # an older driver or a platform without it: sysfs tells instead
        except pynvml.NVMLError as exc:
            errors.append(f"GPU {gpu.index} {what}: {exc}")
    return found


def _cpu_affinity(handle: Any) -> set[int]:
    return mask_bits(pynvml.nvmlDeviceGetCpuAffinity(handle, CPU_SET_WORDS))


def _numa_affinity(handle: Any) -> set[int]:
    scope = pynvml.NVML_AFFINITY_SCOPE_NODE
    return mask_bits(pynvml.nvmlDeviceGetMemoryAffinity(handle, NODE_SET_WORDS, scope))


def mask_bits(words: Iterable[int]) -> set[int]:
    """The set bits of NVML's affinity masks (arrays of 64-bit words, lowest word first)."""
    return {
        word_index * _WORD_BITS + bit
        for word_index, word in enumerate(words)
        for bit in range(_WORD_BITS)
        if int(word) >> bit & 1
    }


def _common_ancestors(
    gpus: Sequence[Device], handles: dict[str, Any], errors: list[str]
) -> dict[frozenset[str], PciePath]:
    paths = {}
    present = [gpu for gpu in gpus if gpu.id in handles]
    for i, a in enumerate(present):
        for b in present[i + 1 :]:
            try:
                level = pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[a.id], handles[b.id])
            except _UNAVAILABLE:
                continue
            except pynvml.NVMLError as exc:
                errors.append(f"GPU {a.index}-{b.index} common ancestor: {exc}")
                continue
            if level in LEVELS:
                paths[frozenset((a.id, b.id))] = LEVELS[level]
    return paths
