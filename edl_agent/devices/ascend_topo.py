"""`npu-smi info -t topo`: the NPU-by-NPU matrix, text in, cells out. Pure.

Layouts read (tests/fixtures/real/ascend/SOURCES.md):
- 910B (npu-smi 23/24): labels `NPU<id>` (the NPU id of `npu-smi info`), header indented with a
  tab or spaces, a `CPU Affinity` column, cells HCCS / PIX / PXB / PHB / SYS / NA.
- Atlas A3 / 910C: labels `Phy-ID<n>` (the die's physical id, N of /dev/davinci<N>), cells SIO
  (the two dies of one NPU) and HCCS_SW (HCCS through the switch), no CPU Affinity column.
- Atlas 350 adds UB cells (read like the others; no recorded sample).
The legend (with or without a blank line after `Legend:`) ends the matrix. A row shorter than the
header keeps the cells it has; a missing row leaves that NPU's pairs unknown (both noted in
`problems`). Output without a header is refused, except npu-smi's own "does not support" line,
which reads as an empty matrix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from edl_agent.devices.ascend_smi import NpuSmiParseError

_LABEL = re.compile(r"^(NPU|Phy-ID)(\d+)$")
_TITLE_SPLIT = re.compile(r"\s{2,}|\t")
_UNSUPPORTED = re.compile(r"does not support", re.IGNORECASE)


@dataclass(frozen=True)
class NpuTopo:
    """The ids in column order, each pair's cell (`HCCS`, `SIO`, `PIX`, `NA`, ...) and each id's
    `CPU Affinity` text. `label` says what the ids are: `NPU` (NPU ids) or `Phy-ID` (dies)."""

    npus: tuple[int, ...]
    cells: dict[tuple[int, int], str]
    cpu_affinity: dict[int, str]
    label: str = "NPU"
    problems: tuple[str, ...] = ()
    unsupported: str | None = None  # npu-smi's own "does not support" line, when it printed one


def parse_npu_smi_topo(text: str) -> NpuTopo:
    ids: tuple[int, ...] = ()
    label = "NPU"
    trailing: list[str] = []
    cells: dict[tuple[int, int], str] = {}
    affinity: dict[int, str] = {}
    problems: list[str] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if line.startswith("Legend"):
            break
        if not ids:
            titles = _TITLE_SPLIT.split(line)
            if _is_header(titles):
                columns = [t for t in titles if _LABEL.match(t)]
                first = _LABEL.match(columns[0])
                label = first.group(1) if first else label
                ids = tuple(int(t[len(label) :]) for t in columns)
                trailing = titles[len(columns) :]
            continue
        tokens = line.split()
        row = _LABEL.match(tokens[0]) if tokens else None
        if row is None or int(row.group(2)) not in ids:
            continue
        number = int(row.group(2))
        values = tokens[1 : 1 + len(ids)]
        if len(values) < len(ids):
            problems.append(f"line {lineno}: {len(values)} of {len(ids)} cells for {tokens[0]}")
        cells.update(((number, column), value) for column, value in zip(ids, values, strict=False))
        extra = dict(zip(trailing, tokens[1 + len(ids) :], strict=False))
        if "CPU Affinity" in extra:
            affinity[number] = extra["CPU Affinity"]
    if not ids:
        if _UNSUPPORTED.search(text):
            return NpuTopo(npus=(), cells={}, cpu_affinity={}, unsupported=text.strip()[:200])
        raise NpuSmiParseError("no `NPU0 NPU1 ...` or `Phy-ID0 Phy-ID1 ...` header")
    problems += [f"no row for {label}{n}" for n in ids if (n, n) not in cells]
    return NpuTopo(
        npus=ids, cells=cells, cpu_affinity=affinity, label=label, problems=tuple(problems)
    )


def _is_header(titles: list[str]) -> bool:
    """`NPU0  NPU1 ...`, `NPU0  CPU Affinity` or `Phy-ID12  Phy-ID13`; a row starts `NPU0  X`."""
    if not titles or not _LABEL.match(titles[0]):
        return False
    rest = titles[1:]
    return not rest or bool(_LABEL.match(rest[0])) or rest == ["CPU Affinity"]
