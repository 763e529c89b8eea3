"""The supervisor: parts that die are heard at once, logged, counted and run again after a
backoff; readiness names the parts that are not ready; stop ends every part at once (the stop
signal calls back whatever a part blocks in); nothing is left running. Real threads, no sleeps
longer than the parts' own waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import structlog.testing

from edl_agent.runtime.backoff import Backoff, backoff_delay
from edl_agent.runtime.steps import Steps
from edl_agent.runtime.supervisor import Every, StopSignal, Supervisor, on_stop
from tests.parts import stop as stop_parts
from tests.parts import supervised
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


def test_backoff_doubles_with_jitter_up_to_its_cap_and_resets() -> None:
    backoff = Backoff(initial=1.0, maximum=8.0, random=lambda: 0.999999)
    delays = [round(backoff.next_delay(), 3) for _ in range(6)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    backoff.reset()
    assert round(backoff.next_delay(), 3) == 1.0
    assert backoff_delay(1, initial=1.0, maximum=8.0, jitter=0.0) == 0.5


class Dies:
    """Serves until `release` is set, then raises (once); serves until stopped after that."""

    name = "dies"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.runs = 0

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        self.runs += 1
        ready()
        if self.runs == 1:
            self.release.wait()
            msg = "lost its connection"
            raise ConnectionError(msg)
        stop.wait()


def test_a_death_is_heard_at_once_and_the_part_runs_again() -> None:
    """The part runs on the supervisor's own thread: its raise is the supervisor's news, with
    nothing looked at on a timer (a backoff of an hour shows the part down until it is over)."""
    part = Dies()
    with supervised(part, initial_backoff=3600, max_backoff=3600) as supervisor:
        wait_until(lambda: supervisor.ready() == (True, "ok"))
        part.release.set()
        wait_until(lambda: supervisor.statuses()[0].restarts == 1)
        [status] = supervisor.statuses()
        assert (status.up, status.ready) == (False, False)
        assert status.last_error == "ConnectionError: lost its connection"
        assert supervisor.ready() == (False, "parts not ready: dies")
    again = Dies()
    with supervised(again) as supervisor:
        again.release.set()
        wait_until(lambda: again.runs == 2 and supervisor.ready() == (True, "ok"))
        assert supervisor.restarts("dies") == 1


def test_the_same_error_again_is_logged_without_its_traceback() -> None:
    class Same:
        name = "same"

        def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
            raise OSError("driver not loaded")

    with structlog.testing.capture_logs() as logs, supervised(Same()) as supervisor:
        wait_until(lambda: supervisor.restarts("same") >= 3)
    died = [e for e in logs if e["event"] == "part died"]
    assert died[0].get("exc_info") is True
    assert all("exc_info" not in e and e["again"] for e in died[1:])
    assert {e.get("error") for e in died[1:]} == {"OSError: driver not loaded"}


def test_a_part_waits_its_own_backoff() -> None:
    part = Flaky("own", failures=1)
    supervisor = Supervisor(StopSignal(), initial_backoff=3600, max_backoff=3600)
    supervisor.add(part, backoff=Backoff(0.01, 0.01))
    supervisor.start()
    try:
        wait_until(lambda: supervisor.ready() == (True, "ok"))  # not an hour later
    finally:
        stop_parts(supervisor)
    assert part.runs == 2


def test_join_waits_for_a_part_at_most_its_stop_seconds() -> None:
    """A part whose wait cannot be cut short (NVML's) does not hold up the others' stop."""
    release = threading.Event()

    class Deaf:
        name = "deaf"

        def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
            ready()
            release.wait()

    stop = StopSignal()
    supervisor = Supervisor(stop)
    supervisor.add(Deaf(), stop_seconds=0.05)
    supervisor.add(Flaky("prompt", failures=0))
    supervisor.start()
    wait_until(lambda: supervisor.ready() == (True, "ok"))
    stop.set()
    with structlog.testing.capture_logs() as logs:
        began = time.monotonic()
        supervisor.join(timeout=30)
    assert time.monotonic() - began < 10
    assert [e["event"] for e in logs] == ["part ends on its own after the stop"]
    release.set()
    stop_parts(supervisor)


# --- the stop signal --------------------------------------------------------------------------


def test_a_stop_signal_calls_back_once_on_the_thread_that_sets_it() -> None:
    signal = StopSignal()
    called: list[str] = []
    signal.on_set(lambda: called.append(threading.current_thread().name))
    forget = signal.on_set(lambda: called.append("forgotten"))
    forget()
    setter = threading.Thread(target=signal.set, name="setter")
    setter.start()
    setter.join()
    signal.set()  # a second set calls nothing again
    assert called == ["setter"]
    signal.on_set(lambda: called.append("late"))  # set already: called at once, here
    assert called == ["setter", "late"]


def test_a_callback_that_raises_does_not_keep_the_others_from_theirs() -> None:
    signal = StopSignal()
    woken = signal.waker()

    def broken() -> None:
        raise RuntimeError("broken callback")

    signal.on_set(broken)
    with structlog.testing.capture_logs() as logs:
        signal.set()
    assert woken.is_set()
    assert [e["event"] for e in logs] == ["a stop callback failed"]


def test_a_part_that_must_be_woken_refuses_a_plain_event() -> None:
    with pytest.raises(TypeError, match="needs a StopSignal"):
        on_stop(threading.Event(), lambda: None)
    assert on_stop(StopSignal(), lambda: None)() is None


# --- the steps of a round ---------------------------------------------------------------------


def test_a_failing_step_is_counted_and_logged_as_it_starts_changes_and_ends() -> None:
    steps = Steps()
    errors = iter([OSError("kubelet gone"), OSError("kubelet gone"), OSError("socket refused")])

    def sync() -> None:
        error = next(errors, None)
        if error is not None:
            raise error

    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            steps.run("plugins", sync)
            assert steps.failing("plugins")
        steps.run("plugins", sync)
    assert not steps.failing("plugins")
    assert steps.failures == {"plugins": 3}
    assert [(e["event"], "exc_info" in e) for e in logs] == [
        ("agent step failed", True),
        ("agent step still fails", False),
        ("agent step works again", False),
    ]
