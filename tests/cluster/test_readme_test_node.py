"""The README's quick start on a test node (its `<!-- test-node -->` blocks), run as written, in
order, as one bash script: `scripts/test-node up`, an agent on a simulated DGX H100, the quick
start's pod and policy, an XID on the pod's GPU, and what shows it (the pod's
allocatedResourcesStatus, the node's condition and Event), then `scripts/test-node down`. Only
the directory differs (a fresh short one under /tmp instead of /tmp/edl-node), and the agent's
metrics port (any free one: another agent may hold 9400 on a shared machine)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import testnode

from tests.readme_blocks import README, command_blocks, end_group

pytestmark = [pytest.mark.kubelet, pytest.mark.timeout(400)]

REPO = README.parent
WRITTEN_DIR = "/tmp/edl-node"


def script(directory: Path) -> str:
    blocks = command_blocks("test-node")
    assert len(blocks) >= 2, "the quick start's test-node blocks are gone"
    text = "\n".join(block.commands() for block in blocks)
    assert WRITTEN_DIR in text
    text = text.replace(WRITTEN_DIR, str(directory))
    return text.replace("--metrics-addr 127.0.0.1:9400", "--metrics-addr 127.0.0.1:0")


def test_the_quick_start_on_a_test_node_runs_as_written() -> None:
    problem = testnode.preflight()
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    directory = Path(tempfile.mkdtemp(prefix="edl-rn-", dir="/tmp"))
    venv_bin = str(Path(sys.executable).parent)
    home = Path.home()
    env = {
        **os.environ,
        # The README's PATH line names $PWD/.venv/bin; this test's interpreter may live elsewhere.
        "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
        # kubectl's discovery cache goes under $HOME: the scratch directory's, not the machine's.
        "HOME": str(directory / "home"),
        "EDL_CACHE_DIR": os.environ.get("EDL_CACHE_DIR", str(home / ".cache" / "edl-agent")),
        "GOPATH": os.environ.get("GOPATH", str(home / "go")),
        "GOCACHE": os.environ.get("GOCACHE", str(home / ".cache" / "go-build")),
    }
    shell = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", script(directory)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = shell.communicate(timeout=300)
    finally:
        left_in_group = end_group(shell)
        left = testnode.down(directory) if (directory / "kubeconfig").exists() else []
        agent_log = directory / "agent.log"
        log_tail = agent_log.read_text(errors="replace")[-3000:] if agent_log.exists() else ""
        shutil.rmtree(directory, ignore_errors=True)
    assert shell.returncode == 0, f"the blocks failed:\n{output}\nagent log:\n{log_tail}"
    assert not left, f"processes the blocks' `down` did not stop: {left}"
    assert not left_in_group, f"processes the blocks started and left running: {left_in_group}"
    print(output)
    assert "AcceleratorUnhealthy" in output, output
    assert "XID79" in output or "XID 79" in output, output
