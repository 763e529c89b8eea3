"""The DCMI library of a simulated Ascend node: a fake `libdcmi.so` (built from fake_dcmi.c) where
the driver installs it, its data file, and its fault events.

The data file holds one line per chip (its format is in fake_dcmi.c): what `npu-smi info` shows
for it, as DCMI reports it. `set_chip` changes a chip's health and fault codes, and appends the
events the driver raises for the change: each code that appears is raised (assertion 1), each
code that goes is recovered (assertion 0). `ascend_tree.set_npu_health` calls it, so a fault
injected into the simulated node reaches the tool and the library alike.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from edl_agent.sim import fake_lib_build
from edl_agent.sim.ascend_layout import SimNpu
from edl_agent.sim.fake_lib_build import FakeLibrary

DCMI = FakeLibrary("libdcmi.so", "fake_dcmi.c", "fake-dcmi")
LIBRARY = "/usr/local/Ascend/driver/lib64/driver/libdcmi.so"
LIBRARY_DATA = LIBRARY + ".data"
LIBRARY_EVENTS = LIBRARY + ".events"  # append-only; the library delivers what is added
HEALTH_CODES = {"ok": 0, "warning": 1, "alarm": 2, "critical": 3}
OTHER_HEALTH = 3  # a word DCMI has no value for reads as critical


def install(root: Path, npus: Sequence[SimNpu], *, hbm: bool) -> None:
    """The fake library and its data (every chip healthy) in the tree. The library is copied in
    as a new file renamed into place: a process that has the old file loaded keeps its code."""
    local = root / LIBRARY.lstrip("/")
    local.parent.mkdir(parents=True, exist_ok=True)
    staging = local.with_name(f".{local.name}.tmp")
    shutil.copyfile(fake_lib_build.library_path(DCMI), staging)
    staging.chmod(0o755)
    staging.replace(local)
    _write(root / LIBRARY_DATA.lstrip("/"), data(npus, hbm=hbm))


def data(npus: Sequence[SimNpu], *, hbm: bool) -> str:
    """One line per chip: logic ids in davinci order (as the driver numbers them on a server
    whose chips are all visible), the figures `npu-smi info` shows for a healthy chip; training
    chips (those with HBM) have a RoCE address, as `hccn_tool` would configure it."""
    lines = ["# fake DCMI data, written by edl_agent/sim/ascend_dcmi.py"]
    for logic, npu in enumerate(npus):
        domain, bus, rest = npu.bus_id.split(":")
        slot, function = rest.split(".")
        fields = {
            "card": npu.npu_id,
            "device": npu.chip_id,
            "logic": logic,
            "phy": npu.index,
            "name": npu.chip_name,
            "type": "Ascend",
            "ver": "V1",
            "aicore": 20,
            "domain": int(domain, 16),
            "bus": int(bus, 16),
            "slot": int(slot, 16),
            "func": int(function),
            "health": HEALTH_CODES.get(npu.health.lower(), OTHER_HEALTH),
            "codes": "",
            "hbm_mb": npu.memory_mib if hbm else 0,
            "hbm_used_mb": 3 if hbm else 0,
            "ddr_mb": npu.ddr_mib if hbm else npu.memory_mib,
            "ddr_util": 0,
            "temp": 40 + npu.index % 4,
            "power_dw": 905,
            "aicore_util": 0,
            "ip": f"192.168.{100 + npu.index // 8}.{npu.index % 8 + 1}" if hbm else "",
        }
        lines.append("\t".join(["chip", *(f"{key}={value}" for key, value in fields.items())]))
    return "\n".join(lines) + "\n"


def set_chip(root: Path, phy_id: int, health: str, codes: Sequence[int]) -> None:
    """Chip `phy_id` reports `health` and `codes`; the events of the change are appended. A tree
    without the library is left alone."""
    path = root / LIBRARY_DATA.lstrip("/")
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines):
        if not line.startswith("chip\t"):
            continue
        fields = dict(field.split("=", 1) for field in line.split("\t")[1:])
        if fields.get("phy") != str(phy_id):
            continue
        before = [int(code, 16) for code in fields["codes"].split(",") if code]
        value = HEALTH_CODES.get(health.strip().lower(), OTHER_HEALTH)
        fields["health"] = str(value)
        fields["codes"] = ",".join(f"{code:08X}" for code in codes)
        lines[number] = "\t".join(["chip", *(f"{k}={v}" for k, v in fields.items())])
        _write(path, "\n".join(lines) + "\n")
        logic = int(fields["logic"])
        raised = [code for code in codes if code not in before]
        recovered = [code for code in before if code not in codes]
        events = [(code, 1) for code in raised] + [(code, 0) for code in recovered]
        append_events(root, [(logic, code, value, assertion) for code, assertion in events])
        return


def append_events(root: Path, events: Sequence[tuple[int, int, int, int]], name: str = "") -> None:
    """Fault events (logic id, event id, severity, assertion) for the library to deliver."""
    if not events:
        return
    with (root / LIBRARY_EVENTS.lstrip("/")).open("a", encoding="utf-8") as file:
        for logic, code, severity, assertion in events:
            text = " ".join((name or f"simulated event {code:08X}").split())[:200]
            file.write(
                f"event\tlogic={logic}\tid={code:08X}\tseverity={severity}"
                f"\tassertion={assertion}\tname={text}\n"
            )


def reset_script_lines() -> str:
    """Shell lines for the npu-smi stand-in's reset of NPU `$npu`: its chips read healthy, with
    no codes, in the library's data too. No recovery event is written: the reset is known by
    the next read finding the chip clean."""
    return (
        '    data="$here/../lib64/driver/libdcmi.so.data"\n'
        '    [ -f "$data" ] && sed -i -E '
        '"/^chip\\tcard=$npu\\t/ '
        '{ s/\\thealth=[0-9]+/\\thealth=0/; s/\\tcodes=[^\\t]*/\\tcodes=/ }"'
        ' "$data"\n'
    )


def _write(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(text, encoding="utf-8")
    staging.replace(path)  # the library re-reads the file: it must never see half of it


def remove(root: Path) -> None:
    """The node's driver without its DCMI library: Ascend is read through `npu-smi` alone."""
    for name in (LIBRARY, LIBRARY_DATA, LIBRARY_EVENTS):
        (root / name.lstrip("/")).unlink(missing_ok=True)
