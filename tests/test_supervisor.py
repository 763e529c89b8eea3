"""The agent's supervisor: parts that die are logged, counted and run again after a backoff;
readiness names the parts that are not ready; stop ends every part at once; nothing is left
running. Real threads, no sleeps longer than the parts' own waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog.testing

from edl_agent.runtime.backoff import Backoff, backoff_delay
from edl_agent.runtime.supervisor import Every, StopSignal, Supervisor, Watched
from tests.waiting import wait_until


class Flaky:
    """Raises `failures` times, then serves until stopped."""

    def __init__(self, name: str, failures: int) -> None:
        self.name = name
        self.failures = failures
        self.runs = 0

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        self.runs += 1
        if self.runs <= self.failures:
            msg = f"broken {self.runs}"
            raise RuntimeError(msg)
        ready()
        stop.wait()


class Quitter:
    name = "quitter"

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        ready()  # and returns while the agent runs: that is dying too


def test_a_part_that_dies_is_restarted_after_a_backoff_and_counted() -> None:
    stop = threading.Event()
    supervisor = Supervisor(stop, initial_backoff=0.02, max_backoff=0.05)
    flaky = Flaky("flaky", failures=2)
    supervisor.add(flaky)
    with structlog.testing.capture_logs() as logs:
        supervisor.start()
        wait_until(lambda: supervisor.ready() == (True, "ok"))
    [status] = supervisor.statuses()
    assert (status.name, status.up, status.ready, status.restarts) == ("flaky", True, True, 2)
    assert status.last_error == "RuntimeError: broken 2"
    assert [e["event"] for e in logs].count("part died") == 2
    stop.set()
    supervisor.join(timeout=5)
    assert not [t for t in threading.enumerate() if t.name.startswith("part-")]


def test_readiness_names_the_part_that_is_not_ready_and_ignores_optional_ones() -> None:
    stop = threading.Event()
    supervisor = Supervisor(stop, initial_backoff=10, max_backoff=10)
    supervisor.add(Flaky("plugins", failures=0))
    supervisor.add(Flaky("poll-ascend", failures=1))  # dies once, then waits 5-10 s
    supervisor.add(Quitter(), critical=False)
    supervisor.start()
    wait_until(lambda: any(s.restarts for s in supervisor.statuses() if s.name == "quitter"))
    wait_until(lambda: not supervisor.ready()[0])
    assert supervisor.ready() == (False, "parts not ready: poll-ascend")
    started = time.monotonic()
    stop.set()
    supervisor.join(timeout=5)
    assert time.monotonic() - started < 2  # a backoff never delays the stop
    assert {s.name: s.up for s in supervisor.statuses()} == {
        "plugins": False,
        "poll-ascend": False,
        "quitter": False,
    }


def test_every_runs_its_step_on_time_and_when_woken() -> None:
    stop, wake = threading.Event(), threading.Event()
    steps: list[float] = []
    supervisor = Supervisor(stop)
    supervisor.add(Every("tick", lambda: 60.0, lambda: steps.append(time.monotonic()), wake))
    supervisor.start()
    wait_until(lambda: len(steps) == 1)
    wake.set()
    wait_until(lambda: len(steps) == 2)
    stop.set()
    wake.set()
    supervisor.join(timeout=5)
    assert len(steps) in (2, 3)


def test_a_watched_thread_that_ended_is_started_again() -> None:
    class Owner:
        def __init__(self) -> None:
            self.starts = 0
            self.thread: threading.Thread | None = None
            self.done = threading.Event()

        def alive(self) -> bool:
            return self.thread is not None and self.thread.is_alive()

        def restart(self) -> None:
            self.starts += 1
            # The first thread ends by itself; the second runs until the test is over.
            self.thread = threading.Thread(
                target=self.done.wait, args=(0.05 if self.starts == 1 else 30,), daemon=True
            )
            self.thread.start()

    stop = threading.Event()
    owner = Owner()
    owner.restart()
    supervisor = Supervisor(stop, initial_backoff=0.01, max_backoff=0.01)
    supervisor.add(Watched("owned", owner))
    supervisor.start()
    wait_until(lambda: owner.starts == 2, timeout=10)
    wait_until(lambda: supervisor.statuses()[0].restarts == 1)
    stop.set()
    supervisor.join(timeout=5)
    owner.done.set()
    assert owner.thread is not None
    owner.thread.join(timeout=5)


def test_backoff_doubles_with_jitter_up_to_its_cap_and_resets() -> None:
    backoff = Backoff(initial=1.0, maximum=8.0, random=lambda: 0.999999)
    delays = [round(backoff.next_delay(), 3) for _ in range(6)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    backoff.reset()
    assert round(backoff.next_delay(), 3) == 1.0
    assert backoff_delay(1, initial=1.0, maximum=8.0, jitter=0.0) == 0.5


def test_a_watched_thread_that_tells_its_end_is_restarted_without_polling() -> None:
    """An owner that calls back as its thread ends, under a `StopSignal`: the supervisor hears
    of the end at once although it would look only once an hour."""

    class Owner:
        def __init__(self) -> None:
            self.starts = 0
            self.release = threading.Event()
            self.thread: threading.Thread | None = None
            self.on_end: Callable[[], None] | None = None

        def alive(self) -> bool:
            return self.thread is not None and self.thread.is_alive()

        def notify_on_end(self, callback: Callable[[], None] | None) -> None:
            self.on_end = callback
            if callback is not None and not self.alive():
                callback()

        def restart(self) -> None:
            self.starts += 1
            self.thread = threading.Thread(target=self._run, args=(self.starts,), daemon=True)
            self.thread.start()

        def _run(self, start: int) -> None:
            if start == 1:
                self.release.wait()
            else:
                stop.wait()
            if self.on_end is not None:
                self.on_end()

    stop = StopSignal()
    owner = Owner()
    supervisor = Supervisor(stop, initial_backoff=0.01, max_backoff=0.01)
    supervisor.add(Watched("owned", owner, poll_seconds=3600))
    supervisor.start()
    wait_until(lambda: supervisor.ready() == (True, "ok"))
    owner.release.set()  # the first thread ends
    wait_until(lambda: owner.starts == 2)
    wait_until(lambda: supervisor.ready() == (True, "ok"))
    assert supervisor.statuses()[0].restarts == 1
    stop.set()
    supervisor.join(timeout=5)
    assert owner.thread is not None
    owner.thread.join(5)  # the owner's own thread ends on the stop
    assert not owner.alive()
    assert not any(t.name == "part-owned" for t in threading.enumerate())
