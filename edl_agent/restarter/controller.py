"""The restarter's loop: faults in (intake and watchers), decisions and replacements out.

Faults queue up for one worker thread, which handles them one at a time, so two faults of a
job never race on its policy's status. For each pod of a fault: the policy that covers it (from
a list+watch of FaultTolerancePolicy objects; a malformed one gets condition SpecValid=False in
its status and covers nothing), then read the policy, `decide`, persist the decision's status
with the read resourceVersion (on a conflict read and decide again), and only then act: Restart
replaces the pods of its scope, Backoff decides again at `until`, the others are only recorded.
Each decision is logged with its reason. A fault id is handled once (an agent's report and the
watcher's observation of the same exit carry the same id).
"""

from __future__ import annotations

import functools
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog
from kubernetes import client

from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.kube import ApiError
from edl_agent.restarter.actuator import GROUP, PLURAL, VERSION, Actuator, Conflict
from edl_agent.restarter.decide import Action, Decision, decide
from edl_agent.restarter.policy import Policy, RestartScope
from edl_agent.restarter.spec import parse_policy
from edl_agent.restarter.status import format_time, read_job, record_decision
from edl_agent.restarter.watchers import ClusterWatcher, ListWatch, deleted_by_us, pod_ref
from edl_agent.typed import SchemaError

log = structlog.get_logger(__name__)

SPEC_VALID = "SpecValid"
DECIDE_ATTEMPTS = 5
KEEP_IDS = 100_000


@dataclass(frozen=True)
class _Item:
    fault: Fault
    retry: bool = False  # a Backoff's second look: not a duplicate


class Controller:
    def __init__(
        self,
        api: client.ApiClient,
        *,
        namespaces: Iterable[str] = (),
        node_grace: float = 40.0,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._clock = clock
        self._namespaces = list(namespaces)
        self.watcher = ClusterWatcher(
            api, on_fault=self.submit, namespaces=self._namespaces, node_grace=node_grace
        )
        self.actuator = Actuator(api, before_delete=self.watcher.ignore_uid)
        self._queue: queue.Queue[_Item] = queue.Queue()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._policies: dict[tuple[str, str], Policy | None] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._timers: set[threading.Timer] = set()
        objects: Any = client.CustomObjectsApi(api)
        self._policy_watches = []
        scopes: list[str | None] = [*self._namespaces] or [None]
        for namespace in scopes:

            def call(ns: str | None = namespace, **kwargs: Any) -> Any:
                if ns is None:
                    return objects.list_cluster_custom_object(GROUP, VERSION, PLURAL, **kwargs)
                return objects.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, **kwargs)

            self._policy_watches.append(
                ListWatch(
                    f"policies/{namespace or '*'}",
                    call,
                    on_list=functools.partial(self._policies_listed, namespace),
                    on_event=self._policy_event,
                )
            )
        self._worker = threading.Thread(target=self._work, name="restarter", daemon=True)

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        for watch in self._policy_watches:
            watch.start()
        self.watcher.start()
        self._worker.start()

    def wait_synced(self, timeout: float = 30.0) -> bool:
        return all(w.synced.wait(timeout) for w in self._policy_watches) and (
            self.watcher.wait_synced(timeout)
        )

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            timers = list(self._timers)
        for timer in timers:
            timer.cancel()
        self.watcher.stop()
        for watch in self._policy_watches:
            watch.stop()
        self._worker.join(timeout=10)

    def knows_policy(self, namespace: str, name: str) -> bool:
        """Whether the policy watch has seen this policy (valid or not)."""
        with self._lock:
            return (namespace, name) in self._policies

    def submit(self, fault: Fault) -> None:
        """Queue a fault (the intake's and the watcher's sink); returns at once."""
        self._queue.put(_Item(fault))

    # --- policies ------------------------------------------------------------------------

    def _policies_listed(self, namespace: str | None, items: list[dict[str, Any]]) -> None:
        with self._lock:
            for key in [k for k in self._policies if namespace is None or k[0] == namespace]:
                del self._policies[key]
        for item in items:
            self._policy_event("ADDED", item)

    def _policy_event(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        if kind == "DELETED":
            with self._lock:
                self._policies.pop(key, None)
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
        self._mark_valid(obj, problem)

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
            "lastTransitionTime": format_time(self._clock()),
        }
        status["conditions"] = [c for c in conditions if c.get("type") != SPEC_VALID] + [condition]
        try:
            self.actuator.write_status(obj, status)
        except (Conflict, ApiError) as exc:
            log.info("could not write the policy's condition; next event retries", error=str(exc))

    def _covering(
        self, namespace: str, ref: PodRef, labels: Mapping[str, str]
    ) -> tuple[str, Policy] | None:
        with self._lock:
            found = sorted(
                (name, policy)
                for (ns, name), policy in self._policies.items()
                if ns == namespace and policy is not None and policy.identify(ref, labels)
            )
        if len(found) > 1:
            log.warning(
                "several policies cover a pod; the first by name decides",
                pod=f"{ref.namespace}/{ref.name}",
                policies=[name for name, _ in found],
            )
        return found[0] if found else None

    # --- the worker ----------------------------------------------------------------------

    def _work(self) -> None:
        while not self._stopping.is_set():
            try:
                item = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if not item.retry:
                with self._lock:
                    if item.fault.id in self._seen:
                        log.debug("duplicate fault", fault_id=item.fault.id)
                        continue
                    self._seen[item.fault.id] = None
                    while len(self._seen) > KEEP_IDS:
                        self._seen.popitem(last=False)
            try:
                self._handle(item.fault)
            except Exception:
                log.exception("handling a fault failed", fault_id=item.fault.id)

    def _handle(self, fault: Fault) -> None:
        for ref in fault.pods:
            pod = self.watcher.find_pod(ref) or self.actuator.read_pod(ref.namespace, ref.name)
            if pod is None or (ref.uid and pod_ref(pod).uid != ref.uid):
                log.info("fault about an unknown pod", fault_id=fault.id, pod=ref.name)
                continue
            found = pod_ref(pod)
            labels = (pod.get("metadata") or {}).get("labels") or {}
            covering = self._covering(found.namespace, found, labels)
            if covering is None:
                log.debug("no policy covers the pod", fault_id=fault.id, pod=found.name)
                continue
            self._decide_and_act(fault, pod, found, covering[0])

    def _decide_and_act(self, fault: Fault, pod: dict[str, Any], ref: PodRef, name: str) -> None:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        for _ in range(DECIDE_ATTEMPTS):
            obj = self.actuator.read_policy(ref.namespace, name)
            try:
                policy = parse_policy(obj.get("spec"))
            except (SchemaError, ValueError):
                return  # the watch marks it
            identity = policy.identify(ref, labels)
            if identity is None:
                return
            now = self._clock()
            decision = decide(
                fault=fault,
                pod=identity,
                policy=policy,
                record=read_job(obj.get("status"), identity.job),
                now=now,
            )
            log.info(
                "decision",
                action=str(decision.action),
                reason=decision.reason,
                fault_id=fault.id,
                pod=f"{ref.namespace}/{ref.name}",
                policy=name,
            )
            if decision.action is Action.STALE:
                return
            try:
                self.actuator.write_status(
                    obj, record_decision(obj.get("status"), decision, now=now)
                )
            except Conflict:
                log.info("the policy changed; deciding again", policy=name, fault_id=fault.id)
                continue
            break
        else:
            log.error("could not record a decision; the policy keeps changing", policy=name)
            return
        if decision.action is Action.RESTART:
            self._restart(decision, pod, policy)
        elif decision.action is Action.BACKOFF and decision.until is not None:
            self._retry_at(fault, decision.until)

    def _restart(self, decision: Decision, pod: dict[str, Any], policy: Policy) -> None:
        fault, identity = decision.fault, decision.pod
        targets = [pod]
        if decision.scope is not RestartScope.POD:
            selector = f"{policy.selector},{policy.job_label}={identity.job}"
            if decision.scope is RestartScope.REPLICA and policy.replica_type_label:
                selector += f",{policy.replica_type_label}={identity.replica_type}"
            uid = pod_ref(pod).uid
            targets += [
                p
                for p in self.actuator.list_pods(pod_ref(pod).namespace, selector)
                if pod_ref(p).uid != uid
                and not deleted_by_us(p)
                and not (p.get("metadata") or {}).get("deletionTimestamp")
            ]
        for target in targets:
            node = str((target.get("spec") or {}).get("nodeName") or "")
            force = bool(node) and (
                self.watcher.node_not_ready(node)
                or (fault.kind is FaultKind.NODE_NOT_READY and node == fault.node)
            )
            try:
                self.actuator.replace(
                    target, fault_kind=fault.kind, failed_node=fault.node, force=force
                )
            except ApiError as exc:
                log.error(
                    "could not replace a pod",
                    pod=pod_ref(target).name,
                    fault_id=fault.id,
                    error=str(exc),
                )

    def _retry_at(self, fault: Fault, until: datetime) -> None:
        delay = max(0.0, (until - self._clock()).total_seconds()) + 0.05

        def fire() -> None:
            with self._lock:
                self._timers.discard(timer)
            if not self._stopping.is_set():
                self._queue.put(_Item(fault, retry=True))

        timer = threading.Timer(delay, fire)
        timer.daemon = True
        with self._lock:
            self._timers.add(timer)
        timer.start()
