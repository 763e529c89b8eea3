"""Goodput from the trainers' own reports (bench/goodput.py; definitions in bench/README.md).

- The fault-free step time: wall time over the steps of a run with no fault.
- Effective training time of a run: useful steps times the fault-free step time, over its wall
  time. A useful step is one the job keeps: the step reached at the end minus the step at the
  start (steps re-done after resuming from a checkpoint count once).
- A fault's cost: the wall time from it to the next fault (or the end) minus the time the
  progress made in between would take without faults. It holds both the time to recover and
  the steps lost (re-done).
- At another fault rate (one per `every` seconds), with the measured mean cost per fault:
  effective training time = 1 - cost / every.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tests.training.progress import Report


@dataclass(frozen=True)
class Fault:
    kind: str
    at: float


@dataclass(frozen=True)
class FaultCost:
    kind: str
    at: float
    seconds: float  # training time it cost


class Progress:
    """The newest step the job reported at any time (the step its trainers were at)."""

    def __init__(self, reports: Iterable[Report]) -> None:
        steps = sorted((r.t, r.step) for r in reports if r.event == "step")
        self._times = [t for t, _ in steps]
        self._steps = [s for _, s in steps]

    def at(self, t: float) -> int:
        """The step of the last report at or before `t` (0 before any)."""
        index = bisect.bisect_right(self._times, t)
        return self._steps[index - 1] if index else 0


def step_time(reports: Iterable[Report], start: float, end: float) -> float:
    """Seconds per step of a fault-free run between `start` and `end` (its first and last
    reports in that span)."""
    steps = sorted((r.t, r.step) for r in reports if r.event == "step" and start <= r.t <= end)
    if len(steps) < 2 or steps[-1][1] <= steps[0][1]:
        raise ValueError("too few steps to time")
    (t0, s0), (t1, s1) = steps[0], steps[-1]
    return (t1 - t0) / (s1 - s0)


def effective(
    reports: Iterable[Report], start: float, end: float, seconds_per_step: float
) -> float:
    """Useful steps times the fault-free step time, over the wall time from `start` to `end`."""
    progress = Progress(reports)
    useful = progress.at(end) - progress.at(start)
    return useful * seconds_per_step / (end - start)


def costs(
    reports: Iterable[Report], faults: Sequence[Fault], end: float, seconds_per_step: float
) -> list[FaultCost]:
    """Each fault's cost: the wall time to the next fault (or `end`) less what the progress
    made in it would have taken without faults."""
    progress = Progress(reports)
    found = []
    ordered = sorted(faults, key=lambda f: f.at)
    for fault, until in zip(ordered, [*(f.at for f in ordered[1:]), end], strict=True):
        made = progress.at(until) - progress.at(fault.at)
        found.append(FaultCost(fault.kind, fault.at, (until - fault.at) - made * seconds_per_step))
    return found


def mean_cost_by_kind(found: Iterable[FaultCost]) -> dict[str, float]:
    kinds: dict[str, list[float]] = {}
    for cost in found:
        kinds.setdefault(cost.kind, []).append(cost.seconds)
    return {kind: statistics.fmean(seconds) for kind, seconds in sorted(kinds.items())}


def projected(mean_cost: float, every: float) -> float:
    """Effective training time at one fault per `every` seconds, each costing `mean_cost`."""
    return max(0.0, 1.0 - mean_cost / every)


def mix_cost(by_kind: Mapping[str, float], mix: Mapping[str, float]) -> float:
    """The mean cost of a fault drawn from `mix` (kind → share, summing to 1)."""
    return sum(by_kind[kind] * share for kind, share in mix.items())
