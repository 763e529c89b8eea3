"""Read a node's accelerator topology: each vendor's own source, and sysfs for every device.

Per vendor:
- NVIDIA: NVML (nvidia_topology.py).
- Ascend: `npu-smi info -t topo` (HCCS, HCCS_SW, SIO and UB links and PCIe paths between NPUs,
  each NPU's CPU affinity).
- Hygon: xGMI links between DCUs from the KFD topology's io_links.
- Kunlunxin: nothing of its own; XPU Links are not read.
- Every device: its PCI location, NUMA node and nearby CPUs from sysfs, which give the paths no
  vendor source tells (and every path between devices of different vendors).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import structlog

from edl_agent.devices import ascend, hygon, nvidia_topology
from edl_agent.devices.hostroot import HostRoot, ToolError, parse_numa_node
from edl_agent.devices.model import Device, Inventory, LinkKind, Vendor
from edl_agent.devices.topology import (
    PairFacts,
    PciePath,
    Placement,
    Source,
    Topology,
    VendorTopology,
    assemble,
    parse_cpulist,
    pci_location,
)
from edl_agent.devices.unreadable import warn_unreadable

NUMA_NODES = "/sys/devices/system/node"
KFD_IOLINK_XGMI = 11  # CRAT_IOLINK_TYPE_XGMI in the kernel's KFD topology
ASCEND_KNOWN = (
    "npu-smi info -t topo: HCCS, HCCS_SW, SIO and UB links (not counted) and PCIe paths between "
    "NPUs, CPU affinity where printed; NUMA affinity from sysfs"
)
HYGON_KNOWN = "KFD topology: xGMI links between DCUs (not counted); PCIe paths and NUMA from sysfs"
KUNLUNXIN_KNOWN = "no XPU Link information is read; PCIe paths, CPU and NUMA affinity from sysfs"
_PATHS = {path.value: path for path in PciePath}
_ASCEND_LINKS = {
    "HCCS": LinkKind.HCCS,
    "HCCS_SW": LinkKind.HCCS_SW,  # through an HCCS switch (Atlas A3)
    "SIO": LinkKind.SIO,  # the two dies of one A3 NPU
    "UB": LinkKind.UB,  # unified bus (Atlas 350)
}

Reader = Callable[[HostRoot, Sequence[Device]], VendorTopology]


def read_topology(root: HostRoot, inventory: Inventory) -> Topology:
    """The topology of the inventory's physical devices (MIG devices and other partitions are
    their parent's) as the host under `root` shows it."""
    devices = [d for d in inventory.devices if d.parent is None]
    nodes = _numa_nodes(root)
    placements = [placement(root, device, nodes) for device in devices]
    vendors = []
    for vendor, reader in READERS.items():
        own = [d for d in devices if d.vendor is vendor]
        if own:
            vendors.append(reader(root, own))
    for report in vendors:
        if report.error:
            structlog.get_logger().warning(
                "topology source failed", vendor=report.vendor.value, error=report.error
            )
    return assemble(node=inventory.node, placements=placements, vendors=vendors)


def placement(root: HostRoot, device: Device, numa_nodes: Sequence[int] = ()) -> Placement:
    """Where sysfs puts a device. A device without a NUMA node on a host with a single one is on
    that one (the kernel leaves numa_node at -1 where there is no choice)."""
    numa = device.numa_node
    if numa is None and len(numa_nodes) == 1:
        numa = numa_nodes[0]
    if device.pci_bus_id is None:
        return Placement(device=device, numa_node=numa, cpus=_node_cpus(root, numa))
    directory = f"/sys/bus/pci/devices/{device.pci_bus_id}"
    if numa is None:
        numa = parse_numa_node(root.read_optional(f"{directory}/numa_node"))
    cpus = _cpulist(root.read_optional(f"{directory}/local_cpulist"))
    return Placement(
        device=device,
        pci=pci_location(_real_host_path(root, directory)),
        numa_node=numa,
        cpus=cpus or _node_cpus(root, numa),
    )


def _real_host_path(root: HostRoot, host_path: str) -> str:
    """The host path that `host_path` resolves to (sysfs links are relative, so they stay under
    the root); empty when it resolves outside the root."""
    try:
        return "/" + str(root.path(host_path).resolve().relative_to(root.root))
    except (OSError, ValueError):
        return ""


def _numa_nodes(root: HostRoot) -> list[int]:
    names = [path.rsplit("/", 1)[-1] for path in root.glob(NUMA_NODES, "node[0-9]*")]
    return [int(name[4:]) for name in names if name[4:].isdigit()]


def _node_cpus(root: HostRoot, numa: int | None) -> frozenset[int] | None:
    if numa is None:
        return None
    return _cpulist(root.read_optional(f"{NUMA_NODES}/node{numa}/cpulist"))


def _cpulist(text: str | None) -> frozenset[int] | None:
    if not text:
        return None
    try:
        return parse_cpulist(text) or None
    except ValueError:
        return None


def read_ascend(root: HostRoot, npus: Sequence[Device]) -> VendorTopology:
    """Links and PCIe paths from `npu-smi info -t topo`. Its `NPU<i>` is the NPU id that
    `npu-smi info` prints (the `npu_id` attribute; the device index when the table is missing):
    NPU ids of multi-chip cards name no single device and are left out. Its `Phy-ID<n>` (Atlas A3)
    is the die, N of /dev/davinci<N>: the device index."""
    try:
        topo = root.read_tool(ascend.TOOL, ascend.TOPO_ARGS, ascend.parse_npu_smi_topo)
    except ToolError as exc:
        return VendorTopology(vendor=Vendor.ASCEND, known=ASCEND_KNOWN, error=str(exc))
    warn_unreadable(structlog.get_logger(), f"{ascend.TOOL} info -t topo", topo.problems)
    device = _ascend_ids(npus, by_phy_id=topo.label == "Phy-ID")
    pairs: dict[frozenset[str], PairFacts] = {}
    for (a, b), cell in topo.cells.items():
        if a == b or a not in device or b not in device:
            continue
        if cell in _ASCEND_LINKS:
            facts = PairFacts(link=_ASCEND_LINKS[cell], link_source=Source.NPU_SMI)
        elif cell in _PATHS:
            facts = PairFacts(path=_PATHS[cell], path_source=Source.NPU_SMI)
        else:
            continue  # NA, or a code this reader does not know: sysfs tells the path
        pairs[frozenset((device[a], device[b]))] = facts
    cpus = {
        device[npu]: found
        for npu, text in topo.cpu_affinity.items()
        if npu in device and (found := _cpulist(text))
    }
    return VendorTopology(
        vendor=Vendor.ASCEND, known=ASCEND_KNOWN, source=Source.NPU_SMI, pairs=pairs, cpus=cpus
    )


def _ascend_ids(npus: Sequence[Device], *, by_phy_id: bool) -> dict[int, str]:
    """The matrix's numbers to device ids: device indexes for Phy-IDs, else NPU ids that name a
    single device."""
    if by_phy_id:
        return {npu.index: npu.id for npu in npus}
    by_npu: dict[int, list[Device]] = {}
    for npu in npus:
        by_npu.setdefault(int(npu.attributes.get("npu_id", npu.index)), []).append(npu)
    return {npu_id: found[0].id for npu_id, found in by_npu.items() if len(found) == 1}


def read_hygon(root: HostRoot, dcus: Sequence[Device]) -> VendorTopology:
    """xGMI links from the KFD topology: each GPU node's io_links name the node at their far end
    and their type. KFD gives no count, so a link is a link."""
    by_location = {hygon.kfd_location_key(d.pci_bus_id): d.id for d in dcus if d.pci_bus_id}
    node_device: dict[str, str] = {}
    links: dict[str, list[Mapping[str, int]]] = {}
    for node in root.glob(hygon.KFD_NODES, "*"):
        properties = hygon.parse_kfd_properties(root.read_optional(f"{node}/properties") or "")
        key = (properties.get("domain", 0), properties.get("location_id", -1))
        if properties.get("simd_count", 0) <= 0 or key not in by_location:
            continue
        node_id = node.rsplit("/", 1)[-1]
        node_device[node_id] = by_location[key]
        links[node_id] = [
            hygon.parse_kfd_properties(root.read_optional(f"{link}/properties") or "")
            for link in root.glob(f"{node}/io_links", "*")
        ]
    pairs = {}
    for node_id, node_links in links.items():
        near = node_device[node_id]
        for link in node_links:
            far = node_device.get(str(link.get("node_to")))
            if link.get("type") == KFD_IOLINK_XGMI and far is not None and far != near:
                pairs[frozenset((near, far))] = PairFacts(
                    link=LinkKind.XGMI, link_source=Source.KFD
                )
    return VendorTopology(vendor=Vendor.HYGON, known=HYGON_KNOWN, pairs=pairs)


def read_kunlunxin(_root: HostRoot, _xpus: Sequence[Device]) -> VendorTopology:
    return VendorTopology(vendor=Vendor.KUNLUNXIN, known=KUNLUNXIN_KNOWN)


READERS: Mapping[Vendor, Reader] = {
    Vendor.NVIDIA: nvidia_topology.read_topology,
    Vendor.KUNLUNXIN: read_kunlunxin,
    Vendor.HYGON: read_hygon,
    Vendor.ASCEND: read_ascend,
}
