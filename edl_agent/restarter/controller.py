"""The restarter's loop: faults in (intake and watchers), decisions and replacements out.

The decisions themselves are pure (`dispatch` drops duplicates, holds node faults in a storm and
keeps the backoff schedule; `plan` decides a batch of faults under one policy and says what to
record); this module only moves faults between threads and carries out what those say,
through two small ports (`port`): on a real API server `Actuator` and `ClusterWatcher`
(`kube_controller.connect` wires them), in tests `memory.InMemoryCluster`. Nothing here builds
an API client.

A dispatcher thread takes each fault, asks `Dispatch`, and hands each pod of a fault to one of
`workers` threads chosen by the policy that covers the pod, so the faults of one policy are
decided in order while different policies proceed in parallel. A worker takes every task
waiting for it, decides them together against the policy object last seen, and records them
all with one status write carrying the resourceVersion read (on a Conflict it reads the
policy and decides again). Only then does it act: a Restart replaces the pods of its scope
(recorded as pendingRestarts first), a Backoff is recorded as pendingBackoffs and looked at
again at `until`. A fault is settled (and later copies are duplicates) once its decisions are
recorded; `accept` waits for that, so the intake acknowledges an agent's fault only once the
API holds what became of it.

A restarter that starts (or becomes leader) first finishes the pendingRestarts and schedules
the pendingBackoffs it finds in the policies: a restarter killed at any moment delays a
restart, and never loses one nor makes one twice (replacement names are deterministic, deletes
are conditional on the pod's uid). Pending restarts whose pods are all gone are dropped in the
next write, or by a tidy pass once the policy is quiet.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import structlog

from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.faults.pod_faults import controller_owned, pod_ref
from edl_agent.kube import ApiError, object_version
from edl_agent.kube_time import format_micro_time
from edl_agent.restarter.covering import PolicyIndex
from edl_agent.restarter.decide import Action, Decision
from edl_agent.restarter.dispatch import Admission, Dispatch
from edl_agent.restarter.metrics import RestarterMetrics
from edl_agent.restarter.plan import Plan, Pod, Task, plan, tidy
from edl_agent.restarter.pod_cache import is_whole
from edl_agent.restarter.policy import Policy, RestartScope
from edl_agent.restarter.port import ClusterPort, Conflict, PodView
from edl_agent.restarter.reference import reference
from edl_agent.restarter.spec import parse_policy
from edl_agent.restarter.status import (
    PendingRestart,
    pending_backoffs,
    pending_restarts,
    pod_template,
)
from edl_agent.restarter.storm import StormGuard
from edl_agent.runtime.backoff import Backoff
from edl_agent.runtime.bounded import BoundedMap
from edl_agent.typed import SchemaError

log = structlog.get_logger(__name__)

SPEC_VALID = "SpecValid"
DECIDE_ATTEMPTS = 5
SYNC_TIMEOUT = 300.0
BATCH = 512
TICK = 0.2
CHECK_EVERY = 2.0
# A recorded restart whose pods are still there this long after it was decided is carried out
# again (its replacement failed, or the replica that decided it died mid-way).
RESUME_AFTER = timedelta(seconds=10)
# Finished pending restarts leave the status with the policy's next decision; a policy without
# one for this long gets a write of its own for them.
TIDY_AFTER = 60.0
RETRY_INITIAL, RETRY_MAX = 1.0, 30.0
KEEP_TEMPLATES = 4096


class NotRecorded(Exception):
    """A fault could not be recorded now (the API refused or did not answer, or it took too
    long); its sender should send it again."""


@dataclass
class _Waiter:
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


@dataclass(frozen=True)
class _Item:
    fault: Fault
    waiter: _Waiter | None = None
    retry: bool = False  # a Backoff's second look, a held fault released: not a duplicate


@dataclass
class _Progress:
    """The tasks of one fault still to be recorded, and whether all went well so far."""

    left: int
    ok: bool = True


class Source(Protocol):
    """Something that feeds the controller (its faults, its policies) from a cluster."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def wait_synced(self, timeout: float) -> bool:
        """Whether it has listed what it watches (waiting up to `timeout` seconds)."""
        ...


class EventSink(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...

    def emit(self, involved: Mapping[str, str], kind: str, reason: str, message: str) -> None: ...


class Controller:
    def __init__(
        self,
        *,
        port: ClusterPort,
        pods: PodView,
        sources: Iterable[Source] = (),
        storm: StormGuard | None = None,
        metrics: RestarterMetrics | None = None,
        events: EventSink | None = None,
        storm_object: Mapping[str, str] | None = None,
        workers: int = 16,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        tidy_after: float = TIDY_AFTER,
    ) -> None:
        """`port` and `pods`: the cluster (see `port`; `kube_controller.connect` builds them
        for an API server); `sources` are started and stopped with the controller, and feed it
        faults (`submit`, `accept`) and policies (`policies_listed`, `policy_event`).
        `storm_object`: the object (see `events.reference`) storm Events are about."""
        self._clock = clock
        self.metrics = metrics or RestarterMetrics()
        self._events = events
        self._storm_object = storm_object
        self._dispatch: Dispatch[_Waiter] = Dispatch(storm or StormGuard())
        self.recovered = threading.Event()
        self.port = port
        self.pods = pods
        self._sources = list(sources)
        self._queue: queue.Queue[_Item] = queue.Queue()
        self._busy = 0  # faults and tasks in hand (under _lock)
        self.metrics.queue_depth.set_function(self.queue_depth)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._policies: dict[tuple[str, str], Policy | None] = {}
        self._index = PolicyIndex()
        # The newest policy objects seen (watch events and our own writes): decisions start
        # from them instead of a read; a stale one costs a Conflict and a read.
        self._latest: dict[tuple[str, str], dict[str, Any]] = {}
        self._progress: dict[str, _Progress] = {}
        self._replacing: set[tuple[str, str, str]] = set()  # (namespace, job, fault id)
        self._retries: dict[str, Backoff] = {}
        # uid → the template of a pod gone from the API whose restart or backoff is recorded
        # (`status.pod_template`): what its replacement is made of. Bounded: the status holds
        # them too, and a new start reads them from there.
        self._templates: BoundedMap[str, Mapping[str, Any]] = BoundedMap(KEEP_TEMPLATES)
        self._last_check = 0.0
        self._tidy_after = tidy_after
        self._last_write: dict[tuple[str, str], float] = {}  # policy → monotonic time
        self._worker = threading.Thread(target=self._work, name="restarter", daemon=True)
        self._tasks: list[queue.Queue[Task | None]] = [queue.Queue() for _ in range(workers)]
        self._workers = [
            threading.Thread(target=self._decide_tasks, args=(q,), name=f"decide-{i}", daemon=True)
            for i, q in enumerate(self._tasks)
        ]

    def add_source(self, source: Source) -> None:
        """Another feed, started with the controller (before `start`)."""
        self._sources.append(source)

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        if self._events is not None:
            self._events.start()
        for source in self._sources:
            source.start()
        self._worker.start()
        for worker in self._workers:
            worker.start()

    def wait_synced(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        return all(
            source.wait_synced(max(0.0, deadline - time.monotonic())) for source in self._sources
        )

    def stop(self) -> None:
        self._stopping.set()
        for source in self._sources:
            source.stop()
        if self._worker.is_alive():
            self._worker.join(timeout=10)
        for tasks in self._tasks:
            tasks.put(None)
        for worker in self._workers:
            if worker.is_alive():
                worker.join(timeout=10)
        if self._events is not None:
            self._events.stop()
        with self._lock:
            waiting = list(self._progress)
        for fault_id in waiting:
            self._settle(fault_id, recorded=False, error="the restarter is stopping")

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
        """Queue a fault (the watcher's sink); returns at once."""
        self._queue.put(_Item(fault))

    def accept(self, fault: Fault, timeout: float = 8.0) -> None:
        """Queue a fault and return once what becomes of it is recorded in the API (the
        intake's sink: only then may the agent drop it). `NotRecorded` when it could not be
        recorded within `timeout`; the fault may still be recorded later, and a copy sent
        again then joins it or is answered as a duplicate."""
        waiter = _Waiter()
        self._queue.put(_Item(fault, waiter))
        if not waiter.done.wait(timeout):
            msg = f"fault {fault.id} not recorded within {timeout:g}s"
            raise NotRecorded(msg)
        if waiter.error is not None:
            raise NotRecorded(waiter.error)

    # --- policies ------------------------------------------------------------------------

    def policies_listed(self, namespace: str | None, items: list[dict[str, Any]]) -> None:
        with self._lock:
            for key in [k for k in self._policies if namespace is None or k[0] == namespace]:
                del self._policies[key]
                self._index.remove(*key)
                self._latest.pop(key, None)
        for item in items:
            self.policy_event("ADDED", item)

    def policy_event(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        if kind == "DELETED":
            with self._lock:
                self._policies.pop(key, None)
                self._index.remove(*key)
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
            self._index.put(*key, policy)
        self._remember(obj)
        self._mark_valid(obj, problem)

    def _remember(self, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        with self._lock:
            old = self._latest.get(key)
            if old is None or object_version(old) <= object_version(obj):
                self._latest[key] = dict(obj)

    def _written(self, obj: Mapping[str, Any]) -> None:
        """A policy as our own status write returned it."""
        self._remember(obj)
        meta = obj.get("metadata") or {}
        with self._lock:
            self._last_write[(str(meta.get("namespace")), str(meta.get("name")))] = time.monotonic()

    def _policy_object(self, namespace: str, name: str, *, fresh: bool) -> dict[str, Any]:
        if not fresh:
            with self._lock:
                cached = self._latest.get((namespace, name))
            if cached is not None:
                return cached
        obj = self.port.read_policy(namespace, name)
        self._remember(obj)
        return obj

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
            self.port.write_status(obj, status)
        except (Conflict, ApiError) as exc:
            log.info("could not write the policy's condition; next event retries", error=str(exc))

    def _covering(
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

    # --- the dispatcher ------------------------------------------------------------------

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
            log.exception("finishing the restarts and backoffs recorded before failed")
        self.recovered.set()
        while not self._stopping.is_set():
            try:
                item = self._queue.get(timeout=TICK)
            except queue.Empty:
                self._tick()
                continue
            with self._working():
                try:
                    self._dispatch_one(item)
                except Exception:
                    log.exception("dispatching a fault failed", fault_id=item.fault.id)
                    self._settle(item.fault.id, recorded=False, error="internal error")
            if self._queue.empty():
                self._tick()

    def _dispatch_one(self, item: _Item) -> None:
        fault = item.fault
        with self._lock:
            self._check_storm()
            admission = self._dispatch.admit(fault, item.waiter, retry=item.retry)
            self.metrics.held_faults.set(len(self._dispatch.held))
        if admission is Admission.DUPLICATE:
            log.debug("duplicate fault", fault_id=fault.id)
            _tell(item.waiter, None)
            return
        if admission is Admission.JOINED:
            return
        if admission is Admission.HELD:
            log.info("node fault held by the storm guard", fault_id=fault.id, node=fault.node)
            _tell(item.waiter, None)  # node faults are the watcher's: seen again after a restart
            return
        tasks = self._tasks_of(fault)
        if not tasks:
            self._settle(fault.id, recorded=True)
            return
        with self._lock:
            self._progress[fault.id] = _Progress(len(tasks))
        for task in tasks:
            shard = zlib.crc32(f"{task.ref.namespace}/{task.policy}".encode()) % len(self._tasks)
            self._tasks[shard].put(task)

    def _tasks_of(self, fault: Fault) -> list[Task]:
        tasks = []
        for ref in fault.pods:
            pod = self.pods.find_pod(ref)
            if pod is None or (ref.uid and pod_ref(pod).uid != ref.uid):
                pod = self._from_template(ref)
            if pod is None:
                log.info("fault about an unknown pod", fault_id=fault.id, pod=ref.name)
                continue
            found = pod_ref(pod)
            if self.pods.replaced(found):
                # Ours: its slot has a new pod, and the old one's exit as it is deleted (137)
                # is no fault of the job's.
                log.debug("fault about a pod already replaced", fault_id=fault.id, pod=found.name)
                continue
            labels = (pod.get("metadata") or {}).get("labels") or {}
            covering = self._covering(found.namespace, found, labels)
            if covering is None:
                log.debug("no policy covers the pod", fault_id=fault.id, pod=found.name)
                continue
            tasks.append(Task(fault, pod, found, covering[0]))
        return tasks

    def _from_template(self, ref: PodRef) -> dict[str, Any] | None:
        """A pod gone from the API as its recorded template shows it, marked as deleted (so
        that nothing takes it for a pod kubelet could still restart)."""
        with self._lock:
            template = self._templates.get(ref.uid)
        if template is None:
            return None
        meta = dict(template.get("metadata") or {})
        meta["deletionTimestamp"] = format_micro_time(self._clock())
        return {**template, "metadata": meta, "status": {}}

    def _gone(self, ref: PodRef) -> Mapping[str, Any] | None:
        """The template of a pod the API no longer has (or is deleting), to record with a
        decision about it; None for a live pod, or when no whole copy is at hand."""
        if self.pods.exists(ref):
            return None
        with self._lock:
            known = self._templates.get(ref.uid)
        if known is not None:
            return known
        pod = self.pods.whole(ref) or self.pods.find_pod(ref)
        if pod is None or pod_ref(pod).uid != ref.uid or not is_whole(pod) or controller_owned(pod):
            return None
        template = pod_template(pod)
        with self._lock:
            self._templates[ref.uid] = template
        return template

    def _settle(self, fault_id: str, *, recorded: bool, error: str | None = None) -> bool:
        """End a fault's handling; whether anybody waited for it."""
        with self._lock:
            self._progress.pop(fault_id, None)
            waiters = self._dispatch.settle(fault_id, recorded=recorded)
        for waiter in waiters:
            _tell(waiter, None if recorded else (error or "not recorded"))
        return bool(waiters)

    def _task_done(self, task: Task, *, ok: bool, error: str | None = None) -> None:
        fault = task.fault
        with self._lock:
            progress = self._progress.get(fault.id)
            if progress is None:
                return
            progress.left -= 1
            progress.ok = progress.ok and ok
            if progress.left > 0:
                return
            all_ok = progress.ok
        waited = self._settle(fault.id, recorded=all_ok, error=error)
        if all_ok:
            self._retries.pop(fault.id, None)
        elif not waited and not self._stopping.is_set():
            # Nobody waits to send it again (a watcher's fault): look at it again later.
            backoff = self._retries.setdefault(fault.id, Backoff(RETRY_INITIAL, RETRY_MAX))
            later = self._clock() + timedelta(seconds=backoff.next_delay())
            with self._lock:
                self._dispatch.schedule(fault, later)
            log.warning("a fault could not be recorded; trying again", fault_id=fault.id)

    # --- ticks: storms, due backoffs, tidying --------------------------------------------

    def _tick(self) -> None:
        now = self._clock()
        with self._lock:
            self._check_storm()
            due = self._dispatch.due(now)
        for fault in due:
            self._queue.put(_Item(fault, retry=True))
        if time.monotonic() - self._last_check >= CHECK_EVERY:
            self._last_check = time.monotonic()
            try:
                self._check_pending(now)
            except Exception:
                log.exception("checking the policies' pending restarts failed")

    def _check_storm(self) -> None:
        """(Under _lock.)"""
        failing, total = self.pods.node_counts()
        self.metrics.nodes_not_ready.set(failing)
        change = self._dispatch.nodes_seen(failing, total, self.pods.node_not_ready)
        if change is None:
            return
        self.metrics.storm_paused.set(1 if change.storming else 0)
        self.metrics.held_faults.set(len(self._dispatch.held))
        if change.storming:
            log.warning("storm guard: node-failure restarts paused", nodes=change.description)
            self._event(
                "Warning",
                "RestartStormPaused",
                f"node-failure restarts paused: {change.description}",
            )
            return
        held = len(change.released) + change.dropped
        log.warning(
            "storm guard: node-failure restarts resume",
            held=held,
            still_failing=len(change.released),
            nodes=f"{failing} of {total} NotReady",
        )
        self._event(
            "Normal",
            "RestartStormOver",
            f"node-failure restarts resume ({failing} of {total} nodes NotReady); "
            f"{len(change.released)} of {held} held faults are on nodes still failing",
        )
        for fault in change.released:
            self._queue.put(_Item(fault, retry=True))

    def _event(self, kind: str, reason: str, message: str, about: Any = None) -> None:
        target = about if about is not None else self._storm_object
        if target is not None and self._events is not None:
            self._events.emit(target, kind, reason, message)

    def _check_pending(self, now: datetime) -> None:
        """Carry out again the recorded restarts whose pods are still there well after they were
        decided; drop the finished ones of policies that have been quiet for a while."""
        with self._lock:
            objects = [o for o in self._latest.values() if _has_pending(o)]
        for obj in objects:
            meta = obj["metadata"]
            for pending in pending_restarts(obj):
                with self._lock:
                    if (meta["namespace"], pending.job, pending.fault_id) in self._replacing:
                        continue
                if now - pending.at >= RESUME_AFTER and not all(map(self._done, pending.pods)):
                    log.info("carrying out a recorded restart again", fault_id=pending.fault_id)
                    self._replace_all(pending, meta["namespace"])
            policy = (str(meta["namespace"]), str(meta["name"]))
            with self._lock:
                last = self._last_write.get(policy, 0.0)
            if time.monotonic() - last >= self._tidy_after:
                self._write_tidy(*policy)

    def _write_tidy(self, namespace: str, name: str) -> None:
        for attempt in range(DECIDE_ATTEMPTS):
            obj = self._policy_object(namespace, name, fresh=attempt > 0)
            status = tidy(obj, replaced=self._done)
            if status is None:
                return
            try:
                self._written(self.port.write_status(obj, status))
                return
            except Conflict:
                continue
            except ApiError as exc:
                log.info("could not tidy a policy's status; later", policy=name, error=str(exc))
                return

    # --- restarts and backoffs a previous run left -----------------------------------------

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
                with self._lock:
                    self._templates.update(pending.templates)
                log.info(
                    "finishing a restart recorded before this start",
                    policy=f"{namespace}/{name}",
                    job=pending.job,
                    fault_id=pending.fault_id,
                    pods=[p.name for p in pending.pods],
                )
                self._replace_all(pending, namespace)
            for backoff in pending_backoffs(obj):
                log.info(
                    "resuming a backoff recorded before this start",
                    policy=f"{namespace}/{name}",
                    fault_id=backoff.fault.id,
                    until=backoff.until.isoformat(),
                )
                with self._lock:
                    if backoff.template is not None and backoff.fault.pods:
                        self._templates[backoff.fault.pods[0].uid] = backoff.template
                    self._dispatch.schedule(backoff.fault, backoff.until)

    # --- the deciding workers --------------------------------------------------------------

    def _decide_tasks(self, tasks: queue.Queue[Task | None]) -> None:
        while (first := tasks.get()) is not None:
            batch = [first]
            while len(batch) < BATCH:
                try:
                    more = tasks.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    tasks.put(None)
                    break
                batch.append(more)
            if self._stopping.is_set():
                return
            groups: dict[tuple[str, str], list[Task]] = {}
            for task in batch:
                groups.setdefault((task.ref.namespace, task.policy), []).append(task)
            for (namespace, name), group in groups.items():
                with self._working():
                    try:
                        self._decide_batch(namespace, name, group)
                    except Exception:
                        log.exception("deciding faults failed", policy=f"{namespace}/{name}")
                        for task in group:
                            self._task_done(task, ok=False, error="internal error")

    @contextlib.contextmanager
    def _working(self) -> Iterator[None]:
        with self._lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1

    def _decide_batch(self, namespace: str, name: str, tasks: list[Task]) -> None:
        """Decide and record `tasks` (all under policy namespace/name), then act."""
        error = None
        obj: dict[str, Any] = {}
        result = Plan()
        for attempt in range(DECIDE_ATTEMPTS):
            now = self._clock()
            try:
                obj = self._policy_object(namespace, name, fresh=attempt > 0)
            except ApiError as exc:
                error = f"cannot read policy {namespace}/{name}: {exc}"
                break
            result = plan(
                obj, tasks, members=self._members, replaced=self._done, now=now, gone=self._gone
            )
            if result.status is not None:
                try:
                    self._written(self.port.write_status(obj, result.status))
                except Conflict:
                    log.info("the policy changed; deciding again", policy=name)
                    continue
                except ApiError as exc:
                    error = f"cannot record decisions in {namespace}/{name}: {exc}"
                    break
            break
        else:
            error = f"policy {namespace}/{name} keeps changing"
        if error is not None:
            log.warning("decisions not recorded; their faults come again", error=error)
            for task in tasks:
                self._task_done(task, ok=False, error=error)
            return
        for task, decision in result.decisions:
            self._decided(decision, task.ref, name, policy=obj)
        for task in tasks:
            self._task_done(task, ok=True)
        with self._lock:
            for fault, until in result.backoffs:
                self._dispatch.schedule(fault, until)
        observed = {d.fault.id: d.fault.observed_at for _, d in result.decisions}
        for pending in result.restarts:
            self._replace_all(pending, namespace)
            elapsed = (self._clock() - observed[pending.fault_id]).total_seconds()
            self.metrics.fault_to_replacement.labels(str(pending.fault)).observe(max(0.0, elapsed))

    def _done(self, ref: PodRef) -> bool:
        """Whether a pod of a recorded restart needs nothing more: it is gone or being deleted,
        and replaced (or owned by a controller, which replaces it, or no longer known)."""
        if self.pods.exists(ref):
            return False
        if self.pods.replaced(ref):
            with self._lock:
                self._templates.pop(ref.uid, None)
            return True
        with self._lock:
            if ref.uid in self._templates:
                return False  # gone, and its replacement is still to be made from the template
        pod = self.pods.find_pod(ref)
        return pod is None or pod_ref(pod).uid != ref.uid or controller_owned(pod)

    def _members(self, policy: Policy, decision: Decision, pod: Pod) -> list[Pod]:
        """The other live pods a Restart of `decision.scope` replaces along with `pod`."""
        identity = decision.pod
        ref = pod_ref(pod)
        found = []
        for other in self.pods.pods_in(ref.namespace):
            other_ref = pod_ref(other)
            if other_ref.uid == ref.uid or not self.pods.exists(other_ref):
                continue
            if self.pods.replaced(other_ref):  # by us: replaced, or marked and deleted
                continue
            labels = (other.get("metadata") or {}).get("labels") or {}
            placed = policy.identify(other_ref, labels)
            if placed is None or placed.job != identity.job:
                continue
            if (
                decision.scope is RestartScope.REPLICA
                and placed.replica_type != identity.replica_type
            ):
                continue
            found.append(other)
        return sorted(found, key=lambda p: pod_ref(p).name)

    def _replace_all(self, pending: PendingRestart, namespace: str) -> None:
        """Replace the pods of a recorded Restart, each at most once: a pod already replaced is
        skipped, a replacement already made is found. Each pod is replaced from a whole copy:
        the one its fault was seen on, else read afresh, else (gone) its last state or recorded
        template. What fails stays recorded and is carried out again by `_check_pending`."""
        key = (namespace, pending.job, pending.fault_id)
        with self._lock:
            if key in self._replacing:
                return
            self._replacing.add(key)
        try:
            for ref in pending.pods:
                self._replace_one(pending, ref)
        finally:
            with self._lock:
                self._replacing.discard(key)

    def _replace_one(self, pending: PendingRestart, ref: PodRef) -> None:
        try:
            if self.pods.replaced(ref) and not self.pods.exists(ref):
                return  # an earlier try got as far as deleting it
            # The pod as the fault showed it saves a read; the delete is conditional on its
            # uid, and a replacement made already is found by its name.
            pod = self.pods.whole(ref) or self.port.read_pod(ref.namespace, ref.name)
            if pod is not None and not (ref.uid and pod_ref(pod).uid != ref.uid):
                deleting = bool((pod.get("metadata") or {}).get("deletionTimestamp"))
                if deleting and self.pods.replaced(ref):
                    return  # an earlier try got as far as deleting it
            else:
                if self.pods.replaced(ref):
                    return  # an earlier try finished
                # Gone, and not by our hand (force-deleted, evicted): replaced from its last
                # state as seen. A replacement made already is found by its name.
                pod = self.pods.find_pod(ref)
                if pod is None or (ref.uid and pod_ref(pod).uid != ref.uid) or not is_whole(pod):
                    with self._lock:
                        template = pending.templates.get(ref.uid) or self._templates.get(ref.uid)
                    pod = None if template is None else dict(template)
                if pod is None:
                    log.info("a pod gone without a copy to replace it from", pod=ref.name)
                    return
            node = str((pod.get("spec") or {}).get("nodeName") or "")
            force = bool(node) and (
                self.pods.node_not_ready(node)
                or (pending.fault is FaultKind.NODE_NOT_READY and node == pending.node)
            )
            self.port.replace(pod, fault_kind=pending.fault, failed_node=pending.node, force=force)
        except ApiError as exc:
            self.metrics.replacement_errors.inc()
            log.error(
                "could not replace a pod; trying again later",
                pod=ref.name,
                fault_id=pending.fault_id,
                error=str(exc),
            )

    def _decided(
        self, decision: Decision, ref: PodRef, name: str, policy: Mapping[str, Any]
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


def _tell(waiter: _Waiter | None, error: str | None) -> None:
    if waiter is not None:
        waiter.error = error
        waiter.done.set()


def _has_pending(obj: Mapping[str, Any]) -> bool:
    return any(j.get("pendingRestarts") for j in (obj.get("status") or {}).get("jobs") or [])
