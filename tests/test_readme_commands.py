"""Every command the README gives is tested: the blocks that need no cluster are run here, as
written, each in a scratch directory of its own; the others must say what they need
(tests/readme_blocks.py lists the markers), and are checked for what can be checked without a
cluster. A command block nobody marked and that does not run fails here, so no untested command
joins the README unnoticed."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.readme_blocks import (
    MARKS,
    NOT_COMMANDS,
    README,
    Block,
    blocks,
    command_blocks,
    end_group,
    repository_paths,
)
from tests.waiting import wait_for

REPO = README.parent
VENV_BIN = Path(sys.executable).parent
BLOCK_TIMEOUT = 100.0
# The block's own exit status stays its result; its background jobs are asked to stop (SIGTERM)
# and waited for.
STOP_JOBS = "status=$?; kill $(jobs -p) 2>/dev/null || true; wait || true; exit $status"


def ids(block: Block) -> str:
    return block.name


@pytest.fixture
def scratch() -> Iterator[tuple[Path, dict[str, str]]]:
    """A working directory where `.venv` is this test's environment (the README runs
    `.venv/bin/edl-agent` from the repository's root), and an environment with nothing of the
    shell running the tests: no kubeconfig, no `EDL_*` settings, HOME and TMPDIR in scratch.

    Two settings differ from the README's defaults, for running beside other tests and agents on
    one machine: metrics on a free port of 127.0.0.1 (`:9400` may be taken), and short NVML waits
    (a stop ends sooner). The fake NVML library is taken from (and compiled into) the cache the
    other tests use."""
    # Short: the simulated node's kubelet sockets live under it (unix paths: 107 bytes at most).
    base = Path(tempfile.mkdtemp(prefix="edl-readme-"))
    work, home, tmp = base / "w", base / "h", base / "t"
    for folder in (work, home, tmp):
        folder.mkdir()
    (work / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    cache = os.environ.get("EDL_CACHE_DIR") or str(Path.home() / ".cache" / "edl-agent")
    env = {
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(home),
        "TMPDIR": str(tmp),
        "LANG": "C.UTF-8",
        "EDL_CACHE_DIR": cache,
        "EDL_METRICS_ADDR": "127.0.0.1:0",
        "EDL_HEALTH__NVML_WAIT_SECONDS": "0.5",
    }
    try:
        yield work, env
        assert not [p.name for p in tmp.iterdir()], "a command left files in TMPDIR"
    finally:
        shutil.rmtree(base)


def test_every_block_says_what_it_is() -> None:
    """A block without a known info string, or a marker nobody knows, is refused: the other
    tests could not tell whether to run it."""
    unknown = [b.name for b in blocks() if not b.is_commands and b.info not in NOT_COMMANDS]
    assert not unknown, f"say sh, console, yaml, json or text after the fence: {unknown}"
    bad = [b.name for b in blocks() if b.mark_line is not None and b.mark not in MARKS]
    assert not bad, f"unknown markers (tests/readme_blocks.py lists them): {bad}"
    marked = [b.name for b in blocks() if b.mark is not None and not b.is_commands]
    assert not marked, f"markers belong to command blocks only: {marked}"


def test_only_marked_blocks_are_transcripts() -> None:
    """A transcript (`console`) shows output that needs something this test cannot give it."""
    unmarked = [b.name for b in command_blocks(None) if b.info == "console"]
    assert not unmarked, f"mark these transcripts (<!-- cluster -->): {unmarked}"


def test_there_are_blocks_of_each_kind() -> None:
    """The parser finds what the README holds (a parser that found nothing would pass the rest)."""
    kinds = {b.mark for b in blocks() if b.is_commands}
    assert kinds >= {None, "cluster", "setup", "test-node", "serves", "expect"}


@pytest.mark.parametrize("block", command_blocks(None) + command_blocks("expect"), ids=ids)
def test_a_command_block_runs(block: Block, scratch: tuple[Path, dict[str, str]]) -> None:
    work, env = scratch
    script = work.parent / "block.sh"
    # Whatever a block starts in the background ends with it: asked to stop, then waited for.
    script.write_text(f"set -euo pipefail\ntrap {shlex.quote(STOP_JOBS)} EXIT\n{block.commands()}")
    shell = subprocess.Popen(
        ["bash", str(script)],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = shell.communicate(timeout=BLOCK_TIMEOUT)
    finally:
        left = end_group(shell)
    output = stdout + stderr
    assert shell.returncode == 0, f"{block.name} exited {shell.returncode}:\n{output[-3000:]}"
    if block.mark == "expect":
        assert block.mark_text is not None
        assert block.mark_text in output, f"{block.name} did not print {block.mark_text!r}"
    assert not left, f"{block.name} left processes running: {left}"


@pytest.mark.parametrize("block", command_blocks("serves"), ids=ids)
def test_a_serving_command_answers_and_stops_on_ctrl_c(
    block: Block, scratch: tuple[Path, dict[str, str]]
) -> None:
    work, env = scratch
    [line] = [line for line in block.commands().splitlines() if line.strip()]
    assert block.mark_text is not None
    log = work.parent / "output.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            shlex.split(line), cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:

        class Running:
            @staticmethod
            def check_alive() -> None:
                if process.poll() is not None:
                    text = log.read_text()[-3000:]
                    raise AssertionError(f"exited {process.returncode}:\n{text}")

        wait_for(
            f"{block.mark_text!r} in the output of {line}",
            log.read_text,
            lambda text: block.mark_text in text,
            timeout=BLOCK_TIMEOUT,
            alive=Running(),
        )
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    "block",
    command_blocks("cluster") + command_blocks("setup") + command_blocks("test-node"),
    ids=ids,
)
def test_a_block_not_run_here_parses_and_names_paths_that_exist(block: Block) -> None:
    """What cannot run here is at least valid shell, and names files this repository has."""
    parsed = subprocess.run(
        ["bash", "-n"], input=block.commands(), capture_output=True, text=True, check=False
    )
    assert parsed.returncode == 0, f"{block.name}: {parsed.stderr}"
    missing = [p for p in repository_paths(block) if not (REPO / p).exists()]
    assert not missing, f"{block.name} names paths the repository lacks: {missing}"
