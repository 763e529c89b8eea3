"""Kunlunxin XPU discovery: `/dev/xpu<N>` device nodes, facts from `xpu-smi -q`.

Device ids are `kunlunxin-xpu<N>` (N from `/dev/xpu<N>`), not the serial number or UUID that
xpu-smi prints: an id must stay the same when the tool is briefly broken, or kubelet would see
every device vanish and come back under a new name. Serial number and UUID are attributes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import structlog

from edl_agent.devices.hostroot import HostRoot, ToolError
from edl_agent.devices.model import Device, Health, Vendor, VendorReport

TOOL = "xpu-smi"
QUERY_ARGS = ("-q",)
CONTROL_NODE = "/dev/xpuctrl"  # shared by all XPUs; containers get it with their /dev/xpu<N>

_NODE_NAME = re.compile(r"^xpu(\d+)$")
_BLOCK_HEADING = re.compile(r"^XPU\s+(\S+)$")
_BUS_ID = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_MIB = re.compile(r"^(\d+)\s*MiB$")
_NUMBER = re.compile(r"^(\d+(?:\.\d+)?)\s*(?:C|W|%|MiB)?$")


class XpuSmiParseError(ValueError):
    """`xpu-smi -q` printed something this parser does not understand."""


@dataclass(frozen=True)
class XpuRecord:
    """One XPU block of `xpu-smi -q`."""

    bus_id: str  # sysfs form, 0000:01:00.0
    product: str
    memory_mib: int
    minor: int | None = None  # N of /dev/xpu<N>
    serial_number: str | None = None
    uuid: str | None = None
    part_number: str | None = None
    architecture: str | None = None
    # Live figures, None where the block does not print them (or prints N/A).
    temperature_c: float | None = None
    power_w: float | None = None
    utilization_percent: float | None = None
    memory_used_mib: float | None = None
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    state: str | None = None  # designed `XPU State` of the simulated tool; absent on real nodes


@dataclass(frozen=True)
class XpuSmiReport:
    driver_version: str | None
    runtime_version: str | None
    xpus: tuple[XpuRecord, ...]


def parse_xpu_smi_query(text: str) -> XpuSmiReport:
    """Parse `xpu-smi -q`: a header of `Key : Value` lines, then one `XPU <bus id>` block per
    device whose keys nest by indentation (`PCI` > `Bus Id`, `Memory Usage` > `Total`).

    Format from a recorded P800 sample quoted in zstackio/zstack-utility (kunlunxin vendor module,
    driver 5.0.21.26); other driver versions are unverified.
    """
    header: dict[str, str] = {}
    blocks: list[tuple[str, dict[str, str]]] = []
    sections: list[tuple[int, str]] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("="):  # blank lines and the `=== XPUSMI LOG ===` banner
            continue
        indent = len(raw) - len(raw.lstrip())
        heading = _BLOCK_HEADING.match(line) if indent == 0 else None
        if heading is not None:
            blocks.append((heading.group(1), {}))
            sections = []
            continue
        key, colon, value = line.partition(":")
        if indent == 0 and (blocks or not colon):
            msg = f"line {lineno}: unexpected {_clip(line)!r}"
            raise XpuSmiParseError(msg)
        while sections and sections[-1][0] >= indent:
            sections.pop()
        if not colon:
            sections.append((indent, line))
            continue
        path = "/".join([name for _, name in sections] + [key.strip()])
        (blocks[-1][1] if blocks else header)[path] = value.strip()

    attached = header.get("Attached XPUs")
    if attached is None and not blocks:
        raise XpuSmiParseError("no XPU blocks and no `Attached XPUs` line")
    if attached is not None and (not attached.isdigit() or int(attached) != len(blocks)):
        msg = f"`Attached XPUs : {attached}` but {len(blocks)} XPU blocks"
        raise XpuSmiParseError(msg)
    return XpuSmiReport(
        driver_version=header.get("Driver Version"),
        runtime_version=header.get("XPU-RT Version"),
        xpus=tuple(_xpu_record(heading, fields) for heading, fields in blocks),
    )


def _xpu_record(heading: str, fields: Mapping[str, str]) -> XpuRecord:
    where = f"XPU {heading}"
    product = fields.get("Product Name")
    if not product:
        msg = f"{where}: no Product Name"
        raise XpuSmiParseError(msg)
    memory = _MIB.match(fields.get("Memory Usage/Total", ""))
    if memory is None:
        msg = f"{where}: no `Memory Usage > Total : <n> MiB`"
        raise XpuSmiParseError(msg)
    minor = fields.get("Minor Number")
    if minor is not None and not minor.isdigit():
        msg = f"{where}: Minor Number {minor!r} is not a number"
        raise XpuSmiParseError(msg)
    return XpuRecord(
        bus_id=normalize_bus_id(fields.get("PCI/Bus Id", heading), where=where),
        product=product,
        memory_mib=int(memory.group(1)),
        minor=int(minor) if minor is not None else None,
        serial_number=fields.get("Serial Number"),
        uuid=fields.get("XPU UUID"),
        part_number=fields.get("XPU Part Number"),
        architecture=fields.get("Product Architecture"),
        temperature_c=_number(_leaf(fields, "XPU Current Temp")),
        power_w=_number(_leaf(fields, "Power Draw")),
        utilization_percent=_number(_leaf(fields, "Xpu")),
        memory_used_mib=_number(fields.get("Memory Usage/Used")),
        ecc_corrected=_count(fields.get("ECC Errors/Volatile/DRAM Correctable")),
        ecc_uncorrected=_count(fields.get("ECC Errors/Volatile/DRAM Uncorrectable")),
        state=fields.get("XPU State") or None,
    )


def _leaf(fields: Mapping[str, str], name: str) -> str | None:
    """The value of the first key named `name` in any section (sections vary by driver)."""
    for path, value in fields.items():
        if path.rsplit("/", 1)[-1] == name:
            return value
    return None


def _number(text: str | None) -> float | None:
    """`40 C`, `93.5 W`, `12 %`, `0 MiB` to a number; None for N/A or anything else."""
    match = _NUMBER.match(text.strip()) if text is not None else None
    return float(match.group(1)) if match is not None else None


def _count(text: str | None) -> int | None:
    return int(text) if text is not None and text.strip().isdigit() else None


def normalize_bus_id(text: str, *, where: str) -> str:
    """`00000000:01:00.0` (NVML style, 8-digit domain) to sysfs form `0000:01:00.0`."""
    match = _BUS_ID.match(text.strip())
    if match is None:
        msg = f"{where}: bad PCI bus id {text!r}"
        raise XpuSmiParseError(msg)
    domain, bus, slot, function = match.groups()
    return f"{int(domain, 16):04x}:{bus}:{slot}.{function}".lower()


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
    if error is not None:
        log.warning("kunlunxin tool failed; listing devices from /dev only", error=error)

    records = records_by_index(report) if report is not None else {}
    shared = (CONTROL_NODE,) if root.exists(CONTROL_NODE) else ()
    devices = tuple(
        _device(
            root, index, nodes.get(index), records.get(index), shared, tool_ok=report is not None
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
        # Without xpu-smi nothing on the node names the model or its memory: 0 means unknown.
        product=record.product if record is not None else "unknown",
        memory_mib=record.memory_mib if record is not None else 0,
        numa_node=root.pci_numa_node(bus_id),
        pci_bus_id=bus_id,
        device_nodes=((node,) if node is not None else ()) + shared,
        health=health,
        attributes=attributes,
    )


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
