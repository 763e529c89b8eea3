"""`edl-agent simulate list | build | record | replay`: simulated nodes from the shipped profiles
or from recordings of real nodes. (`record` reads a node as the other node commands do, so its
handler stays with them in the top-level cli; `inject` is `sim/inject_cli.py`.)"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from edl_agent import log
from edl_agent.errors import UsageError
from edl_agent.sim import inject_cli

DESCRIPTION = (
    "Simulated nodes are directory trees with device files, sysfs attributes, vendor-tool "
    "stand-ins and a fake libnvidia-ml.so.1 (compiled with gcc) that serve a profile's (or a "
    "recorded real node's) hardware to the same discovery code that reads a real node."
)


def add_parsers(
    sim_commands: argparse._SubParsersAction[argparse.ArgumentParser],
    *,
    node_options: argparse.ArgumentParser,
    record: Callable[[argparse.Namespace], int],
) -> None:
    sim_list = sim_commands.add_parser("list", help="list the shipped profiles")
    sim_list.set_defaults(handler=_list)
    sim_build = sim_commands.add_parser(
        "build",
        help="write a simulated node's host-root tree",
        description="Write the host-root tree of PROFILE into DIR (created if missing; must be "
        "empty). Point any command at it with --host-root DIR.",
    )
    sim_build.add_argument("profile", metavar="PROFILE", help="a name from `simulate list`")
    sim_build.add_argument("directory", metavar="DIR", type=Path, help="where to write the tree")
    sim_build.add_argument(
        "--node-name",
        metavar="NAME",
        help="the node's hostname, and device uuids and serials of its own (default: the "
        "profile's, the same on every build); give each node of a simulated fleet its name",
    )
    sim_build.set_defaults(handler=_build)
    sim_record = sim_commands.add_parser(
        "record",
        parents=[node_options],
        help="record a real NVIDIA node into a recording a simulated node can replay",
        description="Read the node's GPUs through NVML (every query discovery, the health "
        "watcher, telemetry and reset evidence make), the sysfs and /proc files discovery "
        "reads, `nvidia-smi -q`, `-L` and `topo -m`, and what `discover` finds, into DIR. "
        "UUIDs, serial numbers and the host name are replaced by stable stand-ins. Replay it "
        "with `simulate replay DIR TREE` or `--simulate DIR`. Needs only NVML and read access: "
        "nothing on the node is changed.",
    )
    sim_record.add_argument("directory", metavar="DIR", type=Path, help="where to write it")
    sim_record.set_defaults(handler=record)
    sim_replay = sim_commands.add_parser(
        "replay",
        help="write a simulated node's tree from a recording",
        description="Write the host-root tree of the node recorded in RECORDING into DIR "
        "(created if missing; must be empty).",
    )
    sim_replay.add_argument("recording", metavar="RECORDING", type=Path)
    sim_replay.add_argument("directory", metavar="DIR", type=Path, help="where to write the tree")
    sim_replay.set_defaults(handler=_replay)
    inject_cli.add_parser(sim_commands)


SIMULATED_MARKER = ".edl-simulated"


def simulated_profile(root: Path) -> str | None:
    """The profile (or recording) a tree built by `simulate build` or `replay` holds; None for a
    real host root."""
    try:
        return (root / SIMULATED_MARKER).read_text().strip()
    except OSError:
        return None


def build_tree(name: str, directory: Path, node_name: str | None = None) -> None:
    """The tree of profile `name` in `directory`, marked as simulated (`SIMULATED_MARKER`, so
    that `run --host-root` keeps its state inside it); UsageError (one line) when it cannot
    be. `node_name`: the node's hostname, and device ids of its own."""
    from edl_agent.sim.fake_lib_build import FakeLibraryBuildError
    from edl_agent.sim.profile import load_profile
    from edl_agent.sim.tree import build_tree as write_tree

    try:
        profile = load_profile(name)
        write_tree(profile if node_name is None else profile.on_node(node_name), directory)
        (directory / SIMULATED_MARKER).write_text(name + "\n")
    except FakeLibraryBuildError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        msg = f"cannot write simulated node into {directory}: {exc.strerror or exc}"
        raise UsageError(msg) from None


def replay_tree(recording: Path, directory: Path) -> None:
    """The tree of the node recorded in `recording`; UsageError (one line) when it cannot be."""
    from edl_agent.sim.fake_lib_build import FakeLibraryBuildError
    from edl_agent.sim.replay import replay

    try:
        replay(recording, directory)
        (directory / SIMULATED_MARKER).write_text(recording.name + "\n")
    except FakeLibraryBuildError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        msg = f"cannot write the replayed node into {directory}: {exc.strerror or exc}"
        raise UsageError(msg) from None


def require_empty(directory: Path) -> None:
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        msg = f"{directory}: exists and is not an empty directory"
        raise UsageError(msg)


def _list(_: argparse.Namespace) -> int:
    from edl_agent.sim.profile import load_profile, profile_names

    for name in profile_names():
        print(f"{name:16} {load_profile(name).description}")
    return 0


def _build(args: argparse.Namespace) -> int:
    log.configure()
    directory: Path = args.directory
    from edl_agent.sim.profile import load_profile

    load_profile(args.profile)  # unknown or malformed profiles fail before anything is written
    require_empty(directory)
    build_tree(args.profile, directory, args.node_name)
    print(f"simulated node {args.profile} written to {directory}")
    print(f"read it with: edl-agent discover --host-root {directory}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    log.configure()
    from edl_agent.sim.replay import read_meta

    directory: Path = args.directory
    meta = read_meta(args.recording)
    require_empty(directory)
    replay_tree(args.recording, directory)
    print(f"node recorded {meta.get('recorded_at')} written to {directory}")
    print(f"read it with: edl-agent discover --host-root {directory}")
    return 0
