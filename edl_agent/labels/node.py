"""Writes labels, the AcceleratorHealthy condition and Events to this node's Node object.

`sync()` is called with what the Node should say. It writes only what changed since the last
write (no API call at all when nothing did), or everything again when `force` is set — the
caller's periodic resync, which also refreshes the condition's heartbeat and repairs labels that
someone removed. Labels go through a merge patch guarded by the Node's resourceVersion: on a
conflict (409) the Node is read again and the patch computed afresh, so the owned-keys
bookkeeping never works from a stale view. The condition is a strategic merge patch of
nodes/status that leaves every other condition alone. Without an API (`api` None) everything is
logged instead.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import structlog

from edl_agent.config import NodeSettings
from edl_agent.devices.model import Device
from edl_agent.kube import CONFLICT, ApiError, NodeApi
from edl_agent.labels.condition import (
    CONDITION_TYPE,
    AcceleratorHealth,
    DeviceFault,
    find_condition,
    node_condition,
)
from edl_agent.labels.cordon import (
    RELEASE_DEVICES,
    Cordon,
    Release,
    cordon_annotation,
    cordoned_devices,
)
from edl_agent.labels.events import EventSpec, health_events
from edl_agent.labels.features import write_features_file
from edl_agent.labels.ownership import label_patch
from edl_agent.labels.recorder import EventRecorder

ATTEMPTS = 5


@dataclass(frozen=True)
class SyncResult:
    labels_written: bool = False
    condition_written: bool = False
    events: tuple[EventSpec, ...] = ()  # created, bumped or (log only) logged


class NodeUpdater:
    def __init__(self, *, api: NodeApi | None, node_name: str, settings: NodeSettings) -> None:
        self.api = api
        self.node_name = node_name
        self.settings = settings
        self.conflicts = 0
        self.recorder = (
            None if api is None else EventRecorder(api=api, node_name=node_name, settings=settings)
        )
        self._log = structlog.get_logger().bind(part="node-updater", node=node_name)
        self._lock = threading.Lock()
        self._node: dict[str, Any] | None = None  # the latest Node seen (read, patch, watch)
        self._labels: dict[str, str] | None = None  # last written; None: not yet
        self._health: AcceleratorHealth | None = None
        self._condition: Mapping[str, Any] | None = None
        self._faults: tuple[DeviceFault, ...] = ()
        self._degraded: tuple[DeviceFault, ...] = ()

    @property
    def log_only(self) -> bool:
        return self.api is None

    def sync(
        self,
        *,
        labels: Mapping[str, str],
        health: AcceleratorHealth,
        now: datetime,
        force: bool = False,
        announced: Sequence[EventSpec] = (),
    ) -> SyncResult:
        """Bring the Node to `labels` and `health`; events for the faults that changed since the
        last sync, and the `announced` ones (remediation steps, releases). Each part is tried
        even when another fails; the first failure is raised."""
        desired = dict(labels)
        changed = health_events(self._faults, health.faults, self._degraded, health.degraded)
        events = [*changed, *announced]
        self._faults, self._degraded = health.faults, health.degraded
        labels_due = self.settings.labels != "off" and (force or desired != self._labels)
        condition_due = force or _shown(health) != _shown(self._health)
        labels_written = False
        if labels_due and self.settings.labels == "features_file":
            labels_written = self._write_file(desired)  # needs no API: log-only mode too
            labels_due = False
        api, recorder = self.api, self.recorder
        if api is None or recorder is None:
            self._log_only(desired if labels_due else None, health, events, condition_due)
            return SyncResult(labels_written or labels_due, condition_due, tuple(events))
        errors: list[ApiError] = []
        condition_written = False
        if labels_due:
            try:
                labels_written = self._write_labels(api, desired)
                self._labels = desired
            except ApiError as exc:
                errors.append(exc)
        if condition_due:
            try:
                self._write_condition(api, health, now, fresh=force)
                self._health = health
                condition_written = True
            except ApiError as exc:
                errors.append(exc)
        sent = recorder.record(events, now=now, node_uid=self._uid()) if events else ()
        if errors:
            raise errors[0]
        return SyncResult(labels_written, condition_written, sent)

    def observe(self, node: Mapping[str, Any]) -> None:
        """A newer Node object (from a watch, say): cordon and patches start from it."""
        with self._lock:
            self._node = dict(node)

    def read(self) -> Mapping[str, Any]:
        """Read the Node now (and remember it)."""
        if self.api is None:
            msg = "no Kubernetes API (log-only mode)"
            raise ApiError(None, msg)
        node = self.api.read_node(self.node_name)
        self.observe(node)
        return node

    def cordoned(self, devices: Sequence[Device]) -> Cordon:
        """Devices named by the `edl.io/cordoned-devices` annotation of the Node last seen."""
        with self._lock:
            node = self._node
        annotations = (node or {}).get("metadata", {}).get("annotations")
        return cordoned_devices(cordon_annotation(annotations), devices)

    def released(self, devices: Sequence[Device]) -> Release | None:
        """The devices an operator releases through `edl.io/release-devices` on the Node last
        seen, with the annotation's value; None when the annotation is not there."""
        with self._lock:
            node = self._node
        value = ((node or {}).get("metadata", {}).get("annotations") or {}).get(RELEASE_DEVICES)
        if value is None:
            return None
        return Release(cordoned_devices(value, devices), value)

    def forget_release(self, value: str) -> bool:
        """Remove `edl.io/release-devices` once its release is done, if it still reads `value`
        (an operator who changed it since is seen again on the next watch event); True when
        removed. The resourceVersion precondition makes the check and the removal one step."""
        if self.api is None:
            return False
        node = self.read()
        metadata = node.get("metadata", {})
        if (metadata.get("annotations") or {}).get(RELEASE_DEVICES) != value:
            return False
        patch = {
            "metadata": {
                "resourceVersion": metadata.get("resourceVersion"),
                "annotations": {RELEASE_DEVICES: None},
            }
        }
        try:
            self.observe(self.api.patch_node(self.node_name, patch))
        except ApiError as exc:
            if exc.status != CONFLICT:
                raise
            return False
        return True

    def _write_labels(self, api: NodeApi, desired: dict[str, str]) -> bool:
        for _ in range(ATTEMPTS):
            node = self.read()
            metadata = node.get("metadata", {})
            patch = label_patch(
                labels=metadata.get("labels") or {},
                annotations=metadata.get("annotations") or {},
                desired=desired,
            )
            if patch.body is None:
                return False
            patch.body["metadata"]["resourceVersion"] = metadata.get("resourceVersion")
            try:
                self.observe(api.patch_node(self.node_name, patch.body))
            except ApiError as exc:
                if exc.status != CONFLICT:
                    raise
                self.conflicts += 1
                continue
            self._log.info(
                "node labels written",
                set=dict(patch.set) or None,
                removed=list(patch.removed) or None,
                taken_over=list(patch.taken_over) or None,
            )
            return True
        msg = f"node {self.node_name} kept changing: gave up after {ATTEMPTS} conflicts"
        raise ApiError(CONFLICT, msg)

    def _write_condition(
        self, api: NodeApi, health: AcceleratorHealth, now: datetime, *, fresh: bool
    ) -> None:
        previous = self._condition
        if previous is None or fresh:
            previous = find_condition(self.read())
        condition = node_condition(health, previous=previous, now=now)
        node = api.patch_node_status(self.node_name, {"status": {"conditions": [condition]}})
        self.observe(node)
        self._condition = condition
        if previous is None or previous.get("status") != condition["status"]:
            log = self._log.warning if not health.healthy else self._log.info
            log("accelerator condition", status=health.status, reason=health.reason)

    def _uid(self) -> str | None:
        with self._lock:
            node = self._node
        uid = (node or {}).get("metadata", {}).get("uid")
        return str(uid) if uid else None

    def _write_file(self, desired: dict[str, str]) -> bool:
        written = write_features_file(self.settings.features_file, desired)
        if written:
            self._log.info("feature file written", path=self.settings.features_file)
        self._labels = desired
        return written

    def _log_only(
        self,
        labels: dict[str, str] | None,
        health: AcceleratorHealth,
        events: list[EventSpec],
        condition_due: bool,
    ) -> None:
        if labels is not None:
            self._log.info("node labels (log only: no Kubernetes API)", labels=labels)
            self._labels = labels
        if condition_due:
            self._log.info(
                "node condition (log only: no Kubernetes API)",
                type=CONDITION_TYPE,
                status=health.status,
                reason=health.reason,
                message=health.message,
            )
            self._health = health
        for event in events:
            self._log.info(
                "node event (log only: no Kubernetes API)",
                type=event.type,
                reason=event.reason,
                message=event.message,
            )


def _shown(health: AcceleratorHealth | None) -> tuple[str, str, str] | None:
    return None if health is None else (health.status, health.reason, health.message)
