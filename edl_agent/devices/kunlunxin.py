"""Kunlunxin XPU discovery: `/dev/xpu<N>` device nodes, facts from `xpu-smi -q` (read per field
by `kunlunxin_smi`; when -q fails, `xpu-smi -L` still names the product of a node whose XPUs are
all one model). Records are matched to /dev/xpu<N> by their Minor Number: xpu-smi's own index is
not N.

Device ids are `kunlunxin-xpu<N>` (N from `/dev/xpu<N>`), not the serial number or UUID that
xpu-smi prints: an id must stay the same when the tool is briefly broken, or kubelet would see
every device vanish and come back under a new name. Serial number and UUID are attributes.
"""

from __future__ import annotations

import re

import structlog

from edl_agent.devices.hostroot import HostRoot, ToolError
from edl_agent.devices.kunlunxin_smi import (
    XpuListEntry,
    XpuRecord,
    XpuSmiParseError,
    XpuSmiReport,
    parse_xpu_smi_list,
    parse_xpu_smi_query,
    sysfs_bus_id,
)
from edl_agent.devices.model import Device, Health, Vendor, VendorReport
from edl_agent.devices.unreadable import warn_unreadable

__all__ = [
    "CONTROL_NODE",
    "LIST_ARGS",
    "QUERY_ARGS",
    "TOOL",
    "XpuListEntry",
    "XpuRecord",
    "XpuSmiParseError",
    "XpuSmiReport",
    "discover",
    "parse_xpu_smi_list",
    "parse_xpu_smi_query",
    "records_by_index",
    "sysfs_bus_id",
]

TOOL = "xpu-smi"
QUERY_ARGS = ("-q",)
LIST_ARGS = ("-L",)  # names and UUIDs only; read when -q fails
CONTROL_NODE = "/dev/xpuctrl"  # shared by all XPUs; containers get it with their /dev/xpu<N>

_NODE_NAME = re.compile(r"^xpu(\d+)$")


def discover(root: HostRoot) -> VendorReport | None:
    log = structlog.get_logger().bind(vendor=Vendor.KUNLUNXIN.value)
    nodes = _xpu_nodes(root)
    tool = root.which(TOOL)
    if not nodes and tool is None:
        return None
    report: XpuSmiReport | None = None
    error: str | None = None
    if tool is not None:
        try:
            report = root.read_tool(tool, QUERY_ARGS, parse_xpu_smi_query)
        except ToolError as exc:
            error = str(exc)
    if not nodes and (report is None or not report.xpus):
        # A tool installed on a node without XPUs (it usually fails there): nothing to report.
        log.debug("kunlunxin tool without devices", error=error)
        return None
    listed_product = None
    if error is not None:
        log.warning("kunlunxin tool failed; listing devices from /dev only", error=error)
        listed_product = _product_from_list(root) if tool is not None else None
    if report is not None:
        warn_unreadable(log, f"{TOOL} -q", report.problems)
        if any(record.minor is None for record in report.xpus):
            log.warning("xpu-smi -q prints no Minor Number: XPUs matched to /dev/xpu<N> in order")

    records = records_by_index(report) if report is not None else {}
    shared = (CONTROL_NODE,) if root.exists(CONTROL_NODE) else ()
    devices = tuple(
        _device(
            root,
            index,
            nodes.get(index),
            records.get(index),
            shared,
            tool_ok=report is not None,
            listed_product=listed_product,
        )
        for index in sorted(nodes.keys() | records.keys())
    )
    driver = {}
    if report is not None and report.driver_version:
        driver["driver_version"] = report.driver_version
    if report is not None and report.runtime_version:
        driver["runtime_version"] = report.runtime_version
    log.debug("kunlunxin discovered", count=len(devices))
    return VendorReport(vendor=Vendor.KUNLUNXIN, devices=devices, driver=driver, error=error)


def _product_from_list(root: HostRoot) -> str | None:
    """The product every line of `xpu-smi -L` names, when they all name the same one: its index
    is not /dev/xpu<N>, so a product that differs between lines cannot be placed."""
    try:
        entries = root.read_tool(TOOL, LIST_ARGS, parse_xpu_smi_list)
    except ToolError:
        return None
    names = {entry.name for entry in entries}
    return names.pop() if len(names) == 1 else None


def _xpu_nodes(root: HostRoot) -> dict[int, str]:
    nodes = {}
    for path in root.glob("/dev", "xpu*"):
        match = _NODE_NAME.match(path.rsplit("/", 1)[-1])
        if match is not None:
            nodes[int(match.group(1))] = path
    return nodes


def records_by_index(report: XpuSmiReport) -> dict[int, XpuRecord]:
    """Key records by /dev/xpu<N> minor; blocks without a Minor Number count in printed order."""
    return {
        record.minor if record.minor is not None else position: record
        for position, record in enumerate(report.xpus)
    }


def _device(
    root: HostRoot,
    index: int,
    node: str | None,
    record: XpuRecord | None,
    shared: tuple[str, ...],
    *,
    tool_ok: bool,
    listed_product: str | None = None,
) -> Device:
    attributes: dict[str, str] = {}
    health = Health.HEALTHY
    if node is None:
        health = Health.UNHEALTHY
        attributes["problem"] = f"{TOOL} lists it but /dev/xpu{index} is missing"
    elif record is None and tool_ok:
        health = Health.UNHEALTHY
        attributes["problem"] = f"/dev/xpu{index} exists but {TOOL} does not list it"
    if record is not None:
        optional = {
            "serial_number": record.serial_number,
            "uuid": record.uuid,
            "part_number": record.part_number,
            "architecture": record.architecture,
        }
        attributes.update({key: value for key, value in optional.items() if value})
    bus_id = record.bus_id if record is not None else None
    return Device(
        vendor=Vendor.KUNLUNXIN,
        kind="xpu",
        index=index,
        id=f"kunlunxin-xpu{index}",
        # What xpu-smi does not tell (or cannot be read) is "unknown" and 0.
        product=(record.product if record is not None else listed_product) or "unknown",
        memory_mib=(record.memory_mib if record is not None else None) or 0,
        numa_node=root.pci_numa_node(bus_id),
        pci_bus_id=bus_id,
        device_nodes=((node,) if node is not None else ()) + shared,
        health=health,
        attributes=attributes,
    )
