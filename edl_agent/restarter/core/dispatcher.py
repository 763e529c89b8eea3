"""The dispatcher part: takes each fault in (the intake's `accept`, the watchers' `submit`), asks
`dispatch.Dispatch` what to do with it, and hands each pod of a new one to the deciders.

A fault is settled (and later copies are duplicates) once its decisions are recorded; `accept`
waits for that, so the intake acknowledges an agent's fault only once the API holds what became
of it. The deciders tell how each task went through `task_done`; a watcher's fault that could
not be recorded is looked at again after a backoff.

The dispatcher runs a round only when there is a reason, and otherwise waits (`wakeup.Wakeup`)
for the next one: faults queued; a node that changed (`nodes_changed`: the storm guard looks at
the node counts, and hands back the faults it held once a storm is over); a Backoff's second look
falling due (the earliest of `Dispatch`'s schedule); and, only while some policy has pending
restarts, the re-check of those restarts (`recorded.Recorded.check`) every
`check_every_seconds`. With nothing queued and nothing due it sleeps until woken. A metric
tells when it last ran a round (by its clock).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import structlog

from edl_agent.faults.model import Fault
from edl_agent.kube_errors import ApiError
from edl_agent.restarter.core.deciders import Deciders
from edl_agent.restarter.core.dispatch import Admission, Dispatch
from edl_agent.restarter.core.metrics import RestarterMetrics
from edl_agent.restarter.core.plan import Task
from edl_agent.restarter.core.policies import PolicyCache
from edl_agent.restarter.core.port import PodView
from edl_agent.restarter.core.recorded import Recorded
from edl_agent.restarter.core.settings import ControllerSettings
from edl_agent.restarter.core.storm import StormGuard
from edl_agent.restarter.core.storm_watch import StormWatch
from edl_agent.restarter.core.wakeup import Wakeup
from edl_agent.runtime.backoff import Backoff

log = structlog.get_logger(__name__)

Announce = Callable[[str, str, str], None]


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


class Dispatcher:
    name = "dispatcher"

    def __init__(
        self,
        *,
        pods: PodView,
        deciders: Deciders,
        recorded: Recorded,
        policies: PolicyCache,
        metrics: RestarterMetrics,
        announce: Announce,
        synced: Callable[[float], bool],
        storm: StormGuard | None = None,
        settings: ControllerSettings | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """`synced(timeout)`: whether the watches have listed (the first run waits for them
        before it finishes what a previous run recorded)."""
        self.settings = settings or ControllerSettings()
        self._deciders, self._recorded, self._policies = deciders, recorded, policies
        self._metrics = metrics
        self._synced = synced
        self._clock, self._monotonic = clock, monotonic
        self._dispatch: Dispatch[_Waiter] = Dispatch(storm or StormGuard())
        self._storm = StormWatch(pods, metrics, announce)
        self._queue: queue.Queue[_Item] = queue.Queue()  # each item done once dispatched
        self._lock = threading.Lock()
        self._progress: dict[str, _Progress] = {}
        self._retries: dict[str, Backoff] = {}
        self._retry = (self.settings.retry_initial_seconds, self.settings.retry_max_seconds)
        self._wakeup = Wakeup()
        self._node_news = True  # the node counts are to be looked at (from the first round on)
        self._last_check = float("-inf")  # monotonic
        self._stopping = threading.Event()
        self.recovered = threading.Event()
        self.rounds = 0  # rounds run (tests wait on it, and on `idle`)
        self.checks = 0  # rounds of the recorded restarts' check done

    # --- what comes in ---------------------------------------------------------------------

    def submit(self, fault: Fault) -> None:
        """Queue a fault (the watcher's sink); returns at once."""
        self._queue.put(_Item(fault))
        self._wakeup.wake()

    def accept(self, fault: Fault, timeout: float = 8.0) -> None:
        """Queue a fault and return once what becomes of it is recorded in the API. Raises
        `NotRecorded` when it could not be recorded within `timeout`; the fault may still be
        recorded later, and a copy sent again then joins it or is answered as a duplicate."""
        waiter = _Waiter()
        self._queue.put(_Item(fault, waiter))
        self._wakeup.wake()
        if not waiter.done.wait(timeout):
            msg = f"fault {fault.id} not recorded within {timeout:g}s"
            raise NotRecorded(msg)
        if waiter.error is not None:
            raise NotRecorded(waiter.error)

    def nodes_changed(self) -> None:
        """A node changed (readiness, or one came or went): the storm guard looks again."""
        with self._lock:
            self._node_news = True
        self._wakeup.wake()

    def wake(self) -> None:
        """Look again now whether anything is due (the clock moved, restarts were recorded)."""
        self._wakeup.wake()

    def idle(self) -> bool:
        """Whether the dispatcher waits for its next due time with nothing unseen in hand."""
        return self._wakeup.idle()

    def queue_depth(self) -> int:
        """Faults waiting for the dispatcher or being dispatched, and pods waiting for a decision
        or being decided about and acted on: each counts from when it is handed over until it is
        done. 0: every fault taken in so far is decided about and what was decided is done, or
        left for a later round (a Backoff's second look, a replacement the API refused)."""
        return self._queue.unfinished_tasks + self._deciders.waiting()

    # --- the part --------------------------------------------------------------------------

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        """Dispatch until `stop` (a `StopSignal`). The first run waits for the watches and
        finishes what a previous run recorded; a run after a death goes straight on."""
        if not self.recovered.is_set():
            self._recover(stop)
            if stop.is_set():
                return
        self._wakeup.attach(stop)
        try:
            ready()
            while not stop.is_set():
                self._wakeup.begin()
                self._round()
                self._wakeup.wait(self.next_wait())
        finally:
            self._wakeup.detach()

    def stop(self) -> None:
        """The restarter stops: a fault that could not be recorded is not tried again."""
        self._stopping.set()

    def abandon(self) -> None:
        """Answer every fault still waited on that it was not recorded (once the parts have
        ended)."""
        with self._lock:
            waiting = list(self._progress)
        for fault_id in waiting:
            self._settle(fault_id, recorded=False, error="the restarter is stopping")

    def _recover(self, stop: threading.Event) -> None:
        deadline = self._monotonic() + self.settings.sync_timeout_seconds
        while not self._synced(1.0):  # a second at a time: a stop ends the wait
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

    def _round(self) -> None:
        """The storm guard's news, the backoffs due, the faults queued and the recorded
        restarts' check when due. One that raises kills the part: the supervisor logs, counts
        and runs it again (the faults queued wait for it)."""
        now = self._clock()
        with self._lock:
            news, self._node_news = self._node_news, False
            try:
                again = self._storm.check(self._dispatch) if news else []
            except BaseException:
                self._node_news = True  # looked at again by the next run
                raise
            again += self._dispatch.due(now)
            self._metrics.held_faults.set(len(self._dispatch.held))
        for fault in again:
            self._queue.put(_Item(fault, retry=True))
        worked = news
        for _ in range(self._queue.qsize()):  # those queued later: the next round, at once
            item = self._queue.get_nowait()
            worked = True
            try:
                self._dispatch_one(item)
            except Exception:
                log.exception("dispatching a fault failed", fault_id=item.fault.id)
                self._settle(item.fault.id, recorded=False, error="internal error")
            finally:
                self._queue.task_done()  # its tasks, if any, are the deciders' now
        if self._check_due():
            self._last_check = self._monotonic()
            try:
                self._recorded.check(now)
            except ApiError as exc:
                log.warning("checking the policies' pending restarts failed", error=str(exc))
            self.checks += 1
            worked = True
        if worked:
            self.rounds += 1
            self._metrics.dispatcher_round.set(self._clock().timestamp())

    def _check_due(self) -> bool:
        return self._policies.has_pending_restarts() and (
            self._monotonic() - self._last_check >= self.settings.check_every_seconds
        )

    def next_wait(self) -> float | None:
        """Seconds until something is due by itself (None: nothing is)."""
        waits = []
        with self._lock:
            due = self._dispatch.next_due()
        now = self._clock()
        if due is not None:
            waits.append((due - now).total_seconds())
        if self._policies.has_pending_restarts():
            waits.append(self._last_check + self.settings.check_every_seconds - self._monotonic())
        return max(0.0, min(waits)) if waits else None

    def _dispatch_one(self, item: _Item) -> None:
        fault = item.fault
        with self._lock:
            released = self._storm.check(self._dispatch)
            admission = self._dispatch.admit(fault, item.waiter, retry=item.retry)
            self._metrics.held_faults.set(len(self._dispatch.held))
        for again in released:
            self._queue.put(_Item(again, retry=True))
        if released:
            self._wakeup.wake()
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
        tasks = self._deciders.tasks_of(fault)
        if not tasks:
            self._settle(fault.id, recorded=True)
            return
        with self._lock:
            self._progress[fault.id] = _Progress(len(tasks))
        for task in tasks:
            self._deciders.put(task)

    def _settle(self, fault_id: str, *, recorded: bool, error: str | None = None) -> bool:
        """End a fault's handling; whether anybody waited for it."""
        with self._lock:
            self._progress.pop(fault_id, None)
            waiters = self._dispatch.settle(fault_id, recorded=recorded)
        for waiter in waiters:
            _tell(waiter, None if recorded else (error or "not recorded"))
        return bool(waiters)

    # --- what the deciders tell (`deciders.Progress`) ----------------------------------------

    def task_done(self, task: Task, *, ok: bool, error: str | None = None) -> None:
        """A task is recorded, or could not be."""
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

    def schedule(self, fault: Fault, until: datetime) -> None:
        """Look at `fault` again at `until`."""
        with self._lock:
            self._dispatch.schedule(fault, until)
        self._wakeup.wake()


def _tell(waiter: _Waiter | None, error: str | None) -> None:
    if waiter is not None:
        waiter.error = error
        waiter.done.set()
