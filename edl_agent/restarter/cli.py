"""`edl-agent restarter`: the central restarter (watchers, fault intake, policies, actuator)."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path
from typing import Any

import structlog

from edl_agent import log
from edl_agent.errors import UsageError
from edl_agent.kube import KubeConfigError, api_client
from edl_agent.restarter.auth import CachedReviewer, TokenReviewer, service_account_user
from edl_agent.restarter.controller import Controller
from edl_agent.restarter.intake import FaultIntake, IntakeError, IntakeServer

logger = structlog.get_logger(__name__)

DESCRIPTION = """\
Run the restarter: watch pods and nodes for faults, take faults that node agents report on the
authenticated gRPC intake, and replace pods as the FaultTolerancePolicy objects say. Runs until
SIGTERM or SIGINT.
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
        "--kubeconfig", default="", help="kubeconfig file (default: the in-cluster account)"
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
        "--log-level", default="info", choices=("debug", "info", "warning", "error")
    )
    parser.add_argument("--log-format", default="auto", choices=("auto", "json", "console"))
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    log.configure(args.log_level, args.log_format)
    namespace, _, name = str(args.agent_service_account).partition("/")
    if not namespace or not name:
        msg = f"--agent-service-account: expected NS/NAME, got {args.agent_service_account!r}"
        raise UsageError(msg)
    try:
        api = api_client(args.kubeconfig)
    except KubeConfigError as exc:
        raise UsageError(str(exc)) from None
    if api is None:
        msg = "no Kubernetes credentials: pass --kubeconfig or run in a cluster"
        raise UsageError(msg)
    controller = Controller(api, namespaces=args.namespaces, node_grace=args.node_grace_seconds)
    server: IntakeServer | None = None
    if args.listen:
        reviewer: Any = CachedReviewer(TokenReviewer(api, audiences=[args.audience]))
        intake = FaultIntake(
            review=reviewer,
            agent_user=service_account_user(namespace, name),
            on_fault=controller.submit,
        )
        server = IntakeServer(
            intake, listen=args.listen, tls_cert=args.tls_cert, tls_key=args.tls_key
        )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    controller.start()
    try:
        if server is not None:
            try:
                server.start()
            except IntakeError as exc:
                raise UsageError(str(exc)) from None
        logger.info("restarter running", namespaces=args.namespaces or "all", intake=args.listen)
        stop.wait()
        logger.info("restarter stopping")
    finally:
        if server is not None:
            server.stop()
        controller.stop()
        api.close()  # type: ignore[no-untyped-call]
    return 0
