"""Sends the Node's events through the core/v1 Events API, as the EventGate decides.

Core/v1 rather than events.k8s.io/v1: it is what kubelet and the node problem detector write
and what `kubectl describe node` shows, and its `count`/`lastTimestamp` make deduplication one
small patch. Events about a cluster-scoped Node must live in `default` (the API server rejects
them elsewhere), as kubelet's do.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import structlog

from edl_agent.config import NodeSettings
from edl_agent.kube import NOT_FOUND, ApiError, NodeApi
from edl_agent.kube_time import format_time
from edl_agent.labels.events import Action, EventGate, EventSpec

COMPONENT = "edl-agent"
REPORTING_COMPONENT = "edl.io/agent"
EVENT_NAMESPACE = "default"


class EventRecorder:
    def __init__(self, *, api: NodeApi, node_name: str, settings: NodeSettings) -> None:
        self.api = api
        self.node_name = node_name
        self.namespace = EVENT_NAMESPACE
        self.gate = EventGate(
            window_seconds=settings.event_dedupe_seconds,
            capacity=settings.event_burst,
            per_minute=settings.events_per_minute,
        )
        self.failures = 0
        self._log = structlog.get_logger().bind(part="node-events", node=node_name)

    def record(
        self, events: Sequence[EventSpec], *, now: datetime, node_uid: str | None
    ) -> tuple[EventSpec, ...]:
        """Send what the gate lets through; the ones sent. Failures are logged and counted:
        events are best effort, the node condition is the record."""
        sent: list[EventSpec] = []
        for spec in events:
            decision = self.gate.decide(spec, now.timestamp())
            if decision.action is Action.DROP:
                self._log.warning("node event dropped (rate limit)", reason=spec.reason)
                continue
            try:
                if decision.action is Action.BUMP and decision.name is not None:
                    self._bump(spec, decision.name, decision.count, now, node_uid)
                else:
                    self._create(spec, now, node_uid)
            except ApiError as exc:
                self.failures += 1
                self._log.warning("node event not recorded", reason=spec.reason, error=str(exc))
                continue
            sent.append(spec)
        return tuple(sent)

    def _create(self, spec: EventSpec, now: datetime, node_uid: str | None) -> None:
        stamp = format_time(now)
        name = f"{self.node_name}.{time.time_ns():x}"
        involved: dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "name": self.node_name}
        if node_uid:
            involved["uid"] = node_uid
        body = {
            "metadata": {"name": name, "namespace": self.namespace},
            "involvedObject": involved,
            "type": spec.type,
            "reason": spec.reason,
            "message": spec.message,
            "count": 1,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "source": {"component": COMPONENT, "host": self.node_name},
            "reportingComponent": REPORTING_COMPONENT,
            "reportingInstance": self.node_name,
        }
        self.api.create_event(self.namespace, body)
        self.gate.sent(spec, name=name, count=1, now=now.timestamp())

    def _bump(
        self, spec: EventSpec, name: str, count: int, now: datetime, node_uid: str | None
    ) -> None:
        try:
            self.api.patch_event(
                self.namespace, name, {"count": count, "lastTimestamp": format_time(now)}
            )
        except ApiError as exc:
            if exc.status != NOT_FOUND:
                raise
            self.gate.forget(spec)  # expired (events live an hour): start a new one
            self._create(spec, now, node_uid)
            return
        self.gate.sent(spec, name=name, count=count, now=now.timestamp())
