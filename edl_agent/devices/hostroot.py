"""Every file and tool the agent reads is found under a host root: `/` on a node, `/host` in a
DaemonSet pod, a directory tree for a simulated node. Discovery code only ever sees host paths."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar, cast

from edl_agent.devices.tool_runs import TOOL_RUNS

T = TypeVar("T")

# Where vendor command-line tools live on the nodes we support, in search order.
TOOL_DIRS = (
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
    "/usr/local/Ascend/driver/tools",
    "/usr/local/xpu/bin",
    "/opt/hyhal/bin",
    "/opt/dtk/bin",  # DTK's rocm-smi on Hygon nodes without hy-smi
    "/opt/rocm/bin",
)


# A vendor tool's output is a few KiB per device; more than this is a broken tool, and reading
# it all would hold the agent's memory for good.
MAX_TOOL_OUTPUT = 16 << 20
MAX_TOOL_ERRORS = 64 << 10
_CHUNK = 1 << 16


class ToolError(Exception):
    """A vendor tool exists but could not be run or failed; the message says which and why."""


@dataclass(frozen=True)
class HostRoot:
    root: Path
    tool_timeout: float = 10.0
    """How long a vendor tool may run when the caller names no timeout."""

    @classmethod
    def at(cls, root: str | os.PathLike[str]) -> HostRoot:
        return cls(Path(root).resolve())

    def path(self, host_path: str) -> Path:
        """The local path of `host_path` (absolute, as on the host)."""
        if not host_path.startswith("/"):
            msg = f"host paths are absolute, got {host_path!r}"
            raise ValueError(msg)
        return self.root / host_path.lstrip("/")

    def exists(self, host_path: str) -> bool:
        # os.path rather than pathlib: Allocate asks this for every device node it hands out.
        return os.path.exists(os.path.join(self.root, host_path.lstrip("/")))  # noqa: PTH110, PTH118

    def read_text(self, host_path: str) -> str:
        return self.path(host_path).read_text(encoding="utf-8", errors="replace")

    def read_optional(self, host_path: str) -> str | None:
        """The file's stripped text, or None when it is missing or unreadable."""
        try:
            return self.read_text(host_path).strip()
        except OSError:
            return None

    def pci_numa_node(self, bus_id: str | None) -> int | None:
        """The NUMA node sysfs reports for a PCI device (`0000:18:00.0`), or None."""
        if bus_id is None:
            return None
        return parse_numa_node(self.read_optional(f"/sys/bus/pci/devices/{bus_id}/numa_node"))

    def glob(self, host_dir: str, pattern: str) -> list[str]:
        """Host paths in `host_dir` matching `pattern`, in natural order (nvidia2, nvidia10)."""
        local = self.path(host_dir)
        if not local.is_dir():
            return []
        names = [p.name for p in local.glob(pattern)]
        return [f"{host_dir.rstrip('/')}/{name}" for name in sorted(names, key=natural_key)]

    def which(self, tool: str) -> Path | None:
        """The local path of an executable vendor tool under the root, or None."""
        for directory in TOOL_DIRS:
            candidate = self.path(f"{directory}/{tool}")
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
        return None

    def run_tool(self, tool: Path, args: Sequence[str], *, timeout: float = 10.0) -> str:
        """Run a vendor tool found by `which` and return its stdout; failures raise ToolError.

        Output is bounded (`MAX_TOOL_OUTPUT`; a tool printing more is killed) and decoded as
        UTF-8 with undecodable bytes replaced, so a localised tool never raises here. The tool
        runs in a session of its own: on a timeout or an overflow its whole process group is
        killed and reaped, so nothing it started is left behind."""
        command = f"{tool.name} {' '.join(args)}".strip()
        started = time.monotonic()
        try:
            return self._run_tool(tool, args, command, timeout)
        finally:
            TOOL_RUNS.record(tool.name, time.monotonic() - started)

    def _run_tool(self, tool: Path, args: Sequence[str], command: str, timeout: float) -> str:
        try:
            process = subprocess.Popen(
                [str(tool), *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            msg = f"{command} could not run: {exc.strerror or exc}"
            raise ToolError(msg) from exc
        try:
            out, err, problem = _collect(process, timeout)
        finally:
            _end(process)
        if problem == "timeout":
            msg = f"{command} timed out after {timeout:g}s"
            raise ToolError(msg)
        if problem == "overflow":
            msg = f"{command} printed more than {MAX_TOOL_OUTPUT >> 20} MiB: stopped"
            raise ToolError(msg)
        stdout = out.decode("utf-8", errors="replace")
        if process.returncode != 0:
            detail = (err.decode("utf-8", errors="replace") or stdout).strip().splitlines()
            tail = detail[-1][:200] if detail else "no output"
            msg = f"{command} exited {process.returncode}: {tail}"
            raise ToolError(msg)
        return stdout

    def read_tool(
        self,
        tool: str | Path,
        args: Sequence[str],
        parse: Callable[[str], T],
        *,
        timeout: float | None = None,
    ) -> T:
        """Run a vendor tool (a name looked up with `which`, or its path) and parse its output.
        A missing tool, a failed run, or output that `parse` rejects (ValueError) all raise one
        ToolError whose message names the tool, its arguments and the problem."""
        path = self.which(tool) if isinstance(tool, str) else tool
        if path is None:
            msg = f"{tool} not found under the host root"
            raise ToolError(msg)
        output = self.run_tool(path, args, timeout=timeout or self.tool_timeout)
        try:
            return parse(output)
        except Exception as exc:  # any parser failure is the tool's output, never a crash
            reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            msg = f"{path.name} {' '.join(args)}: unexpected output: {reason}"[:300]
            raise ToolError(msg) from None


def parse_numa_node(text: str | None) -> int | None:
    """A sysfs `numa_node` value; -1 (the platform does not say) and garbage give None."""
    if text is None or not text.strip().lstrip("-").isdigit():
        return None
    node = int(text)
    return node if node >= 0 else None


def natural_key(name: str) -> tuple[str, int, str]:
    """Sort key that orders `card2` before `card10`."""
    stem = name.rstrip("0123456789")
    digits = name[len(stem) :]
    return (stem, int(digits) if digits else -1, name)


def _collect(process: subprocess.Popen[bytes], timeout: float) -> tuple[bytes, bytes, str | None]:
    """stdout and stderr of `process` until both end, up to their bounds and `timeout`; the
    third value says why reading stopped early ("timeout", "overflow") or is None."""
    stdout = cast("IO[bytes]", process.stdout).fileno()  # both are PIPEs: never None
    stderr = cast("IO[bytes]", process.stderr).fileno()
    limits = {stdout: MAX_TOOL_OUTPUT, stderr: MAX_TOOL_ERRORS}
    chunks: dict[int, list[bytes]] = {fd: [] for fd in limits}
    sizes = dict.fromkeys(limits, 0)
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        for fd in limits:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return b"", b"", "timeout"
            for key, _ in selector.select(left):
                data = os.read(key.fd, _CHUNK)
                if not data:
                    selector.unregister(key.fd)
                    continue
                sizes[key.fd] += len(data)
                if sizes[key.fd] > limits[key.fd]:
                    if key.fd == stdout:
                        return b"", b"", "overflow"
                    continue  # stderr past its bound: keep reading, stop keeping
                chunks[key.fd].append(data)
    try:
        process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return b"", b"", "timeout"
    return b"".join(chunks[stdout]), b"".join(chunks[stderr]), None


def _end(process: subprocess.Popen[bytes]) -> None:
    """Kill the tool's process group if it still runs, reap it, close its pipes."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()
