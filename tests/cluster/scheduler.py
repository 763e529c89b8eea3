"""Processes for end-to-end tests: a real kube-scheduler against the test control plane, and the
small process helpers the e2e tests use for it and for `edl-agent` commands.

The session's control plane (scripts/testcluster.py) runs no scheduler, so that the other cluster
tests control every binding themselves. An end-to-end test that needs pods placed the way a
cluster places them starts one here, with the control plane's admin kubeconfig, and stops it
when it is done. The binary comes from `k8sbinaries.find("kube-scheduler")` (built by
`scripts/k8s-binaries`); when it is missing the test fails and says so, it never skips.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import k8sbinaries

LOOPBACK = "127.0.0.1"
PR_SET_PDEATHSIG = 1
OK = 200


class ProcessError(RuntimeError):
    """A test process could not be started, or died; the message says why (with its log)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> Callable[[], None]:
    """A preexec_fn: SIGKILL the child when the test process dies, so nothing outlives pytest."""
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "    (no log)"
    return "\n".join(f"    {line}" for line in text[-lines:])


@dataclass
class Process:
    """A child process with its output in `log` (stdout and stderr, or stderr only when
    `stdout` is given); `stop()` sends SIGTERM to its group, waits, then SIGKILLs."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    stdout: Path | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            raise ProcessError(
                f"{self.name} exited with {self.popen.returncode}; its log {self.log}:\n"
                f"{tail(self.log)}"
            )

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM (the whole process group), wait up to `timeout`, then SIGKILL; exit code."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        # Children of the group (none expected) must not outlive it either.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        return int(self.popen.returncode)


def spawn(
    name: str,
    argv: Sequence[str],
    directory: Path,
    *,
    env: Mapping[str, str] | None = None,
    separate_stdout: bool = False,
) -> Process:
    """Start `argv` in its own session (stop() signals the group), output under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / f"{name}.log"
    out_path = directory / f"{name}.stdout" if separate_stdout else None
    with contextlib.ExitStack() as files:
        err = files.enter_context(log.open("ab"))
        out = files.enter_context(out_path.open("ab")) if out_path is not None else err
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err if out_path is not None else subprocess.STDOUT,
            cwd=directory,
            env=dict(os.environ if env is None else env),
            start_new_session=True,
            preexec_fn=_die_with_parent(),  # noqa: PLW1509 - prctl only, no locks taken
        )
    return Process(name, popen, log, out_path)


# --- kube-scheduler -----------------------------------------------------------------------


def scheduler_binary() -> Path:
    path = k8sbinaries.find("kube-scheduler")
    if path is None:
        raise ProcessError(
            f"kube-scheduler {k8sbinaries.K8S_VERSION} is not in {k8sbinaries.bin_dir()}: run "
            "`scripts/k8s-binaries` (it builds kube-scheduler from the Go module proxy), or "
            "deselect the end-to-end tests with -m 'not cluster'"
        )
    return path


def _healthz(port: int) -> int | None:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the scheduler's self-signed serving certificate
    try:
        with urllib.request.urlopen(
            f"https://{LOOPBACK}:{port}/healthz", context=context, timeout=2
        ) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)
    except (OSError, urllib.error.URLError):
        return None


def start_scheduler(kubeconfig: Path, directory: Path, *, timeout: float = 60.0) -> Process:
    """kube-scheduler for the control plane of `kubeconfig` (admin), healthy within `timeout`.

    No leader election (one scheduler, and no Lease to leave behind); serving (healthz) on a free
    loopback port with a self-signed certificate written under `directory`; the admin kubeconfig
    also for delegated authentication and authorization of its own endpoints.
    """
    binary = scheduler_binary()
    port = free_port()
    argv = [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--leader-elect=false",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={port}",
        f"--cert-dir={directory / 'certs'}",
        "--v=2",
    ]
    process = spawn("kube-scheduler", argv, directory)
    wait_started(process, lambda: _healthz(port) == OK, timeout)
    return process


def wait_started(process: Process, ready: Callable[[], bool], timeout: float) -> None:
    """Until `ready()`; ProcessError with the end of its log, the process stopped, when it exits
    first or is not ready within `timeout`."""
    deadline = time.monotonic() + timeout
    while not ready():
        if not process.alive() or time.monotonic() > deadline:
            code = process.popen.poll()
            process.stop()
            why = f"exited with {code}" if code is not None else f"not ready in {timeout:.0f}s"
            raise ProcessError(f"{process.name} {why}; its log {process.log}:\n{tail(process.log)}")
        time.sleep(0.2)
