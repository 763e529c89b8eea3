"""Ascend NPU discovery: `/dev/davinci<N>` device nodes, facts from the `npu-smi info` table.

Ids are `ascend-npu<N>` (N from `/dev/davinci<N>`, the driver's device id): `npu-smi info` prints
no serial number, and an id must not depend on the tool working.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import structlog

from edl_agent.devices.hostroot import HostRoot, ToolError
from edl_agent.devices.model import Device, Health, Vendor, VendorReport

TOOL = "npu-smi"
QUERY_ARGS = ("info",)
HEALTH_ARGS = ("info", "-t", "health", "-i", "{npu}", "-c", "{chip}")  # one chip's alarm codes
TOPO_ARGS = ("info", "-t", "topo")
SHARED_NODES = ("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc")
DRIVER_VERSION_FILE = "/usr/local/Ascend/driver/version.info"  # `Version=24.1.rc2` lines
# npu-smi's health words; Warning is a minor alarm that leaves the chip usable.
USABLE_HEALTH = frozenset({"OK", "Warning"})

_NODE_NAME = re.compile(r"^davinci(\d+)$")
_VERSION = re.compile(r"npu-smi\s+\S+\s+Version:\s*(\S+)")
_NPU_CELL = re.compile(r"^(\d+)\s+(\S+)$")
_CHIP_CELL = re.compile(r"^(\d+)(?:\s+(\d+))?$")
_BUS_ID = re.compile(r"^([0-9a-fA-F]{4}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_USAGE = re.compile(r"(\d+)\s*/\s*(\d+)")
_CODE_SEPARATORS = re.compile(r"[\s,;]+")
_FAULT_CODE = re.compile(r"^(?:0[xX])?([0-9a-fA-F]{1,8})$")
_TOPO_LABEL = re.compile(r"^NPU(\d+)$")


class NpuSmiParseError(ValueError):
    """`npu-smi info` printed something this parser does not understand."""


@dataclass(frozen=True)
class NpuHealth:
    """`npu-smi info -t health -i <npu> -c <chip>`: the chip's health word and alarm codes."""

    health: str
    codes: tuple[int, ...] = ()
    information: str = ""


@dataclass(frozen=True)
class NpuRecord:
    """One chip row of `npu-smi info` with the NPU row above it."""

    npu_id: int
    chip_id: int
    index: int  # N of /dev/davinci<N>
    name: str  # chip name as printed, e.g. 910B3
    health: str  # OK, Warning, Alarm, Critical, ...
    bus_id: str  # sysfs form, 0000:c1:00.0
    memory_mib: int  # HBM total where the table has an HBM column, else memory total
    # Live figures; None where the table prints NA. Power and temperature are the NPU row's, so
    # the chips of a multi-chip card share them.
    power_w: float | None = None
    temperature_c: float | None = None
    aicore_percent: float | None = None
    memory_used_mib: int | None = None  # of the same column as memory_mib


@dataclass(frozen=True)
class NpuSmiInfo:
    version: str | None
    npus: tuple[NpuRecord, ...]


def parse_npu_smi_info(text: str) -> NpuSmiInfo:
    """Parse the device table of `npu-smi info`.

    Between `+===+` borders each NPU has one row (`| <npu> <name> | <health> | ...`) followed by
    one row per chip (`| <chip> [<device>] | <bus id> | <aicore> <used> / <total> ... |`).
    Format checked against recorded 910B3 output (npu-smi 24.1 and 25.3, in vllm-ascend issue
    reports). Rows with two numbers in the chip cell (multi-chip cards, whose header reads
    `Chip Device` or `Chip Phy-ID`) take the second as the device id: inferred, not verified.
    The process table that follows is ignored.
    """
    version_match = _VERSION.search(text)
    headers = 0
    usage_columns = 1  # `<used> / <total>` pairs per chip row: Memory-Usage, and HBM-Usage if any
    records: list[NpuRecord] = []
    npu: _NpuRow | None = None
    expect_npu_row = False
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if line.startswith("+"):
            expect_npu_row = True
            continue
        if not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if any("Process id" in cell for cell in cells):
            break
        if cells[1:2] in (["Health"], ["Bus-Id"]):
            headers += 1
            if cells[1] == "Bus-Id" and len(cells) > 2:
                usage_columns = max(1, cells[2].count("-Usage("))
            continue
        if headers < 2 or len(cells) != 3:
            continue  # the title row, or a row of some other table
        if expect_npu_row:
            npu = _npu_row(cells, lineno)
            expect_npu_row = False
        elif npu is None:
            msg = f"line {lineno}: chip row before any NPU row"
            raise NpuSmiParseError(msg)
        else:
            records.append(_chip_row(cells, lineno, npu, usage_columns, position=len(records)))
    if headers < 2:
        raise NpuSmiParseError("no `NPU Name | Health` / `Chip | Bus-Id` table header")
    if not records:
        raise NpuSmiParseError("no NPU rows in the table")
    return NpuSmiInfo(
        version=version_match.group(1) if version_match else None, npus=tuple(records)
    )


@dataclass(frozen=True)
class _NpuRow:
    npu_id: int
    name: str
    health: str
    power_w: float | None
    temperature_c: float | None


def _npu_row(cells: list[str], lineno: int) -> _NpuRow:
    match = _NPU_CELL.match(cells[0])
    if match is None or not cells[1]:
        msg = f"line {lineno}: expected `<npu id> <name> | <health>`, got {cells[0]!r}"
        raise NpuSmiParseError(msg)
    figures = cells[2].split()  # Power(W) Temp(C) Hugepages-Usage; NA where unknown
    return _NpuRow(
        npu_id=int(match.group(1)),
        name=match.group(2),
        health=cells[1],
        power_w=_figure(figures, 0),
        temperature_c=_figure(figures, 1),
    )


def _figure(tokens: list[str], position: int) -> float | None:
    try:
        return float(tokens[position])
    except (IndexError, ValueError):
        return None


def _chip_row(
    cells: list[str], lineno: int, npu: _NpuRow, usage_columns: int, *, position: int
) -> NpuRecord:
    chip = _CHIP_CELL.match(cells[0])
    bus = _BUS_ID.match(cells[1])
    usage = _USAGE.findall(cells[2])
    if chip is None or bus is None or len(usage) != usage_columns:
        msg = (
            f"line {lineno}: expected `<chip> | <bus id> | <aicore>"
            f"{' <used> / <total>' * usage_columns}`, got {cells!r}"
        )
        raise NpuSmiParseError(msg)
    device = chip.group(2)
    return NpuRecord(
        npu_id=npu.npu_id,
        chip_id=int(chip.group(1)),
        index=int(device) if device is not None else position,
        name=npu.name,
        health=npu.health,
        bus_id=cells[1].lower(),
        memory_mib=int(usage[-1][1]),  # HBM-Usage is the last column when the card has HBM
        power_w=npu.power_w,
        temperature_c=npu.temperature_c,
        aicore_percent=_figure(cells[2].split(), 0),
        memory_used_mib=int(usage[-1][0]),
    )


def parse_npu_smi_health(text: str) -> NpuHealth:
    """Parse `npu-smi info -t health -i <npu> -c <chip>`: `Key : Value` lines

        Health Status                  : OK
        Error Code                     : NA
        Error Information              : NA

    (layout from Huawei's MindCluster log-collection guide, npu-smi 23.0). `Error Code` holds hex
    codes without `0x`; how several codes are separated is not documented, so commas, semicolons
    and blanks are all accepted.
    """
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            fields[key.strip().lower()] = value.strip()
    health = fields.get("health status") or fields.get("health")
    if not health:
        raise NpuSmiParseError("no `Health Status : <word>` line")
    raw_codes = fields.get("error code", "NA")
    codes: list[int] = []
    if raw_codes.upper() not in ("NA", "N/A", ""):
        for token in filter(None, _CODE_SEPARATORS.split(raw_codes)):
            match = _FAULT_CODE.match(token)
            if match is None:
                msg = f"Error Code {raw_codes!r}: {token!r} is not a hex fault code"
                raise NpuSmiParseError(msg)
            codes.append(int(match.group(1), 16))
    information = fields.get("error information", "")
    return NpuHealth(
        health=health,
        codes=tuple(codes),
        information="" if information.upper() in ("NA", "N/A") else information,
    )


@dataclass(frozen=True)
class NpuTopo:
    """`npu-smi info -t topo`: the NPU ids in column order, each pair's cell (`HCCS`, `PIX`,
    `SYS`, `NA`, ...) and each NPU's `CPU Affinity` text."""

    npus: tuple[int, ...]
    cells: dict[tuple[int, int], str]
    cpu_affinity: dict[int, str]


def parse_npu_smi_topo(text: str) -> NpuTopo:
    """Parse the matrix of `npu-smi info -t topo`: a header of `NPU<i>` columns followed by
    `CPU Affinity`, then one row per NPU (`NPU0  X  HCCS ...  144-167`), then the legend.

    Format checked against a recorded 910B3 output (npu-smi 24.1.rc1, in the ms-swift NPU guide).
    Cells are single words; the trailing columns are matched by their header titles, so a
    version that adds one (or drops `CPU Affinity`) still parses.
    """
    npus: tuple[int, ...] = ()
    trailing: list[str] = []
    cells: dict[tuple[int, int], str] = {}
    affinity: dict[int, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if line.startswith("Legend"):
            break
        titles = re.split(r"\s{2,}|\t", line)
        if not npus and _is_topo_header(titles):
            columns = [t for t in titles if _TOPO_LABEL.match(t)]
            npus = tuple(int(t[3:]) for t in columns)
            trailing = titles[len(columns) :]
            continue
        tokens = line.split()
        label = _TOPO_LABEL.match(tokens[0]) if tokens else None
        if not npus or label is None:
            continue
        row = int(label.group(1))
        if len(tokens) < 1 + len(npus) or row not in npus:
            msg = f"line {lineno}: expected {len(npus)} cells for NPU{row}, got {line!r}"
            raise NpuSmiParseError(msg)
        for column, cell in zip(npus, tokens[1 : 1 + len(npus)], strict=True):
            cells[(row, column)] = cell
        extra = dict(zip(trailing, tokens[1 + len(npus) :], strict=False))
        if "CPU Affinity" in extra:
            affinity[row] = extra["CPU Affinity"]
    if not npus:
        raise NpuSmiParseError("no `NPU0 NPU1 ... CPU Affinity` header")
    missing = [npu for npu in npus if (npu, npu) not in cells]
    if missing:
        msg = f"no row for NPU{missing[0]}"
        raise NpuSmiParseError(msg)
    return NpuTopo(npus=npus, cells=cells, cpu_affinity=affinity)


def _is_topo_header(titles: list[str]) -> bool:
    """`NPU0  NPU1 ...` or `NPU0  CPU Affinity`; a row starts `NPU0  X`."""
    if len(titles) < 2 or not _TOPO_LABEL.match(titles[0]):
        return False
    return bool(_TOPO_LABEL.match(titles[1])) or titles[1:] == ["CPU Affinity"]


def parse_version_info(text: str) -> str | None:
    """`Version=...` from the driver's version.info (`key=value` lines)."""
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "Version" and value.strip():
            return value.strip()
    return None


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
        attributes.update(
            chip_name=record.name,
            health_text=record.health,
            npu_id=str(record.npu_id),
            chip_id=str(record.chip_id),
        )
        if record.health not in USABLE_HEALTH:
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
        # Without npu-smi nothing names the chip or its memory: "unknown" and 0 say so.
        product=f"Ascend{record.name}" if record is not None else "unknown",
        memory_mib=record.memory_mib if record is not None else 0,
        numa_node=root.pci_numa_node(bus_id),
        pci_bus_id=bus_id,
        device_nodes=((node,) if node is not None else ()) + shared,
        health=health,
        attributes=attributes,
    )
