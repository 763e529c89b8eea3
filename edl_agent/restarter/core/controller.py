"""The restarter's controller: faults in (intake and watchers), decided, recorded, acted on.

The decisions themselves are pure (`dispatch` drops duplicates, holds node faults in a storm and
keeps the backoff schedule; `plan` decides a batch of faults under one policy and says what to
record); the controller builds the parts that carry out what those say and runs them, through
two small ports (`port`): on a real API server `Actuator` and `ClusterWatcher`
(`kube_controller.connect` wires them), in tests `memory.InMemoryCluster`. Nothing here builds
an API client, nor imports a client library.

The dispatcher (`dispatcher`) takes each fault and hands each pod of it to the deciders
(`deciders`), which decide, record and act, and tell what became of each task through the
`Progress` callback this class passes on to the dispatcher. The other jobs live in their own
modules: the policy cache (`policies`), the gone pods' templates (`templates`), the replacements
(`replacer`), the restarts and backoffs a previous run left (`recorded`).

Every thread is a part under a `runtime.supervisor.Supervisor`: `parts()` lists the sources'
(watches, node-grace ticker), the Event writer, the dispatcher and the deciders. `start()` runs
them under a supervisor of its own (tests), or under the process's (`process.Restarter`). A part
that dies is logged, counted and run again after a backoff.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Protocol

from edl_agent.faults.model import Fault
from edl_agent.restarter.core.deciders import Deciders
from edl_agent.restarter.core.dispatcher import Dispatcher
from edl_agent.restarter.core.metrics import RestarterMetrics
from edl_agent.restarter.core.plan import Task
from edl_agent.restarter.core.policies import PolicyCache
from edl_agent.restarter.core.port import ClusterPort, PodView
from edl_agent.restarter.core.recorded import Recorded
from edl_agent.restarter.core.replacer import Replacer
from edl_agent.restarter.core.settings import ControllerSettings
from edl_agent.restarter.core.storm import StormGuard
from edl_agent.restarter.core.templates import GoneTemplates
from edl_agent.runtime.supervisor import Part, StopSignal, Supervisor


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
        faults (`submit`, `accept`), node changes (`nodes_changed`) and policies
        (`policies.listed`, `policies.event`). `storm_object`: the object (see
        `events.reference`) storm Events are about. `clock` and `monotonic`: the wall time and
        the seconds of intervals."""
        self.settings = s = settings or ControllerSettings()
        self.metrics = metrics or RestarterMetrics()
        self._events = events
        self._storm_object = storm_object
        self.port, self.pods = port, pods
        self._sources = list(sources)
        self._stopping: threading.Event = StopSignal()
        self.supervisor: Supervisor | None = None
        self._own_supervisor = False
        self.policies = PolicyCache(port, clock=clock, monotonic=monotonic, on_pending=self.wake)
        templates = GoneTemplates(pods, clock=clock, keep=s.keep_templates)
        replacer = Replacer(
            port=port, pods=pods, templates=templates, metrics=self.metrics, announce=self.announce
        )
        self.deciders = Deciders(
            port=port,
            pods=pods,
            policies=self.policies,
            templates=templates,
            replacer=replacer,
            metrics=self.metrics,
            progress=self,
            clock=clock,
            workers=s.workers,
            batch=s.batch,
            attempts=s.decide_attempts,
        )
        recorded = Recorded(
            port=port,
            policies=self.policies,
            templates=templates,
            replacer=replacer,
            schedule=self.schedule,
            resume_after=s.resume_after_seconds,
            tidy_after=s.tidy_after_seconds,
            attempts=s.decide_attempts,
        )
        self.dispatcher = Dispatcher(
            pods=pods,
            deciders=self.deciders,
            recorded=recorded,
            policies=self.policies,
            metrics=self.metrics,
            announce=self.announce,
            synced=self.wait_synced,
            storm=storm,
            settings=s,
            clock=clock,
            monotonic=monotonic,
        )
        self._monotonic = monotonic
        self.recovered = self.dispatcher.recovered
        self.metrics.queue_depth.set_function(self.queue_depth)

    def add_source(self, source: Source) -> None:
        """Another feed, run with the controller (before `start`)."""
        self._sources.append(source)

    # --- lifecycle -----------------------------------------------------------------------

    def parts(self) -> list[Part]:
        """Every part the controller needs running: the sources', the Event writer, the
        dispatcher and the deciders."""
        parts: list[Part] = [p for source in self._sources for p in source.parts()]
        if self._events is not None:
            parts.append(self._events)
        return [*parts, self.dispatcher, *self.deciders.parts()]

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
        self.dispatcher.stop()
        self._stopping.set()
        for source in self._sources:
            source.stop()
        self.deciders.stop()
        if self._events is not None:
            self._events.stop()
        if self.supervisor is not None:
            self.supervisor.join()
        self.dispatcher.abandon()

    def workers_alive(self) -> bool:
        """Whether the dispatcher and every decider run."""
        if self.supervisor is None:
            return False
        ours = {self.dispatcher.name, *(p.name for p in self.deciders.parts())}
        return all(s.up for s in self.supervisor.statuses() if s.name in ours)

    # --- what the sources and the intake tell ------------------------------------------------

    def submit(self, fault: Fault) -> None:
        """Queue a fault (the watcher's sink); returns at once."""
        self.dispatcher.submit(fault)

    def accept(self, fault: Fault, timeout: float = 8.0) -> None:
        """Queue a fault and return once what becomes of it is recorded in the API (the
        intake's sink: only then may the agent drop it); `dispatcher.NotRecorded` when it could
        not be recorded within `timeout`."""
        self.dispatcher.accept(fault, timeout)

    def nodes_changed(self) -> None:
        """A node's readiness changed, or a node came or went (the watcher's news)."""
        self.dispatcher.nodes_changed()

    def wake(self) -> None:
        """Have the dispatcher look now at what is due (a test's clock moved)."""
        self.dispatcher.wake()

    def queue_depth(self) -> int:
        """Faults and tasks in hand (`Dispatcher.queue_depth`)."""
        return self.dispatcher.queue_depth()

    @property
    def checks(self) -> int:
        """Rounds of the recorded restarts' check done (what tests wait on)."""
        return self.dispatcher.checks

    # --- Progress: what the deciders tell, passed on to the dispatcher ------------------------

    def task_done(self, task: Task, *, ok: bool, error: str | None = None) -> None:
        """(Progress) A task is recorded, or could not be."""
        self.dispatcher.task_done(task, ok=ok, error=error)

    def schedule(self, fault: Fault, until: datetime) -> None:
        """(Progress) Look at `fault` again at `until`."""
        self.dispatcher.schedule(fault, until)

    def announce(
        self, kind: str, reason: str, message: str, about: Mapping[str, str] | None = None
    ) -> None:
        """(Progress) An Event about `about`, by default the storm object (best effort)."""
        target = about if about is not None else self._storm_object
        if target is not None and self._events is not None:
            self._events.emit(target, kind, reason, message)
