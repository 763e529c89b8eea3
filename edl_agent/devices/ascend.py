"""Ascend NPU discovery: `/dev/davinci<N>` device nodes, facts from the driver's DCMI library
where it answers (`dcmi`: no process started), else from the `npu-smi info` table.

Ids are `ascend-npu<N>` (N from `/dev/davinci<N>`, the driver's device id): `npu-smi info` prints
no serial number, and an id must not depend on the tool working. The table is read per field
(`ascend_smi`): a chip whose cells cannot all be read keeps what could be, the rest is unknown,
and discovery warns once with the cells it could not read. Both sources give the same records:
DCMI's card and device ids are the table's NPU and Chip columns, its physical id the device
index, its health value the Health word. `driver.health_source` says which one is used.
"""

from __future__ import annotations

import re

import structlog

from edl_agent.devices import dcmi
from edl_agent.devices.ascend_smi import (
    NpuHealth,
    NpuRecord,
    NpuSmiInfo,
    NpuSmiParseError,
    parse_npu_smi_health,
    parse_npu_smi_info,
    parse_version_info,
)
from edl_agent.devices.ascend_topo import NpuTopo, parse_npu_smi_topo
from edl_agent.devices.hostroot import HostRoot, ToolError
from edl_agent.devices.model import Device, Health, Vendor, VendorReport
from edl_agent.devices.unreadable import warn_unreadable

__all__ = [
    "DRIVER_VERSION_FILE",
    "HEALTH_ARGS",
    "QUERY_ARGS",
    "SHARED_NODES",
    "TOOL",
    "TOPO_ARGS",
    "USABLE_HEALTH",
    "NpuHealth",
    "NpuRecord",
    "NpuSmiInfo",
    "NpuSmiParseError",
    "NpuTopo",
    "device_id",
    "discover",
    "parse_npu_smi_health",
    "parse_npu_smi_info",
    "parse_npu_smi_topo",
    "parse_version_info",
]

TOOL = "npu-smi"
QUERY_ARGS = ("info",)
HEALTH_ARGS = ("info", "-t", "health", "-i", "{npu}", "-c", "{chip}")  # one chip's alarm codes
TOPO_ARGS = ("info", "-t", "topo")
SHARED_NODES = ("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc")
DRIVER_VERSION_FILE = "/usr/local/Ascend/driver/version.info"  # `Version=24.1.rc2` lines
# npu-smi's health words; Warning is a minor alarm that leaves the chip usable.
USABLE_HEALTH = frozenset({"OK", "Warning"})

_NODE_NAME = re.compile(r"^davinci(\d+)$")


def discover(root: HostRoot) -> VendorReport | None:
    log = structlog.get_logger().bind(vendor=Vendor.ASCEND.value)
    nodes = _davinci_nodes(root)
    tool = root.which(TOOL)
    library = dcmi.find_library(root)
    if not nodes and tool is None and library is None:
        return None
    info, source, error, library_error = None, TOOL, None, None
    if library is not None:
        try:
            info, source = library_info(library), dcmi.HEALTH_SOURCE
        except (OSError, dcmi.DcmiError) as exc:
            library_error = str(exc)
    if info is None and tool is not None:
        try:
            info = root.read_tool(tool, QUERY_ARGS, parse_npu_smi_info)
        except ToolError as exc:
            error = str(exc)
    elif library_error is not None:
        error = f"{dcmi.LIBRARY}: {library_error}"
    if not nodes and info is None:
        # npu-smi installed on a node without NPUs fails to reach the driver: nothing to report.
        log.debug("ascend tool without devices", error=error, library_error=library_error)
        return None
    if library_error is not None and info is not None:
        log.warning("ascend library failed; read through the tool", library_error=library_error)
    if error is not None:
        log.warning("ascend tool failed; listing devices from /dev only", error=error)
    if info is not None:
        warn_unreadable(log, f"{TOOL} info", info.problems)

    records = {record.index: record for record in info.npus} if info is not None else {}
    shared = tuple(node for node in SHARED_NODES if root.exists(node))
    listed_by = source if info is not None else None
    devices = tuple(
        _device(root, index, nodes.get(index), records.get(index), shared, listed_by=listed_by)
        for index in sorted(nodes.keys() | records.keys())
    )
    version = info.version if info is not None else None
    version = version or parse_version_info(root.read_optional(DRIVER_VERSION_FILE) or "")
    driver = {"driver_version": version} if version else {}
    if info is not None:
        driver["health_source"] = source
    log.debug("ascend discovered", count=len(devices), health_source=driver.get("health_source"))
    return VendorReport(vendor=Vendor.ASCEND, devices=devices, driver=driver, error=error)


def device_id(index: int) -> str:
    """The id of the chip at /dev/davinci<index>."""
    return f"ascend-npu{index}"


def library_info(path: str) -> NpuSmiInfo:
    """What `npu-smi info` would show, read through DCMI (DcmiError or OSError when it cannot)."""
    chips = dcmi.open_library(path).chips(addresses=True)
    return NpuSmiInfo(version=None, npus=tuple(record(chip) for chip in chips))


def record(chip: dcmi.NpuChip) -> NpuRecord:
    """A DCMI chip as the npu-smi table's record of it."""
    return NpuRecord(
        npu_id=chip.card,
        chip_id=chip.device,
        index=chip.phy_id,
        name=chip.chip_name,
        health=chip.health_word,
        bus_id=chip.bus_id,
        memory_mib=chip.memory_mib,
        power_w=chip.power_w,
        temperature_c=chip.temperature_c,
        aicore_percent=chip.aicore_percent,
        memory_used_mib=chip.memory_used_mib,
        device_ip=chip.ip,
    )


def _davinci_nodes(root: HostRoot) -> dict[int, str]:
    nodes = {}
    for path in root.glob("/dev", "davinci*"):  # davinci_manager does not match the pattern below
        match = _NODE_NAME.match(path.rsplit("/", 1)[-1])
        if match is not None:
            nodes[int(match.group(1))] = path
    return nodes


def _device(
    root: HostRoot,
    index: int,
    node: str | None,
    record: NpuRecord | None,
    shared: tuple[str, ...],
    *,
    listed_by: str | None,
) -> Device:
    """`listed_by`: the source whose list this is (None: /dev alone, the source failed)."""
    attributes: dict[str, str] = {}
    health = Health.HEALTHY
    if record is not None:
        known = {
            "chip_name": record.name,
            "health_text": record.health,
            "npu_id": record.npu_id,
            "chip_id": record.chip_id,
            "device_ip": record.device_ip,
        }
        attributes.update({key: str(value) for key, value in known.items() if value is not None})
        if record.health is not None and record.health not in USABLE_HEALTH:
            health = Health.UNHEALTHY
    if node is None:
        health = Health.UNHEALTHY
        attributes["problem"] = f"{listed_by} lists it but /dev/davinci{index} is missing"
    elif record is None and listed_by is not None:
        health = Health.UNHEALTHY
        attributes["problem"] = f"/dev/davinci{index} exists but {listed_by} does not list it"
    bus_id = record.bus_id if record is not None else None
    return Device(
        vendor=Vendor.ASCEND,
        kind="npu",
        index=index,
        id=device_id(index),
        # What npu-smi does not tell (or cannot be read) is "unknown" and 0.
        product=(record.product if record is not None else None) or "unknown",
        memory_mib=(record.memory_mib if record is not None else None) or 0,
        numa_node=root.pci_numa_node(bus_id),
        pci_bus_id=bus_id,
        device_nodes=((node,) if node is not None else ()) + shared,
        health=health,
        attributes=attributes,
    )
