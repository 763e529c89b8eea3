"""Keeps the agent's view of its own Node current through a watch: a supervised part of its own.

The live per-device cordon (`edl.io/cordoned-devices`) takes effect as soon as an operator sets
it, with no polling: one long-lived watch per node, of one object. The watch is started again
whenever the server ends it (every `timeout_seconds`), from scratch after 410 Gone, and after a
back-off on any other API failure; such a failure is logged and counted, never the end of the
watching.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from edl_agent.kube import NodeApi
from edl_agent.kube_watch import WatchLoop


class NodeWatcher(WatchLoop):
    name = "node-watch"

    def __init__(
        self,
        api: NodeApi,
        node_name: str,
        on_node: Callable[[Mapping[str, Any]], None],
        *,
        timeout_seconds: int = 300,
        retry_seconds: float = 5.0,
    ) -> None:
        super().__init__(log_context={"node": node_name})
        self.api = api
        self.node_name = node_name
        self.on_node = on_node
        self.timeout_seconds = timeout_seconds
        self.retry_seconds = retry_seconds
        self._seen = threading.Event()

    def wait_seen(self, timeout: float) -> bool:
        """True once the Node has been seen at least once."""
        return self._seen.wait(timeout)

    def _watch(self, version: str | None) -> str | None:
        stream = self.api.watch_node(
            self.node_name,
            resource_version=version,
            timeout_seconds=self.timeout_seconds,
            opened=self._opened,
        )
        for kind, node in stream:
            version = node.get("metadata", {}).get("resourceVersion") or version
            if kind in ("ADDED", "MODIFIED"):
                self.on_node(node)
                self._seen.set()
        return version

    def _retry_delay(self, failures_in_row: int) -> float:
        return self.retry_seconds
