"""Goodput, measured: the real PaddlePaddle elastic job of tests/cluster/test_training.py (3
workers on 3 real kubelet v1.37 nodes, the agents, kube-scheduler, kube-controller-manager and
the restarter) for `--minutes` with no fault, then as long through a fault schedule at a
compressed rate (one fault every `--interval` seconds: XID 95, XID 94 made a graceful
replacement, a policy exit code, a force delete, once a node's death), run by
tests/cluster/test_goodput.py.

    .venv/bin/python bench/goodput.py [--quick] [--minutes 20] [--interval 120]

Prints the fault-free step time, the effective training time of the faulty run (useful steps
times the fault-free step time, over its wall time; bench/README.md), each fault kind's mean
cost in seconds of training and the steps lost (from each recovery of the trainers' own logs),
and the effective training time the measured costs give at Llama 3's rate of one interruption
every 3 hours, with the arithmetic on stderr. Full mode only (two runs of `--minutes` and the
set-up: about twice the minutes, plus 6, on 2 cores); `--quick` prints nothing and exits 0.

Exit status 3 when the Kubernetes binaries or the trainer's environment cannot be had; 1 when a
run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchstats import run_test_for_figures  # noqa: E402

from tests.training.goodput import (  # noqa: E402 - the repository's root goes on the path first
    Fault,
    costs,
    effective,
    mean_cost_by_kind,
    projected,
)
from tests.training.progress import Report, recovery  # noqa: E402

TEST = "tests/cluster/test_goodput.py"
LLAMA3_EVERY_S = 3 * 3600.0  # 466 interruptions in 54 days on 16,384 H100s: about one per 3 h
WORLD = 3


def run(minutes: float, interval: float) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="edl-goodput-") as scratch:
        figures = Path(scratch) / "figures.jsonl"
        env = {
            **os.environ,
            "GOODPUT_FIGURES_FILE": str(figures),
            "GOODPUT_MINUTES": str(minutes),
            "GOODPUT_INTERVAL": str(interval),
        }
        run_test_for_figures(REPO, TEST, env, f"goodput, {minutes:g} min per run")
        if not figures.exists():
            raise SystemExit(1)
        return [json.loads(line) for line in figures.read_text().splitlines() if line]


def report(free: dict[str, Any], faulty: dict[str, Any]) -> None:
    step = float(free["step_time_s"])
    wall = float(faulty["wall_s"])
    reports = [Report(r["t"], r["event"], r["world"], 0, r["step"]) for r in faulty["reports"]]
    faults = [Fault(f["kind"], f["at_s"]) for f in faulty["faults"]]
    ratio = effective(reports, 0.0, wall, step)
    found = costs(reports, faults, wall, step)
    by_kind = mean_cost_by_kind(found)
    print(f"goodput_fault_free_step_time {step * 1000:.2f} ms")
    print(f"goodput_faults {len(faults)} faults")
    print(f"goodput_effective_training_time_every_{faulty['interval_s']:g}s {ratio * 100:.1f} %")
    for kind, seconds in by_kind.items():
        print(f"goodput_cost_{kind} {seconds:.1f} s")
        lost = [
            found_one.steps_lost
            for fault in faults
            if fault.kind == kind and (found_one := recovery(reports, fault.at, WORLD)) is not None
        ]
        if lost:
            print(f"goodput_steps_lost_{kind}_max {max(lost)} steps")
    mean = sum(c.seconds for c in found) / len(found)
    at_llama = projected(mean, LLAMA3_EVERY_S)
    print(f"goodput_projected_effective_training_time_every_3h {at_llama * 100:.2f} %")
    print(
        f"[goodput] at one fault per {LLAMA3_EVERY_S:.0f} s, each costing the measured mean of "
        f"{mean:.1f} s: 1 - {mean:.1f} / {LLAMA3_EVERY_S:.0f} = {at_llama:.4f} (a real job also "
        "loses up to one checkpoint interval per unwarned fault; this job checkpoints every "
        f"50 steps, {50 * step:.1f} s)",
        file=sys.stderr,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="print nothing (full mode only)")
    parser.add_argument("--minutes", type=float, default=20.0, help="each run's length (20)")
    parser.add_argument("--interval", type=float, default=120.0, help="seconds between faults")
    args = parser.parse_args()
    if args.quick:
        print("[goodput] full mode only", file=sys.stderr)
        return 0
    if args.minutes <= 0 or args.interval <= 0:
        parser.error("--minutes and --interval must be positive")
    trainer_env = [str(REPO / "scripts" / "trainer-env"), "paddle"]
    if subprocess.run(trainer_env, check=False).returncode != 0:
        return 3
    runs = {figures["run"]: figures for figures in run(args.minutes, args.interval)}
    if set(runs) != {"fault_free", "faults"}:
        print(f"[goodput] runs missing: {sorted(runs)}", file=sys.stderr)
        return 1
    report(runs["fault_free"], runs["faults"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
