"""Keeps the agent's view of its own Node current through a watch, on its own thread.

The live per-device cordon (`edl.io/cordoned-devices`) takes effect as soon as an operator sets
it, with no polling: one long-lived watch per node, of one object. The watch is started again
whenever the server ends it (every `timeout_seconds`), from scratch after 410 Gone, and after a
back-off on any other failure; a failure is logged and counted, never the end of the watching.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from edl_agent.kube import GONE, ApiError, Closable, KubeApi


class NodeWatcher:
    def __init__(
        self,
        api: KubeApi,
        node_name: str,
        on_node: Callable[[Mapping[str, Any]], None],
        *,
        timeout_seconds: int = 300,
        retry_seconds: float = 5.0,
    ) -> None:
        self.api = api
        self.node_name = node_name
        self.on_node = on_node
        self.timeout_seconds = timeout_seconds
        self.retry_seconds = retry_seconds
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._response: Closable | None = None
        self._seen = threading.Event()
        self._log = structlog.get_logger().bind(part="node-watch", node=node_name)

    def start(self) -> None:
        if self._thread is not None:
            msg = "NodeWatcher already started"
            raise RuntimeError(msg)
        self._thread = threading.Thread(target=self._run, name="node-watch", daemon=True)
        self._thread.start()

    def wait_seen(self, timeout: float) -> bool:
        """True once the Node has been seen at least once."""
        return self._seen.wait(timeout)

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            _shutdown(response)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._log.warning("node watcher did not stop in time", timeout=timeout)

    def _opened(self, response: Closable) -> None:
        self._response = response
        if self._stop.is_set():
            _shutdown(response)

    def _run(self) -> None:
        version: str | None = None
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                version = self._watch(version)
                if time.monotonic() - started < 1.0:
                    self._stop.wait(1.0)  # a server or proxy ending watches at once: no spinning
            except ApiError as exc:
                if self._stop.is_set():
                    return
                if exc.status == GONE:
                    version = None  # too old: start over from the current object
                    continue
                self._failed(str(exc))
            except Exception as exc:  # a bug must not end the watching: retry like a failure
                if self._stop.is_set():
                    return
                self._log.exception("node watcher crashed")
                self._failed(f"{type(exc).__name__}: {exc}")

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

    def _failed(self, error: str) -> None:
        self.failures += 1
        self._log.warning("node watch failed; retrying", error=error, failures=self.failures)
        self._stop.wait(self.retry_seconds)


def _shutdown(response: Closable) -> None:
    """Unblock the read the watch thread waits in (urllib3 >= 2.3; else close the response)."""
    shutdown = getattr(response, "shutdown", None) or getattr(response, "close", None)
    if shutdown is not None:
        shutdown()
