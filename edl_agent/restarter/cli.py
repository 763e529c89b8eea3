"""`edl-agent restarter`: the central restarter (watchers, fault intake, policies, actuator)."""

from __future__ import annotations

import argparse
import json
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, get_args

from edl_agent import log
from edl_agent.errors import UsageError
from edl_agent.restarter.core.settings import (
    IntakeSettings,
    RestarterSettings,
    load_restarter_settings,
)
from edl_agent.settings_loader import (
    PRECEDENCE,
    Layer,
    LogFormat,
    LogLevel,
    assignment,
    describe_settings,
    set_path,
)

MAX_PEM_BYTES = 1024 * 1024

DESCRIPTION = """\
Run the restarter: watch pods and nodes for faults, take faults that node agents report on the
authenticated gRPC intake, and replace pods as the FaultTolerancePolicy objects say. Runs until
SIGTERM or SIGINT.

With leader election (the default) several replicas run and one acts: the holder of the Lease
--lease-namespace/--lease-name. A standby serves only its metrics and probes; when the leader
stops renewing, a standby takes over within the lease duration (at once when the leader stops
gracefully and releases the Lease). A leader that loses the Lease exits with status 1. With
POD_NAME and POD_NAMESPACE set (downward API), the leader labels its pod
edl.io/restarter-leader=true, which the intake Service selects.
"""

SETTINGS_EPILOG = (
    textwrap.fill(
        "settings: each flag sets one key of the restarter's settings (named in [brackets]). "
        "Every key can also come from --config FILE (YAML), from an EDL_RESTARTER_* environment "
        "variable (EDL_RESTARTER_STORM__MAX_SHARE=0.2, "
        "EDL_RESTARTER_REPLACEMENT__DROP_LABELS='[a, example.com/*]') or from --set KEY=VALUE "
        "(--set 'replacement.drop_labels=[a, example.com/*]'); "
        f"{PRECEDENCE}, and the file over POD_NAMESPACE/POD_NAME. `edl-agent restarter config` "
        "prints the effective settings, and `edl-agent restarter config --keys` lists every key "
        "with its default and meaning.",
        width=96,
        break_on_hyphens=False,
        break_long_words=False,
    )
    + "\n"
)
USAGE = """\
edl-agent restarter [FLAGS]                 run the restarter
       edl-agent restarter config [--keys] [FLAGS]   print its settings instead"""

CONFIG_DESCRIPTION = """\
Print the restarter's settings, as JSON, after merging its defaults, POD_NAMESPACE/POD_NAME, the
config file, EDL_RESTARTER_* environment variables and the flags given here; nothing is
started. With --keys: every key, its default and its meaning.
"""

# The flag (`--` and the dest with dashes) that sets each key. An error about the value a flag
# gave names that flag as its source.
FLAG_KEYS = {
    "listen": "intake.listen",
    "kubeconfig": "kubeconfig",
    "namespace": "namespaces",
    "agent_service_account": "intake.agent_service_account",
    "audience": "intake.audience",
    "tls_cert": "intake.tls_cert",
    "tls_key": "intake.tls_key",
    "node_grace_seconds": "node_grace_seconds",
    "storm_max_share": "storm.max_share",
    "storm_min_nodes": "storm.min_nodes",
    "metrics_addr": "metrics_addr",
    "leader_elect": "election.enabled",
    "lease_namespace": "election.lease_namespace",
    "lease_name": "election.lease_name",
    "identity": "election.identity",
    "lease_duration_seconds": "election.lease_duration_seconds",
    "renew_deadline_seconds": "election.renew_deadline_seconds",
    "retry_period_seconds": "election.retry_period_seconds",
    "log_level": "log_level",
    "log_format": "log_format",
}


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common: dict[str, Any] = {
        "parents": [_flags()],
        "epilog": SETTINGS_EPILOG,
        "formatter_class": argparse.RawDescriptionHelpFormatter,
    }
    parser = commands.add_parser(
        "restarter", help="run the central restarter", description=DESCRIPTION, **common
    )
    parser.set_defaults(handler=run)
    # Optional: `edl-agent restarter [flags]` runs the restarter.
    sub = parser.add_subparsers(dest="restarter_command", metavar="config")
    config = sub.add_parser(
        "config",
        help="print the effective settings instead of running (`config --keys`: every key)",
        description=CONFIG_DESCRIPTION,
        **common,
    )
    config.add_argument("--keys", action="store_true", help="list every key, default and meaning")
    config.set_defaults(handler=print_config)
    # Set once `config`'s own name is made from the parent's: argparse would print the optional
    # subcommand as a positional (`[config] ...`) among the flags.
    parser.usage = USAGE


def _flags() -> argparse.ArgumentParser:
    """The flags of `restarter` and `restarter config`. Only those given are in the parsed
    namespace (SUPPRESS): the rest of the settings come from the lower layers."""
    d = RestarterSettings()
    flags = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    flags.add_argument("--config", metavar="FILE", help="YAML settings file")
    flags.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        dest="assignments",
        help="set any setting, e.g. --set storm.max_share=0.2 (repeatable)",
    )
    flag = _adder(flags)
    flag(
        "listen",
        metavar="HOST:PORT",
        help=f"the fault intake's address (default {d.intake.listen}; empty: no intake)",
    )
    flag(
        "kubeconfig",
        metavar="FILE",
        help="kubeconfig file (default: $KUBECONFIG, else the pod's service account in a cluster)",
    )
    flag(
        "namespace",
        action="append",
        metavar="NS",
        help="watch pods and policies in NS only (repeatable; default: all namespaces)",
    )
    flag(
        "agent_service_account",
        metavar="NS/NAME",
        help=f"the ServiceAccount agents report as (default {d.intake.agent_service_account})",
    )
    flag("audience", help=f"the agents' token audience (default {d.intake.audience})")
    flag("tls_cert", metavar="TLS_CERT", help="the intake's TLS certificate (PEM)")
    flag("tls_key", metavar="TLS_KEY", help="the intake's TLS key (PEM)")
    flag(
        "node_grace_seconds",
        type=float,
        metavar="S",
        help="how long a node is NotReady before its pods fault "
        f"(default {d.node_grace_seconds:g})",
    )
    flag(
        "storm_max_share",
        type=float,
        metavar="SHARE",
        help="hold node-failure restarts while more than SHARE of the nodes are NotReady "
        f"(default {d.storm.max_share:g}; 1 turns the guard off)",
    )
    flag(
        "storm_min_nodes",
        type=int,
        metavar="N",
        help=f"... and at least N nodes (default {d.storm.min_nodes})",
    )
    flag(
        "metrics_addr",
        metavar="HOST:PORT",
        help=f"address of /metrics, /healthz and /readyz (default {d.metrics_addr}; empty: none)",
    )
    election = _adder(flags.add_argument_group("leader election"))
    election(
        "leader_elect",
        action=argparse.BooleanOptionalAction,
        help="act only while holding the Lease (default on)",
    )
    election(
        "lease_namespace",
        metavar="NS",
        help=f"the Lease's namespace (default $POD_NAMESPACE, else {d.election.lease_namespace})",
    )
    election("lease_name", help=f"the Lease's name (default {d.election.lease_name})")
    election(
        "identity",
        help="this replica's name in the Lease (default $POD_NAME, else hostname-random)",
    )
    election(
        "lease_duration_seconds",
        type=float,
        metavar="S",
        help="a standby takes over after the Lease stood still this long "
        f"(default {d.election.lease_duration_seconds:g})",
    )
    election(
        "renew_deadline_seconds",
        type=float,
        metavar="S",
        help="the leader gives up when it could not renew for this long "
        f"(default {d.election.renew_deadline_seconds:g})",
    )
    election(
        "retry_period_seconds",
        type=float,
        metavar="S",
        help="how often the Lease is read and renewed "
        f"(default {d.election.retry_period_seconds:g})",
    )
    flag("log_level", choices=get_args(LogLevel), help=f"(default {d.log_level})")
    flag("log_format", choices=get_args(LogFormat), help=f"(default {d.log_format})")
    return flags


def _adder(group: argparse._ActionsContainer) -> Callable[..., None]:
    """`add(dest, **kwargs)`: the flag `--<dest with dashes>`, its key shown in its help."""

    def add(dest: str, *, help: str, **kwargs: Any) -> None:
        group.add_argument(_flag(dest), dest=dest, help=f"{help} [{FLAG_KEYS[dest]}]", **kwargs)

    return add


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def settings_from_args(
    args: argparse.Namespace, *, environ: Mapping[str, str] | None = None
) -> RestarterSettings:
    """The settings from the downward API, --config, the environment (`environ`; None: the
    process's), --set and the flags given (each its own layer, named in errors)."""
    given = vars(args)
    overrides: list[Layer] = []
    assigned: dict[str, Any] = {}
    for text in given.get("assignments", []):
        path, value = assignment(text, RestarterSettings)
        set_path(assigned, path, value)
    if assigned:
        overrides.append(("--set", assigned))
    for dest, key in FLAG_KEYS.items():
        if dest in given:
            layer: dict[str, Any] = {}
            set_path(layer, key.split("."), given[dest])
            overrides.append((_flag(dest), layer))
    return load_restarter_settings(file=given.get("config"), environ=environ, overrides=overrides)


def print_config(args: argparse.Namespace) -> int:
    if args.keys:
        for key, default, meaning in describe_settings(RestarterSettings):
            print(f"{key:40} {default:24} {meaning}")
        return 0
    print(json.dumps(asdict(settings_from_args(args)), indent=2))
    return 0


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    log.configure(settings.log_level, settings.log_format)
    check_tls_files(settings.intake)
    # Imported only now: the Kubernetes client and the controller take most of the command's
    # start-up time, which neither a mistyped flag nor any other command should wait for.
    from edl_agent.kube import KubeConfigError, api_client
    from edl_agent.restarter.core.callers import service_account_user
    from edl_agent.restarter.process import Restarter

    try:
        # Watches (pods per namespace, nodes, policies), decision workers, events, the Lease.
        api = api_client(settings.kubeconfig, name="kubeconfig", connections=32)
    except KubeConfigError as exc:
        raise UsageError(str(exc)) from None
    if api is None:
        msg = "no Kubernetes credentials: pass --kubeconfig, set $KUBECONFIG or run in a cluster"
        raise UsageError(msg)
    try:
        agent_user = service_account_user(*settings.intake.agent_account)
        return Restarter(settings, api, agent_user).run()
    finally:
        api.close()  # type: ignore[no-untyped-call]


def check_tls_files(intake: IntakeSettings) -> None:
    """The intake's certificate and key can be read (checked at start, not first when this
    replica becomes leader)."""
    for key, path in (("intake.tls_cert", intake.tls_cert), ("intake.tls_key", intake.tls_key)):
        if not path:
            continue
        try:
            with Path(path).open("rb") as stream:
                head = stream.read(MAX_PEM_BYTES + 1)
        except OSError as exc:
            raise UsageError(f"{key} {path}: {exc.strerror or exc}") from None
        if len(head) > MAX_PEM_BYTES or b"-----BEGIN " not in head:
            raise UsageError(f"{key} {path}: not a PEM file")
