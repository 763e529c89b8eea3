"""`edl-agent restarter`: the central restarter (watchers, fault intake, policies, actuator)."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import structlog

from edl_agent import log
from edl_agent.errors import UsageError
from edl_agent.kube import KubeConfigError, api_client
from edl_agent.metrics.server import MetricsServer
from edl_agent.restarter.auth import CachedReviewer, TokenReviewer, service_account_user
from edl_agent.restarter.controller import Controller
from edl_agent.restarter.events import EventWriter
from edl_agent.restarter.intake import FaultIntake, IntakeError, IntakeServer
from edl_agent.restarter.leader import LeaderElector, label_own_pod
from edl_agent.restarter.metrics import RestarterMetrics
from edl_agent.restarter.storm import StormGuard

logger = structlog.get_logger(__name__)

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
    namespace, _, name = str(args.agent_service_account).partition("/")
    if not namespace or not name:
        msg = f"--agent-service-account: expected NS/NAME, got {args.agent_service_account!r}"
        raise UsageError(msg)
    if not args.storm_max_share > 0:
        raise UsageError(f"--storm-max-share: expected a share > 0, got {args.storm_max_share}")
    if args.leader_elect and not (
        0 < args.retry_period_seconds < args.renew_deadline_seconds < args.lease_duration_seconds
    ):
        msg = (
            "leader election needs 0 < --retry-period-seconds < --renew-deadline-seconds "
            "< --lease-duration-seconds"
        )
        raise UsageError(msg)
    try:
        # Watches (pods per namespace, nodes, policies), decision workers, events, the Lease.
        api = api_client(args.kubeconfig, connections=32)
    except KubeConfigError as exc:
        raise UsageError(str(exc)) from None
    if api is None:
        msg = "no Kubernetes credentials: pass --kubeconfig or run in a cluster"
        raise UsageError(msg)
    try:
        return Restarter(args, api, service_account_user(namespace, name)).run()
    finally:
        api.close()  # type: ignore[no-untyped-call]


class Restarter:
    """The restarter process: metrics and probes always; the controller and the intake while
    leading (or always, without leader election)."""

    def __init__(self, args: argparse.Namespace, api: Any, agent_user: str) -> None:
        self.args, self.api = args, api
        self.identity = args.identity or f"{socket.gethostname()}-{secrets.token_hex(3)}"
        self.pod = (os.environ.get("POD_NAMESPACE", ""), os.environ.get("POD_NAME", ""))
        self.metrics = RestarterMetrics()
        self.stop = threading.Event()
        self.exit_code = 0
        self.controller = Controller(
            api,
            namespaces=args.namespaces,
            node_grace=args.node_grace_seconds,
            storm=StormGuard(args.storm_max_share, args.storm_min_nodes),
            metrics=self.metrics,
            events=EventWriter(api, instance=self.identity),
            storm_object=self._storm_object(),
        )
        self.server: IntakeServer | None = None
        if args.listen:
            reviewer: Any = CachedReviewer(TokenReviewer(api, audiences=[args.audience]))
            intake = FaultIntake(
                review=reviewer, agent_user=agent_user, on_fault=self.controller.submit
            )
            self.metrics.watch_intake(intake.counts)
            self.server = IntakeServer(
                intake, listen=args.listen, tls_cert=args.tls_cert, tls_key=args.tls_key
            )
        self.elector: LeaderElector | None = None
        if args.leader_elect:
            self.elector = LeaderElector(
                api,
                namespace=args.lease_namespace,
                name=args.lease_name,
                identity=self.identity,
                lease_duration=args.lease_duration_seconds,
                renew_deadline=args.renew_deadline_seconds,
                retry_period=args.retry_period_seconds,
                on_started=self._lead,
                on_stopped=self._lost,
            )
        self.acting = threading.Event()
        self.failed: str | None = None

    def _storm_object(self) -> dict[str, str] | None:
        if self.args.leader_elect:
            return {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "name": self.args.lease_name,
                "namespace": self.args.lease_namespace,
            }
        namespace, name = self.pod
        if namespace and name:
            return {"apiVersion": "v1", "kind": "Pod", "name": name, "namespace": namespace}
        return None

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self.stop.set())
        metrics_server: MetricsServer | None = None
        if self.args.metrics_addr:
            metrics_server = MetricsServer(
                self.args.metrics_addr, self.metrics.registry, ready=self._ready
            )
            try:
                metrics_server.start()
            except OSError as exc:
                raise UsageError(f"--metrics-addr {self.args.metrics_addr}: {exc}") from None
        try:
            if self.elector is None:
                self._lead()
            else:
                if all(self.pod):
                    label_own_pod(self.api, *self.pod, leader=False)
                self.elector.start()
            self.stop.wait()
            logger.info("restarter stopping")
        finally:
            if self.server is not None:
                self.server.stop()
            if self.acting.is_set():
                self.controller.stop()
            if self.elector is not None:
                self.elector.stop()
            if metrics_server is not None:
                metrics_server.stop()
        if self.failed is not None:
            raise UsageError(self.failed)
        return self.exit_code

    def _lead(self) -> None:
        self.metrics.leader.set(1)
        if self.elector is not None and all(self.pod):
            label_own_pod(self.api, *self.pod, leader=True)
        self.controller.start()
        self.acting.set()
        if self.server is not None:
            try:
                self.server.start()
            except IntakeError as exc:
                self.failed = str(exc)
                self.stop.set()
                return
        logger.info(
            "restarter acting",
            namespaces=self.args.namespaces or "all",
            intake=self.args.listen,
            identity=self.identity,
        )

    def _lost(self) -> None:
        self.metrics.leader.set(0)
        self.exit_code = 1
        self.stop.set()

    def _ready(self) -> tuple[bool, str]:
        if self.elector is not None and not self.elector.leading:
            return True, f"standby ({self.identity})"
        if not self.acting.is_set():
            return False, "starting"
        if not self.controller.recovered.is_set():
            return False, "listing pods, nodes and policies"
        return True, f"acting ({self.identity})"
