"""One agent per node: a second `edl-agent run` on the same kubelet directory, whatever its own
state directory, exits 2 with one line naming the first, and touches nothing of the first's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from edl_agent.node_lock import LOCK_NAME, AnotherAgent, one_agent_per_node
from tests.kubelet_standin import KubeletStandIn

TIMEOUT = 60.0


def agent_argv(kubelet_dir: Path, state: Path) -> list[str]:
    return [
        sys.executable, "-m", "edl_agent.cli", "run", "--simulate", "dgx-h100",
        "--kubelet-dir", str(kubelet_dir), "--metrics-addr", "", "--state-dir", str(state),
    ]  # fmt: skip


def sockets(directory: Path) -> dict[str, tuple[int, int]]:
    """Our sockets in kubelet's directory, each with what tells a re-made one apart."""
    found = {}
    for path in directory.glob("edl-*.sock"):
        stat = path.stat()
        found[path.name] = (stat.st_ino, stat.st_ctime_ns)
    return found


def test_a_second_agent_exits_2_naming_the_first_and_touches_nothing(tmp_path: Path) -> None:
    kubelet = KubeletStandIn(tmp_path / "kubelet")
    kubelet.start()
    first = subprocess.Popen(
        agent_argv(kubelet.directory, tmp_path / "state-1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        kubelet.wait_registered({"nvidia.com/gpu"}, timeout=TIMEOUT)
        before = sockets(kubelet.directory)
        registrations = len(kubelet.registrations)

        second = subprocess.run(
            agent_argv(kubelet.directory, tmp_path / "state-2"),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )

        assert second.returncode == 2, second.stderr
        # One line says why (a simulated node logs its building before it).
        (line,) = [x for x in second.stderr.splitlines() if x.startswith("edl-agent: error:")]
        assert f"pid {first.pid}" in line
        assert "one agent per node" in line
        assert before
        assert sockets(kubelet.directory) == before
        assert len(kubelet.registrations) == registrations
        assert not (tmp_path / "state-2").exists()  # refused before it made anything
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=30)
        kubelet.stop()
    assert first.returncode == 0
    assert (kubelet.directory / LOCK_NAME).exists()  # kept, for the next agent to lock


def test_the_lock_is_free_again_once_its_holder_is_gone(tmp_path: Path) -> None:
    with (
        one_agent_per_node(tmp_path),
        pytest.raises(AnotherAgent, match=f"pid {os.getpid()}"),
        one_agent_per_node(tmp_path),
    ):
        pass
    with one_agent_per_node(tmp_path):  # released on exit, even with the file left
        pass
