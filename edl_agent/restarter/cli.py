"""`edl-agent restarter`: the central restarter (watchers, fault intake, policies, actuator)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from edl_agent import log
from edl_agent.errors import UsageError
from edl_agent.restarter.options import check_options, check_tls_files

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


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "restarter",
        help="run the central restarter",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--listen",
        default=":8443",
        metavar="HOST:PORT",
        help="the fault intake's address (default :8443; empty: no intake)",
    )
    parser.add_argument(
        "--kubeconfig",
        default="",
        metavar="FILE",
        help="kubeconfig file (default: $KUBECONFIG, else the pod's service account in a cluster)",
    )
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        dest="namespaces",
        metavar="NS",
        help="watch pods and policies in NS only (repeatable; default: all namespaces)",
    )
    parser.add_argument(
        "--agent-service-account",
        default="edl-system/edl-agent",
        metavar="NS/NAME",
        help="the ServiceAccount agents report as (default edl-system/edl-agent)",
    )
    parser.add_argument("--audience", default="edl-restarter", help="the agents' token audience")
    parser.add_argument("--tls-cert", type=Path, help="the intake's TLS certificate (PEM)")
    parser.add_argument("--tls-key", type=Path, help="the intake's TLS key (PEM)")
    parser.add_argument(
        "--node-grace-seconds",
        type=float,
        default=40.0,
        metavar="S",
        help="how long a node is NotReady before its pods fault (default 40)",
    )
    parser.add_argument(
        "--storm-max-share",
        type=float,
        default=0.1,
        metavar="SHARE",
        help="hold node-failure restarts while more than SHARE of the nodes are NotReady "
        "(default 0.1; 1 turns the guard off)",
    )
    parser.add_argument(
        "--storm-min-nodes",
        type=int,
        default=3,
        metavar="N",
        help="... and at least N nodes (default 3)",
    )
    parser.add_argument(
        "--metrics-addr",
        default=":9401",
        metavar="HOST:PORT",
        help="address of /metrics, /healthz and /readyz (default :9401; empty: none)",
    )
    election = parser.add_argument_group("leader election")
    election.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="act only while holding the Lease (default on)",
    )
    election.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE") or "edl-system",
        metavar="NS",
        help="the Lease's namespace (default $POD_NAMESPACE, else edl-system)",
    )
    election.add_argument("--lease-name", default="edl-restarter", help="the Lease's name")
    election.add_argument(
        "--identity",
        default=os.environ.get("POD_NAME") or "",
        help="this replica's name in the Lease (default $POD_NAME, else hostname-random)",
    )
    election.add_argument(
        "--lease-duration-seconds",
        type=float,
        default=15.0,
        metavar="S",
        help="a standby takes over after the Lease stood still this long (default 15)",
    )
    election.add_argument(
        "--renew-deadline-seconds",
        type=float,
        default=10.0,
        metavar="S",
        help="the leader gives up when it could not renew for this long (default 10)",
    )
    election.add_argument(
        "--retry-period-seconds",
        type=float,
        default=2.0,
        metavar="S",
        help="how often the Lease is read and renewed (default 2)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error")
    )
    parser.add_argument("--log-format", default="auto", choices=("auto", "json", "console"))
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    log.configure(args.log_level, args.log_format)
    namespace, name = check_options(args)
    check_tls_files(args.tls_cert, args.tls_key)
    # Imported only now: the Kubernetes client and the controller take most of the command's
    # start-up time, which neither a mistyped flag nor any other command should wait for.
    from edl_agent.kube import KubeConfigError, api_client
    from edl_agent.restarter.auth import service_account_user
    from edl_agent.restarter.process import Restarter

    try:
        # Watches (pods per namespace, nodes, policies), decision workers, events, the Lease.
        api = api_client(args.kubeconfig, name="--kubeconfig", connections=32)
    except KubeConfigError as exc:
        raise UsageError(str(exc)) from None
    if api is None:
        msg = "no Kubernetes credentials: pass --kubeconfig, set $KUBECONFIG or run in a cluster"
        raise UsageError(msg)
    try:
        return Restarter(args, api, service_account_user(namespace, name)).run()
    finally:
        api.close()  # type: ignore[no-untyped-call]
