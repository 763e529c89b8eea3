"""The `edl-agent` command: every subcommand's parser under one, and `main`, which turns the
errors a command raises into one line on stderr and an exit status."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from edl_agent import __version__
from edl_agent.cli import config, discover, run, simulate
from edl_agent.cli.parser import (
    EXIT_BROKEN_PIPE,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    SETTINGS_EPILOG,
    Parser,
    error_line,
    node_options,
)
from edl_agent.errors import Unavailable, UsageError
from edl_agent.hosts import command as hosts_command
from edl_agent.restarter import cli as restarter_cli
from edl_agent.settings_loader import ConfigError

DESCRIPTION = """\
edl-agent discovers the accelerators of a Kubernetes node (NVIDIA GPUs with MIG, Kunlunxin XPUs,
Hygon DCUs, Huawei Ascend NPUs and shared slices of them) and tells kubelet, the node and the
restarter about them. Every command reads the node under --host-root (default /), or under a
simulated node built from a profile with --simulate PROFILE (see `edl-agent simulate list`).
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except (UsageError, ConfigError) as exc:  # a ProfileError is a UsageError
        print(error_line(str(exc)), file=sys.stderr)
        return EXIT_USAGE
    except Unavailable as exc:
        print(error_line(str(exc)), file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader has gone (`edl-agent config --keys | head`): end as a tool killed by
        # SIGPIPE does, without the traceback Python would print flushing stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def build_parser() -> argparse.ArgumentParser:
    # Typed as the base class: subcommand parsers are made with the same class at run time.
    parser: argparse.ArgumentParser = Parser(
        prog="edl-agent",
        description=DESCRIPTION,
        epilog=SETTINGS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"edl-agent {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    node = node_options()
    discover.add_parser(commands, node)
    run.add_parser(commands, node)
    restarter_cli.add_parser(commands)
    hosts_command.add_parser(commands)
    config.add_parser(commands, node)
    simulate.add_parser(commands)
    return parser
