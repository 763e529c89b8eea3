"""The agent starts on a full or read-only disk: its state directory is a tiny tmpfs, mounted in
a private mount namespace of the agent's own (gone with the agent, nothing on the host), full
to its last inode or mounted read-only. The agent registers with kubelet, reports that what it
cannot write is held in memory, and stops cleanly."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kubelet_standin import KubeletStandIn

TIMEOUT = 60.0

pytestmark = pytest.mark.skipif(
    shutil.which("unshare") is None or os.geteuid() != 0,
    reason="needs unshare(1) and root for a private mount namespace",
)


def mount_then_run(state: Path, how: str, agent: list[str]) -> list[str]:
    """A shell line for unshare: a 16 KiB tmpfs with 4 inodes on `state`, made full (`full`)
    or read-only (`read-only`), then the agent in its place."""
    fill = f"(dd if=/dev/zero of={state}/fill bs=4k; mkdir {state}/a {state}/b) 2>/dev/null || true"
    script = [
        f"mount -n -t tmpfs -o size=16k,nr_inodes=4 tmpfs {state}",
        fill,  # no space left, no inode left
        *([f"mount -n -o remount,ro {state}"] if how == "read-only" else []),
        "exec " + shlex.join(agent),
    ]
    return ["unshare", "--mount", "--propagation", "private", "sh", "-ec", "; ".join(script)]


@pytest.mark.parametrize("how", ["full", "read-only"])
def test_the_agent_starts_and_serves_on_a_disk_it_cannot_write(tmp_path: Path, how: str) -> None:
    state = tmp_path / "state"
    state.mkdir()
    kubelet = KubeletStandIn(tmp_path / "kubelet")
    kubelet.start()
    token = tmp_path / "token"
    token.write_text("a-token")
    agent_argv = [
        sys.executable, "-m", "edl_agent.cli", "run", "--simulate", "dgx-h100",
        "--kubelet-dir", str(kubelet.directory), "--metrics-addr", "", "--log-format", "json",
        "--state-dir", str(state),
        "--set", "faults.restarter_address=127.0.0.1:9", "--set", f"faults.token_file={token}",
    ]  # fmt: skip
    agent = subprocess.Popen(
        mount_then_run(state, how, agent_argv),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        kubelet.wait_registered({"nvidia.com/gpu"}, timeout=TIMEOUT)  # served, not exit 2
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=TIMEOUT)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate()
        kubelet.stop()
    assert agent.returncode == 0, err[-3000:]
    assert "faults are kept in memory until it can be" in err
    assert list(state.iterdir()) == []  # the tmpfs went with the agent's namespace
