"""The restarter's dispatcher: faults in (intake and watchers), handed to the deciders.

The decisions themselves are pure (`dispatch` drops duplicates, holds node faults in a storm and
keeps the backoff schedule; `plan` decides a batch of faults under one policy and says what to
record); the controller moves faults between supervised parts and carries out what those say,
through two small ports (`port`): on a real API server `Actuator` and `ClusterWatcher`
(`kube_controller.connect` wires them), in tests `memory.InMemoryCluster`. Nothing here builds
an API client, nor imports a client library.

The `Controller` is itself the dispatcher part: it takes each fault, asks `Dispatch`, and hands
each pod of a fault to the deciders (`deciders`), which decide, record and act, and tell what
became of each task through the `Progress` callback this class implements. A fault is settled
(and later copies are duplicates) once its decisions are recorded; `accept` waits for that, so
the intake acknowledges an agent's fault only once the API holds what became of it. Between
faults the dispatcher ticks: the storm guard, due backoffs, and every `check_every_seconds` the
restarts recorded but not carried out (`recorded`). The metrics tell when it last ticked (by its
clock) and how many faults and tasks are in hand, each counted from its arrival until it is
done. The other jobs live in their own modules: the policy cache (`policies`), the gone pods'
templates (`templates`), the replacements (`replacer`), the restarts and backoffs a previous run
left (`recorded`).

Every thread is a part under a `runtime.supervisor.Supervisor`: `parts()` lists the sources'
(watches, node-grace ticker), the Event writer, the dispatcher and the deciders. `start()` runs
them under a supervisor of its own (tests), or under the process's (`process.Restarter`). A part
that dies (a tick that raised) is logged, counted and run again after a backoff.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Protocol

import structlog

from edl_agent.faults.model import Fault
from edl_agent.kube_errors import ApiError
from edl_agent.restarter.core.deciders import Deciders
from edl_agent.restarter.core.dispatch import Admission, Dispatch
from edl_agent.restarter.core.metrics import RestarterMetrics
from edl_agent.restarter.core.plan import Task
from edl_agent.restarter.core.policies import PolicyCache
from edl_agent.restarter.core.port import ClusterPort, PodView
from edl_agent.restarter.core.recorded import Recorded
from edl_agent.restarter.core.replacer import Replacer
from edl_agent.restarter.core.settings import ControllerSettings
from edl_agent.restarter.core.storm import StormGuard
from edl_agent.restarter.core.storm_watch import StormWatch
from edl_agent.restarter.core.templates import GoneTemplates
from edl_agent.runtime.backoff import Backoff
from edl_agent.runtime.supervisor import Part, StopSignal, Supervisor

log = structlog.get_logger(__name__)


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

    def parts(self) -> list[Part]:
        """Its supervised parts (watches, tickers)."""
        ...

    def stop(self) -> None:
        """Unblock and end its threads (after the stop is set)."""

    def wait_synced(self, timeout: float) -> bool:
        """Whether it has listed what it watches (waiting up to `timeout` seconds)."""
        ...


class EventSink(Part, Protocol):
    def stop(self) -> None: ...

    def emit(self, involved: Mapping[str, str], kind: str, reason: str, message: str) -> None: ...


class Controller:
    name = "dispatcher"

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
        settings: ControllerSettings | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """`port` and `pods`: the cluster (see `port`; `kube_controller.connect` builds them
        for an API server); `sources` are run and stopped with the controller, and feed it
        faults (`submit`, `accept`) and policies (`policies.listed`, `policies.event`).
        `storm_object`: the object (see `events.reference`) storm Events are about. `clock`
        and `monotonic`: the wall time and the seconds of intervals."""
        self.settings = s = settings or ControllerSettings()
        self._clock, self._monotonic = clock, monotonic
        self.metrics = metrics or RestarterMetrics()
        self._events = events
        self._storm_object = storm_object
        self._dispatch: Dispatch[_Waiter] = Dispatch(storm or StormGuard())
        self.recovered = threading.Event()
        self.port, self.pods = port, pods
        self._sources = list(sources)
        self._queue: queue.Queue[_Item] = queue.Queue()  # each item done once dispatched
        self.metrics.queue_depth.set_function(self.queue_depth)
        self._stopping: threading.Event = StopSignal()
        self.supervisor: Supervisor | None = None
        self._own_supervisor = False
        self._lock = threading.Lock()
        self._progress: dict[str, _Progress] = {}
        self._retries: dict[str, Backoff] = {}
        self._retry = (s.retry_initial_seconds, s.retry_max_seconds)
        self._last_check = 0.0
        self._storm = StormWatch(pods, self.metrics, self.announce)
        self.policies = PolicyCache(port, clock=clock, monotonic=monotonic)
        self._templates = GoneTemplates(pods, clock=clock, keep=s.keep_templates)
        replacer = Replacer(
            port=port,
            pods=pods,
            templates=self._templates,
            metrics=self.metrics,
            announce=self.announce,
        )
        self.deciders = Deciders(
            port=port,
            pods=pods,
            policies=self.policies,
            templates=self._templates,
            replacer=replacer,
            metrics=self.metrics,
            progress=self,
            clock=clock,
            workers=s.workers,
            batch=s.batch,
            attempts=s.decide_attempts,
        )
        self.checks = 0  # rounds of the recorded restarts' check done (what tests wait on)
        self._recorded = Recorded(
            port=port,
            policies=self.policies,
            templates=self._templates,
            replacer=replacer,
            schedule=self.schedule,
            resume_after=s.resume_after_seconds,
            tidy_after=s.tidy_after_seconds,
            attempts=s.decide_attempts,
        )

    def add_source(self, source: Source) -> None:
        """Another feed, run with the controller (before `start`)."""
        self._sources.append(source)

    # --- lifecycle -----------------------------------------------------------------------

    def parts(self) -> list[Part]:
        """Every part the controller needs running: the sources', the Event writer, the
        dispatcher (this object) and the deciders."""
        parts: list[Part] = [p for source in self._sources for p in source.parts()]
        if self._events is not None:
            parts.append(self._events)
        return [*parts, self, *self.deciders.parts()]

    def start(self, supervisor: Supervisor | None = None) -> None:
        """Run the parts under `supervisor` (its stop is then the controller's), or under a
        supervisor of its own, started now."""
        if supervisor is None:
            supervisor = Supervisor(
                self._stopping,
                initial_backoff=self.settings.part_backoff_seconds,
                max_backoff=self.settings.part_backoff_max_seconds,
            )
            self._own_supervisor = True
        else:
            self._stopping = supervisor.stop_event
        self.supervisor = supervisor
        for part in self.parts():
            supervisor.add(part)
        if self._own_supervisor:
            supervisor.start()

    def ready(self) -> tuple[bool, str]:
        """Whether every part runs and is ready (the supervisor's view), and why not."""
        if self.supervisor is None:
            return False, "not started"
        if not self.recovered.is_set():
            return False, "listing pods, nodes and policies"
        return self.supervisor.ready()

    def wait_synced(self, timeout: float = 30.0) -> bool:
        deadline = self._monotonic() + timeout
        return all(
            source.wait_synced(max(0.0, deadline - self._monotonic())) for source in self._sources
        )

    def stop(self) -> None:
        """Stop every part (the process's too, when run under its supervisor) and answer the
        faults still waiting that they were not recorded."""
        self._stopping.set()
        for source in self._sources:
            source.stop()
        self.deciders.stop()
        if self._events is not None:
            self._events.stop()
        if self.supervisor is not None:
            self.supervisor.join()
        with self._lock:
            waiting = list(self._progress)
        for fault_id in waiting:
            self._settle(fault_id, recorded=False, error="the restarter is stopping")

    def queue_depth(self) -> int:
        """Faults waiting for the dispatcher or being dispatched, and pods waiting for a decision
        or being decided about and acted on: each counts from when it is handed over until it is
        done (a fault in hand is work too: a slow one must show). 0: every fault taken in so far
        is decided about and what was decided is done, or left for a later round (a Backoff's
        second look, a replacement the API refused)."""
        return self._queue.unfinished_tasks + self.deciders.waiting()

    def workers_alive(self) -> bool:
        """Whether the dispatcher and every decider run."""
        if self.supervisor is None:
            return False
        ours = {"dispatcher", *(p.name for p in self.deciders.parts())}
        return all(s.up for s in self.supervisor.statuses() if s.name in ours)

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

    # --- the dispatcher part -------------------------------------------------------------

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        """Dispatch until `stop`. The first run waits for the watches and finishes what a
        previous run recorded; a run after a death goes straight on."""
        if not self.recovered.is_set():
            deadline = self._monotonic() + self.settings.sync_timeout_seconds
            while not self.wait_synced(1.0):
                if stop.is_set():
                    return
                if self._monotonic() > deadline:
                    log.warning("the watches are not synced yet; deciding anyway")
                    break
            try:
                self._recorded.recover()
            except Exception:
                log.exception("finishing the restarts and backoffs recorded before failed")
            self.recovered.set()
        ready()
        while not stop.is_set():
            try:
                item = self._queue.get(timeout=self.settings.tick_seconds)
            except queue.Empty:
                self._tick()
                continue
            try:
                self._dispatch_one(item)
            except Exception:
                log.exception("dispatching a fault failed", fault_id=item.fault.id)
                self._settle(item.fault.id, recorded=False, error="internal error")
            finally:
                self._queue.task_done()  # its tasks, if any, are the deciders' now
            if self._queue.empty():
                self._tick()

    def _dispatch_one(self, item: _Item) -> None:
        fault = item.fault
        with self._lock:
            released = self._storm.check(self._dispatch)
            admission = self._dispatch.admit(fault, item.waiter, retry=item.retry)
            self.metrics.held_faults.set(len(self._dispatch.held))
        for again in released:
            self._queue.put(_Item(again, retry=True))
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
        tasks = self.deciders.tasks_of(fault)
        if not tasks:
            self._settle(fault.id, recorded=True)
            return
        with self._lock:
            self._progress[fault.id] = _Progress(len(tasks))
        for task in tasks:
            self.deciders.put(task)

    def _settle(self, fault_id: str, *, recorded: bool, error: str | None = None) -> bool:
        """End a fault's handling; whether anybody waited for it."""
        with self._lock:
            self._progress.pop(fault_id, None)
            waiters = self._dispatch.settle(fault_id, recorded=recorded)
        for waiter in waiters:
            _tell(waiter, None if recorded else (error or "not recorded"))
        return bool(waiters)

    def task_done(self, task: Task, *, ok: bool, error: str | None = None) -> None:
        """(Progress) A task is recorded, or could not be."""
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
            backoff = self._retries.setdefault(fault.id, Backoff(*self._retry))
            later = self._clock() + timedelta(seconds=backoff.next_delay())
            self.schedule(fault, later)
            log.warning("a fault could not be recorded; trying again", fault_id=fault.id)

    # --- Progress: what the deciders tell ---------------------------------------------------

    def schedule(self, fault: Fault, until: datetime) -> None:
        """(Progress) Look at `fault` again at `until`."""
        with self._lock:
            self._dispatch.schedule(fault, until)

    def announce(
        self, kind: str, reason: str, message: str, about: Mapping[str, str] | None = None
    ) -> None:
        """(Progress) An Event about `about`, by default the storm object (best effort)."""
        target = about if about is not None else self._storm_object
        if target is not None and self._events is not None:
            self._events.emit(target, kind, reason, message)

    # --- ticks: storms, due backoffs, recorded restarts ------------------------------------

    def _tick(self) -> None:
        """A tick that raises kills the dispatcher part: the supervisor logs, counts and runs it
        again (the faults queued wait for it)."""
        now = self._clock()
        with self._lock:
            released = self._storm.check(self._dispatch)
            due = self._dispatch.due(now)
        for fault in released:
            self._queue.put(_Item(fault, retry=True))
        for fault in due:
            self._queue.put(_Item(fault, retry=True))
        self.metrics.dispatcher_round.set(now.timestamp())
        if self._monotonic() - self._last_check >= self.settings.check_every_seconds:
            self._last_check = self._monotonic()
            try:
                self._recorded.check(now)
            except ApiError as exc:
                log.warning("checking the policies' pending restarts failed", error=str(exc))
            self.checks += 1


def _tell(waiter: _Waiter | None, error: str | None) -> None:
    if waiter is not None:
        waiter.error = error
        waiter.done.set()
