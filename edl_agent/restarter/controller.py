"""The restarter's loop: faults in (intake and watchers), decisions and replacements out.

Faults queue up for a dispatcher thread, which drops duplicates, asks the storm guard, and hands
each pod of a fault to one of `workers` threads chosen by the policy that covers the pod, so the
faults of one policy are decided in order while different policies proceed in parallel (and
two writers of one policy's status would still be safe: every write is conditional on the
resourceVersion read). For each pod of a fault: the policy that covers it (from
a list+watch of FaultTolerancePolicy objects; a malformed one gets condition SpecValid=False in
its status and covers nothing), then read the policy, `decide`, persist the decision's status
with the read resourceVersion (on a conflict read and decide again), and only then act: Restart
replaces the pods of its scope, Backoff decides again at `until`, the others are only recorded.
Each decision is logged with its reason, counted in the metrics, and a Restart or a reached
limit is an Event on the policy. A fault id is handled once (an agent's report and the watcher's
observation of the same exit carry the same id).

A Restart is written to the status together with the pods it is about to replace
(`pendingRestarts`) and removed from there once they are replaced; the worker's first job after
a start is to finish what is pending, so a restarter killed mid-replacement neither loses the
replacement nor makes a second one (replacement names are deterministic) nor counts it twice.
Node-failure faults wait while the storm guard says too many nodes are failing at once.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog
from kubernetes import client

from edl_agent.bounded import BoundedSet
from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.kube import ApiError
from edl_agent.kube_time import format_micro_time
from edl_agent.restarter.actuator import GROUP, PLURAL, VERSION, Actuator, Conflict
from edl_agent.restarter.decide import Action, Decision, decide
from edl_agent.restarter.events import EventWriter, reference
from edl_agent.restarter.metrics import RestarterMetrics
from edl_agent.restarter.policy import Policy, RestartScope
from edl_agent.restarter.spec import parse_policy
from edl_agent.restarter.status import (
    PendingRestart,
    finish_restart,
    pending_restarts,
    read_job,
    record_decision,
)
from edl_agent.restarter.storm import StormGuard
from edl_agent.restarter.watchers import ClusterWatcher, ListWatch, deleted_by_us, pod_ref
from edl_agent.typed import SchemaError

log = structlog.get_logger(__name__)

SPEC_VALID = "SpecValid"
DECIDE_ATTEMPTS = 5
KEEP_IDS = 100_000
SYNC_TIMEOUT = 300.0


@dataclass(frozen=True)
class _Item:
    fault: Fault
    retry: bool = False  # a Backoff's second look: not a duplicate


@dataclass(frozen=True)
class _Task:
    fault: Fault
    pod: dict[str, Any]
    ref: PodRef
    policy: str


class Controller:
    def __init__(
        self,
        api: client.ApiClient,
        *,
        namespaces: Iterable[str] = (),
        node_grace: float = 40.0,
        storm: StormGuard | None = None,
        metrics: RestarterMetrics | None = None,
        events: EventWriter | None = None,
        storm_object: Mapping[str, str] | None = None,
        workers: int = 8,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        """`storm_object`: the object (see `events.reference`) storm Events are about."""
        self._clock = clock
        self._namespaces = list(namespaces)
        self._storm = storm or StormGuard()
        self.metrics = metrics or RestarterMetrics()
        self._events = events or EventWriter(api, instance=socket.gethostname())
        self._storm_object = storm_object
        self._held: dict[str, Fault] = {}
        self._storming = False
        self.recovered = threading.Event()
        self.watcher = ClusterWatcher(
            api, on_fault=self.submit, namespaces=self._namespaces, node_grace=node_grace
        )
        self.actuator = Actuator(api, before_delete=self.watcher.ignore_uid)
        self._queue: queue.Queue[_Item] = queue.Queue()
        self._busy = 0  # faults and tasks in hand (under _lock)
        self.metrics.queue_depth.set_function(self.queue_depth)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._policies: dict[tuple[str, str], Policy | None] = {}
        # The newest policy objects seen (watch events and our own writes): decisions start
        # from them instead of a read; a stale one costs a Conflict and a read.
        self._latest: dict[tuple[str, str], dict[str, Any]] = {}
        self._seen = BoundedSet(KEEP_IDS)
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
        self._tasks: list[queue.Queue[_Task | None]] = [queue.Queue() for _ in range(workers)]
        self._workers = [
            threading.Thread(target=self._decide_tasks, args=(q,), name=f"decide-{i}", daemon=True)
            for i, q in enumerate(self._tasks)
        ]

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self._events.start()
        for watch in self._policy_watches:
            watch.start()
        self.watcher.start()
        self._worker.start()
        for worker in self._workers:
            worker.start()

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
        for tasks in self._tasks:
            tasks.put(None)
        for worker in self._workers:
            worker.join(timeout=10)
        self._events.stop()

    def knows_policy(self, namespace: str, name: str) -> bool:
        """Whether the policy watch has seen this policy (valid or not)."""
        with self._lock:
            return (namespace, name) in self._policies

    def queue_depth(self) -> int:
        """Faults waiting for the dispatcher or being dispatched, and pods waiting for a decision
        or being decided about (a fault in hand is work too: a slow one must show)."""
        with self._lock:
            busy = self._busy
        return self._queue.qsize() + sum(q.qsize() for q in self._tasks) + busy

    def workers_alive(self) -> bool:
        return self._worker.is_alive() and all(w.is_alive() for w in self._workers)

    def submit(self, fault: Fault) -> None:
        """Queue a fault (the intake's and the watcher's sink); returns at once."""
        self._queue.put(_Item(fault))

    # --- policies ------------------------------------------------------------------------

    def _policies_listed(self, namespace: str | None, items: list[dict[str, Any]]) -> None:
        with self._lock:
            for key in [k for k in self._policies if namespace is None or k[0] == namespace]:
                del self._policies[key]
                self._latest.pop(key, None)
        for item in items:
            self._policy_event("ADDED", item)

    def _policy_event(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        if kind == "DELETED":
            with self._lock:
                self._policies.pop(key, None)
                self._latest.pop(key, None)
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
        self._remember(obj)
        self._mark_valid(obj, problem)

    def _remember(self, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        with self._lock:
            old = self._latest.get(key)
            if old is None or _version(old) <= _version(obj):
                self._latest[key] = dict(obj)

    def _policy_object(self, namespace: str, name: str, *, fresh: bool) -> dict[str, Any]:
        if not fresh:
            with self._lock:
                cached = self._latest.get((namespace, name))
            if cached is not None:
                return cached
        obj = self.actuator.read_policy(namespace, name)
        self._remember(obj)
        return obj

    def _write_status(self, obj: Mapping[str, Any], status: Mapping[str, Any]) -> None:
        self._remember(self.actuator.write_status(obj, status))

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
        deadline = time.monotonic() + SYNC_TIMEOUT
        while not self.wait_synced(1.0):
            if self._stopping.is_set():
                return
            if time.monotonic() > deadline:
                log.warning("the watches are not synced yet; deciding anyway")
                break
        try:
            self._recover()
        except Exception:
            log.exception("finishing pending restarts failed")
        self.recovered.set()
        while not self._stopping.is_set():
            try:
                item = self._queue.get(timeout=0.2)
            except queue.Empty:
                self._check_storm()
                continue
            if not item.retry:
                with self._lock:
                    if not self._seen.add(item.fault.id):
                        log.debug("duplicate fault", fault_id=item.fault.id)
                        continue
            if item.fault.kind is FaultKind.NODE_NOT_READY and self._hold_in_storm(item.fault):
                continue
            with self._working():
                try:
                    self._handle(item.fault)
                except Exception:
                    log.exception("handling a fault failed", fault_id=item.fault.id)

    # --- the storm guard -----------------------------------------------------------------

    def _hold_in_storm(self, fault: Fault) -> bool:
        """Hold a node-failure fault while too many nodes fail at once."""
        self._check_storm()
        if not self._storming:
            return False
        self._held[fault.id] = fault
        self.metrics.held_faults.set(len(self._held))
        log.info("node fault held by the storm guard", fault_id=fault.id, node=fault.node)
        return True

    def _check_storm(self) -> None:
        failing, total = self.watcher.node_counts()
        self.metrics.nodes_not_ready.set(failing)
        storming = self._storm.storming(failing, total)
        if storming == self._storming:
            return
        self._storming = storming
        self.metrics.storm_paused.set(1 if storming else 0)
        what = self._storm.describe(failing, total)
        if storming:
            log.warning("storm guard: node-failure restarts paused", nodes=what)
            self._event("Warning", "RestartStormPaused", f"node-failure restarts paused: {what}")
            return
        held = list(self._held.values())
        self._held.clear()
        self.metrics.held_faults.set(0)
        still = [f for f in held if self.watcher.node_not_ready(f.node)]
        log.warning(
            "storm guard: node-failure restarts resume",
            held=len(held),
            still_failing=len(still),
            nodes=f"{failing} of {total} NotReady",
        )
        self._event(
            "Normal",
            "RestartStormOver",
            f"node-failure restarts resume ({failing} of {total} nodes NotReady); "
            f"{len(still)} of {len(held)} held faults are on nodes still failing",
        )
        for fault in still:
            self._queue.put(_Item(fault, retry=True))

    def _event(self, kind: str, reason: str, message: str, about: Any = None) -> None:
        target = about if about is not None else self._storm_object
        if target is not None:
            self._events.emit(target, kind, reason, message)

    # --- restarts a previous run left half done ------------------------------------------

    def _recover(self) -> None:
        with self._lock:
            keys = sorted(k for k, policy in self._policies.items() if policy is not None)
        for namespace, name in keys:
            try:
                obj = self._policy_object(namespace, name, fresh=False)  # just listed
            except ApiError as exc:
                log.warning("cannot read a policy to finish its restarts", error=str(exc))
                continue
            for pending in pending_restarts(obj):
                log.info(
                    "finishing a restart recorded before this start",
                    policy=f"{namespace}/{name}",
                    job=pending.job,
                    fault_id=pending.fault_id,
                    pods=[p.name for p in pending.pods],
                )
                self._replace_all(pending, namespace, name)

    def _replace_all(
        self, pending: PendingRestart, namespace: str, policy: str, pods: list[Any] | None = None
    ) -> None:
        """Replace the pods of a recorded Restart (each at most once: a pod already gone is
        skipped, a replacement already made is found), then drop it from pendingRestarts."""
        failed = 0
        for index, ref in enumerate(pending.pods):
            pod = pods[index] if pods is not None else None
            if pod is None:
                pod = self.actuator.read_pod(ref.namespace, ref.name)
                if pod is None or (ref.uid and pod_ref(pod).uid != ref.uid):
                    continue  # replaced already
            node = str((pod.get("spec") or {}).get("nodeName") or "")
            force = bool(node) and (
                self.watcher.node_not_ready(node)
                or (pending.fault is FaultKind.NODE_NOT_READY and node == pending.node)
            )
            try:
                self.actuator.replace(
                    pod, fault_kind=pending.fault, failed_node=pending.node, force=force
                )
            except ApiError as exc:
                failed += 1
                self.metrics.replacement_errors.inc()
                log.error(
                    "could not replace a pod; the next start retries",
                    pod=ref.name,
                    fault_id=pending.fault_id,
                    error=str(exc),
                )
        if not failed:
            self._finish(namespace, policy, pending)

    def _finish(self, namespace: str, name: str, pending: PendingRestart) -> None:
        for attempt in range(DECIDE_ATTEMPTS):
            try:
                obj = self._policy_object(namespace, name, fresh=attempt > 0)
                self._write_status(
                    obj, finish_restart(obj.get("status"), pending.job, [pending.fault_id])
                )
                return
            except Conflict:
                continue
            except ApiError as exc:
                log.warning("could not mark a restart done", policy=name, error=str(exc))
                return

    def _handle(self, fault: Fault) -> None:
        """Hand each pod of `fault` to the worker of the policy that covers it."""
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
            shard = zlib.crc32(f"{found.namespace}/{covering[0]}".encode()) % len(self._tasks)
            self._tasks[shard].put(_Task(fault, pod, found, covering[0]))

    def _decide_tasks(self, tasks: queue.Queue[_Task | None]) -> None:
        while (task := tasks.get()) is not None:
            if self._stopping.is_set():
                return
            with self._working():
                try:
                    self._decide_and_act(task.fault, task.pod, task.ref, task.policy)
                except Exception:
                    log.exception("handling a fault failed", fault_id=task.fault.id)

    @contextlib.contextmanager
    def _working(self) -> Iterator[None]:
        with self._lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1

    def _decide_and_act(self, fault: Fault, pod: dict[str, Any], ref: PodRef, name: str) -> None:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        targets: list[dict[str, Any]] = []
        for attempt in range(DECIDE_ATTEMPTS):
            obj = self._policy_object(ref.namespace, name, fresh=attempt > 0)
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
            if decision.action is Action.STALE:
                self._decided(decision, ref, name)
                return
            if decision.action is Action.RESTART:
                targets = self._targets(decision, pod, policy)
            try:
                self._write_status(
                    obj,
                    record_decision(
                        obj.get("status"),
                        decision,
                        now=now,
                        targets=[pod_ref(t) for t in targets],
                    ),
                )
            except Conflict:
                log.info("the policy changed; deciding again", policy=name, fault_id=fault.id)
                continue
            break
        else:
            log.error("could not record a decision; the policy keeps changing", policy=name)
            return
        self._decided(decision, ref, name, policy=obj)
        if decision.action is Action.RESTART:
            pending = PendingRestart(
                job=decision.pod.job,
                fault_id=fault.id,
                fault=fault.kind,
                node=fault.node,
                at=now,
                pods=tuple(pod_ref(t) for t in targets),
            )
            self._replace_all(pending, ref.namespace, name, pods=targets)
            elapsed = (self._clock() - fault.observed_at).total_seconds()
            self.metrics.fault_to_replacement.labels(str(fault.kind)).observe(max(0.0, elapsed))
        elif decision.action is Action.BACKOFF and decision.until is not None:
            self._retry_at(fault, decision.until)

    def _decided(
        self, decision: Decision, ref: PodRef, name: str, policy: Mapping[str, Any] | None = None
    ) -> None:
        """Log, count and (Restart, LimitExceeded) announce a decision."""
        action, fault = decision.action, decision.fault
        log.info(
            "decision",
            action=str(action),
            reason=decision.reason,
            fault_id=fault.id,
            pod=f"{ref.namespace}/{ref.name}",
            policy=name,
        )
        self.metrics.decisions.labels(str(action), str(fault.kind)).inc()
        if policy is None:
            return
        if action is Action.RESTART:
            self._event(
                "Normal",
                "Restarted",
                f"{decision.scope} restart of job {decision.pod.job} "
                f"({ref.namespace}/{ref.name}): {decision.reason}",
                about=reference(policy),
            )
        elif action is Action.LIMIT_EXCEEDED:
            self._event(
                "Warning",
                "RestartLimitExceeded",
                f"job {decision.pod.job} ({ref.namespace}/{ref.name}): {decision.reason}",
                about=reference(policy),
            )

    def _targets(
        self, decision: Decision, pod: dict[str, Any], policy: Policy
    ) -> list[dict[str, Any]]:
        """The pods a Restart replaces: the pod, or every live pod of its replica type or job."""
        targets = [pod]
        if decision.scope is RestartScope.POD:
            return targets
        identity = decision.pod
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
        return targets

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


def _version(obj: Mapping[str, Any]) -> int:
    """resourceVersion as a number (etcd's revision); 0 when it is not one."""
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion", 0))
    except (TypeError, ValueError):
        return 0
