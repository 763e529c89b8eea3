"""`edl-agent config`: the effective settings as the agent would use them, or every key."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from edl_agent.cli.parser import SETTINGS_EPILOG
from edl_agent.cli.settings import node_settings
from edl_agent.config import Settings
from edl_agent.settings_loader import describe_settings


def add_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], node: argparse.ArgumentParser
) -> None:
    config = commands.add_parser(
        "config",
        parents=[node],
        help="print the effective settings, or every key with its default",
        description="Print the settings after merging the config file, EDL_* environment and "
        "flags (and the profile's defaults with --simulate), as the agent would use them: "
        "node_name resolved as the agent resolves it (the setting, else $NODE_NAME, else the "
        "host root's /etc/hostname, else this machine's hostname), paths made absolute.",
        epilog=SETTINGS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    config.add_argument("--keys", action="store_true", help="list every key, default and meaning")
    config.add_argument(
        "--format",
        choices=("yaml", "json"),
        default="yaml",
        help="yaml (default; a valid --config file) or json",
    )
    config.set_defaults(handler=config_command)


def config_command(args: argparse.Namespace) -> int:
    if args.keys:
        for key, default, meaning in describe_settings(Settings):
            print(f"{key:32} {default:24} {meaning}")
        return 0
    with node_settings(args) as settings:
        print(render_config(resolved(settings), fmt=args.format), end="")
    return 0


def resolved(settings: Settings) -> Settings:
    """The settings as the agent uses them: the node's name resolved as discovery does."""
    from edl_agent.devices.discovery import node_name
    from edl_agent.devices.hostroot import HostRoot

    name = node_name(settings, HostRoot.at(settings.host_root), os.environ)
    return dataclasses.replace(settings, node_name=name)


def render_config(settings: Settings, *, fmt: str) -> str:
    """`settings` as YAML (block style, in the schema's order) or as JSON."""
    plain = json.loads(json.dumps(dataclasses.asdict(settings)))  # tuples and enums made plain
    if fmt == "json":
        return json.dumps(plain, indent=2) + "\n"
    import yaml

    text: str = yaml.safe_dump(plain, sort_keys=False, default_flow_style=False, width=1000)
    return text
