"""Host-root trees whose vendor tool prints a recorded real output (tests/fixtures/real/).

Each tree holds what discovery reads besides the tool: the device nodes (`/dev/davinci<N>`,
`/dev/xpu<N>`) or the Hygon DRM cards in sysfs, and a stand-in for the tool that prints, for each
argument list it is given, the file recorded for it (or fails like a tool that cannot run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from edl_agent.devices import ascend, hygon, kunlunxin

REAL = Path(__file__).parent / "fixtures" / "real"
RECONSTRUCTED = Path(__file__).parent / "fixtures" / "reconstructed"

ASCEND_TOOL = "/usr/local/Ascend/driver/tools/npu-smi"
KUNLUNXIN_TOOL = "/usr/local/bin/xpu-smi"
HYGON_TOOL = "/opt/hyhal/bin/hy-smi"

_STAND_IN = """#!/bin/sh
# Prints the output recorded for these arguments; any other call fails.
answer="$(dirname "$0")/.answers/$(printf '%s_' "$@")"
[ -f "$answer" ] && exec cat "$answer"
echo "$(basename "$0") (recorded): no output recorded for: $*" >&2
exit 1
"""


def sample(path: str) -> str:
    """A corpus file by its path under tests/fixtures/ (`real/ascend/...`)."""
    return (REAL.parent / path).read_text(encoding="utf-8")


def _write(root: Path, host_path: str, text: str = "", mode: int = 0o644) -> None:
    local = root / host_path.lstrip("/")
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_text(text, encoding="utf-8")
    local.chmod(mode)


def stand_in(root: Path, tool: str, answers: Mapping[Sequence[str], str]) -> None:
    """The tool at host path `tool`, printing `answers[args]` when run with `args`."""
    _write(root, tool, _STAND_IN, mode=0o755)
    for args, text in answers.items():
        name = "".join(f"{arg}_" for arg in args)
        _write(root, f"{tool.rsplit('/', 1)[0]}/.answers/{name}", text)


def ascend_node(
    root: Path,
    devices: Sequence[int],
    info: str,
    *,
    topo: str | None = None,
    health: Mapping[tuple[int, int], str] | None = None,
) -> Path:
    """/dev/davinci<N> for each of `devices`, the shared nodes, and npu-smi printing `info`
    (and `topo`, and per (npu, chip) `health`)."""
    for node in (*ascend.SHARED_NODES, *(f"/dev/davinci{n}" for n in devices)):
        _write(root, node, mode=0o666)
    answers: dict[Sequence[str], str] = {ascend.QUERY_ARGS: info}
    if topo is not None:
        answers[ascend.TOPO_ARGS] = topo
    for (npu, chip), text in (health or {}).items():
        args = tuple(arg.format(npu=npu, chip=chip) for arg in ascend.HEALTH_ARGS)
        answers[args] = text
    stand_in(root, ASCEND_TOOL, answers)
    return root


def kunlunxin_node(
    root: Path, devices: Sequence[int], query: str | None, *, listing: str | None = None
) -> Path:
    """/dev/xpu<N> for each of `devices`, /dev/xpuctrl, and xpu-smi printing `query` for -q
    (failing when it is None) and `listing` for -L."""
    for node in (kunlunxin.CONTROL_NODE, *(f"/dev/xpu{n}" for n in devices)):
        _write(root, node, mode=0o666)
    answers: dict[Sequence[str], str] = {}
    if query is not None:
        answers[kunlunxin.QUERY_ARGS] = query
    if listing is not None:
        answers[kunlunxin.LIST_ARGS] = listing
    stand_in(root, KUNLUNXIN_TOOL, answers)
    return root


def hygon_node(
    root: Path,
    cards: Sequence[str],
    *,
    query: str | None = None,
    status: str | None = None,
    tool: str = HYGON_TOOL,
) -> Path:
    """A Hygon DRM card (`card1`, `card2`, ...; card0 is left to a BMC's VGA) with a render node
    for each PCI address in `cards`, /dev/kfd, and the tool at `tool` printing `query` for the
    discovery flags and `status` for the poller's."""
    _write(root, "/dev/kfd", mode=0o666)
    for number, bus_id in enumerate(cards, start=1):
        pci = root / "sys/bus/pci/devices" / bus_id
        (pci / "drm" / f"renderD{127 + number}").mkdir(parents=True)
        (pci / "vendor").write_text(hygon.PCI_VENDOR + "\n")
        card = root / "sys/class/drm" / f"card{number}"
        card.mkdir(parents=True)
        (card / "device").symlink_to(f"../../../bus/pci/devices/{bus_id}")
        _write(root, f"/dev/dri/card{number}", mode=0o666)
        _write(root, f"/dev/dri/renderD{127 + number}", mode=0o666)
    answers: dict[Sequence[str], str] = {}
    if query is not None:
        answers[hygon.QUERY_ARGS] = query
    if status is not None:
        answers[hygon.STATUS_ARGS] = status
    stand_in(root, tool, answers)
    return root
