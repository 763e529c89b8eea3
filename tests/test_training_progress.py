"""Reading the trainers' logs (tests/training/progress.py): formations, progress and recovery."""

from __future__ import annotations

import json

from tests.training.progress import parse, progressing, recovery


def line(t: float, event: str, world: int, rank: int, step: int, *, cri: bool = False) -> str:
    fields: dict[str, object] = {"t": t, "event": event, "world": world, "rank": rank}
    fields["resumed_from" if event == "start" else "step"] = step
    text = json.dumps(fields)
    return f"2026-11-27T01:00:00.000000000Z stdout F {text}" if cri else text


LOG = "\n".join(
    [
        "LAUNCH INFO 2026-11-27 00:42:07,203 max_restart: 20",
        line(10.0, "start", 3, 0, 0),
        line(11.0, "step", 3, 0, 10),
        line(14.0, "step", 3, 0, 120),
        "LAUNCH WARNING peer not ready",
        # The fault at t=15: a first formation of 2 breaks up, then 3 form from checkpoint 100.
        line(25.0, "start", 2, 0, 100, cri=True),
        line(26.0, "start", 3, 1, 100, cri=True),
        line(27.0, "step", 2, 0, 110),
        line(28.5, "step", 3, 1, 110),
        line(30.0, "step", 3, 1, 150),
        "{not json",
    ]
)


def test_parse_reads_plain_and_cri_lines_and_skips_the_rest() -> None:
    reports = parse(LOG, "pod-a")
    assert [(r.event, r.world, r.step) for r in reports][:3] == [
        ("start", 3, 0),
        ("step", 3, 10),
        ("step", 3, 120),
    ]
    assert len(reports) == 8
    assert {r.source for r in reports} == {"pod-a"}


def test_recovery_is_the_first_full_size_step_of_a_formation_after_the_fault() -> None:
    found = recovery(parse(LOG), fault_at=15.0, world=3)
    assert found is not None
    assert (found.resumed_at, found.resumed_from, found.last_step_before) == (28.5, 100, 120)
    assert found.steps_lost == 20
    assert (found.going_again_at, found.going_again_world) == (27.0, 2)  # on two, first


def test_no_recovery_before_a_full_size_formation_made_a_step() -> None:
    assert recovery(parse(LOG), fault_at=29.0, world=3) is None
    partial = [r for r in parse(LOG) if r.t < 28.0]
    assert recovery(partial, fault_at=15.0, world=3) is None


def test_progressing_counts_steps_at_the_world_size_after_a_time() -> None:
    reports = parse(LOG)
    assert progressing(reports, 3, since=0.0, steps=100)
    assert not progressing(reports, 3, since=20.0, steps=100)
    assert progressing(reports, 3, since=20.0, steps=40)
    assert not progressing(reports, 2, since=0.0, steps=1)


def test_steps_made_after_the_fault_until_the_job_broke_up_count_as_lost() -> None:
    """A fault the trainers do not feel at once (an XID; the pod is replaced a second later):
    the steps they made meanwhile are lost when the job resumes from an older checkpoint."""
    found = recovery(parse(LOG), fault_at=12.0, world=3)
    assert found is not None
    assert (found.last_step_before, found.resumed_from, found.steps_lost) == (120, 100, 20)


def test_only_the_formation_the_fault_hit_can_lose_steps() -> None:
    """A second fault soon after the first: the job had resumed from checkpoint 100, behind the
    120 it had reached before the first fault; what the second loses is counted from the steps
    of that resumed formation only."""
    second = "\n".join(
        [
            LOG,
            line(31.0, "step", 3, 1, 160),
            # The second fault at t=32; the job re-forms from checkpoint 150.
            line(40.0, "start", 3, 0, 150),
            line(41.0, "step", 3, 0, 160),
        ]
    )
    found = recovery(parse(second), fault_at=32.0, world=3)
    assert found is not None
    assert (found.last_step_before, found.resumed_from, found.steps_lost) == (160, 150, 10)
    before_it = "\n".join([LOG, line(40.0, "start", 3, 0, 100), line(41.0, "step", 3, 0, 110)])
    again = recovery(parse(before_it), fault_at=32.0, world=3)
    assert again is not None
    assert again.steps_lost == 50  # 150, the newest of the formation it hit, back to 100
