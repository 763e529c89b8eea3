"""One supervisor for the long-running parts of a process.

A part is anything with a `name` and `run(stop, ready)`: it runs in the caller's thread until
`stop` is set, calls `ready()` once it serves, and returns promptly when stopped. The supervisor
runs each part on a thread of its own, so a raise or a return is seen at once, with no polling,
and one that hangs (a vendor tool) delays nothing else — least of all kubelet's registration.

There is one error policy, this one: a part that raises, or returns while not stopping, has
died. The death is logged (with its traceback, unless it is the same error as the part's last
one), counted, the part is marked down and not ready, and it is run again after a backoff
(doubling, jittered, capped; reset once the part has run `HEALTHY_SECONDS`). Waits are on
`stop`, so shutdown is never delayed by a backoff. `statuses()` feeds `edl_part_up{part}` and
`edl_part_restarts_total{part}`; `ready()` feeds /readyz.

The stop is a `StopSignal`: a part blocked where `stop.wait()` cannot reach (a streaming read,
a `select`, a gRPC call) asks `on_stop(stop, callback)` to be woken when it is set.
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


class StopSignal(threading.Event):
    """A stop flag that also calls back: `set()` calls every `on_set` callback (on the thread
    that sets it), so a part can be woken wherever it blocks."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._next_key = 0
        self._callbacks_lock = threading.Lock()

    def on_set(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback()` once the signal is set (at once, on this thread, when it is set
        already). Returns the function that forgets the callback: a part that registers one per
        run forgets it as the run ends."""
        with self._callbacks_lock:
            if not self.is_set():
                key = self._next_key
                self._next_key += 1
                self._callbacks[key] = callback
                return lambda: self._forget(key)
        callback()
        return _nothing

    def waker(self) -> threading.Event:
        """A wake-up event of one part, set by `set()` too: the part waits for its own wake-up
        and for the stop with one `wait`."""
        event = threading.Event()
        self.on_set(event.set)
        return event

    def set(self) -> None:
        # The flag is set under the lock `on_set` checks it under: a callback is either called
        # here or by `on_set` itself, never missed.
        with self._callbacks_lock:
            super().set()
            callbacks, self._callbacks = list(self._callbacks.values()), {}
        for callback in callbacks:
            try:
                callback()
            except Exception:  # one broken callback must not keep the others' parts blocked
                structlog.get_logger().exception("a stop callback failed")

    def _forget(self, key: int) -> None:
        with self._callbacks_lock:
            self._callbacks.pop(key, None)


def _nothing() -> None:
    pass


def on_stop(stop: threading.Event, callback: Callable[[], None]) -> Callable[[], None]:
    """`stop.on_set(callback)`, for a part given its stop as a `threading.Event`. A plain Event
    cannot call back, and a part that relies on being woken would never end under one: it is
    refused (TypeError) — run such a part under a `StopSignal`, as the supervisors' are."""
    if not isinstance(stop, StopSignal):
        msg = f"a part woken by its stop needs a StopSignal, not {type(stop).__name__}"
        raise TypeError(msg)
    return stop.on_set(callback)


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
    def __init__(
        self, part: Part, *, critical: bool, backoff: Backoff, stop_seconds: float | None
    ) -> None:
        self.part = part
        self.critical = critical
        self.backoff = backoff
        self.stop_seconds = stop_seconds
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
        """`stop` ends every part; a `StopSignal` (as every caller in this package uses), so
        that the parts blocked elsewhere than in `stop.wait()` are woken."""
        self.stop_event = stop
        self._initial = initial_backoff
        self._maximum = max_backoff
        self._clock = clock
        self._slots: list[_Slot] = []
        self._lock = threading.Lock()
        self._log = structlog.get_logger().bind(part="supervisor")

    def add(
        self,
        part: Part,
        *,
        critical: bool = True,
        backoff: Backoff | None = None,
        stop_seconds: float | None = None,
    ) -> None:
        """Supervise `part` (started now when the supervisor already runs). A part that is not
        critical does not count for readiness (its deaths are still counted). `backoff`: the
        part's own wait before it runs again, instead of the supervisor's. `stop_seconds`: the
        longest `join` waits for this part (one whose wait cannot be cut short, as NVML's)."""
        backoff = backoff or Backoff(self._initial, self._maximum)
        slot = _Slot(part, critical=critical, backoff=backoff, stop_seconds=stop_seconds)
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
        """Wait for every part to end once `stop` is set (at most `timeout` in all, and at most
        its `stop_seconds` for a part)."""
        deadline = self._clock() + timeout
        with self._lock:
            slots = list(self._slots)
        for slot in slots:
            if slot.thread is None:
                continue
            wait = max(0.0, deadline - self._clock())
            if slot.stop_seconds is not None:
                wait = min(wait, slot.stop_seconds)
            slot.thread.join(wait)
            if not slot.thread.is_alive():
                continue
            if slot.stop_seconds is not None:
                self._log.info("part ends on its own after the stop", name=slot.part.name)
            else:
                self._log.error("part did not stop in time", name=slot.part.name)

    def statuses(self) -> list[PartStatus]:
        with self._lock:
            return [
                PartStatus(s.part.name, s.up, s.ready, s.restarts, s.critical, s.last_error)
                for s in self._slots
            ]

    def restarts(self, name: str) -> int:
        """How often the part called `name` has died (0 for none by that name)."""
        return sum(s.restarts for s in self.statuses() if s.name == name)

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
                if self.stop_event.is_set():  # unblocked by the stop, it may well end so
                    self._log.info("part ended in an error as it stopped", name=slot.part.name)
                    break
                self._died(slot, f"{type(exc).__name__}: {exc}"[:300], traceback=True)
            else:
                if self.stop_event.is_set():
                    break
                self._died(slot, "returned while the process runs", traceback=False)
            slot.up, slot.ready = False, False
            if self.stop_event.is_set():
                break
            if self._clock() - started >= HEALTHY_SECONDS:
                slot.backoff.reset()
            slot.restarts += 1
            delay = slot.backoff.next_delay()
            self._log.info("part restarts", name=slot.part.name, retry_in=round(delay, 2))
            self.stop_event.wait(delay)

    def _died(self, slot: _Slot, error: str, *, traceback: bool) -> None:
        """Log a death: with its traceback, unless the part died of this very error last time
        (a driver that stays missing is not worth a traceback every few seconds)."""
        again = error == slot.last_error
        slot.last_error = error
        if traceback and not again:
            self._log.exception("part died", name=slot.part.name)
        else:
            self._log.error("part died", name=slot.part.name, error=error, again=again)


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
