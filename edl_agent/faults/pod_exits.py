"""The agent's pod watcher: containers on this node that exited with a non-zero code, as faults.

One thread lists the pods on the node (field selector `spec.nodeName=<node>`, every namespace)
and then watches them from the list's resourceVersion. Every container (init containers too,
ephemeral debug containers not) whose `state.terminated` or `lastState.terminated` has a
non-zero `exitCode` becomes a CONTAINER_EXIT fault whose id comes from `ids.container_exit_id`,
so the same exit seen again (in the next MODIFIED event, after a re-list, after an agent
restart, or by the restarter's own watcher) carries the same id. Ids already handed on are
remembered (the newest `REMEMBERED`) so that a pod's later status updates do not enqueue its
exits again; after a restart the outbox and the restarter's intake answer them as duplicates.

The watch is started again whenever the server ends it, from a fresh list after 410 Gone, and
after a back-off (doubling up to `retry_max_seconds`) on any other failure; a failure is logged
and counted, never the end of the watching. RBAC cannot restrict `list`/`watch` of pods to one
node: the field selector is ours.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

from edl_agent.backoff import backoff_delay
from edl_agent.bounded import BoundedSet
from edl_agent.faults.ids import container_exit_id
from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.kube import NodeApi
from edl_agent.kube_time import parse_time
from edl_agent.kube_watch import WatchLoop

REMEMBERED = 10_000
MAX_DETAIL = 512
# Not ephemeral containers: a `kubectl debug` shell that exits non-zero says nothing about the
# workload (the restarter's watcher does not count them either).
STATUS_LISTS = ("initContainerStatuses", "containerStatuses")


def container_exits(
    pod: Mapping[str, Any], node: str, *, now: Callable[[], datetime] = lambda: datetime.now(UTC)
) -> list[Fault]:
    """The non-zero container exits recorded in one pod's status, as faults (pure)."""
    metadata = pod.get("metadata") or {}
    ref = PodRef(
        namespace=str(metadata.get("namespace", "")),
        name=str(metadata.get("name", "")),
        uid=str(metadata.get("uid", "")),
    )
    status = pod.get("status") or {}
    faults: list[Fault] = []
    for key in STATUS_LISTS:
        for container in status.get(key) or ():
            name = str(container.get("name", ""))
            restarts = int(container.get("restartCount") or 0)
            # The exit in lastState happened before the restart that bumped restartCount.
            for which, restart_count in (("state", restarts), ("lastState", restarts - 1)):
                terminated = (container.get(which) or {}).get("terminated")
                if not terminated:
                    continue
                exit_code = int(terminated.get("exitCode") or 0)
                if exit_code == 0:
                    continue
                if restart_count < 0:
                    continue  # a status no kubelet writes: no number for this exit
                finished = parse_time(terminated.get("finishedAt"))
                fault_id = container_exit_id(ref.uid, name, restart_count)
                faults.append(
                    Fault(
                        id=fault_id,
                        kind=FaultKind.CONTAINER_EXIT,
                        node=node,
                        observed_at=finished or now(),
                        pods=(ref,),
                        container=name,
                        exit_code=exit_code,
                        reason=str(terminated.get("reason") or "Error"),
                        detail=str(terminated.get("message") or "")[:MAX_DETAIL],
                    )
                )
    return faults


class PodExitWatcher(WatchLoop):
    """Watches the pods on `node` and hands every new non-zero container exit to `on_fault`."""

    name = "pod-exit-watch"
    restart_after_crash = True

    def __init__(
        self,
        api: NodeApi,
        node: str,
        on_fault: Callable[[Fault], None],
        *,
        timeout_seconds: int = 300,
        retry_seconds: float = 1.0,
        retry_max_seconds: float = 60.0,
    ) -> None:
        super().__init__(log_context={"node": node})
        self.api = api
        self.node = node
        self.on_fault = on_fault
        self.timeout_seconds = timeout_seconds
        self.retry_seconds = retry_seconds
        self.retry_max_seconds = retry_max_seconds
        self._listed = threading.Event()
        self._reported = BoundedSet(REMEMBERED)
        self._selector = f"spec.nodeName={node}"

    def wait_listed(self, timeout: float) -> bool:
        """True once the node's pods have been listed at least once."""
        return self._listed.wait(timeout)

    def _list(self) -> str | None:
        listing = self.api.list_pods(self._selector)
        for pod in listing.get("items") or ():
            self._observe(pod)
        self._listed.set()
        version = (listing.get("metadata") or {}).get("resourceVersion")
        return str(version) if version else None

    def _watch(self, version: str | None) -> str | None:
        stream: Iterator[tuple[str, dict[str, Any]]] = self.api.watch_pods(
            self._selector,
            resource_version=version,
            timeout_seconds=self.timeout_seconds,
            opened=self._opened,
        )
        for kind, pod in stream:
            version = (pod.get("metadata") or {}).get("resourceVersion") or version
            if kind in ("ADDED", "MODIFIED"):
                self._observe(pod)
        return version

    def _observe(self, pod: Mapping[str, Any]) -> None:
        for fault in container_exits(pod, self.node):
            if fault.id in self._reported:
                continue
            self.on_fault(fault)
            self._reported.add(fault.id)

    def _retry_delay(self, failures_in_row: int) -> float:
        return backoff_delay(
            failures_in_row,
            initial=self.retry_seconds,
            maximum=self.retry_max_seconds,
            jitter=random.random(),  # noqa: S311 - spreading retries, not secrets
        )
