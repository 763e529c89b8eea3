"""The restarter process: metrics and probes always; the controller and the fault intake while
leading (or always, without leader election). `edl-agent restarter` builds it (cli.py)."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import threading
from typing import Any

import structlog

from edl_agent.backoff import Backoff
from edl_agent.errors import UsageError
from edl_agent.metrics.server import MetricsServer
from edl_agent.restarter.auth import CachedReviewer, TokenReviewer
from edl_agent.restarter.controller import Controller
from edl_agent.restarter.events import EventWriter
from edl_agent.restarter.intake import FaultIntake, IntakeError, IntakeServer
from edl_agent.restarter.leader import LeaderElector, label_own_pod
from edl_agent.restarter.metrics import RestarterMetrics
from edl_agent.restarter.storm import StormGuard

logger = structlog.get_logger(__name__)

LABEL_RETRY_SECONDS = 0.5
LABEL_RETRY_MAX_SECONDS = 30.0


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
                review=reviewer,
                agent_user=agent_user,
                on_fault=self.controller.submit,
                find_pod=self.controller.watcher.find_pod,
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
        # Set once the leader's pod carries the label the intake Service selects on.
        self.labelled = threading.Event()
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
                msg = f"--metrics-addr {self.args.metrics_addr}: {exc.strerror or exc}"
                raise UsageError(msg) from None
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
            threading.Thread(target=self._label_as_leader, name="leader-label", daemon=True).start()
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

    def _label_as_leader(self) -> None:
        """Label our pod for the intake Service until that works: without the label agents
        cannot reach this leader (their faults wait in their outboxes), and /readyz says so."""
        backoff = Backoff(LABEL_RETRY_SECONDS, LABEL_RETRY_MAX_SECONDS)
        while not self.stop.is_set():
            try:
                done = label_own_pod(self.api, *self.pod, leader=True)
            except Exception as exc:  # no answer at all (a connection refused): try again
                logger.warning("could not label the restarter's pod", error=str(exc))
                done = False
            if done:
                self.labelled.set()
                if backoff.failures:
                    logger.info("restarter pod labelled for the intake", tries=backoff.failures + 1)
                return
            self.stop.wait(backoff.next_delay())

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
        if self.elector is not None and all(self.pod) and not self.labelled.is_set():
            return False, "leading, but its pod is not labelled for the intake Service yet"
        return True, f"acting ({self.identity})"
