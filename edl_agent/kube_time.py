"""Kubernetes times (RFC 3339), read and written one way for the whole package.

The API server writes `2026-05-01T12:00:00Z` (Time) and `2026-05-01T12:00:00.123456Z` (MicroTime).
A time without a zone is taken as UTC, never as the local time of whoever reads it.
"""

from __future__ import annotations

from datetime import UTC, datetime


def parse_time(text: object) -> datetime | None:
    """An aware UTC datetime; None when `text` is absent, empty or not a time."""
    if not isinstance(text, str) or not text:
        return None
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment.astimezone(UTC) if moment.tzinfo else moment.replace(tzinfo=UTC)


def format_time(moment: datetime) -> str:
    """Time, whole seconds: `2026-05-01T12:00:00Z` (a naive `moment` is taken as UTC)."""
    return _utc(moment).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_micro_time(moment: datetime) -> str:
    """MicroTime (Leases, Events, our status records): `2026-05-01T12:00:00.000000Z`."""
    return _utc(moment).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def _utc(moment: datetime) -> datetime:
    return moment.astimezone(UTC) if moment.tzinfo else moment.replace(tzinfo=UTC)
