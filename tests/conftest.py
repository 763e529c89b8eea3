"""Shared test hygiene."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import grpc.aio
import psutil
import pytest
import structlog

# How long a test's threads and processes get to end after its fixtures are torn down.
LEFTOVER_GRACE_SECONDS = 5.0
# Processes a session fixture owns, asked at each check: a test may restart one of them (the
# control plane's kube-apiserver) and its new process still belongs to the session.
SESSION_PROCESSES = pytest.StashKey[list[Callable[[], Iterable[int]]]]()


def session_owns(config: pytest.Config, pids: Callable[[], Iterable[int]]) -> None:
    """Register what a session fixture runs, so the per-test check does not count it."""
    config.stash.setdefault(SESSION_PROCESSES, []).append(pids)


@pytest.fixture(autouse=True, scope="session")
def _no_ambient_kubeconfig() -> Iterator[None]:
    """$KUBECONFIG is a credential source for the agents and restarters tests start; tests name
    their kubeconfig explicitly and must never reach the cluster of the shell running them."""
    saved = os.environ.pop("KUBECONFIG", None)
    yield
    if saved is not None:
        os.environ["KUBECONFIG"] = saved


@pytest.fixture(autouse=True, scope="session")
def _agent_defaults_for_tests(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Agents tests start without naming a state directory keep their quarantine and outbox in
    the session's scratch folder, never in /var/lib/edl-agent (nor each other's, across runs);
    and their NVML waits are short, so each agent a test stops ends within half a second (the
    5 s default only makes the agent's own shutdown slower)."""
    values = {
        "EDL_FAULTS__STATE_DIR": str(tmp_path_factory.mktemp("agent-state")),
        "EDL_HEALTH__NVML_WAIT_SECONDS": "0.5",
    }
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True, scope="session")
def _grpc_asyncio_poller() -> Iterator[None]:
    """grpc's asyncio server polls through one thread per process, started by the first server
    and kept for the process's life. Started here, before any test, it is nobody's leftover."""
    grpc.aio.init_grpc_aio()
    yield
    grpc.aio.shutdown_grpc_aio()


@pytest.fixture(autouse=True)
def _fresh_logging() -> Iterator[None]:
    """Commands configure structlog globally; give every test the library defaults back."""
    yield
    structlog.reset_defaults()


@pytest.fixture(autouse=True)
def _nothing_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that leaves a thread or a child process of its own running fails: every thread has
    an owner that stops and joins it, every process is ended by whoever started it. What session
    fixtures run (a control plane) started before the test and does not count."""
    threads_before = set(threading.enumerate())
    me = psutil.Process()
    children_before = {p.pid for p in me.children(recursive=True)}
    yield
    deadline = time.monotonic() + LEFTOVER_GRACE_SECONDS
    threads = [t for t in threading.enumerate() if t not in threads_before]
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    left_threads = sorted(t.name for t in threads if t.is_alive())
    owned = {pid for pids in request.config.stash.get(SESSION_PROCESSES, []) for pid in pids()}
    children = [p for p in me.children(recursive=True) if p.pid not in children_before | owned]
    _gone, alive = psutil.wait_procs(children, timeout=max(0.0, deadline - time.monotonic()))
    left_processes = sorted(f"{p.pid} {_name(p)}" for p in alive)
    assert not left_threads, f"threads left running: {left_threads}"
    assert not left_processes, f"processes left running: {left_processes}"


def _name(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline()[:3])
    except psutil.Error:
        return "?"
