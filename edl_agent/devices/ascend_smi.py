"""`npu-smi info` and `npu-smi info -t health`: text in, records out. Pure.

The device table reads per field, not per table: a cell that cannot be read leaves that field of
that chip unknown (None) and adds a line to `problems`; the chip and the rest of the table stay.
Only output with no device table at all is refused.

Layouts read (each from a recorded output, see tests/fixtures/real/ascend/SOURCES.md):
- npu-smi 20.2 (910A): no Hugepages column, third column 45 wide.
- npu-smi 23.0-25.x single-chip NPUs (910A/910ProB, 910B): header `Chip`, one NPU row and one
  chip row per NPU, `Memory-Usage` and `HBM-Usage` pairs (both non-zero on 910A).
- Atlas A3 / 910C: header `Chip  Phy-ID`; the NPU row is repeated before each of its two dies,
  the Name is already `Ascend910`, the second die's Power is `-`.
- 310P (Atlas 300I Duo) and 310B: header `Chip  Device`, wider columns, Power `NA`, no HBM
  column; both chips of a 300I Duo share one Bus-Id; 310B prints Bus-Id `NA`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_VERSION = re.compile(r"npu-smi\s+\S+\s+Version:\s*(\S+)")
_NPU_CELL = re.compile(r"^(\d+)(?:\s+(\S.*?))?$")
_CHIP_CELL = re.compile(r"^(\d+)(?:\s+(\d+))?$")
_BUS_ID = re.compile(r"^([0-9a-fA-F]{4}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_USAGE = re.compile(r"(\d+)\s*/\s*(\d+)")
_USAGE_TITLE = re.compile(r"([A-Za-z]+)-Usage\(")
_NOT_AVAILABLE = frozenset({"NA", "N/A", "-", ""})
_CODE_SEPARATORS = re.compile(r"[\s,;]+")
_FAULT_CODE = re.compile(r"^(?:0[xX])?([0-9a-fA-F]{1,8})$")


class NpuSmiParseError(ValueError):
    """`npu-smi` printed something this parser cannot read at all."""


@dataclass(frozen=True)
class NpuRecord:
    """One chip row of `npu-smi info` with the NPU row above it; None where a cell is unknown."""

    npu_id: int | None
    chip_id: int | None
    index: int  # N of /dev/davinci<N>: the Device / Phy-ID column, else the row's position
    name: str | None  # as printed: 910B3, 910ProB, 310P3, Ascend910
    health: str | None  # OK, Warning, Alarm, Critical, ...
    bus_id: str | None  # sysfs form, 0000:c1:00.0; None for NA or an unreadable cell
    memory_mib: int | None  # HBM total where the table has an HBM column, else memory total
    # Live figures; None where the table prints NA or -. Power and temperature are the NPU row's.
    power_w: float | None = None
    temperature_c: float | None = None
    aicore_percent: float | None = None
    memory_used_mib: int | None = None  # of the same column as memory_mib
    device_ip: str | None = None  # the RoCE port's address: DCMI tells it, the table does not

    @property
    def product(self) -> str | None:
        """`Ascend910B3`; A3 tables already print `Ascend910`, which stays as it is."""
        if not self.name:
            return None
        return self.name if self.name.startswith("Ascend") else f"Ascend{self.name}"


@dataclass(frozen=True)
class NpuSmiInfo:
    version: str | None
    npus: tuple[NpuRecord, ...]
    problems: tuple[str, ...] = ()  # cells that could not be read, one line each


@dataclass(frozen=True)
class NpuHealth:
    """`npu-smi info -t health -i <npu> -c <chip>`: the chip's health word and alarm codes."""

    health: str
    codes: tuple[int, ...] = ()
    information: str = ""


@dataclass
class _Table:
    """What the two header rows say and what has been read so far."""

    usage_titles: list[str] = field(default_factory=list)  # ["Memory", "HBM"]
    headers: int = 0
    npu: _NpuRow | None = None
    records: list[NpuRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _NpuRow:
    npu_id: int | None
    name: str | None
    health: str | None
    power_w: float | None
    temperature_c: float | None


def parse_npu_smi_info(text: str) -> NpuSmiInfo:
    """Parse the device table of `npu-smi info` (the process table that follows is ignored)."""
    version_match = _VERSION.search(text)
    table = _Table()
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
        if _header(cells, table):
            continue
        if table.headers < 2 or len(cells) != 3:
            continue  # the title row, or a row of some other table
        if expect_npu_row or table.npu is None:
            table.npu = _npu_row(cells, lineno, table.problems)
            expect_npu_row = False
        else:
            table.records.append(_chip_row(cells, lineno, table, table.npu))
    if table.headers < 2:
        raise NpuSmiParseError("no `NPU Name | Health` / `Chip | Bus-Id` table header")
    if not table.records:
        raise NpuSmiParseError("no NPU rows in the table")
    return NpuSmiInfo(
        version=version_match.group(1) if version_match else None,
        npus=tuple(table.records),
        problems=tuple(table.problems),
    )


def _header(cells: list[str], table: _Table) -> bool:
    if cells[1:2] == ["Health"]:
        table.headers += 1
        return True
    if cells[1:2] == ["Bus-Id"]:
        table.headers += 1
        table.usage_titles = _USAGE_TITLE.findall(cells[2]) if len(cells) > 2 else []
        return True
    return False


def _npu_row(cells: list[str], lineno: int, problems: list[str]) -> _NpuRow:
    match = _NPU_CELL.match(cells[0])
    name = match.group(2) if match else None
    if match is None:
        problems.append(f"line {lineno}: NPU cell {cells[0]!r} unreadable: NPU id unknown")
        words = cells[0].split()
        name = words[-1] if len(words) > 1 else None  # `<id> <name>` with an unreadable id
    figures = cells[2].split()  # Power(W) Temp(C) [Hugepages-Usage]; NA or - where unknown
    return _NpuRow(
        npu_id=int(match.group(1)) if match else None,
        name=name,
        health=cells[1] or None,
        power_w=_figure(figures, 0),
        temperature_c=_figure(figures, 1),
    )


def _chip_row(cells: list[str], lineno: int, table: _Table, npu: _NpuRow) -> NpuRecord:
    chip = _CHIP_CELL.match(cells[0])
    if chip is None:
        table.problems.append(f"line {lineno}: chip cell {cells[0]!r} unreadable")
    device = chip.group(2) if chip is not None else None
    memory = _memory(cells[2], table.usage_titles)
    if memory is None:
        table.problems.append(f"line {lineno}: memory cell {cells[2]!r} unreadable")
    return NpuRecord(
        npu_id=npu.npu_id,
        chip_id=int(chip.group(1)) if chip is not None else None,
        index=int(device) if device is not None else len(table.records),
        name=npu.name,
        health=npu.health,
        bus_id=_bus_id(cells[1], lineno, table.problems),
        memory_mib=memory[1] if memory else None,
        power_w=npu.power_w,
        temperature_c=npu.temperature_c,
        aicore_percent=_figure(cells[2].split(), 0),
        memory_used_mib=memory[0] if memory else None,
    )


def _bus_id(cell: str, lineno: int, problems: list[str]) -> str | None:
    if _BUS_ID.match(cell):
        return cell.lower()
    if cell.upper() not in _NOT_AVAILABLE:  # NA: the chip has no PCIe address (310B)
        problems.append(f"line {lineno}: Bus-Id {cell!r} unreadable")
    return None


def _memory(cell: str, titles: list[str]) -> tuple[int, int] | None:
    """(used, total) MiB: the HBM pair where the header has one, else the memory pair. None when
    the cell does not hold one pair per header title."""
    pairs = _USAGE.findall(cell)
    if not pairs or (titles and len(pairs) != len(titles)):
        return None
    position = titles.index("HBM") if "HBM" in titles else len(pairs) - 1
    used, total = pairs[position]
    return int(used), int(total)


def _figure(tokens: list[str], position: int) -> float | None:
    try:
        return float(tokens[position])
    except (IndexError, ValueError):
        return None


def parse_npu_smi_health(text: str) -> NpuHealth:
    """Parse `npu-smi info -t health -i <npu> -c <chip>`: `Key : Value` lines

        Health Status                  : OK
        Error Code                     : NA
        Error Information              : NA

    (as MindCluster's log-collection guide prints it, with or without leading blanks). `Error
    Code` holds hex codes without `0x`; how several codes are separated is not documented, so
    commas, semicolons and blanks are all accepted."""
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


def parse_version_info(text: str) -> str | None:
    """`Version=...` from the driver's version.info (`key=value` lines)."""
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "Version" and value.strip():
            return value.strip()
    return None
