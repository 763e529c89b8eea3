"""What a received fault may carry (`faults.bounds`): names that cannot be real make it invalid,
free text and device ids are cut with a mark, and a time ahead of the restarter's clock becomes
the time of receipt. Pure."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edl_agent.faults.bounds import (
    MAX_CLOCK_AHEAD,
    MAX_DETAIL,
    MAX_DEVICE_ID,
    MAX_DEVICE_IDS,
    MAX_REASON,
    bound,
    named_ids,
    too_long_name,
)
from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.restarter.core.decide import describe

NOW = datetime(2026, 11, 28, 12, tzinfo=UTC)


def fault(**changes: object) -> Fault:
    base = Fault(
        id="device/n1/GPU-1/XID79",
        kind=FaultKind.DEVICE_UNHEALTHY,
        node="n1",
        observed_at=NOW - timedelta(seconds=2),
        pods=(PodRef("ml", "worker-0", "2f1c9a3e-0000-4000-8000-000000000000"),),
        reason="XID79",
        device_ids=("GPU-1",),
        detail="GPU has fallen off the bus",
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_a_fault_within_its_bounds_is_kept_as_it_is() -> None:
    original = fault()
    assert bound(original, now=NOW).fault is original
    assert bound(original, now=NOW).trimmed == ()


def test_free_text_is_cut_with_a_mark_of_how_much() -> None:
    bounded = bound(fault(reason="R" * 5000, detail="d" * 100_000), now=NOW)
    assert bounded.trimmed == ("reason", "detail")
    assert bounded.fault.reason == "R" * MAX_REASON + f"… (+{5000 - MAX_REASON} characters)"
    assert bounded.fault.detail.startswith("d" * MAX_DETAIL + "… (+")
    assert bounded.fault.detail.endswith(f"{100_000 - MAX_DETAIL} characters)")


def test_device_ids_are_cut_in_number_and_length_and_the_last_says_how_many_more() -> None:
    ids = tuple(f"GPU-{i}-" + "x" * 1000 for i in range(1600))
    bounded = bound(fault(device_ids=ids), now=NOW)
    assert bounded.trimmed == ("device_ids",)
    kept = bounded.fault.device_ids
    assert len(kept) == MAX_DEVICE_IDS + 1
    assert kept[0] == ids[0][:MAX_DEVICE_ID] + "…"
    assert kept[-1] == f"… (+{1600 - MAX_DEVICE_IDS} more)"
    assert named_ids(kept) == 1600
    assert describe(bounded.fault).endswith(", +1596 more) on n1")


def test_a_few_ids_are_all_described() -> None:
    few = fault(device_ids=("GPU-1", "GPU-2"))
    assert named_ids(few.device_ids) == 2
    assert describe(few) == "deviceUnhealthy (GPU-1, GPU-2) on n1"


@pytest.mark.parametrize(
    ("ahead", "counted"),
    [
        (timedelta(hours=1), True),  # a clock an hour fast
        (timedelta(days=365 * 74), True),  # 2100
        (MAX_CLOCK_AHEAD + timedelta(microseconds=1), True),
        (MAX_CLOCK_AHEAD, False),  # drift: taken as now, not worth a word
        (timedelta(milliseconds=3), False),
    ],
)
def test_a_time_ahead_of_the_restarter_s_clock_becomes_now(ahead: timedelta, counted: bool) -> None:
    bounded = bound(fault(observed_at=NOW + ahead), now=NOW)
    assert bounded.fault.observed_at == NOW
    assert ("observed_at" in bounded.trimmed) is counted


def test_a_time_in_the_past_is_kept() -> None:
    """An outbox may hold a fault for hours; whether it is still news is the decision's (stale
    by the slot's restarts), not the intake's."""
    old = NOW - timedelta(days=30)
    assert bound(fault(observed_at=old), now=NOW).fault.observed_at == old


@pytest.mark.parametrize(
    ("changes", "what"),
    [
        ({"node": "n" * 254}, "node name"),
        ({"container": "c" * 64}, "container name"),
        ({"pods": (PodRef("ml", "p" * 254, "u"),)}, "pod name"),
        ({"pods": (PodRef("n" * 64, "p", "u"),)}, "pod name"),
        ({"pods": (PodRef("ml", "p", "u" * 65),)}, "pod uid"),
    ],
)
def test_names_longer_than_kubernetes_allows_are_named(
    changes: dict[str, object], what: str
) -> None:
    found = too_long_name(fault(**changes))
    assert found is not None
    assert found.startswith(what)


def test_real_names_at_their_longest_pass() -> None:
    longest = fault(
        node="n" * 253,
        container="c" * 63,
        pods=(PodRef("n" * 63, "p" * 253, "2f1c9a3e-0000-4000-8000-000000000000"),),
    )
    assert too_long_name(longest) is None


@given(
    reason=st.text(max_size=3000),
    detail=st.text(max_size=20_000),
    ids=st.lists(st.text(max_size=400), max_size=200),
    ahead=st.integers(min_value=-(10**9), max_value=10**9),
)
def test_whatever_arrives_the_kept_fault_fits_a_small_budget(
    reason: str, detail: str, ids: list[str], ahead: int
) -> None:
    bounded = bound(
        fault(
            reason=reason,
            detail=detail,
            device_ids=tuple(ids),
            observed_at=NOW + timedelta(seconds=ahead),
        ),
        now=NOW,
    ).fault
    kept = [bounded.reason, bounded.detail, list(bounded.device_ids)]
    size = len(json.dumps(kept, ensure_ascii=False).encode())
    # Each kept character is at most 6 bytes as JSON (a control character escaped as \\uXXXX).
    assert size <= 6 * (MAX_REASON + MAX_DETAIL + (MAX_DEVICE_IDS + 1) * (MAX_DEVICE_ID + 1)) + 512
    assert bounded.observed_at <= NOW
