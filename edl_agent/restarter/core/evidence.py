"""What the restarter's own pod cache says about a fault an agent reported: pure.

An agent is believed only about pods the cache shows on the agent's node, and about a container
exit only when that pod's status shows it. The cache follows the API server through a watch, a
moment behind an agent that watches its own node, so "the cache does not show it" is no proof
against the agent: such a check answers `NOT_YET` (ask again later; after the cache's lag, the
refusal it names holds). It answers `REFUSED` only where no later cache can change the answer:
the pod, by its uid, is bound to another node (a binding never changes); the exit's id does not
name this pod's container; the container has run again since the exit, with nothing of it left.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from edl_agent.faults.ids import parse_container_exit_id
from edl_agent.faults.model import Fault, PodRef
from edl_agent.faults.pod_faults import container_exit_faults, container_statuses, pod_node, pod_ref
from edl_agent.restarter.core.callers import Refusal


class Outcome(enum.Enum):
    BELIEVED = "believed"
    REFUSED = "refused"  # for good
    NOT_YET = "not_yet"  # the cache may be behind the agent


@dataclass(frozen=True)
class Check:
    outcome: Outcome
    refusal: Refusal | None = None  # why refused; for NOT_YET, the refusal once the lag is over


BELIEVED = Check(Outcome.BELIEVED)


def check_pod(named: PodRef, node: str, cached: Mapping[str, Any] | None) -> Check:
    """Is the pod an agent on `node` named (`named`) that pod, on that node, by the
    cache (`cached`: what the cache found by its uid, else by its name)?"""
    if cached is None:
        return Check(Outcome.NOT_YET, Refusal.POD_UNKNOWN)
    if named.uid and pod_ref(cached).uid != named.uid:
        # The cache knows another pod by that name: the named one may be newer than the cache.
        return Check(Outcome.NOT_YET, Refusal.POD_ELSEWHERE)
    bound = pod_node(cached)
    if not bound:
        return Check(Outcome.NOT_YET, Refusal.POD_UNKNOWN)  # its binding not seen yet
    if bound != node:
        # By uid: that very pod is bound elsewhere, for good. By name only: perhaps a pod of
        # that name that the cache has not yet seen replaced.
        return Check(Outcome.REFUSED if named.uid else Outcome.NOT_YET, Refusal.POD_ELSEWHERE)
    return BELIEVED


def check_exit(reported: Fault, cached: Mapping[str, Any]) -> tuple[Check, Fault | None]:
    """Does the status of `cached` (the pod `reported` names, believed on its node) show the
    container exit `reported` says it does? When it does, the fault as the status tells it (the
    id, the code, the reason, the time: the agent's word for none of them but the time when the
    status has no `finishedAt`)."""
    derived = container_exit_faults(cached, now=reported.observed_at, source="agent")
    for fault in derived:
        if fault.id == reported.id and fault.container == reported.container:
            return BELIEVED, fault
    not_seen = Check(Outcome.REFUSED, Refusal.EXIT_NOT_SEEN)
    parsed = parse_container_exit_id(reported.id)
    if parsed is None or parsed[:2] != (pod_ref(cached).uid, reported.container):
        return not_seen, None  # not the id of an exit of this pod's container
    number = parsed[2]
    status = next((s for s in container_statuses(cached) if s.get("name") == parsed[1]), None)
    if status is None:
        if parsed[1] in _ephemeral(cached):
            return not_seen, None  # an ephemeral container's exit is no fault
        return Check(Outcome.NOT_YET, Refusal.EXIT_NOT_SEEN), None
    if _moved_past(status, number):
        return not_seen, None
    return Check(Outcome.NOT_YET, Refusal.EXIT_NOT_SEEN), None


def _moved_past(status: Mapping[str, Any], number: int) -> bool:
    """The container's status is past exit `number` (shows it as a zero exit, or has run again
    since with no trace of it): no later status can show it."""
    restarts = int(status.get("restartCount") or 0)
    if restarts > number + 1:
        return True
    if restarts == number + 1:
        return bool((status.get("lastState") or {}).get("terminated"))
    if restarts == number:
        return bool((status.get("state") or {}).get("terminated"))
    return False


def _ephemeral(pod: Mapping[str, Any]) -> set[str]:
    spec = (pod.get("spec") or {}).get("ephemeralContainers") or ()
    status = (pod.get("status") or {}).get("ephemeralContainerStatuses") or ()
    return {str(c.get("name")) for c in (*spec, *status)}
