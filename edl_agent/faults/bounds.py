"""What a received fault may carry, and a fault brought within it. Pure.

A fault travels on from the intake into decisions, their reasons, Events, logs and the policy's
status, so whatever an agent sends must stay small there. Names that cannot be real (a node, a
pod or a container name longer than Kubernetes allows) make the fault invalid; the free text and
the device ids are kept, cut to their bounds with a mark that says how much was cut; and a time
ahead of the restarter's clock is taken as observed now (when it was received), so that one
node's clock cannot date a fault, and the restart it causes, into the future; one further ahead
than `MAX_CLOCK_AHEAD` is also counted and logged.
"""

from __future__ import annotations

import dataclasses
import re
from datetime import datetime, timedelta

from edl_agent.faults.model import Fault

# Kubernetes' own limits: a node or pod name is a DNS subdomain, a namespace and a container
# name a DNS label; uids are 36 characters (a little room for other forms).
MAX_NODE_NAME = 253
MAX_POD_NAME = 253
MAX_NAMESPACE = 63
MAX_CONTAINER_NAME = 63
MAX_UID = 64
# Free text: a reason is a word (OOMKilled, XID79), a detail a sentence or two.
MAX_REASON = 128
MAX_DETAIL = 1024
# A fault names the devices of one node that failed together: a node has at most a few dozen,
# and the decision needs none of them (they are for people reading it).
MAX_DEVICE_IDS = 16
MAX_DEVICE_ID = 128
# NTP keeps clocks within milliseconds; a fault from further ahead is taken as observed now.
MAX_CLOCK_AHEAD = timedelta(seconds=10)
_MORE = re.compile(r"… \(\+(\d+) more\)")


def too_long_name(fault: Fault) -> str | None:
    """What in `fault` is longer than Kubernetes allows (None: nothing)."""
    if len(fault.node) > MAX_NODE_NAME:
        return f"node name longer than {MAX_NODE_NAME} characters"
    if fault.container is not None and len(fault.container) > MAX_CONTAINER_NAME:
        return f"container name longer than {MAX_CONTAINER_NAME} characters"
    for pod in fault.pods:
        if len(pod.name) > MAX_POD_NAME or len(pod.namespace) > MAX_NAMESPACE:
            return "pod name or namespace longer than Kubernetes allows"
        if len(pod.uid) > MAX_UID:
            return f"pod uid longer than {MAX_UID} characters"
    return None


@dataclasses.dataclass(frozen=True)
class Bounded:
    fault: Fault
    trimmed: tuple[str, ...] = ()
    """The fields cut or clamped: reason, detail, device_ids, observed_at."""


def bound(fault: Fault, *, now: datetime) -> Bounded:
    """`fault` with its free text and device ids within their bounds and its time no later than
    `now` (aware, UTC, as fault times are): the time it was received, for a clock ahead of ours.
    `trimmed` names observed_at only beyond `MAX_CLOCK_AHEAD`: closer is a clock's ordinary
    drift, not worth a word."""
    reason = cut(fault.reason, MAX_REASON)
    detail = cut(fault.detail, MAX_DETAIL)
    devices = cut_ids(fault.device_ids)
    observed = min(fault.observed_at, now)
    trimmed = tuple(
        name
        for name, changed in (
            ("reason", reason != fault.reason),
            ("detail", detail != fault.detail),
            ("device_ids", devices != fault.device_ids),
            ("observed_at", fault.observed_at > now + MAX_CLOCK_AHEAD),
        )
        if changed
    )
    if not trimmed and observed == fault.observed_at:
        return Bounded(fault)
    return Bounded(
        dataclasses.replace(
            fault, reason=reason, detail=detail, device_ids=devices, observed_at=observed
        ),
        trimmed,
    )


def cut(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters and a mark of how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… (+{len(text) - limit} characters)"


def named_ids(ids: tuple[str, ...]) -> int:
    """How many device ids the fault named as sent: `ids` after `cut_ids` says so in its last
    entry."""
    found = _MORE.fullmatch(ids[-1]) if ids else None
    return len(ids) if found is None else len(ids) - 1 + int(found.group(1))


def cut_ids(ids: tuple[str, ...]) -> tuple[str, ...]:
    """At most `MAX_DEVICE_IDS` ids, each cut to `MAX_DEVICE_ID` characters (with "…"); the
    last entry says how many more there were."""
    kept = tuple(
        i if len(i) <= MAX_DEVICE_ID else f"{i[:MAX_DEVICE_ID]}…" for i in ids[:MAX_DEVICE_IDS]
    )
    if len(ids) > MAX_DEVICE_IDS:
        kept += (f"… (+{len(ids) - MAX_DEVICE_IDS} more)",)
    return kept
