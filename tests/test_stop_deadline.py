"""A stop that cannot outlast its deadline: the agent, with an API server that accepts
connections and never answers (every call it makes hangs until its read timeout), ends within
the deadline of a SIGTERM, saying what was still running; a process whose stop hangs for good
is ended at the deadline."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from edl_agent.runtime.deadline import STOP_DEADLINE_SECONDS
from tests.waiting import wait_until

MARGIN_SECONDS = 2.0  # the interpreter's own exit, a loaded machine


@dataclass
class SilentServer:
    port: int
    held: list[socket.socket]

    def accepted(self) -> int:
        return len(self.held)


@pytest.fixture
def silent_api_server() -> Iterator[SilentServer]:
    """A TCP port that accepts connections and never sends a byte (nor closes them)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, name="silent-api-server")
    thread.start()
    try:
        yield SilentServer(listener.getsockname()[1], held)
    finally:
        done.set()
        thread.join()
        for connection in held:
            connection.close()
        listener.close()


def test_sigterm_ends_the_agent_within_the_deadline_while_its_api_calls_hang(
    tmp_path: Path, silent_api_server: SilentServer
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: x\n"
        f"clusters: [{{name: c, cluster: {{server: 'https://127.0.0.1:{silent_api_server.port}', "
        "insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: x, context: {cluster: c, user: u}}]\n"
    )
    argv = [
        sys.executable, "-m", "edl_agent.cli", "run", "--simulate", "dgx-h100",
        "--kubeconfig", str(kubeconfig), "--metrics-addr", "",
        "--state-dir", str(tmp_path / "state"), "--kubelet-dir", str(tmp_path / "kubelet"),
        "--set", "nvidia.serve=dra", "--set", f"dra.plugins_registry_dir={tmp_path / 'reg'}",
        "--log-format", "json",
    ]  # fmt: skip
    agent = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []

    def read_log() -> None:
        assert agent.stderr is not None
        for line in agent.stderr:
            lines.append(line)

    reader = threading.Thread(target=read_log, name="agent-log")
    reader.start()
    try:
        assert agent.stdout is not None
        assert agent.stdout.readline().startswith("node ")  # serving: the rest starts now
        # Its parts run, and one of them is in a call the server will never answer.
        wait_until(lambda: any('"agent running"' in line for line in lines), timeout=60)
        before = silent_api_server.accepted()
        wait_until(lambda: silent_api_server.accepted() > before, timeout=30)
        agent.send_signal(signal.SIGTERM)
        began = time.monotonic()
        agent.wait(timeout=STOP_DEADLINE_SECONDS + 30)
        took = time.monotonic() - began
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        reader.join()
        for pipe in (agent.stdout, agent.stderr):
            if pipe is not None:
                pipe.close()
    err = "".join(lines)
    assert agent.returncode == 0
    assert took < STOP_DEADLINE_SECONDS + MARGIN_SECONDS, (took, err[-2000:])
    # The forced exit skips the clean-up of --simulate's temporary tree: it is removed first.
    logged = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    [tree] = [e["root"] for e in logged if e.get("event") == "building simulated node"]
    assert any(e.get("event") == "stopping took too long: exiting now" for e in logged)
    assert not Path(tree).exists()


def test_a_stop_that_hangs_for_good_ends_at_the_deadline() -> None:
    script = (
        "import threading, time\n"
        "from edl_agent.runtime.deadline import StopDeadline\n"
        "deadline = StopDeadline(0.5, on_expiry=lambda running: print('running', running))\n"
        "deadline.arm()\n"
        "threading.Event().wait()  # a stop that never ends\n"
    )
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=False
    )
    assert time.monotonic() - began < 0.5 + 10
    assert done.returncode == 0
    assert done.stdout.startswith("running ['MainThread']")


def test_a_disarmed_deadline_ends_nothing() -> None:
    script = (
        "import time\n"
        "from edl_agent.runtime.deadline import StopDeadline\n"
        "deadline = StopDeadline(0.2)\n"
        "deadline.arm()\n"
        "deadline.disarm()\n"
        "time.sleep(0.6)  # past the deadline: still here\n"
        "raise SystemExit(7)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], timeout=30, check=False)
    assert done.returncode == 7
