"""The agent's pod watcher: containers on this node that exited with a non-zero code, as faults.

One thread lists the pods on the node (field selector `spec.nodeName=<node>`, every namespace)
and then watches them from the list's resourceVersion. Every container (init containers too,
ephemeral debug containers not) whose `state.terminated` or `lastState.terminated` has a
non-zero `exitCode` becomes a CONTAINER_EXIT fault built by `pod_faults.container_exit_faults`
(the restarter's watcher builds its own the same way), so the same exit seen again (in the next
MODIFIED event, after a re-list, after an agent restart, or by the restarter's own watcher)
carries the same id. Ids already handed on are
remembered (the newest `REMEMBERED`) so that a pod's later status updates do not enqueue its
exits again; after a restart the outbox and the restarter's intake answer them as duplicates.

It is a supervised part (`kube_watch.WatchLoop.run`), ready once the pods are listed. The watch
is started again whenever the server ends it, from a fresh list after 410 Gone, and after a
back-off (doubling up to `retry_max_seconds`) on any other API failure; such a failure is logged
and counted, never the end of the watching. RBAC cannot restrict `list`/`watch` of pods to one
node: the field selector is ours.

The watcher also keeps the node's pods as last seen (`pod(namespace, name)`), so that a device
fault can name the pods holding the device with their uids and be dated no earlier than them.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

from edl_agent.faults.model import Fault
from edl_agent.faults.pod_faults import container_exit_faults, pod_ref
from edl_agent.kube import NodeApi
from edl_agent.kube_watch import WatchLoop
from edl_agent.runtime.backoff import backoff_delay
from edl_agent.runtime.bounded import BoundedSet

REMEMBERED = 10_000
SOURCE = "agent"


def container_exits(
    pod: Mapping[str, Any], *, now: Callable[[], datetime] = lambda: datetime.now(UTC)
) -> list[Fault]:
    """The non-zero container exits recorded in one pod's status, as the agent reports them
    (pure; `pod_faults.container_exit_faults`, which the restarter's watcher uses too)."""
    return container_exit_faults(pod, now=now(), source=SOURCE)


class PodExitWatcher(WatchLoop):
    """Watches the pods on `node` and hands every new non-zero container exit to `on_fault`."""

    name = "pod-exits"

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
        self._pods_lock = threading.Lock()
        self._pods: dict[tuple[str, str], Mapping[str, Any]] = {}  # (namespace, name) → pod

    def wait_listed(self, timeout: float) -> bool:
        """True once the node's pods have been listed at least once."""
        return self._listed.wait(timeout)

    def pod(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The node's pod by that name as last listed or watched; None when not seen (yet)."""
        with self._pods_lock:
            return self._pods.get((namespace, name))

    def _list(self) -> str | None:
        listing = self.api.list_pods(self._selector)
        items = listing.get("items") or ()
        with self._pods_lock:
            self._pods = {_key(pod): pod for pod in items}
        for pod in items:
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
                with self._pods_lock:
                    self._pods[_key(pod)] = pod
                self._observe(pod)
            elif kind == "DELETED":
                with self._pods_lock:
                    kept = self._pods.get(_key(pod))
                    if kept is not None and pod_ref(kept).uid == pod_ref(pod).uid:
                        del self._pods[_key(pod)]
        return version

    def _observe(self, pod: Mapping[str, Any]) -> None:
        for fault in container_exits(pod):
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


def _key(pod: Mapping[str, Any]) -> tuple[str, str]:
    ref = pod_ref(pod)
    return ref.namespace, ref.name
