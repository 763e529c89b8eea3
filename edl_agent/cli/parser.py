"""What every `edl-agent` command shares: the argparse class that reports bad input as one line
with exit 2, the settings epilog, and the flags of a command that reads a node."""

from __future__ import annotations

import argparse
import itertools
import re
import sys
import textwrap
from collections.abc import Sequence
from typing import NoReturn

from edl_agent.errors import did_you_mean
from edl_agent.settings_loader import PRECEDENCE

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports a tool whose reader went away
EXIT_UNAVAILABLE = 1

SETTINGS_EPILOG = (
    textwrap.fill(
        "settings: every key (`edl-agent config --keys` lists them, with their defaults and "
        "meanings) can come from --config FILE (YAML), from an EDL_* environment variable "
        "(EDL_LOG_LEVEL=debug, EDL_NVIDIA__MIG_STRATEGY=mixed) or from --set KEY=VALUE; "
        f"{PRECEDENCE}, and the file over a simulated profile's defaults. `edl-agent config` "
        "prints the effective settings.",
        width=96,
        break_on_hyphens=False,
    )
    + "\n"
)


def error_line(message: str) -> str:
    """Bad input is reported as exactly one line, whatever the message holds."""
    return f"edl-agent: error: {' '.join(message.split())}"


class Parser(argparse.ArgumentParser):
    """argparse, with its mistakes reported like every other bad input: one line, exit 2, and
    the closest flag or command for a mistyped one (argparse's own `suggest_on_error` is 3.14+)."""

    # The namespace attribute where the (sub)parser that met an unknown flag leaves its hint.
    HINT = "_edl_flag_hint"
    # The arguments this parser was last given, for `error`: argparse does not pass them.
    _given: Sequence[str] = ()

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)
        parsed, extras = super().parse_known_args(args, namespace)
        # The innermost parser runs first and knows the flags of its command: its hint stays.
        if extras and not getattr(parsed, self.HINT, ""):
            known = [o for action in self._actions for o in action.option_strings]
            flags = (e.partition("=")[0] for e in extras if e.startswith("--"))
            hints = (did_you_mean(flag, known) for flag in flags)
            setattr(parsed, self.HINT, next((h for h in hints if h), ""))
        return parsed, extras

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        hint = getattr(parsed, self.HINT, "")
        if hasattr(parsed, self.HINT):
            delattr(parsed, self.HINT)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return parsed

    def error(self, message: str) -> NoReturn:
        choice = re.match(r"argument .*: invalid choice: '(.*?)' \(choose from (.*)\)$", message)
        if choice:
            flag = self._unknown_flag_before(choice.group(1))
            if flag:
                # `restarter --lisen :1`: the value of a mistyped flag, read as a command.
                known = [o for action in self._actions for o in action.option_strings]
                message = f"unrecognized arguments: {flag}{did_you_mean(flag, known)}"
            else:
                known = [c.strip(" '") for c in choice.group(2).split(",")]
                message += did_you_mean(choice.group(1), known)
        self.exit(EXIT_USAGE, error_line(f"{message} (see {self.prog} --help)") + "\n")

    def _unknown_flag_before(self, value: str) -> str:
        """The flag this parser does not know that stands right before `value` in its
        arguments, or `` when there is none."""
        for flag, following in itertools.pairwise(self._given):
            unknown = flag.startswith("-") and flag not in self._option_string_actions
            if following == value and unknown and "=" not in flag:
                return flag
        return ""


def node_options() -> argparse.ArgumentParser:
    """The flags of a command that reads a node: a parent parser for its subparser."""
    common = argparse.ArgumentParser(add_help=False)
    where = common.add_mutually_exclusive_group()
    where.add_argument(
        "--host-root", metavar="DIR", help="read the node under DIR (default /, or host_root)"
    )
    where.add_argument(
        "--simulate",
        metavar="PROFILE",
        help="build a simulated node for PROFILE (or from a recording directory) in a "
        "temporary directory and read it",
    )
    common.add_argument("--config", metavar="FILE", help="YAML settings file")
    common.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="assignments",
        help="set any setting, e.g. --set nvidia.mig_strategy=mixed (repeatable)",
    )
    common.add_argument("--node-name", help="Kubernetes node name (default $NODE_NAME or hostname)")
    common.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    common.add_argument("--log-format", choices=("auto", "json", "console"))
    return common
