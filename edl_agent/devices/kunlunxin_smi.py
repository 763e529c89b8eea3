"""`xpu-smi -q` and `xpu-smi -L`: text in, records out. Pure.

`-q` prints a header of `Key : Value` lines, then one `XPU <bus id>` block per device whose keys
nest by indentation (`PCI` > `Bus Id`, `Memory Usage` > `Total`). Read per field: a block whose
product, memory, bus id or minor number cannot be read keeps the rest, the field is unknown and
listed in `problems`. Variants read (tests/fixtures/real/kunlunxin/SOURCES.md): block keys
indented under the heading or starting at its column (`-q --id=N` as quoted by ZStack), and an
`Attached XPUs` count that does not match the blocks printed (noted, not refused).

`-L` prints `XPU <i>: <name>  <uuid>` per device (driver 5.0.21.47); the older form
`XPU <i>: <bus id>` is read too. Its `<i>` is xpu-smi's index, not the N of /dev/xpu<N>.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

_BLOCK_HEADING = re.compile(r"^XPU\s+(\S+)$")
_BUS_ID = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_MIB = re.compile(r"^(\d+)\s*MiB$")
_NUMBER = re.compile(r"^(\d+(?:\.\d+)?)\s*(?:C|W|%|MiB)?$")
_LIST_LINE = re.compile(r"^XPU\s+(\d+)\s*:\s*(.+?)\s*$")
_UUID = re.compile(r"\s(GPU-[0-9a-fA-F-]{36})$")


class XpuSmiParseError(ValueError):
    """`xpu-smi` printed nothing this parser can read."""


@dataclass(frozen=True)
class XpuRecord:
    """One XPU block of `xpu-smi -q`; None where the block does not say (or cannot be read)."""

    bus_id: str | None  # sysfs form, 0000:01:00.0
    product: str | None
    memory_mib: int | None
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
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class XpuListEntry:
    """One line of `xpu-smi -L`."""

    smi_index: int
    name: str | None
    uuid: str | None = None
    bus_id: str | None = None


def parse_xpu_smi_query(text: str) -> XpuSmiReport:
    header: dict[str, str] = {}
    blocks: list[tuple[str, dict[str, str]]] = []
    sections: list[tuple[int, str]] = []
    for raw in text.splitlines():
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
        while sections and sections[-1][0] >= indent:
            sections.pop()
        if not colon:
            sections.append((indent, line))  # a section title (`PCI`, `Memory Usage`)
            continue
        path = "/".join([name for _, name in sections] + [key.strip()])
        (blocks[-1][1] if blocks else header)[path] = value.strip()

    problems: list[str] = []
    attached = header.get("Attached XPUs")
    if attached is None and not blocks:
        raise XpuSmiParseError("no XPU blocks and no `Attached XPUs` line")
    if attached is not None and (not attached.isdigit() or int(attached) != len(blocks)):
        problems.append(f"`Attached XPUs : {attached}` but {len(blocks)} XPU blocks printed")
    return XpuSmiReport(
        driver_version=header.get("Driver Version"),
        runtime_version=header.get("XPU-RT Version"),
        xpus=tuple(_xpu_record(heading, fields, problems) for heading, fields in blocks),
        problems=tuple(problems),
    )


def _xpu_record(heading: str, fields: Mapping[str, str], problems: list[str]) -> XpuRecord:
    where = f"XPU {heading}"
    product = fields.get("Product Name") or None
    if product is None:
        problems.append(f"{where}: no Product Name")
    memory = _MIB.match(fields.get("Memory Usage/Total", ""))
    if memory is None:
        problems.append(f"{where}: no `Memory Usage > Total : <n> MiB`")
    minor = fields.get("Minor Number")
    if minor is not None and not minor.isdigit():
        problems.append(f"{where}: Minor Number {minor!r} is not a number")
        minor = None
    bus_id = sysfs_bus_id(fields.get("PCI/Bus Id", heading))
    if bus_id is None:
        problems.append(f"{where}: no readable PCI bus id")
    return XpuRecord(
        bus_id=bus_id,
        product=product,
        memory_mib=int(memory.group(1)) if memory is not None else None,
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


def parse_xpu_smi_list(text: str) -> tuple[XpuListEntry, ...]:
    """`xpu-smi -L`; lines of any other shape are skipped. Refuses output with no XPU line."""
    entries = []
    for raw in text.splitlines():
        match = _LIST_LINE.match(raw.strip())
        if match is None:
            continue
        rest = match.group(2)
        bus_id = sysfs_bus_id(rest)
        uuid = _UUID.search(rest)
        name = rest[: uuid.start()].strip() if uuid else rest
        entries.append(
            XpuListEntry(
                smi_index=int(match.group(1)),
                name=None if bus_id else (name or None),
                uuid=uuid.group(1) if uuid else None,
                bus_id=bus_id,
            )
        )
    if not entries:
        raise XpuSmiParseError("no `XPU <i>: ...` line")
    return tuple(entries)


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


def sysfs_bus_id(text: str) -> str | None:
    """`00000000:01:00.0` (NVML style, 8-digit domain) to sysfs form `0000:01:00.0`; None when
    the text is no PCI address."""
    match = _BUS_ID.match(text.strip())
    if match is None:
        return None
    domain, bus, slot, function = match.groups()
    return f"{int(domain, 16):04x}:{bus}:{slot}.{function}".lower()
