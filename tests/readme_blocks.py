"""The README's code blocks, as the tests that run or check them read them.

Each fenced block says what it is in its info string: `sh` (commands) and `console` (a
transcript, `$ ` before each command) are commands; `yaml`, `json` and `text` are not. A command
block is run by tests/test_readme_commands.py unless the HTML comment on the line right above
its fence marks it:

    <!-- cluster -->        needs a Kubernetes cluster: checked, and run where the cluster tests
                            can (tests/cluster/test_readme_cluster_commands.py)
    <!-- setup -->          sets up this machine (a virtual environment, the test suite itself):
                            checked, not run
    <!-- test-node -->      a test node on this machine (scripts/test-node; root): checked here,
                            and the blocks run in order as one script in the kubelet tier
                            (tests/cluster/test_readme_test_node.py)
    <!-- serves: TEXT -->   one command that runs until stopped: started, and once TEXT is in its
                            output stopped with Ctrl-C (SIGINT), after which it must exit 0
    <!-- expect: TEXT -->   run; it must exit 0 and print TEXT
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil

README = Path(__file__).resolve().parents[1] / "README.md"
COMMANDS = frozenset({"sh", "console"})
NOT_COMMANDS = frozenset({"yaml", "json", "text"})
MARKS = ("cluster", "setup", "test-node", "serves", "expect")
_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<info>.*)$")
_MARK = re.compile(r"^<!-- (?P<kind>[a-z-]+)(?:: (?P<text>.+?))? -->$")


@dataclass(frozen=True)
class Block:
    line: int
    """The line of the opening fence, counted from 1."""
    indent: str
    info: str
    body: str
    mark: str | None
    """The kind of the marker comment above the fence (`cluster`, ...), None without one."""
    mark_text: str | None
    mark_line: str | None
    """The line above the fence when it is an HTML comment, as written."""

    @property
    def is_commands(self) -> bool:
        return self.info in COMMANDS

    @property
    def name(self) -> str:
        first = next((line for line in self.body.splitlines() if line.strip()), "")
        return f"line {self.line}: {first.strip()[:60]}"

    def commands(self) -> str:
        """The shell text of the block (a transcript's `$ ` lines only)."""
        if self.info == "console":
            lines = (line[2:] for line in self.body.splitlines() if line.startswith("$ "))
            return "\n".join(lines) + "\n"
        return self.body


def blocks(text: str | None = None) -> list[Block]:
    """Every fenced block of the README, in order."""
    lines = (README.read_text(encoding="utf-8") if text is None else text).splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        indent, start = fence.group("indent"), i
        end = next(j for j in range(i + 1, len(lines)) if lines[j] == f"{indent}```")
        body = "\n".join(line.removeprefix(indent) for line in lines[i + 1 : end]) + "\n"
        above = lines[start - 1] if start > 0 else ""
        mark = _MARK.match(above)
        found.append(
            Block(
                line=start + 1,
                indent=indent,
                info=fence.group("info").strip(),
                body=body,
                mark=mark.group("kind") if mark else None,
                mark_text=mark.group("text") if mark else None,
                mark_line=above if above.startswith("<!--") else None,
            )
        )
        i = end + 1
    return found


def command_blocks(mark: str | None) -> list[Block]:
    """The command blocks with this marker (None: unmarked)."""
    return [b for b in blocks() if b.is_commands and b.mark == mark]


def repository_paths(block: Block) -> list[str]:
    """The paths of this repository a block names (`deploy/...`, `scripts/...`)."""
    words = re.findall(r"(?<![\w/.-])((?:deploy|scripts|tests|bench)/[\w./-]*[\w])", block.body)
    return sorted(set(words))


def end_group(shell: subprocess.Popen[str]) -> list[str]:
    """What still runs in the block's process group (its shell's pid, start_new_session) once
    the shell has ended, killed; a shell that has not ended is killed with it."""
    if shell.poll() is None:
        os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()
    left = []
    for process in psutil.process_iter(["pid", "name"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(process.pid) == shell.pid:
                left.append(f"{process.pid} {process.info['name']}")
    if left:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
    return left
