"""`edl-agent simulate`: build, record, replay, list and fault simulated nodes. The subcommands
are `edl_agent.sim`'s; `record` reads a node with the settings every command reads it with."""

from __future__ import annotations

import argparse
from pathlib import Path

from edl_agent.cli.parser import node_options
from edl_agent.cli.settings import node_settings
from edl_agent.errors import UsageError
from edl_agent.sim import commands as sim_commands_module


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sim_commands = commands.add_parser(
        "simulate",
        help="build, record and list simulated nodes",
        description=sim_commands_module.DESCRIPTION,
    ).add_subparsers(dest="sim_command", metavar="SUBCOMMAND", required=True)
    sim_commands_module.add_parsers(
        sim_commands, node_options=node_options(), record=record_command
    )


def record_command(args: argparse.Namespace) -> int:
    from edl_agent.devices.discovery import discover_node
    from edl_agent.devices.hostroot import HostRoot
    from edl_agent.sim.record import RecordError, record

    directory: Path = args.directory
    sim_commands_module.require_empty(directory)
    with node_settings(args) as settings:
        root = HostRoot.at(settings.host_root)
        try:
            summary = record(
                root, directory, discover_json=lambda: discover_node(settings).to_json()
            )
        except RecordError as exc:
            raise UsageError(str(exc)) from None
    print(
        f"recorded {summary.gpus} GPUs and {summary.mig_devices} MIG devices into {directory} "
        f"({summary.failed_queries} NVML queries refused, listed in recording.json)"
    )
    print(f"replay it with: edl-agent discover --simulate {directory}")
    return 0
