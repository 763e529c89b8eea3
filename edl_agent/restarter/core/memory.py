"""A cluster in memory that implements both of the restarter's ports (`port.ClusterPort` and
`port.PodView`) with the API server's rules that matter to it: a status write carries the
resourceVersion it read and fails with Conflict when the policy changed since; creating a pod
whose name exists fails AlreadyExists; a delete is conditional on the pod's uid; a status write
larger than the API server takes fails 413. It counts the
calls made, and can be told to fail them, so the controller's orchestration can be tested in
milliseconds, crashes and API errors included.
"""

from __future__ import annotations

import copy
import itertools
import json
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from edl_agent.faults.model import FaultKind, PodRef
from edl_agent.kube_errors import ApiError
from edl_agent.kube_time import format_time
from edl_agent.restarter.core.port import Conflict, EvictionRefused, Replacement
from edl_agent.restarter.core.replacement import (
    NODE_FAULTS,
    REPLACES_UID_ANNOTATION,
    replacement_pod,
)

UNAVAILABLE = 503
TOO_LARGE = 413
# kube-apiserver refuses a request body over 3 MiB (its `--max-request-bytes` default).
MAX_REQUEST_BYTES = 3 * 1024 * 1024


class InMemoryCluster:
    def __init__(self, clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        """`clock` dates the pods made (creationTimestamp, whole seconds as the API's)."""
        self._clock = clock
        self._lock = threading.RLock()
        self._versions = itertools.count(1)
        self.policies: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}  # uid → pod
        self.gone: dict[str, dict[str, Any]] = {}  # uid → deleted pod
        self.not_ready: set[str] = set()
        self.nodes: set[str] = set()
        self.out_of_service: set[str] = set()
        self.calls: Counter[str] = Counter()
        self.failing: set[str] = set()
        self.refuse_evictions = False  # a PodDisruptionBudget that allows no disruption now
        """Call names (`write_status`, `create_pod`, `delete_pod`, `read_policy`, `read_pod`)
        that fail with HTTP 503 while listed."""
        self.max_request_bytes = MAX_REQUEST_BYTES
        """A status write whose policy, as JSON, is larger fails with HTTP 413."""

    # --- set-up --------------------------------------------------------------------------

    def add_policy(self, namespace: str, name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
        with self._lock:
            obj = {
                "apiVersion": "edl.io/v1alpha1",
                "kind": "FaultTolerancePolicy",
                "metadata": {
                    "namespace": namespace,
                    "name": name,
                    "resourceVersion": str(next(self._versions)),
                    "uid": str(uuid.uuid4()),
                },
                "spec": copy.deepcopy(dict(spec)),
            }
            self.policies[(namespace, name)] = obj
            return copy.deepcopy(obj)

    def add_pod(
        self,
        namespace: str,
        name: str,
        *,
        node: str = "node-0",
        labels: Mapping[str, str] | None = None,
        spec: Mapping[str, Any] | None = None,
        status: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        pod_spec: dict[str, Any] = {"containers": [{"name": "main", "image": "busybox"}]}
        pod_spec.update(spec or {})
        pod_spec["nodeName"] = node
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "namespace": namespace,
                "name": name,
                "labels": dict(labels or {}),
                "annotations": {},
            },
            "spec": pod_spec,
            "status": dict(status or {"phase": "Running"}),
        }
        self.nodes.add(node)
        return self._create(pod)

    def force_delete(self, namespace: str, name: str) -> dict[str, Any]:
        """Delete a pod at once, as `kubectl delete --grace-period=0 --force` does."""
        with self._lock:
            pod = self._by_name(namespace, name)
            if pod is None:
                raise KeyError(name)
            del self.pods[pod["metadata"]["uid"]]
            pod["metadata"]["deletionGracePeriodSeconds"] = 0
            self.gone[pod["metadata"]["uid"]] = pod
            return copy.deepcopy(pod)

    def forget_gone(self) -> None:
        """Forget the deleted pods, as a restarter that starts afresh never saw them."""
        with self._lock:
            self.gone.clear()

    def live(self, namespace: str) -> list[dict[str, Any]]:
        """Live pods in `namespace`, by name."""
        with self._lock:
            return sorted(
                (copy.deepcopy(p) for p in self.pods.values() if _ns(p) == namespace),
                key=lambda p: p["metadata"]["name"],
            )

    def writes(self) -> int:
        """Calls that changed something."""
        return sum(self.calls[c] for c in ("write_status", "create_pod", "delete_pod", "evict_pod"))

    # --- ClusterPort ---------------------------------------------------------------------

    def read_policy(self, namespace: str, name: str) -> dict[str, Any]:
        with self._lock:
            self._call("read_policy")
            obj = self.policies.get((namespace, name))
            if obj is None:
                raise ApiError(404, f"policy {namespace}/{name} not found")
            return copy.deepcopy(obj)

    def write_status(self, policy: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, Any]:
        meta = policy["metadata"]
        with self._lock:
            self._call("write_status")
            obj = self.policies.get((meta["namespace"], meta["name"]))
            if obj is None:
                raise ApiError(404, "policy not found")
            if obj["metadata"]["resourceVersion"] != meta["resourceVersion"]:
                raise Conflict("the object has been modified")
            size = len(json.dumps({**obj, "status": status}))
            if size > self.max_request_bytes:
                limit = self.max_request_bytes
                raise ApiError(TOO_LARGE, f"Request entity too large: limit is {limit}")
            obj["status"] = copy.deepcopy(dict(status))
            obj["metadata"]["resourceVersion"] = str(next(self._versions))
            return copy.deepcopy(obj)

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            self._call("read_pod")
            found = self._by_name(namespace, name)
            return None if found is None else copy.deepcopy(found)

    def replace(
        self,
        pod: Mapping[str, Any],
        *,
        fault_kind: FaultKind,
        failed_node: str,
        force: bool,
        why: str = "",
        graceful: bool = False,
        release: bool = True,
    ) -> Replacement:
        meta = pod["metadata"]
        avoid = failed_node if fault_kind in NODE_FAULTS and failed_node else None
        body = replacement_pod(pod, avoid_node=avoid)
        body["metadata"]["namespace"] = meta["namespace"]
        with self._lock:
            if graceful:
                self._call("evict_pod")
                if self.refuse_evictions:
                    raise EvictionRefused(f"{meta['name']}: the disruption budget allows none")
                self._end(meta)
            self._call("create_pod")
            if self._by_name(_ns(body), body["metadata"]["name"]) is None:
                self._create(body)
            if not graceful:
                self._call("delete_pod")
                self._end(meta)
        return Replacement(meta["name"], body["metadata"]["name"], force)

    def _end(self, meta: Mapping[str, Any]) -> None:
        current = self._by_name(meta["namespace"], meta["name"])
        if current is not None and current["metadata"]["uid"] == meta.get("uid"):
            del self.pods[current["metadata"]["uid"]]
            self.gone[current["metadata"]["uid"]] = current

    # --- PodView -------------------------------------------------------------------------

    def find_pod(self, ref: PodRef) -> dict[str, Any] | None:
        with self._lock:
            found = (self.pods.get(ref.uid) or self.gone.get(ref.uid)) if ref.uid else None
            if found is None:
                found = self._by_name(ref.namespace, ref.name)
            return None if found is None else copy.deepcopy(found)

    def whole(self, ref: PodRef) -> dict[str, Any] | None:
        return None  # always read: the calls are counted

    def pods_in(self, namespace: str) -> list[dict[str, Any]]:
        return self.live(namespace)

    def node_not_ready(self, node: str) -> bool:
        return node in self.not_ready

    def node_gone(self, node: str) -> bool:
        return node not in self.nodes or node in self.out_of_service

    def node_counts(self) -> tuple[int, int]:
        return len(self.not_ready), len(self.nodes)

    def exists(self, ref: PodRef) -> bool:
        with self._lock:
            return ref.uid in self.pods

    def replaced(self, ref: PodRef) -> bool:
        with self._lock:
            return any(
                (p["metadata"].get("annotations") or {}).get(REPLACES_UID_ANNOTATION) == ref.uid
                for p in (*self.pods.values(), *self.gone.values())
            )

    # --- inside --------------------------------------------------------------------------

    def _call(self, name: str) -> None:
        self.calls[name] += 1
        if name in self.failing:
            raise ApiError(UNAVAILABLE, f"{name}: the API server is unavailable")

    def _create(self, pod: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            pod = copy.deepcopy(pod)
            pod["metadata"]["uid"] = str(uuid.uuid4())
            pod["metadata"]["creationTimestamp"] = format_time(self._clock())
            pod["metadata"]["resourceVersion"] = str(next(self._versions))
            pod.setdefault("status", {"phase": "Pending"})
            self.pods[pod["metadata"]["uid"]] = pod
            return copy.deepcopy(pod)

    def _by_name(self, namespace: str, name: str) -> dict[str, Any] | None:
        return next(
            (p for p in self.pods.values() if (_ns(p), p["metadata"]["name"]) == (namespace, name)),
            None,
        )


def _ns(pod: Mapping[str, Any]) -> str:
    return str(pod["metadata"].get("namespace", ""))
