"""One way to read and write Kubernetes times."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone

import pytest

from edl_agent.kube_time import format_micro_time, format_time, parse_time
from edl_agent.restarter.core import lease, status


@pytest.fixture
def far_from_utc() -> Iterator[None]:
    """The process's local zone 9 hours ahead of UTC, where a naive time read as local shows."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "Asia/Tokyo"
    time.tzset()
    yield
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


NOON = datetime(2026, 5, 1, 12, tzinfo=UTC)


@pytest.mark.parametrize(
    "text",
    [
        "2026-05-01T12:00:00Z",
        "2026-05-01T12:00:00.000000Z",
        "2026-05-01T21:00:00+09:00",
        "2026-05-01T12:00:00",  # no zone: UTC, never the reader's local time
    ],
)
def test_every_spelling_of_one_moment_reads_the_same(far_from_utc: None, text: str) -> None:
    assert parse_time(text) == NOON


@pytest.mark.parametrize("text", [None, "", "yesterday", 42])
def test_no_time_is_none(text: object) -> None:
    assert parse_time(text) is None


def test_times_are_written_in_utc_as_the_api_writes_them(far_from_utc: None) -> None:
    tokyo = NOON.astimezone(timezone(timedelta(hours=9)))
    assert format_time(tokyo) == "2026-05-01T12:00:00Z"
    assert format_micro_time(tokyo + timedelta(microseconds=5)) == "2026-05-01T12:00:00.000005Z"
    assert format_time(datetime(2026, 5, 1, 12)) == "2026-05-01T12:00:00Z"  # naive: UTC


def test_the_restarter_reads_leases_and_refuses_zoneless_status_records(
    far_from_utc: None,
) -> None:
    record = lease.read_lease(
        {"spec": {"holderIdentity": "a", "renewTime": "2026-05-01T12:00:00.000000Z"}}
    )
    assert record is not None
    assert record.renewed == NOON
    assert status.parse_time("2026-05-01T12:00:00.000000Z") == NOON
    with pytest.raises(ValueError, match="with a zone"):
        status.parse_time("2026-05-01T12:00:00")
