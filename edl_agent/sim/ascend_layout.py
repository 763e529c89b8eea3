"""What the simulated `npu-smi` prints, laid out as the real tool lays it out for each kind of node
(the recordings in tests/fixtures/real/ascend/):

- `legacy`: npu-smi 20.x (910A): no Hugepages column, 45-wide third column, and a Memory-Usage
  pair beside the HBM one.
- `standard`: npu-smi 23-25 on single-chip NPUs (910B): `Chip` header, 52-wide third column.
- `a3`: Atlas A3 / 910C: `Chip  Phy-ID` header, the NPU row repeated before each die, the Name
  `Ascend910`, the second die's Power `-`, a full-width rule between the dies.
- `inference`: 310P / 310B: `Chip  Device` header, wider columns, Power `NA`, no HBM column,
  the chips of one card on one Bus-Id.
Pure: a layout and the chips in, text out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Layout = Literal["legacy", "standard", "a3", "inference"]


@dataclass(frozen=True)
class SimNpu:
    index: int  # N of /dev/davinci<N> (the Phy-ID / Device column where the table has one)
    npu_id: int
    chip_id: int
    chip_name: str  # as npu-smi prints it: 910B3, Ascend910, 310P3
    memory_mib: int
    bus_id: str  # sysfs form
    numa_node: int
    health: str = "OK"
    ddr_mib: int = 0  # the Memory-Usage total beside HBM (910A); 0 prints `0 / 0`


@dataclass(frozen=True)
class _Frame:
    widths: tuple[int, int, int]  # cell contents
    header: tuple[str, str]
    processes: str = ""  # the process table's header; none printed where empty


_FRAMES: dict[Layout, _Frame] = {
    "legacy": _Frame(
        (20, 13, 43),
        (
            "| NPU   Name           | Health        | "
            "Power(W)   Temp(C)                          |",
            "| Chip                 | Bus-Id        | "
            "AICore(%)  Memory-Usage(MB)  HBM-Usage(MB)  |",
        ),
    ),
    "standard": _Frame(
        (25, 13, 50),
        (
            "| NPU   Name                | Health        | "
            "Power(W)    Temp(C)           Hugepages-Usage(page)|",
            "| Chip                      | Bus-Id        | "
            "AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |",
        ),
        processes="| NPU     Chip              | Process id    | "
        "Process name             | Process memory(MB)      |",
    ),
    "a3": _Frame(
        (25, 13, 50),
        (
            "| NPU   Name                | Health        | "
            "Power(W)    Temp(C)           Hugepages-Usage(page)|",
            "| Chip  Phy-ID              | Bus-Id        | "
            "AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |",
        ),
        processes="| NPU     Chip              | Process id    | "
        "Process name             | Process memory(MB)      |",
    ),
    "inference": _Frame(
        (29, 15, 52),
        (
            "| NPU     Name                  | Health          | "
            "Power(W)     Temp(C)           Hugepages-Usage(page) |",
            "| Chip    Device                | Bus-Id          | "
            "AICore(%)    Memory-Usage(MB)                        |",
        ),
        processes="| NPU     Chip                  | Process id      | "
        "Process name             | Process memory(MB)        |",
    ),
}
LEGACY_TOOL_VERSION = "1.8.21"


def health_width(layout: Layout) -> int:
    """The Health cell's width: the longest health word the table can hold."""
    return _FRAMES[layout].widths[1]


def npu_smi_info(layout: Layout, version: str, npus: Sequence[SimNpu]) -> str:
    frame = _FRAMES[layout]
    width = sum(frame.widths) + 8  # three cells, each padded by a blank either side, two bars
    title = _title(layout, version, width)
    lines = ["+" + "-" * width + "+", f"|{title:<{width}}|", _rule(frame, "-"), *frame.header]
    lines.append(_rule(frame, "="))
    for position, npu in enumerate(npus):
        last_of_card = position + 1 == len(npus) or npus[position + 1].npu_id != npu.npu_id
        lines += [_npu_row(layout, frame, npu), _chip_row(layout, frame, npu)]
        if last_of_card:
            lines.append(_rule(frame, "="))
        elif layout == "a3":
            lines.append("+" + "-" * width + "+")
        else:
            lines.append(_rule(frame, "-"))
    if frame.processes:
        lines += [_rule(frame, "-"), frame.processes, _rule(frame, "=")]
        for npu_id in sorted({npu.npu_id for npu in npus}):
            lines += [f"|{f' No running processes found in NPU {npu_id}':<{width}}|"]
            lines.append(_rule(frame, "="))
    return "\n".join(lines) + "\n"


def _title(layout: Layout, version: str, width: int) -> str:
    if layout == "legacy":
        return f" npu-smi {LEGACY_TOOL_VERSION:<25}Version: {version}"
    pad = 41 if layout == "inference" else 25
    return f" npu-smi {version:<{pad}}Version: {version}"[:width]


def _rule(frame: _Frame, char: str) -> str:
    return "+" + "+".join(char * (w + 2) for w in frame.widths) + "+"


def _row(frame: _Frame, *cells: str) -> str:
    return "|" + "|".join(f" {c:<{w}} " for c, w in zip(cells, frame.widths, strict=True)) + "|"


def _npu_row(layout: Layout, frame: _Frame, npu: SimNpu) -> str:
    temp = str(40 + npu.index % 5)
    if layout == "inference":
        figures = f"{'NA':<13}{temp:<18}{0:<6}/ 0"
        return _row(frame, f"{npu.npu_id:<8}{npu.chip_name}", npu.health, figures)
    power = "-" if layout == "a3" and npu.chip_id > 0 else f"{90.0 + npu.index * 0.7:.1f}"
    if layout == "legacy":
        return _row(frame, f"{npu.npu_id:<6}{npu.chip_name}", npu.health, f"{power:<11}{temp}")
    figures = f"{power:<12}{temp:<18}{0:<5}/ 0"
    return _row(frame, f"{npu.npu_id:<6}{npu.chip_name}", npu.health, figures)


def _chip_row(layout: Layout, frame: _Frame, npu: SimNpu) -> str:
    used = 3400 + npu.index
    bus = npu.bus_id.upper()
    if layout == "inference":
        memory = f"{'0':<13}{used:<5}/ {npu.memory_mib}"
        return _row(frame, f"{npu.chip_id:<8}{npu.index}", bus, memory)
    ddr = f"{0:<5}/ {npu.ddr_mib:<11}" if layout != "legacy" else f"{used:<5}/ {npu.ddr_mib:<11}"
    hbm = f"{used:<5}/ {npu.memory_mib}" if layout != "legacy" else f"{0:<5}/ {npu.memory_mib}"
    first = f"{npu.chip_id:<6}{npu.index}" if layout == "a3" else str(npu.chip_id)
    aicore = f"{'0':<11}" if layout == "legacy" else f"{'0':<12}"
    return _row(frame, first, bus, aicore + ddr + hbm)


def npu_smi_map(layout: Layout, npus: Sequence[SimNpu]) -> str:
    """`npu-smi info -m`: NPU id, chip id, chip logic id (and on A3 the Phy-ID) and chip name in
    31-wide columns, tab-indented."""
    head = ["NPU ID", "Chip ID", "Chip Logic ID", "Chip Name"]
    if layout == "a3":
        head.insert(3, "Chip Phy-ID")
    rows = [head]
    for npu in npus:
        row = [str(npu.npu_id), str(npu.chip_id), str(npu.index), f"Ascend {npu.chip_name}"]
        if layout == "a3":
            row[3:] = [str(npu.index), npu.chip_name]
        rows.append(row)
    return "".join("\t" + "".join(f"{cell:<31}" for cell in row) + "\n" for row in rows)


def npu_smi_topo(
    layout: Layout, npus: Sequence[SimNpu], *, links: str, cpus: dict[int, str]
) -> str:
    """`npu-smi info -t topo`. `standard`/`legacy`: `NPU<id>` labels in 11-wide columns, a
    `CPU Affinity` column (npu-smi 24.1 on 910B3), HCCS between every pair when `links` is
    `all`, else PHB within a NUMA node and SYS across. `a3`: `Phy-ID<n>` labels, SIO between the
    dies of one NPU, HCCS_SW between the others, no CPU Affinity (as an A3 prints it).
    `inference`: the line npu-smi prints where the device has no topology to show."""
    if layout == "inference":
        return "This device does not support querying topo.\n"

    def cell(a: SimNpu, b: SimNpu) -> str:
        if a.index == b.index:
            return "X"
        if layout == "a3":
            return "SIO" if a.npu_id == b.npu_id else "HCCS_SW"
        if links == "all":
            return "HCCS"
        return "PHB" if a.numa_node == b.numa_node else "SYS"

    label = "Phy-ID" if layout == "a3" else "NPU"

    def name(npu: SimNpu) -> str:
        return f"{label}{npu.index if layout == 'a3' else npu.npu_id}"

    header = "".join(f"{name(n):<11}" for n in npus)
    if layout == "a3":
        head = " " * 11 + header.rstrip()
        rows = [
            f"{name(a):<11}" + "".join(f"{cell(a, b):<11}" for b in npus).rstrip() for a in npus
        ]
        legend: tuple[str, ...] = _A3_LEGEND
    else:
        head = "\t   " + header + "CPU Affinity"
        rows = [
            f"{name(a):<11}" + "".join(f"{cell(a, b):<11}" for b in npus) + cpus[a.numa_node]
            for a in npus
        ]
        legend = _LEGEND
    return "\n".join([head, *rows, "", "Legend:", "", *legend]) + "\n"


_LEGEND = (
    "  X    = Self",
    "  SYS  = Path traversing PCIe and NUMA nodes. Nodes are connected through SMP, such as QPI, "
    "UPI.",
    "  PHB  = Path traversing PCIe and the PCIe host bridge of a CPU.",
    "  PIX  = Path traversing a single PCIe switch",
    "  PXB  = Path traversing multipul PCIe switches",
    "  HCCS = Connection traversing HCCS.",
    "  NA   = Unknown relationship.",
)
_A3_LEGEND = (
    *_LEGEND[:-1],
    "  SIO  = Path traversing the SIO bus",
    "  HCCS_SW = Connection traversing HCCS through a switch",
    _LEGEND[-1],
)
