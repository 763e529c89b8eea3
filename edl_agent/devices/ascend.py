"""Ascend NPU discovery: `/dev/davinci<N>` device nodes, facts from the `npu-smi info` table.

Ids are `ascend-npu<N>` (N from `/dev/davinci<N>`, the driver's device id): `npu-smi info` prints
no serial number, and an id must not depend on the tool working. The table is read per field
(`ascend_smi`): a chip whose cells cannot all be read keeps what could be, the rest is unknown,
and discovery warns once with the cells it could not read.
"""

from __future__ import annotations

import re

import structlog

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
    if not nodes and tool is None:
        return None
    info: NpuSmiInfo | None = None
    error: str | None = None
    if tool is not None:
        try:
            info = root.read_tool(tool, QUERY_ARGS, parse_npu_smi_info)
        except ToolError as exc:
            error = str(exc)
    if not nodes and info is None:
        # npu-smi installed on a node without NPUs fails to reach the driver: nothing to report.
        log.debug("ascend tool without devices", error=error)
        return None
    if error is not None:
        log.warning("ascend tool failed; listing devices from /dev only", error=error)
    if info is not None:
        warn_unreadable(log, f"{TOOL} info", info.problems)

    records = {record.index: record for record in info.npus} if info is not None else {}
    shared = tuple(node for node in SHARED_NODES if root.exists(node))
    devices = tuple(
        _device(root, index, nodes.get(index), records.get(index), shared, tool_ok=info is not None)
        for index in sorted(nodes.keys() | records.keys())
    )
    version = info.version if info is not None else None
    version = version or parse_version_info(root.read_optional(DRIVER_VERSION_FILE) or "")
    driver = {"driver_version": version} if version else {}
    log.debug("ascend discovered", count=len(devices))
    return VendorReport(vendor=Vendor.ASCEND, devices=devices, driver=driver, error=error)


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
    tool_ok: bool,
) -> Device:
    attributes: dict[str, str] = {}
    health = Health.HEALTHY
    if record is not None:
        known = {
            "chip_name": record.name,
            "health_text": record.health,
            "npu_id": record.npu_id,
            "chip_id": record.chip_id,
        }
        attributes.update({key: str(value) for key, value in known.items() if value is not None})
        if record.health is not None and record.health not in USABLE_HEALTH:
            health = Health.UNHEALTHY
    if node is None:
        health = Health.UNHEALTHY
        attributes["problem"] = f"{TOOL} lists it but /dev/davinci{index} is missing"
    elif record is None and tool_ok:
        health = Health.UNHEALTHY
        attributes["problem"] = f"/dev/davinci{index} exists but {TOOL} does not list it"
    bus_id = record.bus_id if record is not None else None
    return Device(
        vendor=Vendor.ASCEND,
        kind="npu",
        index=index,
        id=f"ascend-npu{index}",
        # What npu-smi does not tell (or cannot be read) is "unknown" and 0.
        product=(record.product if record is not None else None) or "unknown",
        memory_mib=(record.memory_mib if record is not None else None) or 0,
        numa_node=root.pci_numa_node(bus_id),
        pci_bus_id=bus_id,
        device_nodes=((node,) if node is not None else ()) + shared,
        health=health,
        attributes=attributes,
    )
