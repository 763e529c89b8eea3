"""Stopping on SIGTERM/SIGINT: the handler neither blocks nor re-enters, and any burst of signals
stops a real agent once and promptly."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from edl_agent.runtime.signals import stop_on_signals
from tests.waiting import wait_until

ROUNDS = 8
BURST = 5
STOP_SECONDS = 10.0


def test_the_handler_returns_at_once_while_the_stop_itself_is_held() -> None:
    """What deadlocked before: a second signal arriving while the first handler was inside the
    stop. Here the stop is held by this very thread; the handler (called directly, and by real
    signals) must still return at once, and the stop happens once it is free."""
    stopped = threading.Event()
    calls: list[int] = []
    held = threading.Lock()

    def stop() -> None:
        with held:
            calls.append(1)
            stopped.set()

    with stop_on_signals(stop) as handler:
        with held:
            handler(signal.SIGTERM, None)
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
                os.kill(os.getpid(), signum)
            assert not stopped.is_set()
        wait_until(stopped.is_set, what="the stop after the lock is free")
    assert calls == [1]


def test_handlers_are_put_back_afterwards() -> None:
    before = signal.getsignal(signal.SIGINT)
    with stop_on_signals(lambda: None):
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before


def test_bursts_of_signals_stop_a_real_agent_once_and_promptly(tmp_path: Path) -> None:
    rng = random.Random(20261126)  # noqa: S311 - a reproducible rhythm, not a secret
    for round_ in range(ROUNDS):
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "edl_agent.cli",
                "run",
                "--simulate",
                "dgx-h100",
                "--metrics-addr",
                "127.0.0.1:0",
                "--state-dir",
                str(tmp_path / f"state-{round_}"),
                "--log-level",
                "warning",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert agent.stdout is not None
            assert agent.stdout.readline().startswith("node ")  # kubelet served: running
            if round_ % 2:
                time.sleep(rng.uniform(0, 0.3))  # a random moment of the start-up
            for _ in range(BURST):  # back to back: most land while the first is handled
                agent.send_signal(rng.choice((signal.SIGTERM, signal.SIGINT)))
                if rng.random() < 0.3:
                    time.sleep(rng.uniform(0, 0.001))
            began = time.monotonic()
            code = agent.wait(timeout=STOP_SECONDS)
            print(f"round {round_}: exit {code} {time.monotonic() - began:.2f}s after the burst")
            assert code == 0
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
            if agent.stdout is not None:
                agent.stdout.close()
