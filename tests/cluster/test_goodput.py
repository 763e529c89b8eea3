"""Goodput on real kubelets (bench/goodput.py runs this; skipped without GOODPUT_FIGURES_FILE):
the PaddlePaddle elastic job of test_training.py, once with no fault and once through a fault
schedule at a compressed rate (one fault every GOODPUT_INTERVAL seconds, cycling through a fatal
XID, a warned one that the Graceful rule turns into a saved checkpoint, a policy exit code, a
force delete, and once a node's death), each for GOODPUT_MINUTES. Each run appends one JSON line
to GOODPUT_FIGURES_FILE: its wall time, steps, the step time (fault-free) or each fault's kind
and cost (tests/training/goodput.py defines them)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import testcluster
import testnode
from k8s_test_helpers import KwokCluster
from scheduler import Process
from test_e2e import processes  # noqa: F401 - a fixture
from test_training import (  # fixtures too: pytest finds them among the module's names
    WARNED_XID,
    XID,
    Job,
    _exit,
    _force_delete,
    _kill,
    etcd,  # noqa: F401
    managed_scheduler,  # noqa: F401
    policy_crd,  # noqa: F401
    start_job,
    trainer_python,  # noqa: F401
    training_at_full_size,
    xid_on,
)

from tests.training.goodput import Fault, step_time

FIGURES = os.environ.get("GOODPUT_FIGURES_FILE", "")
MINUTES = float(os.environ.get("GOODPUT_MINUTES", "20"))
INTERVAL = float(os.environ.get("GOODPUT_INTERVAL", "120"))
CYCLE = ("xid95", "graceful", "exit101", "xid95", "force_delete", "graceful", "node_death")

pytestmark = [
    pytest.mark.kubelet,
    pytest.mark.skipif(not FIGURES, reason="a benchmark: bench/goodput.py runs it"),
]


def write(figures: dict[str, Any]) -> None:
    with Path(FIGURES).open("a") as out:
        out.write(json.dumps(figures) + "\n")


def running_job(*args: Any, **kwargs: Any) -> tuple[Job, float]:
    """The job started and making progress at full size; the time progress was first seen."""
    started = time.time()
    job = start_job(*args, **kwargs)
    training_at_full_size(job, started)
    return job, time.time()


def inject(job: Job, kind: str, turn: int, killed: set[str]) -> str | None:
    """One fault of `kind` on a Running worker (a different one each turn); None when no worker
    can take it now (all still recovering, or no node left to lose)."""
    running = [p for p in job.pods() if p.status.phase == "Running"]
    if not running:
        return None
    victim = running[turn % len(running)]
    if kind == "node_death":
        if killed:
            return None  # one node's death: the job needs the other two
        killed.add(victim.spec.node_name)
        return _kill(job, victim.spec.node_name)
    faults: dict[str, Callable[[], str]] = {
        "xid95": lambda: xid_on(job, victim, XID),
        "graceful": lambda: xid_on(job, victim, WARNED_XID),
        "exit101": lambda: _exit(job, victim, 101),
        "force_delete": lambda: _force_delete(job, victim),
    }
    return faults[kind]()


def clean(job: Job) -> None:
    for pod in job.pods():
        job.k8s.core.delete_namespaced_pod(
            pod.metadata.name, job.k8s.namespace, grace_period_seconds=0
        )


@pytest.mark.timeout(int(MINUTES * 60 + 900))
@pytest.mark.parametrize("schedule", [False, True], ids=["fault_free", "faults"])
def test_a_run(  # noqa: PLR0917 - fixtures
    k8s_managed: KwokCluster,
    k8s_managed_plane: testcluster.ControlPlane,
    managed_kubelet_nodes: Callable[..., testnode.Node],
    managed_scheduler: Process,  # noqa: F811
    policy_crd: None,  # noqa: F811
    trainer_python: Path,  # noqa: F811
    etcd: str,  # noqa: F811
    processes: list[Process],  # noqa: F811
    tmp_path: Path,
    schedule: bool,
) -> None:
    """The job for MINUTES, with no fault or through the schedule."""
    job, start = running_job(
        k8s_managed,
        k8s_managed_plane,
        managed_kubelet_nodes,
        trainer_python=trainer_python,
        etcd=etcd,
        processes=processes,
        tmp_path=tmp_path,
    )
    try:
        if schedule:
            through_faults(job, start)
        else:
            end = start + MINUTES * 60
            while time.time() < end:
                job.logs.reports()  # read as it goes, as the faulty run must
                time.sleep(5.0)  # the run's length is the measurement itself
            seconds = step_time(job.logs.reports(), start, end)
            steps = round((end - start) / seconds)
            write(
                {"run": "fault_free", "wall_s": end - start, "step_time_s": seconds, "steps": steps}
            )
    finally:
        clean(job)


def through_faults(job: Job, start: float) -> None:
    """One fault every INTERVAL seconds until MINUTES are over; the run's figures written."""
    faults: list[Fault] = []
    notes: list[str] = []
    killed: set[str] = set()
    end = start + MINUTES * 60
    turn = 0
    next_fault = start + INTERVAL / 2
    while time.time() < end:
        if time.time() >= next_fault:
            kind = CYCLE[turn % len(CYCLE)]
            at = time.time()
            note = inject(job, kind, turn, killed)
            if note is not None:
                faults.append(Fault(kind, at))
                notes.append(note)
            turn += 1
            next_fault += INTERVAL
        job.logs.reports()  # read now: a replaced pod's log goes with it
        time.sleep(1.0)  # the schedule is the measurement itself
    reports = job.logs.reports()
    write(
        {
            "run": "faults",
            "wall_s": round(end - start, 3),
            "interval_s": INTERVAL,
            "faults": [
                {"kind": f.kind, "at_s": round(f.at - start, 3), "note": n}
                for f, n in zip(faults, notes, strict=True)
            ],
            "reports": [
                {"t": r.t - start, "event": r.event, "world": r.world, "step": r.step}
                for r in reports
                if start - 5 <= r.t <= end + 5
            ],
        }
    )
    # The figures are bench/goodput.py's to compute; here only that training went on.
    assert faults, "no fault could be injected"
    assert any(r.event == "step" and r.t > faults[0].at + INTERVAL / 2 for r in reports)
