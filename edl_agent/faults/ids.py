"""Fault ids: pure functions, shared by the node agent and the restarter's own watchers.

An id must be the same wherever and whenever one fault is seen — by the agent on the node, by
the restarter watching pods from the centre, by an agent that restarted and lists the pods
again — so that the restarter acts on it once (its intake answers a known id as a duplicate).
Ids are therefore derived from the fault's own identity, never from when it was observed or
from a counter of ours. Both sides build pod faults through `faults.pod_faults`, which takes
its ids from here.

An id never exceeds `MAX_ID_LENGTH` (what the intake accepts): a longer one is hashed, keeping
the kind's prefix (`device/<sha256>`).
"""

from __future__ import annotations

import hashlib
from datetime import datetime

from edl_agent.faults.convert import MAX_ID_LENGTH
from edl_agent.faults.model import PodRef


def bounded_id(fault_id: str) -> str:
    """`fault_id`, or when it is longer than the intake accepts, its first segment followed by
    the SHA-256 of all of it (still unique, still stable)."""
    if len(fault_id) <= MAX_ID_LENGTH:
        return fault_id
    prefix = fault_id.split("/", 1)[0][:32]
    return f"{prefix}/{hashlib.sha256(fault_id.encode('utf-8')).hexdigest()}"


def container_exit_id(pod_uid: str, container: str, restart_count: int) -> str:
    """The id of one container exit: `exit/<pod uid>/<container>/<restart_count>`.

    `pod_uid` is `metadata.uid`, `container` the container's name and `restart_count` the
    number of the exit among that container's runs, which is the `restartCount` the container
    had when it exited: for `status.*ContainerStatuses[].state.terminated`, the status's
    `restartCount`; for `lastState.terminated` (the container was started again since, and
    kubelet bumped the count when it moved the exit there), `restartCount - 1`. A pod uid is
    never reused, so the triple names one exit for good. `finishedAt` is deliberately not part
    of the id: it has only second precision, and callers that see the exit in different states
    must still agree. (A pod uid is at most 36 characters and a container name 63, so the id
    is never hashed.)
    """
    return f"exit/{pod_uid}/{container}/{restart_count}"


def parse_container_exit_id(fault_id: str) -> tuple[str, str, int] | None:
    """(pod uid, container, restart count) of an id `container_exit_id` made; None otherwise."""
    kind, _, rest = fault_id.partition("/")
    uid, _, rest = rest.partition("/")
    container, _, count = rest.rpartition("/")
    if kind != "exit" or not uid or not container or not count.isdigit():
        return None
    return uid, container, int(count)


def eviction_id(pod_uid: str) -> str:
    """The id of a pod's eviction (or DisruptionTarget): one per pod, `evicted/<uid>`."""
    return f"evicted/{pod_uid}"


def force_deletion_id(pod_uid: str) -> str:
    """The id of a pod's deletion with grace 0 before it terminated: `forcedelete/<uid>`."""
    return f"forcedelete/{pod_uid}"


def node_not_ready_id(node: str, since: datetime) -> str:
    """The id of one spell of `node` being NotReady, `since` being when the restarter first saw
    it so: `notready/<node>/<since, ISO 8601>` (the pods it touches get `pod_fault_id`s)."""
    return bounded_id(f"notready/{node}/{since.isoformat()}")


def device_unhealthy_id(node: str, device_id: str, reason: str, since: float) -> str:
    """The id of one spell of a device being unhealthy:
    `device/<node>/<device>/<reason>/<since>`, `since` being when the tracker's condition began
    (`Condition.since`, the agent's monotonic clock, in microseconds). Only the agent that saw
    the spell begin derives it; a fault sent again from the outbox after a restart keeps the id
    it was stored with (the pods it touches get `pod_fault_id`s)."""
    return bounded_id(f"device/{node}/{device_id}/{reason}/{round(since * 1_000_000)}")


def device_degraded_id(node: str, device_id: str, reason: str, since: float) -> str:
    """The id of one spell of a device being degraded: `degraded/<node>/<device>/<reason>/
    <since>`, as `device_unhealthy_id` (a condition that later turns severe keeps its reason and
    start, and its DeviceUnhealthy fault must not read as a repeat of this one)."""
    return bounded_id(f"degraded/{node}/{device_id}/{reason}/{round(since * 1_000_000)}")


def pod_fault_id(node_fault_id: str, pod: PodRef) -> str:
    """The id of what the node-level fault `node_fault_id` means for one pod:
    `<node fault id>/<pod uid>`, or `<node fault id>/<namespace>/<name>` for a pod known only
    by name (kubelet's pod-resources API gives no uid)."""
    key = pod.uid or f"{pod.namespace}/{pod.name}"
    return bounded_id(f"{node_fault_id}/{key}")


def observer_scoped_id(node: str, fault_id: str) -> str:
    """The id under which the restarter keeps a fault the agent on `node` reported and nothing
    else vouches for: `agent/<node>/<id>`. Another node's agent cannot make a real fault look
    like a duplicate by sending its id first ("squatting"): its ids live in its own scope."""
    return bounded_id(f"agent/{node}/{fault_id}")
