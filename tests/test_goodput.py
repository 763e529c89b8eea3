"""Goodput arithmetic on made-up trainer reports (pure): step time, effective training time and
the cost of each fault."""

from __future__ import annotations

import pytest

from tests.training.goodput import (
    Fault,
    Progress,
    costs,
    effective,
    mean_cost_by_kind,
    mix_cost,
    projected,
    step_time,
)
from tests.training.progress import Report


def steps(*pairs: tuple[float, int]) -> list[Report]:
    return [Report(t, "step", 3, 0, step) for t, step in pairs]


def test_progress_is_the_step_of_the_last_report() -> None:
    progress = Progress(steps((10.0, 100), (20.0, 200), (25.0, 150)))
    assert progress.at(5.0) == 0
    assert progress.at(10.0) == 100
    assert progress.at(24.0) == 200
    assert progress.at(30.0) == 150  # resumed from a checkpoint: the job's step went back


def test_step_time_of_a_fault_free_run() -> None:
    reports = steps(*((float(t), 10 * t) for t in range(0, 101)))
    assert step_time(reports, 0.0, 100.0) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="too few"):
        step_time(steps((1.0, 10)), 0.0, 100.0)


def test_a_fault_costs_its_stall_and_its_lost_steps() -> None:
    # 10 steps a second; a fault at t=100 (step 1000): nothing for 15 s, then it resumes from
    # step 950 (50 steps lost) and runs on at full speed until t=200.
    reports = steps(*((float(t), 10 * t) for t in range(0, 101)))
    reports += steps(*((115.0 + t, 950 + 10 * t) for t in range(0, 86)))
    [cost] = costs(reports, [Fault("xid95", 100.0)], end=200.0, seconds_per_step=0.1)
    assert cost.seconds == pytest.approx(15.0 + 5.0)  # the stall and 50 steps re-done
    assert effective(reports, 0.0, 200.0, 0.1) == pytest.approx(1800 / 2000)


def test_costs_by_kind_and_projections() -> None:
    reports = steps((0.0, 0), (50.0, 400), (100.0, 900), (150.0, 1300), (200.0, 1800))
    faults = [Fault("xid95", 0.0), Fault("graceful", 50.0), Fault("xid95", 100.0)]
    found = costs(reports, faults, end=150.0, seconds_per_step=0.1)
    assert [round(c.seconds, 6) for c in found] == [10.0, 0.0, 10.0]
    by_kind = mean_cost_by_kind(found)
    assert by_kind == {"graceful": pytest.approx(0.0), "xid95": pytest.approx(10.0)}
    assert mix_cost(by_kind, {"xid95": 0.5, "graceful": 0.5}) == pytest.approx(5.0)
    assert projected(10.0, 120.0) == pytest.approx(1 - 10 / 120)
    assert projected(10.0, 3 * 3600.0) == pytest.approx(1 - 10 / 10800)
    assert projected(500.0, 120.0) == 0.0
