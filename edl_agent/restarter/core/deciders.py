"""The deciders: `workers` supervised parts, each taking the tasks (one pod of one fault) of the
policies hashed to it, so the faults of one policy are decided in order while different
policies proceed in parallel. A decider takes every task waiting for it, decides them together
against the policy object last seen (`plan`, pure), and records them all with one status write
carrying the resourceVersion read (on a Conflict it reads the policy and decides again). Only
then does it act: a Restart goes to the `Replacer`, a Backoff is scheduled with the dispatcher.
What became of each task is told through the `Progress` callback, never by reaching into the
dispatcher."""

from __future__ import annotations

import queue
import threading
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import structlog

from edl_agent.faults.model import Fault
from edl_agent.faults.pod_faults import exit_counting_owner, pod_ref
from edl_agent.kube_errors import ApiError
from edl_agent.restarter.core.decide import Action, Decision
from edl_agent.restarter.core.metrics import RestarterMetrics
from edl_agent.restarter.core.plan import Plan, Pod, Task, plan
from edl_agent.restarter.core.policies import PolicyCache
from edl_agent.restarter.core.policy import Policy, RestartScope
from edl_agent.restarter.core.port import ClusterPort, Conflict, PodView
from edl_agent.restarter.core.reference import reference
from edl_agent.restarter.core.replacer import Replacer
from edl_agent.restarter.core.templates import GoneTemplates
from edl_agent.runtime.bounded import BoundedSet

log = structlog.get_logger(__name__)


OWNERS_TOLD = 10_000
# What a dry run tells as an Event: what would have changed the cluster or the job's record.
_ACTING = frozenset({Action.RESTART, Action.BACKOFF, Action.LIMIT_EXCEEDED})
# A status write the API server refuses for what it holds (bad request, too large, invalid),
# not for when it came: the same write will be refused again.
REFUSED_WRITE = frozenset({400, 413, 422})


class Progress(Protocol):
    """What the deciders tell the dispatcher."""

    def task_done(self, task: Task, *, ok: bool, error: str | None = None) -> None:
        """A task is recorded (`ok`), or could not be (its fault comes again)."""

    def schedule(self, fault: Fault, until: datetime) -> None:
        """Look at `fault` again at `until` (a Backoff's second look)."""

    def announce(
        self, kind: str, reason: str, message: str, about: Mapping[str, str] | None = None
    ) -> None:
        """An Event (best effort)."""


class Deciders:
    def __init__(
        self,
        *,
        port: ClusterPort,
        pods: PodView,
        policies: PolicyCache,
        templates: GoneTemplates,
        replacer: Replacer,
        metrics: RestarterMetrics,
        progress: Progress,
        clock: Callable[[], datetime],
        workers: int,
        batch: int,
        attempts: int,
    ) -> None:
        self._port, self._pods = port, pods
        self._policies, self._templates, self._replacer = policies, templates, replacer
        self._metrics = metrics
        self._progress = progress
        self._clock = clock
        self.batch, self._attempts = batch, attempts
        self._queues: list[queue.Queue[Task | None]] = [queue.Queue() for _ in range(workers)]
        self._in_hand = 0  # tasks put and not yet decided and acted on (under _in_hand_lock)
        self._in_hand_lock = threading.Lock()
        # (namespace, policy, owner) told about already: one warning each, not one per exit.
        self._owners_told = BoundedSet(OWNERS_TOLD)
        self._owners_lock = threading.Lock()

    def parts(self) -> list[Decider]:
        return [Decider(f"decider-{i}", self, q) for i, q in enumerate(self._queues)]

    def put(self, task: Task) -> None:
        """Hand a task to the decider of its policy."""
        key = f"{task.ref.namespace}/{task.policy}".encode()
        with self._in_hand_lock:
            self._in_hand += 1
        self._queues[zlib.crc32(key) % len(self._queues)].put(task)

    def waiting(self) -> int:
        """Tasks handed over and not done yet: waiting, or being decided about and acted on."""
        with self._in_hand_lock:
            return self._in_hand

    def stop(self) -> None:
        """End every decider after what it has in hand."""
        for tasks in self._queues:
            tasks.put(None)

    def tasks_of(self, fault: Fault) -> list[Task]:
        """One task per pod of `fault` that a policy covers (not one we replaced already)."""
        tasks = []
        for ref in fault.pods:
            pod = self._pods.find_pod(ref)
            if pod is None or (ref.uid and pod_ref(pod).uid != ref.uid):
                pod = self._templates.as_deleted(ref)
            if pod is None:
                log.info("fault about an unknown pod", fault_id=fault.id, pod=ref.name)
                continue
            found = pod_ref(pod)
            if self._pods.replaced(found):
                # Ours: its slot has a new pod, and the old one's exit as it is deleted (137)
                # is no fault of the job's.
                log.debug("fault about a pod already replaced", fault_id=fault.id, pod=found.name)
                continue
            labels = (pod.get("metadata") or {}).get("labels") or {}
            covering = self._policies.covering(found.namespace, found, labels)
            if covering is None:
                log.debug("no policy covers the pod", fault_id=fault.id, pod=found.name)
                continue
            tasks.append(Task(fault, pod, found, covering[0]))
        return tasks

    def decide(self, tasks: list[Task]) -> None:
        """Decide and record a batch of tasks (of any policies), then act; every task's end is
        told to the `Progress`."""
        groups: dict[tuple[str, str], list[Task]] = {}
        for task in tasks:
            groups.setdefault((task.ref.namespace, task.policy), []).append(task)
        try:
            for (namespace, name), group in groups.items():
                try:
                    self.decide_batch(namespace, name, group)
                except Exception:
                    log.exception("deciding faults failed", policy=f"{namespace}/{name}")
                    for task in group:
                        self._progress.task_done(task, ok=False, error="internal error")
        finally:
            with self._in_hand_lock:
                self._in_hand -= len(tasks)

    def decide_batch(self, namespace: str, name: str, tasks: list[Task]) -> None:
        """Decide and record `tasks` (all under policy namespace/name), then act."""
        recorded = self._record(namespace, name, tasks)
        if recorded is None:
            for task in tasks:
                self.decide_batch(namespace, name, [task])
            return
        obj, result, error = recorded
        if result.dropped:
            log.warning(
                "the policy's status is at its budget; left out of it",
                policy=f"{namespace}/{name}",
                dropped=result.dropped,
            )
        if error is not None:
            log.warning("decisions not recorded; their faults come again", error=error)
            for task in tasks:
                self._progress.task_done(task, ok=False, error=error)
            return
        if result.dry_run:
            for task, decision in result.decisions:
                self._told(decision, task, name, policy=obj)
            for task in tasks:
                self._progress.task_done(task, ok=True)
            return
        for task, decision in result.decisions:
            self._decided(decision, task, name, policy=obj)
        for task in tasks:
            self._progress.task_done(task, ok=True)
        for fault, until in result.backoffs:
            self._progress.schedule(fault, until)
        observed = {d.fault.id: d.fault.observed_at for _, d in result.decisions}
        for pending in result.restarts:
            self._replacer.replace_all(pending, namespace)
            elapsed = (self._clock() - observed[pending.fault_id]).total_seconds()
            self._metrics.fault_to_replacement.labels(str(pending.fault)).observe(max(0.0, elapsed))

    def _record(
        self, namespace: str, name: str, tasks: list[Task]
    ) -> tuple[dict[str, Any], Plan, str | None] | None:
        """Decide `tasks` against the policy and write its status: the policy object, the plan
        and the error that kept it from being recorded (None: recorded). None when the API
        server refused the batch's write for what it holds and the batch has more than one
        task: the caller decides each alone, so that one cannot hold up the others."""
        error = None
        obj: dict[str, Any] = {}
        result = Plan()
        for attempt in range(self._attempts):
            now = self._clock()
            try:
                obj = self._policies.object(namespace, name, fresh=attempt > 0)
            except ApiError as exc:
                error = f"cannot read policy {namespace}/{name}: {exc}"
                break
            result = plan(
                obj,
                tasks,
                members=self._members,
                replaced=self._templates.done,
                now=now,
                gone=self._templates.gone,
            )
            if result.status is not None:
                try:
                    self._policies.written(self._port.write_status(obj, result.status))
                except Conflict:
                    log.info("the policy changed; deciding again", policy=name)
                    continue
                except ApiError as exc:
                    if exc.status in REFUSED_WRITE and len(tasks) > 1:
                        log.warning(
                            "status write refused; recording the batch's decisions one by one",
                            policy=f"{namespace}/{name}",
                            tasks=len(tasks),
                            error=str(exc),
                        )
                        return None
                    error = f"cannot record decisions in {namespace}/{name}: {exc}"
                    break
            break
        else:
            error = f"policy {namespace}/{name} keeps changing"
        return obj, result, error

    def _members(self, policy: Policy, decision: Decision, pod: Pod) -> list[Pod]:
        """The other live pods a Restart of `decision.scope` replaces along with `pod`."""
        identity = decision.pod
        ref = pod_ref(pod)
        found = []
        for other in self._pods.pods_in(ref.namespace):
            other_ref = pod_ref(other)
            if other_ref.uid == ref.uid or not self._pods.exists(other_ref):
                continue
            if self._pods.replaced(other_ref):  # by us: replaced, or marked and deleted
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

    def _told(self, decision: Decision, task: Task, name: str, policy: Mapping[str, Any]) -> None:
        """A dry run's decision: logged, counted and, when it would have acted, announced."""
        action, fault, ref = decision.action, decision.fault, task.ref
        log.info(
            "dry-run decision",
            action=str(action),
            reason=decision.reason,
            fault_id=fault.id,
            pod=f"{ref.namespace}/{ref.name}",
            policy=name,
        )
        self._metrics.dry_run_decisions.labels(str(action), str(fault.kind)).inc()
        if action in _ACTING:
            self._progress.announce(
                "Normal",
                "DryRun",
                f"would {action} ({ref.namespace}/{ref.name}, fault {fault.id}): {decision.reason}",
                reference(policy),
            )

    def _decided(
        self, decision: Decision, task: Task, name: str, policy: Mapping[str, Any]
    ) -> None:
        """Log, count and (Restart, LimitExceeded) announce a decision."""
        action, fault, ref = decision.action, decision.fault, task.ref
        log.info(
            "decision",
            action=str(action),
            reason=decision.reason,
            fault_id=fault.id,
            pod=f"{ref.namespace}/{ref.name}",
            policy=name,
        )
        self._metrics.decisions.labels(str(action), str(fault.kind)).inc()
        if action is Action.RESTART:
            self._progress.announce(
                "Normal",
                "Restarted",
                f"{decision.scope} restart of job {decision.pod.job} "
                f"({ref.namespace}/{ref.name}): {decision.reason}",
                reference(policy),
            )
        elif action is Action.OWNER_DECIDES:
            owner = exit_counting_owner(task.pod) or "its owner"
            with self._owners_lock:
                first = self._owners_told.add((ref.namespace, name, owner))
            if first:
                self._progress.announce(
                    "Warning",
                    "OwnerDecidesExits",
                    f"a rule of this policy would restart pods of {owner} on exits, but the "
                    "Job counts its pods' exits itself: its backoffLimit and podFailurePolicy "
                    f"decide, not this policy (first seen on {ref.namespace}/{ref.name})",
                    reference(policy),
                )
        elif action is Action.LIMIT_EXCEEDED:
            self._progress.announce(
                "Warning",
                "RestartLimitExceeded",
                f"job {decision.pod.job} ({ref.namespace}/{ref.name}): {decision.reason}",
                reference(policy),
            )


@dataclass
class Decider:
    """One decider: a supervised part that decides the tasks of the policies hashed to it. A
    batch that raises is told as not recorded (its faults come again); the part lives on."""

    name: str
    deciders: Deciders
    tasks: queue.Queue[Task | None]

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        ready()
        while not stop.is_set() and (first := self.tasks.get()) is not None:
            batch = [first]
            while len(batch) < self.deciders.batch:
                try:
                    more = self.tasks.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self.tasks.put(None)
                    break
                batch.append(more)
            if stop.is_set():
                return
            self.deciders.decide(batch)
