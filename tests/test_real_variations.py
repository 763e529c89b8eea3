"""Variations of npu-smi's output between nodes and versions, applied to one real sample each
(tests/fixtures/real/): the parsers must read every variant the same way. The edits are ours;
Power `NA` and `-` are in the 300I Duo and A3 samples, the others are reported but not in the
corpus (SOURCES.md there)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from edl_agent.devices import ascend
from tests.real_nodes import sample

INFO_910B4 = sample("real/ascend/910b4-npu-smi-24.1.rc3-info.txt")
TOPO_910B = sample("real/ascend/910b-npu-smi-topo-hccs.txt")


def widen_third_column(text: str, extra: int) -> str:
    """Every table line's last column `extra` characters wider (npu-smi 26.0 prints 70 wide,
    seen only in excerpts: SOURCES.md)."""
    lines = []
    for line in text.splitlines():
        if line[:1] in "|+" and len(line) > 1:
            fill = line[-2] if line[0] == "+" else " "
            lines.append(line[:-1] + fill * extra + line[-1])
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def npu_ids(first: str, second: str) -> Callable[[str], str]:
    """NPU ids as large as some nodes are reported to print (215, 2048); no sample in the corpus
    shows one."""

    def edit(text: str) -> str:
        text = text.replace("| 0     910B4     ", f"| {first:<5} 910B4     ", 1)
        return text.replace("| 1     910B4     ", f"| {second:<5} 910B4     ", 1)

    return edit


VARIANTS: dict[str, Callable[[str], str]] = {
    "as printed": lambda text: text,
    "third column 70 wide": lambda text: widen_third_column(text, 18),
    "npu ids 215 and 2048": npu_ids("215", "2048"),
    "power NA and -": lambda text: text.replace("| 85.0   ", "| NA     ", 1).replace(
        "| 84.2   ", "| -      ", 1
    ),
    "windows line ends": lambda text: text.replace("\n", "\r\n"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_npu_smi_info_variants_read_alike(variant: str) -> None:
    info = ascend.parse_npu_smi_info(VARIANTS[variant](INFO_910B4))
    assert info.problems == ()
    assert [(n.index, n.name, n.health) for n in info.npus] == [
        (i, "910B4", "OK") for i in range(8)
    ]
    assert [n.memory_mib for n in info.npus] == [32768] * 8
    assert info.npus[0].bus_id == "0000:c1:00.0"
    if variant == "npu ids 215 and 2048":
        assert [n.npu_id for n in info.npus[:2]] == [215, 2048]
    if variant == "power NA and -":
        assert [n.power_w for n in info.npus[:3]] == [None, None, info.npus[2].power_w]


TOPO_VARIANTS: dict[str, Callable[[str], str]] = {
    "as printed": lambda text: text,
    "header indented with spaces": lambda text: text.replace("\t   ", "           ", 1),
    "trailing blanks": lambda text: re.sub(r"(?m)$", "   ", text),
    "legend without blank line": lambda text: text.replace("Legend:\n\n", "Legend:\n"),
    "no legend": lambda text: text.split("\nLegend:", 1)[0] + "\n",
}


@pytest.mark.parametrize("variant", list(TOPO_VARIANTS))
def test_npu_smi_topo_variants_read_alike(variant: str) -> None:
    topo = ascend.parse_npu_smi_topo(TOPO_VARIANTS[variant](TOPO_910B))
    assert topo.problems == ()
    assert topo.npus == tuple(range(8))
    assert {cell for (a, b), cell in topo.cells.items() if a != b} == {"HCCS"}
    assert topo.cpu_affinity[0] == "144-167"
