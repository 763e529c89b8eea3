"""Fault ids: pure functions, shared by the node agent and the restarter's own watchers.

An id must be the same wherever and whenever one fault is seen — by the agent on the node, by
the restarter watching pods from the centre, by an agent that restarted and lists the pods
again — so that the restarter acts on it once (its intake answers a known id as a duplicate).
Ids are therefore derived from the fault's own identity, never from when it was observed or
from a counter of ours. The restarter's pod watcher must build CONTAINER_EXIT ids with
`container_exit_id` from the same status fields (it yields the `exit/<uid>/<container>/<n>`
form the restarter's watcher uses too).
"""

from __future__ import annotations

import hashlib

from edl_agent.faults.convert import MAX_ID_LENGTH


def container_exit_id(pod_uid: str, container: str, restart_count: int) -> str:
    """The id of one container exit: `exit/<pod uid>/<container>/<restart_count>`.

    `pod_uid` is `metadata.uid`, `container` the container's name and `restart_count` the
    number of the exit among that container's runs, which is the `restartCount` the container
    had when it exited: for `status.*ContainerStatuses[].state.terminated`, the status's
    `restartCount`; for `lastState.terminated` (the container was started again since, and
    kubelet bumped the count when it moved the exit there), `restartCount - 1`. A pod uid is
    never reused, so the triple names one exit for good. `finishedAt` is deliberately not part
    of the id: it has only second precision, and callers that see the exit in different states
    must still agree.
    """
    return f"exit/{pod_uid}/{container}/{restart_count}"


def device_unhealthy_id(node: str, device_id: str, reason: str, since: float) -> str:
    """The id of one spell of a device being unhealthy:
    `device/<node>/<device>/<reason>/<since>`, `since` being when the tracker's condition began
    (`Condition.since`, the agent's monotonic clock, in microseconds). Only the agent that saw
    the spell begin derives it; a fault sent again from the outbox after a restart keeps the id
    it was stored with. An id that would be longer than the intake accepts is hashed."""
    fault_id = f"device/{node}/{device_id}/{reason}/{round(since * 1_000_000)}"
    if len(fault_id) <= MAX_ID_LENGTH:
        return fault_id
    return "device/" + hashlib.sha256(fault_id.encode("utf-8")).hexdigest()
