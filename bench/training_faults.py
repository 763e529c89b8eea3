"""Training through faults, measured: rounds of the training tests (an elastic job of 3 workers
on 3 real kubelet v1.37 nodes with the agents, kube-scheduler, kube-controller-manager and the
restarter; see each test's docstring), each fault's fault → replacement Running → training
resumed at world size 3, read from the trainers' own logs. One stack a column: `bare`
(tests/cluster/test_training.py: PaddlePaddle, the workers are bare pods, as a gang scheduler or
an operator makes them), `jobset` (tests/cluster/test_training_jobset.py: deploy/examples'
paddle-elastic-jobset.yaml, a JobSet admitted by Kueue, the workers an Indexed Job's pods) and
`torchrun` (the same test with torchrun-elastic-jobset.yaml: torchrun's c10d rendezvous).

    .venv/bin/python bench/training_faults.py [--quick] [--rounds 3] [--stacks bare,jobset,torchrun]

Prints per stack and scenario `training_<stack>_<scenario>_fault_to_training_resumed_p50 <s> s`
(and the replacement's p50, and the steps lost at most) over the rounds. Full mode only: one
round takes about 5 minutes a stack on 2 cores (torch's environment installs first, ~2 min);
`--quick` prints nothing and exits 0. The baseline (the same XID with the restarter stopped) has
no resumption to time: its note says what happened.

The side by side is Kubernetes' own: without a restarter a pod on a dead node is evicted after
the taint-based eviction's default 300 s toleration, and nothing replaces a bare pod at all.

Exit status 3 when the Kubernetes binaries or the trainer's environment cannot be had; 1 when a
round fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchstats import run_test_for_figures

REPO = Path(__file__).resolve().parent.parent
JOBSET_TEST = "tests/cluster/test_training_jobset.py::test_a_jobset_trains_through_faults_without_a_gang_restart"  # noqa: E501
STACKS = {
    "bare": "tests/cluster/test_training.py::test_training_keeps_going_through_faults",
    "jobset": f"{JOBSET_TEST}[paddle]",
    "torchrun": f"{JOBSET_TEST}[torchrun]",
}
TRAINERS = {"bare": "paddle", "jobset": "paddle", "torchrun": "torch"}


def slug(scenario: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", scenario.lower()).strip("_")[:40]


def one_round(number: int, stack: str) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="edl-training-bench-") as scratch:
        figures = Path(scratch) / "figures.json"
        env = {**os.environ, "TRAINING_FIGURES_FILE": str(figures)}
        run_test_for_figures(REPO, STACKS[stack], env, f"training_faults {stack} round {number}")
        if not figures.exists():
            raise SystemExit(1)
        rounds: list[dict[str, Any]] = json.loads(figures.read_text())
        return rounds


def environments_ready(stacks: list[str]) -> bool:
    """The trainers' environments the stacks need, installed (scripts/trainer-env)."""
    trainer_env = str(REPO / "scripts" / "trainer-env")
    return all(
        subprocess.run([trainer_env, trainer], check=False).returncode == 0
        for trainer in sorted({TRAINERS[s] for s in stacks})
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="print nothing (full mode only)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the whole job (3)")
    parser.add_argument(
        "--stacks",
        default=",".join(STACKS),
        help=f"the stacks to run, comma-separated, of {', '.join(STACKS)} (all)",
    )
    args = parser.parse_args()
    stacks = [s for s in args.stacks.split(",") if s]
    unknown = sorted(set(stacks) - set(STACKS))
    if unknown or not stacks:
        parser.error(f"unknown stack {', '.join(unknown)} (choose from {', '.join(STACKS)})")
    if args.quick:
        print("[training_faults] full mode only", file=sys.stderr)
        return 0
    if not environments_ready(stacks):
        return 3
    by_scenario: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for number in range(1, args.rounds + 1):
        for stack in stacks:
            for figure in one_round(number, stack):
                by_scenario.setdefault((stack, str(figure["scenario"])), []).append(figure)
    for (stack, scenario), figures in by_scenario.items():
        # A stack's test may name its scenarios after it ("JobSet: ..."): said once is enough.
        bare = scenario.split(": ", 1)[1] if scenario.lower().startswith(f"{stack}: ") else scenario
        name = f"training_{stack}_{slug(bare)}"
        for key, label in (
            ("fault_to_training_resumed_s", "fault_to_training_resumed_p50"),
            ("fault_to_replacement_running_s", "fault_to_replacement_running_p50"),
            ("fault_to_training_going_s", "fault_to_training_going_p50"),
        ):
            values = [float(f[key]) for f in figures if f.get(key) is not None]
            if values:
                print(f"{name}_{label} {statistics.median(values):.2f} s")
        lost = [int(f["steps_lost"]) for f in figures if f.get("steps_lost") is not None]
        if lost:
            print(f"{name}_steps_lost_max {max(lost)} steps")
        for figure in figures:
            if figure.get("fault_to_training_resumed_s") is None and figure.get("note"):
                print(f"[training_faults] {scenario}: {figure['note']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
