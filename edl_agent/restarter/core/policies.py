"""The policy cache: the FaultTolerancePolicies the watch shows, parsed, indexed by the pods
they cover, and the newest object of each (watch events and our own status writes), from which
decisions start instead of a read; a stale one costs a Conflict and a read. It also keeps each
policy's `SpecValid` condition and when our last status write to it was. Pure of API clients:
it reads and writes through the `ClusterPort`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import structlog

from edl_agent.faults.model import PodRef
from edl_agent.kube_errors import ApiError
from edl_agent.kube_objects import object_version
from edl_agent.kube_time import format_micro_time
from edl_agent.restarter.core.covering import PolicyIndex
from edl_agent.restarter.core.policy import Policy
from edl_agent.restarter.core.port import ClusterPort, Conflict
from edl_agent.restarter.core.spec import parse_policy
from edl_agent.typed import SchemaError

log = structlog.get_logger(__name__)

SPEC_VALID = "SpecValid"
Key = tuple[str, str]  # (namespace, name)


def key_of(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


class PolicyCache:
    def __init__(
        self,
        port: ClusterPort,
        *,
        clock: Callable[[], datetime],
        monotonic: Callable[[], float] = time.monotonic,
        on_pending: Callable[[], None] = lambda: None,
    ) -> None:
        """`on_pending()` is called when a policy with pending restarts is seen while none had
        any (the dispatcher looks at them again from then on, until none has any)."""
        self._port = port
        self._on_pending = on_pending
        self._clock = clock
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._policies: dict[Key, Policy | None] = {}
        self._index = PolicyIndex()
        self._latest: dict[Key, dict[str, Any]] = {}
        self._last_write: dict[Key, float] = {}  # monotonic
        self._pending: set[Key] = set()  # those of `_latest` with pending restarts

    # --- what the policy watch tells ---------------------------------------------------------

    def listed(self, namespace: str | None, items: list[dict[str, Any]]) -> None:
        with self._lock:
            for key in [k for k in self._policies if namespace is None or k[0] == namespace]:
                self._drop(key)
        for item in items:
            self.event("ADDED", item)

    def event(self, kind: str, obj: dict[str, Any]) -> None:
        key = key_of(obj)
        if kind == "DELETED":
            with self._lock:
                self._drop(key)
            return
        policy: Policy | None
        try:
            policy = parse_policy(obj.get("spec"))
            problem = None
        except (SchemaError, ValueError) as exc:
            policy, problem = None, str(exc)
            log.warning("malformed FaultTolerancePolicy", policy="/".join(key), error=problem)
        with self._lock:
            self._policies[key] = policy
            self._index.put(*key, policy)
        self.remember(obj)
        self._mark_valid(obj, problem)

    def _drop(self, key: Key) -> None:
        """(Under _lock.)"""
        self._policies.pop(key, None)
        self._index.remove(*key)
        self._latest.pop(key, None)
        self._pending.discard(key)

    # --- what the deciders and the dispatcher ask -------------------------------------------

    def knows(self, namespace: str, name: str) -> bool:
        """Whether the policy watch has seen this policy (valid or not)."""
        with self._lock:
            return (namespace, name) in self._policies

    def valid(self) -> list[Key]:
        """The policies that parsed, by namespace and name."""
        with self._lock:
            return sorted(k for k, policy in self._policies.items() if policy is not None)

    def with_pending_restarts(self) -> list[dict[str, Any]]:
        with self._lock:
            return [self._latest[key] for key in sorted(self._pending)]

    def has_pending_restarts(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def quiet_for(self, key: Key) -> float:
        """Seconds since our last status write to the policy (since ever: a large number)."""
        with self._lock:
            last = self._last_write.get(key)
        return float("inf") if last is None else self._monotonic() - last

    def remember(self, obj: Mapping[str, Any]) -> None:
        key = key_of(obj)
        with self._lock:
            old = self._latest.get(key)
            if old is not None and object_version(old) > object_version(obj):
                return
            self._latest[key] = dict(obj)
            first = not self._pending
            if _has_pending(obj):
                self._pending.add(key)
            else:
                self._pending.discard(key)
            told = first and bool(self._pending)
        if told:
            self._on_pending()

    def written(self, obj: Mapping[str, Any]) -> None:
        """A policy as our own status write returned it."""
        self.remember(obj)
        with self._lock:
            self._last_write[key_of(obj)] = self._monotonic()

    def object(self, namespace: str, name: str, *, fresh: bool) -> dict[str, Any]:
        """The newest policy object seen, or (`fresh`, or none seen) one read now."""
        if not fresh:
            with self._lock:
                cached = self._latest.get((namespace, name))
            if cached is not None:
                return cached
        obj = self._port.read_policy(namespace, name)
        self.remember(obj)
        return obj

    def covering(
        self, namespace: str, ref: PodRef, labels: Mapping[str, str]
    ) -> tuple[str, Policy] | None:
        with self._lock:
            found = self._index.covering(namespace, ref, labels)
        if len(found) > 1:
            log.warning(
                "several policies cover a pod; the first by name decides",
                pod=f"{ref.namespace}/{ref.name}",
                policies=[name for name, _ in found],
            )
        return found[0] if found else None

    def _mark_valid(self, obj: dict[str, Any], problem: str | None) -> None:
        status = dict(obj.get("status") or {})
        conditions = list(status.get("conditions") or [])
        old = next((c for c in conditions if c.get("type") == SPEC_VALID), None)
        state = "True" if problem is None else "False"
        message = problem or "the spec is valid"
        if old is None and problem is None:
            return
        if old is not None and (old.get("status"), old.get("message")) == (state, message):
            return
        condition = {
            "type": SPEC_VALID,
            "status": state,
            "reason": "Valid" if problem is None else "InvalidSpec",
            "message": message,
            "lastTransitionTime": format_micro_time(self._clock()),
        }
        status["conditions"] = [c for c in conditions if c.get("type") != SPEC_VALID] + [condition]
        try:
            self._port.write_status(obj, status)
        except (Conflict, ApiError) as exc:
            log.info("could not write the policy's condition; next event retries", error=str(exc))


def _has_pending(obj: Mapping[str, Any]) -> bool:
    return any(j.get("pendingRestarts") for j in (obj.get("status") or {}).get("jobs") or [])
