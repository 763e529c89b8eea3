"""core/v1 Events the restarter writes about what it did: on a FaultTolerancePolicy (a pod
restarted, a restart limit reached) and on its Lease (the storm guard). Best effort: a failed
Event is logged and dropped, the policy's status is the record. Events are written by a
supervised part of their own (`EventWriter.run`), so the decisions never wait for them, and a
token bucket keeps a burst of faults from flooding the API with Events."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import structlog
from kubernetes import client

from edl_agent.kube import ApiError, call_json
from edl_agent.kube_time import format_time
from edl_agent.rate_limit import TokenBucket
from edl_agent.restarter.core.reference import reference

log = structlog.get_logger(__name__)

COMPONENT = "edl-restarter"
REPORTING_COMPONENT = "edl.io/restarter"
MESSAGE_LIMIT = 1024

__all__ = ["EventWriter", "reference"]


class EventWriter:
    name = "events"

    def __init__(
        self,
        api: client.ApiClient,
        *,
        instance: str,
        burst: int = 50,
        per_minute: float = 120.0,
    ) -> None:
        self._core: Any = client.CoreV1Api(api)
        self._instance = instance
        self._bucket = TokenBucket(capacity=burst, per_second=per_minute / 60)
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=burst)
        self.dropped = 0

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        """The supervised part that writes the queued Events, until `stop()`."""
        ready()
        while (body := self._queue.get()) is not None:
            try:
                call_json(self._core.create_namespaced_event, body["metadata"]["namespace"], body)
            except ApiError as exc:
                log.warning("could not write an event", reason=body["reason"], error=str(exc))
        self._queue.put(None)  # a run after this one ends at once too

    def stop(self) -> None:
        """End the part once what is queued is written (the supervisor's join waits for it)."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=5)

    def emit(self, involved: Mapping[str, str], kind: str, reason: str, message: str) -> None:
        """Queue one Event (`kind` Normal or Warning) about `involved` (see `reference`)."""
        if not self._bucket.take(time.monotonic()):
            self.dropped += 1
            return
        namespace = involved.get("namespace") or "default"
        stamp = format_time(datetime.now(UTC))
        body = {
            "metadata": {
                "name": f"{involved.get('name', 'restarter')}.{time.time_ns():x}",
                "namespace": namespace,
            },
            "involvedObject": dict(involved),
            "type": kind,
            "reason": reason,
            "message": message[:MESSAGE_LIMIT],
            "count": 1,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "source": {"component": COMPONENT},
            "reportingComponent": REPORTING_COMPONENT,
            "reportingInstance": self._instance,
        }
        try:
            self._queue.put_nowait(body)
        except queue.Full:
            self.dropped += 1
