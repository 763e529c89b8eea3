"""The fleet bench at a size CI can hold (bench/fleet_scale.py, on a control plane of its own):
500 KWOK nodes, 5,000 pods over 50 jobs in five namespaces, two restarter replicas, 500 agents'
TLS channels with tokens bound to their nodes; a burst of one report from every node, a steady
load, the leader SIGKILLed under load, and a rack of nodes NotReady past the storm guard.

Nothing lost (every faulted pod replaced), nothing doubled (none replaced twice), nothing
replaced unasked (the rack's returned nodes keep their pods: the storm guard held), every
report taken (accepted, or a duplicate of one accepted), every channel opened. The figures
themselves are the benchmark's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NODES = 500


def run_bench(tmp_path: Path) -> dict[str, float]:
    argv = [
        sys.executable, str(REPO / "bench" / "fleet_scale.py"),
        "--nodes", str(NODES), "--pods", "5000", "--jobs", "50",
        "--steady-seconds", "5", "--kill-seconds", "15", "--idle-seconds", "1", "--rack", "50",
    ]  # fmt: skip
    log = tmp_path / "fleet.log"
    env = os.environ | {"TMPDIR": str(tmp_path)}  # the bench's scratch inside the test's
    with log.open("wb") as err:
        done = subprocess.run(
            argv, stdout=subprocess.PIPE, stderr=err, env=env, timeout=840, check=False
        )
    figures: dict[str, float] = {}
    for line in done.stdout.decode().splitlines():
        name, value, *_ = [*line.split(), ""]
        try:
            figures[name] = float(value)
        except ValueError:
            continue
    if done.returncode != 0 and "fleet_lost" not in figures:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        pytest.fail(f"the fleet bench failed ({done.returncode}):\n{tail}")
    return figures


@pytest.mark.timeout(900)  # about 3 minutes on 2 cores
def test_a_fleet_s_faults_are_each_acted_on_once(tmp_path: Path) -> None:
    figures = run_bench(tmp_path)
    assert figures["fleet_channels_open"] == NODES
    assert figures["fleet_lost"] == 0
    assert figures["fleet_doubled"] == 0
    assert figures["fleet_replaced_unasked"] == 0
    assert figures["fleet_rack_replaced_while_storming"] == 0
    for load in ("burst", "steady", "kill"):
        assert figures[f"fleet_{load}_not_taken"] == 0, load
