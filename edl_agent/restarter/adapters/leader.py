"""The leader elector: one restarter replica acts, the others wait on a Lease (see `lease`).

Every `retry_period` the elector reads the Lease and writes what `lease.next_record` says: a
renewal while it leads, the take-over once the holder's record has stood still for the lease
duration. `on_started` runs when it becomes the leader; when it cannot renew for
`renew_deadline` (or finds another holder) it stops leading and runs `on_stopped` once — the
restarter then exits so that its half-done work is never continued beside a new leader. A
graceful `stop` releases the Lease, so a standby takes over within one retry period. The
elector is a supervised part (`run(stop, ready)`): a crash of it is logged, counted and retried.

While leading, the restarter's own pod carries the label `LEADER_LABEL`: the intake Service
selects on it, so agents reach the leader only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import structlog
from kubernetes import client

from edl_agent.kube import CONFLICT, MERGE_PATCH, NOT_FOUND, ApiError, call_json
from edl_agent.restarter.core.lease import (
    LeaseRecord,
    lease_spec,
    next_record,
    read_lease,
    released,
)

log = structlog.get_logger(__name__)

LEADER_LABEL = "edl.io/restarter-leader"
ALREADY_EXISTS = 409


class LeaderElector:
    name = "leader-election"

    def __init__(
        self,
        api: client.ApiClient,
        *,
        namespace: str,
        name: str,
        identity: str,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        on_started: Callable[[], None],
        on_stopped: Callable[[], None],
        annotations: Callable[[], Mapping[str, str]] = dict,
    ) -> None:
        """`annotations()`: what the leader keeps on the Lease, written with every renewal;
        `inherited` holds what the previous holder left there, once this one leads."""
        if not renew_deadline < lease_duration:
            msg = "the renew deadline must be shorter than the lease duration"
            raise ValueError(msg)
        self.namespace, self.lease_name, self.identity = namespace, name, identity
        self._api: Any = client.CoordinationV1Api(api)
        self._duration = max(1, round(lease_duration))
        self._renew_deadline = renew_deadline
        self._retry = retry_period
        self._on_started, self._on_stopped = on_started, on_stopped
        self._stop = threading.Event()
        self._leading = threading.Event()
        self._seen: tuple[object, ...] | None = None
        self._seen_at = 0.0
        self._renewed_at = 0.0
        self._annotations = annotations
        self.inherited: Mapping[str, str] = {}

    @property
    def leading(self) -> bool:
        return self._leading.is_set()

    def wait_leading(self, timeout: float) -> bool:
        return self._leading.wait(timeout)

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        """The supervised part: elect until `stop` (or until leadership is lost)."""
        log.info(
            "waiting for leadership", lease=f"{self.namespace}/{self.lease_name}", id=self.identity
        )
        ready()
        while not (stop.is_set() or self._stop.is_set()):
            try:
                self._try_once()
            except ApiError as exc:
                log.warning("lease access failed", lease=self.lease_name, error=str(exc))
            except Exception:
                log.exception("leader election step failed")
            overdue = time.monotonic() - self._renewed_at > self._renew_deadline
            if self._leading.is_set() and overdue:
                self._lose("could not renew the lease within the renew deadline")
                return
            if stop.wait(self._retry):
                return

    def stop(self) -> None:
        """Stop electing (once its part has ended); a leader releases the Lease (without
        running `on_stopped`)."""
        self._stop.set()
        if self._leading.is_set():
            self._leading.clear()
            self._release()

    def _try_once(self) -> None:
        obj = self._read()
        current = read_lease(obj)
        now = time.monotonic()
        seen = _fingerprint(obj)
        moved = seen != self._seen
        if moved:
            self._seen, self._seen_at = seen, now
        wanted = next_record(
            current,
            me=self.identity,
            now=datetime.now(UTC),
            duration_seconds=self._duration,
            unchanged_for=now - self._seen_at,
        )
        if wanted is None:
            if self._leading.is_set():
                holder = current.holder if current is not None else ""
                self._lose(f"the lease is held by {holder}")
            elif moved and current is not None:
                # Once per renewal seen: why a standby does not take over (its leader lives).
                log.debug(
                    "standing by: the lease holder renewed",
                    lease=f"{self.namespace}/{self.lease_name}",
                    holder=current.holder,
                    renewed=current.renewed.isoformat() if current.renewed else None,
                )
            return
        if not self._leading.is_set():
            self.inherited = dict(((obj or {}).get("metadata") or {}).get("annotations") or {})
        try:
            self._write(obj, wanted)
        except ApiError as exc:
            if exc.status in (CONFLICT, ALREADY_EXISTS):
                return  # somebody else wrote first; read again next round
            raise
        self._renewed_at = time.monotonic()
        if not self._leading.is_set():
            self._leading.set()
            log.info(
                "leading",
                lease=f"{self.namespace}/{self.lease_name}",
                id=self.identity,
                transitions=wanted.transitions,
            )
            self._on_started()

    def _lose(self, why: str) -> None:
        log.error("lost leadership", lease=f"{self.namespace}/{self.lease_name}", reason=why)
        self._leading.clear()
        self._stop.set()
        self._on_stopped()

    def _read(self) -> dict[str, Any] | None:
        try:
            return call_json(self._api.read_namespaced_lease, self.lease_name, self.namespace)
        except ApiError as exc:
            if exc.status == NOT_FOUND:
                return None
            raise

    def _write(self, obj: dict[str, Any] | None, record: LeaseRecord) -> None:
        metadata: dict[str, Any] = {"name": self.lease_name, "namespace": self.namespace}
        annotations = (dict(self.inherited) if not self._leading.is_set() else {}) | dict(
            self._annotations()
        )
        if annotations:
            metadata["annotations"] = annotations
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": lease_spec(record),
        }
        if obj is None:
            call_json(self._api.create_namespaced_lease, self.namespace, body)
            return
        metadata["resourceVersion"] = obj["metadata"]["resourceVersion"]
        call_json(self._api.replace_namespaced_lease, self.lease_name, self.namespace, body)

    def _release(self) -> None:
        try:
            obj = self._read()
            current = read_lease(obj)
            if obj is None or current is None or current.holder != self.identity:
                return
            self._write(obj, released(current))
            log.info("released the lease", lease=f"{self.namespace}/{self.lease_name}")
        except ApiError as exc:
            log.warning("could not release the lease", lease=self.lease_name, error=str(exc))


def _fingerprint(obj: dict[str, Any] | None) -> tuple[object, ...] | None:
    if obj is None:
        return None
    spec = obj.get("spec") or {}
    return (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("acquireTime"))


def label_own_pod(api: client.ApiClient, namespace: str, name: str, *, leader: bool) -> bool:
    """Set (or remove) `LEADER_LABEL` on the restarter's own pod; True when done. A failure is
    logged, never raised: the Service misses the leader until a later try, and the agents'
    outboxes keep the faults meanwhile."""
    core: Any = client.CoreV1Api(api)
    patch = {"metadata": {"labels": {LEADER_LABEL: "true" if leader else None}}}
    try:
        call_json(core.patch_namespaced_pod, name, namespace, patch, _content_type=MERGE_PATCH)
    except ApiError as exc:
        log.warning("could not label the restarter's pod", pod=name, error=str(exc))
        return False
    return True
