"""The nodes as the restarter's node watch shows them: which exist, which are NotReady (and since
when, on the restarter's clock), which an operator has tainted out of service; and when each
NotReady node's grace ends (`node_grace.GraceTick`, what the node-grace ticker waits for).
A node that comes, goes, or turns Ready or NotReady is told to `on_change` (the storm guard
looks again)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from edl_agent.restarter.adapters.node_grace import GraceTick

OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"


def is_out_of_service(node: Mapping[str, Any]) -> bool:
    """The node carries the `node.kubernetes.io/out-of-service` taint (any effect): an operator
    has said it is down, and what ran there runs no more (Kubernetes' non-graceful shutdown)."""
    taints = (node.get("spec") or {}).get("taints") or []
    return any(t.get("key") == OUT_OF_SERVICE_TAINT for t in taints)


def is_not_ready(node: Mapping[str, Any]) -> bool:
    """The node's Ready condition is False or Unknown (a node without one is taken as Ready).

    When it turned so is not read from the condition: `lastTransitionTime` is the node's own
    clock, and KWOK, say, dates it to the node's creation, so a pod that landed on the node
    after it would look older than its own fault. The grace runs on the restarter's clock from
    when it first saw the node NotReady."""
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") != "True")
    return False


def _name(node: Mapping[str, Any]) -> str:
    return str((node.get("metadata") or {}).get("name", ""))


class Nodes:
    def __init__(
        self,
        *,
        grace: float,
        clock: Callable[[], datetime],
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self._clock = clock
        self._on_change = on_change
        self.grace_tick = GraceTick(grace, clock)
        self._lock = threading.Lock()
        self._nodes: set[str] = set()
        self._not_ready: dict[str, datetime] = {}  # node → since
        self._out_of_service: set[str] = set()

    def listed(self, items: list[dict[str, Any]]) -> None:
        """A full list (the watch's first, or after a 410)."""
        listed = {_name(n) for n in items}
        with self._lock:
            before = set(self._nodes)
            # A re-list keeps when a node still NotReady was first seen so: its grace goes on.
            self._not_ready = {n: s for n, s in self._not_ready.items() if n in listed}
            self._nodes.clear()
            self._out_of_service.clear()
        self.grace_tick.keep_only(listed)
        changed = [self._seen("ADDED", node) for node in items]
        if any(changed) or before != listed:
            self._on_change()

    def event(self, kind: str, node: dict[str, Any]) -> None:
        if self._seen(kind, node):
            self._on_change()

    def _seen(self, kind: str, node: dict[str, Any]) -> bool:
        """Whether the node came, went, or its readiness changed."""
        name = _name(node)
        not_ready = kind != "DELETED" and is_not_ready(node)
        since = None
        with self._lock:
            known = name in self._nodes
            if kind == "DELETED":
                self._nodes.discard(name)
            else:
                self._nodes.add(name)
            if kind != "DELETED" and is_out_of_service(node):
                self._out_of_service.add(name)
            else:
                self._out_of_service.discard(name)
            was_not_ready = name in self._not_ready
            if not_ready and not was_not_ready:
                since = self._not_ready[name] = self._clock()
            elif was_not_ready and not not_ready:
                del self._not_ready[name]
        if since is not None:
            self.grace_tick.not_ready(name, since)
        elif was_not_ready and not not_ready:
            self.grace_tick.ready(name)
        return (kind == "DELETED") == known or was_not_ready != not_ready

    def not_ready(self, node: str) -> bool:
        with self._lock:
            return node in self._not_ready

    def gone(self, node: str) -> bool:
        """Deleted (not among the nodes listed and watched), or tainted out of service."""
        with self._lock:
            return node not in self._nodes or node in self._out_of_service

    def counts(self) -> tuple[int, int]:
        """(NotReady, all)."""
        with self._lock:
            return len(self._not_ready), len(self._nodes)

    def past_grace(self) -> dict[str, datetime]:
        """The nodes NotReady past their grace, with when each was first seen so."""
        past = self.grace_tick.past()
        with self._lock:
            return {n: self._not_ready[n] for n in past if n in self._not_ready}
