"""Every file and tool the agent reads is found under a host root: `/` on a node, `/host` in a
DaemonSet pod, a directory tree for a simulated node. Discovery code only ever sees host paths."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

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
)


class ToolError(Exception):
    """A vendor tool exists but could not be run or failed; the message says which and why."""


@dataclass(frozen=True)
class HostRoot:
    root: Path

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
        """Run a vendor tool found by `which` and return its stdout; failures raise ToolError."""
        try:
            done = subprocess.run(
                [str(tool), *args],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            msg = f"{tool.name} {' '.join(args)} timed out after {timeout:g}s"
            raise ToolError(msg) from exc
        except OSError as exc:
            msg = f"{tool.name} {' '.join(args)} could not run: {exc.strerror or exc}"
            raise ToolError(msg) from exc
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip().splitlines()
            tail = detail[-1] if detail else "no output"
            msg = f"{tool.name} {' '.join(args)} exited {done.returncode}: {tail}"
            raise ToolError(msg)
        return done.stdout

    def read_tool(
        self,
        tool: str | Path,
        args: Sequence[str],
        parse: Callable[[str], T],
        *,
        timeout: float = 10.0,
    ) -> T:
        """Run a vendor tool (a name looked up with `which`, or its path) and parse its output.
        A missing tool, a failed run, or output that `parse` rejects (ValueError) all raise one
        ToolError whose message names the tool, its arguments and the problem."""
        path = self.which(tool) if isinstance(tool, str) else tool
        if path is None:
            msg = f"{tool} not found under the host root"
            raise ToolError(msg)
        output = self.run_tool(path, args, timeout=timeout)
        try:
            return parse(output)
        except ValueError as exc:
            msg = f"{path.name} {' '.join(args)}: unexpected output: {exc}"
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
