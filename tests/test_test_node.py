"""scripts/test-node's promises that need no kubelet: one clear line and exit 2 where a kubelet
node cannot run, and an idempotent `down`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "test-node"


def run(args: list[str], path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env={"PATH": path},
        timeout=60,
        check=False,
    )


def test_up_without_unshare_says_so_in_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    result = run(["up", str(tmp_path / "node")], str(empty))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "the unshare command" in lines[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "node").exists()


def test_down_of_nothing_is_fine_and_repeatable(tmp_path: Path) -> None:
    for _ in range(2):
        result = run(["down", str(tmp_path / "never-up")], "/usr/bin:/bin")
        assert result.returncode == 0, result.stderr
        assert "nothing was running" in result.stderr


def test_exit_needs_namespace_and_pod(tmp_path: Path) -> None:
    result = run(["exit", str(tmp_path), "no-slash", "main", "1"], "/usr/bin:/bin")
    assert result.returncode == 2
    assert "NAMESPACE/POD" in result.stderr
