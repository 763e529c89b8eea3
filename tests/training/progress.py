"""What the trainers' own logs say about a training job: formations (who started, at which world
size, resumed from which checkpoint) and progress (steps at a world size), and from them how a
fault went: when training was back at full size and how many steps were lost.

The trainer (train.py) prints one JSON object per line; a pod's log holds them among the
launcher's own lines, each maybe in CRI log format (`<time> stdout F <line>`)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Report:
    """One line a trainer printed."""

    t: float
    event: str  # "start" or "step"
    world: int
    rank: int
    step: int  # for "start": the checkpoint it resumed from (0: none)
    source: str = ""


def parse(text: str, source: str = "") -> list[Report]:
    """The trainer's reports in a log, in order; other lines are skipped."""
    reports = []
    for line in text.splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            fields = json.loads(line[start:])
        except ValueError:
            continue
        if not isinstance(fields, dict) or fields.get("event") not in ("start", "step"):
            continue
        step = fields["resumed_from"] if fields["event"] == "start" else fields["step"]
        reports.append(
            Report(
                float(fields["t"]),
                fields["event"],
                int(fields["world"]),
                int(fields["rank"]),
                int(step),
                source,
            )
        )
    return reports


@dataclass(frozen=True)
class Recovery:
    """How training went through a fault at `fault_at`."""

    last_step_before: int  # the newest step the formation the fault hit reported before it broke
    resumed_at: float  # first step at full size reported by a formation started after it
    resumed_from: int  # the checkpoint that formation started from
    world: int
    going_again_at: float  # first step after the job re-formed, at whatever size
    going_again_world: int

    @property
    def steps_lost(self) -> int:
        return max(0, self.last_step_before - self.resumed_from)


def recovery(reports: Iterable[Report], fault_at: float, world: int) -> Recovery | None:
    """The recovery after `fault_at` at world size `world`, or None while it has not happened:
    a formation of `world` trainers started after the fault and one of them made a step."""
    ordered = sorted(reports, key=lambda r: r.t)
    restarts = [r for r in ordered if r.event == "start" and r.t > fault_at]
    starts = [r for r in restarts if r.world == world]
    if not starts:
        return None
    # Trainers may go on after the fault until the job breaks up (a pod being replaced stops
    # a moment later): their last steps before the first re-formation are what could be lost.
    broke_at = restarts[0].t
    # ... made by the formation the fault hit: steps of an earlier one (before an earlier fault
    # and its resumption from an older checkpoint) were never this fault's to lose.
    formed_at = max((r.t for r in ordered if r.event == "start" and r.t <= fault_at), default=0.0)
    before = [r.step for r in ordered if r.event == "step" and formed_at <= r.t < broke_at]
    # The formation that made progress: the last start before the first full-size step after
    # the first start (earlier formations may have broken up again).
    first_start = starts[0].t
    for report in ordered:
        if report.event == "step" and report.world == world and report.t > first_start:
            formed = [s for s in starts if s.t <= report.t]
            going = next(r for r in ordered if r.event == "step" and r.t > broke_at)
            return Recovery(
                last_step_before=max(before, default=0),
                resumed_at=report.t,
                resumed_from=formed[-1].step,
                world=world,
                going_again_at=going.t,
                going_again_world=going.world,
            )
    return None


def progressing(reports: Iterable[Report], world: int, since: float, steps: int) -> bool:
    """True once trainers at world size `world` reported `steps` steps' progress after `since`."""
    seen = [r.step for r in reports if r.event == "step" and r.world == world and r.t > since]
    return bool(seen) and max(seen) - min(seen) >= steps
