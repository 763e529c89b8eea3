"""One supervisor for the agent's long-running parts.

A part is anything with a `name` and `run(stop, ready)`: it runs until `stop` is set, calls
`ready()` once it serves, and returns promptly when stopped. A part that raises, or returns while
not stopping, has died: the death is logged once with its traceback, counted, the part is marked
down and not ready, and it is run again after a backoff (doubling, jittered, capped; reset once
the part has run `HEALTHY_SECONDS`). Waits are on `stop`, so shutdown is never delayed by a
backoff. `statuses()` feeds `edl_part_up{part}` and `edl_part_restarts_total{part}`; `ready()`
feeds /readyz. Each part has its own thread, so one that hangs (a vendor tool) delays nothing
else — least of all kubelet's registration.

The supervisor hears of a death from the part itself: its thread is the one the part runs in,
so a raise or a return is seen at once, with no polling. A thread started elsewhere (`Watched`)
tells it the same way when its owner offers `notify_on_end` and the stop flag is a
`StopSignal`; only an owner without them is looked at every `WATCH_SECONDS`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from edl_agent.runtime.backoff import Backoff

HEALTHY_SECONDS = 60.0
WATCH_SECONDS = 0.5


class StopSignal(threading.Event):
    """A stop flag whose `set()` also sets every `waker()`: a part can wait for its own wake-up
    and for the stop with one `wait`."""

    def __init__(self) -> None:
        super().__init__()
        self._wakes: list[threading.Event] = []
        self._wakes_lock = threading.Lock()

    def waker(self) -> threading.Event:
        """A wake-up event of one part, set by `set()` too."""
        event = threading.Event()
        with self._wakes_lock:
            self._wakes.append(event)
        if self.is_set():
            event.set()
        return event

    def forget(self, event: threading.Event) -> None:
        """A waker no longer waited on (its part ended)."""
        with self._wakes_lock:
            if event in self._wakes:
                self._wakes.remove(event)

    def set(self) -> None:
        super().set()
        with self._wakes_lock:
            wakes = list(self._wakes)
        for event in wakes:
            event.set()


class Part(Protocol):
    name: str

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None: ...


@dataclass(frozen=True)
class PartStatus:
    name: str
    up: bool
    ready: bool
    restarts: int
    critical: bool
    last_error: str | None = None


class _Slot:
    def __init__(self, part: Part, *, critical: bool, backoff: Backoff) -> None:
        self.part = part
        self.critical = critical
        self.backoff = backoff
        self.up = False
        self.ready = False
        self.restarts = 0
        self.last_error: str | None = None
        self.thread: threading.Thread | None = None


class Supervisor:
    def __init__(
        self,
        stop: threading.Event,
        *,
        initial_backoff: float = 0.5,
        max_backoff: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stop_event = stop
        self._initial = initial_backoff
        self._maximum = max_backoff
        self._clock = clock
        self._slots: list[_Slot] = []
        self._lock = threading.Lock()
        self._log = structlog.get_logger().bind(part="supervisor")

    def add(self, part: Part, *, critical: bool = True) -> None:
        """Supervise `part` (started now when the supervisor already runs). A part that is not
        critical does not count for readiness (its deaths are still counted)."""
        slot = _Slot(part, critical=critical, backoff=Backoff(self._initial, self._maximum))
        with self._lock:
            self._slots.append(slot)
            running = any(s.thread is not None for s in self._slots)
        if running:
            self._start(slot)

    def start(self) -> None:
        with self._lock:
            slots = [s for s in self._slots if s.thread is None]
        for slot in slots:
            self._start(slot)

    def join(self, timeout: float = 10.0) -> None:
        """Wait for every part to end once `stop` is set (at most `timeout` in all)."""
        deadline = self._clock() + timeout
        with self._lock:
            slots = list(self._slots)
        for slot in slots:
            if slot.thread is not None:
                slot.thread.join(max(0.0, deadline - self._clock()))
                if slot.thread.is_alive():
                    self._log.error("part did not stop in time", name=slot.part.name)

    def statuses(self) -> list[PartStatus]:
        with self._lock:
            return [
                PartStatus(s.part.name, s.up, s.ready, s.restarts, s.critical, s.last_error)
                for s in self._slots
            ]

    def ready(self) -> tuple[bool, str]:
        waiting = [s.name for s in self.statuses() if s.critical and not (s.up and s.ready)]
        if waiting:
            return False, f"parts not ready: {', '.join(waiting)}"
        return True, "ok"

    def _start(self, slot: _Slot) -> None:
        slot.thread = threading.Thread(
            target=self._guard, args=(slot,), name=f"part-{slot.part.name}", daemon=True
        )
        slot.thread.start()

    def _guard(self, slot: _Slot) -> None:
        try:
            self._keep_running(slot)
        finally:  # a BaseException (SystemExit) ends the thread: the part is down for good
            slot.up, slot.ready = False, False

    def _keep_running(self, slot: _Slot) -> None:
        while not self.stop_event.is_set():
            started = self._clock()
            slot.up, slot.ready = True, False

            def ready(slot: _Slot = slot) -> None:
                slot.ready = True

            try:
                slot.part.run(self.stop_event, ready)
            except Exception as exc:
                slot.last_error = f"{type(exc).__name__}: {exc}"[:300]
                self._log.exception("part died", name=slot.part.name)
            else:
                if self.stop_event.is_set():
                    break
                slot.last_error = "returned while the agent runs"
                self._log.error("part died", name=slot.part.name, error=slot.last_error)
            slot.up, slot.ready = False, False
            if self.stop_event.is_set():
                break
            if self._clock() - started >= HEALTHY_SECONDS:
                slot.backoff.reset()
            slot.restarts += 1
            delay = slot.backoff.next_delay()
            self._log.info("part restarts", name=slot.part.name, retry_in=round(delay, 2))
            self.stop_event.wait(delay)


class Wakeable(Protocol):
    def wait(self, timeout: float | None = None) -> bool: ...

    def clear(self) -> None: ...


@dataclass
class Every:
    """A part that runs `step` every `interval` seconds, ready after its first step. `wake`
    (set by someone else, and by the agent's stop) runs the next step at once. A step that
    raises kills the part: the supervisor logs it and runs the part again after a backoff."""

    name: str
    interval: Callable[[], float]
    step: Callable[[], None]
    wake: Wakeable

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        while not stop.is_set():
            self.step()
            ready()
            self.wake.wait(self.interval())
            self.wake.clear()


class Owner(Protocol):
    """A class that runs its own thread: the supervisor only watches it and restarts it."""

    def alive(self) -> bool: ...

    def restart(self) -> None: ...


@dataclass
class Watched:
    """A part watching an `Owner` that was started elsewhere (it binds a port, say, where the
    caller wants the error): down when its thread has ended, started again by the supervisor.

    An owner with `notify_on_end(callback)` (it calls `callback()` as its thread ends) under a
    `StopSignal` is waited on, not polled: the part sleeps until the thread ends or the stop.
    Readiness is still looked at every `poll_seconds` until it is reached."""

    name: str
    owner: Owner
    is_ready: Callable[[], bool] = lambda: True
    poll_seconds: float = WATCH_SECONDS

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        notify = getattr(self.owner, "notify_on_end", None)
        if notify is None or not isinstance(stop, StopSignal):
            self._poll(stop, ready)
            return
        wake = stop.waker()
        try:
            if not self.owner.alive():
                self.owner.restart()
            notify(wake.set)  # at once when it has ended already
            while not self.is_ready() and self.owner.alive():
                if wake.wait(self.poll_seconds):
                    break
            else:
                if self.owner.alive():
                    ready()
            wake.wait()
            if not stop.is_set():
                msg = f"the {self.name} thread ended"
                raise RuntimeError(msg)
        finally:
            notify(None)
            stop.forget(wake)

    def _poll(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        if not self.owner.alive():
            self.owner.restart()
        while not stop.wait(self.poll_seconds):
            if not self.owner.alive():
                msg = f"the {self.name} thread ended"
                raise RuntimeError(msg)
            if self.is_ready():
                ready()
