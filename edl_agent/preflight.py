"""The paths a command will use, checked once before it starts.

The agent's loops retry what fails, which is right for a kubelet that restarts or a directory
that comes back, and wrong for a setting that can never work: a `--kubelet-dir` naming a regular
file would fail four times a second forever. What no retry can fix is refused here, as one line
naming the setting (the command exits 2).
"""

from __future__ import annotations

import os
from pathlib import Path

from edl_agent.config import Settings
from edl_agent.errors import UsageError

UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL


def check_host_root(host_root: str) -> None:
    path = Path(host_root)
    try:
        is_dir = path.is_dir()
    except OSError as exc:
        raise UsageError(f"host root {host_root}: {exc.strerror or exc}") from None
    if not is_dir:
        raise UsageError(f"host root {host_root}: not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise UsageError(f"host root {host_root}: not readable")


def check_run_paths(settings: Settings) -> None:
    """Everything `run` writes or listens under can be used: the kubelet directory exists (it
    is created, as the plugin manager would) and is writable; nothing on the way to the
    pod-resources socket, the state directory or the features file is a regular file."""
    from edl_agent.plugin.server import socket_dir_problem

    kubelet_dir = Path(settings.plugin.kubelet_dir)
    problem = socket_dir_problem(kubelet_dir)
    if problem is not None:
        raise UsageError(problem)
    ensure_directory("plugin.kubelet_dir", kubelet_dir)
    if settings.pod_resources_socket:
        socket = Path(settings.pod_resources_socket)
        if len(os.fsencode(socket)) > UNIX_PATH_MAX:
            msg = f"pod_resources_socket {socket}: longer than a unix socket path may be"
            raise UsageError(msg)
        _not_blocked("pod_resources_socket", socket, leaf_is_dir=False)
    if settings.faults.state_dir:
        _not_blocked("faults.state_dir", Path(settings.faults.state_dir), leaf_is_dir=True)
    if settings.node.labels == "features_file":
        _not_blocked("node.features_file", Path(settings.node.features_file), leaf_is_dir=False)
    if settings.faults.restarter_address and settings.faults.ca_file:
        _readable_file("faults.ca_file", Path(settings.faults.ca_file))


def ensure_directory(key: str, path: Path) -> None:
    """Create `path` (and its parents) unless it exists; UsageError when it cannot be a
    directory we may write in."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"{key} {path}: not a directory") from None
    except OSError as exc:
        raise UsageError(f"{key} {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{key} {path}: not writable")


def _not_blocked(key: str, path: Path, *, leaf_is_dir: bool) -> None:
    """UsageError when `path` can never be created: a parent on the way is a regular file (or
    `path` itself is the wrong kind). Missing parts are fine: they may appear (kubelet makes its
    directories when it starts)."""
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except OSError:
        return  # a directory we may not search: the path cannot be judged from here
    if exists and leaf_is_dir and not is_dir:
        raise UsageError(f"{key} {path}: not a directory")
    if exists and not leaf_is_dir and is_dir:
        raise UsageError(f"{key} {path}: is a directory")
    for parent in path.parents:
        try:
            if parent.is_dir():
                return
            if parent.exists():
                raise UsageError(f"{key} {path}: {parent} is not a directory")
        except OSError:
            return


def _readable_file(key: str, path: Path) -> None:
    try:
        with path.open("rb"):
            pass
    except IsADirectoryError:
        raise UsageError(f"{key} {path}: is a directory") from None
    except OSError as exc:
        raise UsageError(f"{key} {path}: {exc.strerror or exc}") from None
