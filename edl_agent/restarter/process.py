"""The restarter process, its composition root: metrics and probes always; the controller and
the fault intake while leading (or always, without leader election). `edl-agent restarter`
builds it (cli.py).

Every thread is a part under one `runtime.supervisor.Supervisor`: leader election from the
start; once leading, the controller's parts (the pod, node and policy watches, the node-grace
ticker, the Event writer, the dispatcher, the deciders), the intake server and the leader-label
part. A part that dies is logged, counted (`edl_part_up{part}`, `edl_part_restarts_total{part}`)
and run again after a backoff; /readyz is false while any of them is down or not ready yet."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from edl_agent.errors import UsageError
from edl_agent.metrics.server import MetricsServer
from edl_agent.restarter.adapters.auth import CachedReviewer, TokenReviewer
from edl_agent.restarter.adapters.events import EventWriter
from edl_agent.restarter.adapters.intake import FaultIntake
from edl_agent.restarter.adapters.intake_server import IntakeError, IntakeServer
from edl_agent.restarter.adapters.kube_controller import connect
from edl_agent.restarter.adapters.leader import LeaderElector, label_own_pod
from edl_agent.restarter.adapters.watchers import ClusterWatcher
from edl_agent.restarter.core.checkpoint import ANNOTATION, Checkpoint
from edl_agent.restarter.core.metrics import RestarterMetrics
from edl_agent.restarter.core.settings import RestarterSettings
from edl_agent.restarter.core.storm import StormGuard
from edl_agent.runtime.backoff import Backoff
from edl_agent.runtime.deadline import StopDeadline
from edl_agent.runtime.signals import stop_on_signals
from edl_agent.runtime.supervisor import StopSignal, Supervisor

logger = structlog.get_logger(__name__)

LABEL_RETRY_SECONDS = 0.5
LABEL_RETRY_MAX_SECONDS = 30.0


class Restarter:
    """The restarter process: metrics and probes always; the controller and the intake while
    leading (or always, without leader election)."""

    def __init__(self, settings: RestarterSettings, api: Any, agent_user: str) -> None:
        self.settings, self.api = settings, api
        election, intake = settings.election, settings.intake
        self.identity = election.identity or f"{socket.gethostname()}-{secrets.token_hex(3)}"
        self.pod = (settings.pod_namespace, settings.pod_name)
        self.metrics = RestarterMetrics()
        self.stop = StopSignal()
        tuning = settings.controller
        for key in tuning.obsolete():
            logger.warning(
                "a setting no longer used is ignored",
                key=f"controller.{key}",
                value=getattr(tuning, key),
                why="the restarter waits for faults, node changes and due times, not on a tick",
            )
        self.supervisor = Supervisor(
            self.stop,
            initial_backoff=tuning.part_backoff_seconds,
            max_backoff=tuning.part_backoff_max_seconds,
        )
        self.metrics.watch_parts(self.supervisor.statuses)
        self.exit_code = 0
        self.controller = connect(
            api,
            namespaces=settings.namespaces,
            node_grace=settings.node_grace_seconds,
            storm=StormGuard(settings.storm.max_share, settings.storm.min_nodes),
            metrics=self.metrics,
            events=EventWriter(api, instance=self.identity),
            storm_object=self._storm_object(),
            drop_labels=settings.replacement.drop_labels,
            settings=tuning,
        )
        watcher = self.controller.pods
        if not isinstance(watcher, ClusterWatcher):  # connect() wires one
            msg = "the restarter's pod view is not a ClusterWatcher"
            raise TypeError(msg)
        self.watcher = watcher
        self.server: IntakeServer | None = None
        if intake.listen:
            reviewer: Any = CachedReviewer(TokenReviewer(api, audiences=[intake.audience]))
            fault_intake = FaultIntake(
                review=reviewer,
                agent_user=agent_user,
                on_fault=self.controller.accept,
                find_pod=self.controller.pods.find_pod,
            )
            self.metrics.watch_intake(fault_intake.counts)
            self.server = IntakeServer(
                fault_intake,
                listen=intake.listen,
                tls_cert=Path(intake.tls_cert) if intake.tls_cert else None,
                tls_key=Path(intake.tls_key) if intake.tls_key else None,
                workers=intake.workers,
                max_calls_per_connection=intake.max_calls_per_connection,
                max_connections=intake.max_connections,
                max_connections_per_peer=intake.max_connections_per_peer,
                handshake_timeout=intake.handshake_timeout_seconds,
                idle_timeout=intake.idle_timeout_seconds,
            )
        self.elector: LeaderElector | None = None
        if election.enabled:
            self.elector = LeaderElector(
                api,
                namespace=election.lease_namespace,
                name=election.lease_name,
                identity=self.identity,
                lease_duration=election.lease_duration_seconds,
                renew_deadline=election.renew_deadline_seconds,
                retry_period=election.retry_period_seconds,
                on_started=self._lead,
                on_stopped=self._lost,
                annotations=self._lease_annotations,
            )
        self.checkpoint = Checkpoint()
        self.acting = threading.Event()
        self.failed: str | None = None

    def _storm_object(self) -> dict[str, str] | None:
        election = self.settings.election
        if election.enabled:
            return {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "name": election.lease_name,
                "namespace": election.lease_namespace,
            }
        namespace, name = self.pod
        if namespace and name:
            return {"apiVersion": "v1", "kind": "Pod", "name": name, "namespace": namespace}
        return None

    def run(self) -> int:
        def expired(running: list[str]) -> None:
            logger.warning("stopping took too long: exiting now", running=running)

        deadline = StopDeadline(on_expiry=expired)

        def stop() -> None:
            self.stop.set()
            deadline.arm()

        try:
            with stop_on_signals(stop):
                return self._run()
        finally:
            deadline.disarm()

    def _run(self) -> int:
        metrics_server: MetricsServer | None = None
        address = self.settings.metrics_addr
        if address:
            metrics_server = MetricsServer(address, self.metrics.registry, ready=self.ready)
            try:
                metrics_server.start()
            except OSError as exc:
                msg = f"metrics_addr {address}: {exc.strerror or exc}"
                raise UsageError(msg) from None
        try:
            if self.elector is None:
                self._lead()
            else:
                if all(self.pod):
                    label_own_pod(self.api, *self.pod, leader=False)
                self.supervisor.add(self.elector)
            self.supervisor.start()
            self.stop.wait()
            logger.info("restarter stopping")
        finally:
            self.stop.set()
            if self.server is not None:
                self.server.stop()  # no fault comes in while the controller stops
            if self.acting.is_set():
                self.controller.stop()  # ends its parts and joins the supervisor
            self.supervisor.join()
            if self.elector is not None:
                self.elector.stop()
            if metrics_server is not None:
                metrics_server.stop()
        if self.failed is not None:
            raise UsageError(self.failed)
        return self.exit_code

    def _lead(self) -> None:
        """Leading (the elector's part calls it, or `run` without election): the controller's
        parts, the intake and the leader label join the supervisor."""
        self.metrics.leader.set(1)
        if self.elector is not None:
            self.checkpoint.inherited = self.elector.inherited.get(ANNOTATION)
            self.watcher.replay_pods_from(self.checkpoint.inherited)
        self.controller.start(self.supervisor)
        self.acting.set()
        if self.server is not None:
            self.supervisor.add(IntakePart(self.server, self._fail))
        if self.elector is not None and all(self.pod):
            self.supervisor.add(LeaderLabel(self.api, self.pod))
        logger.info(
            "restarter acting",
            namespaces=list(self.settings.namespaces) or "all",
            intake=self.settings.intake.listen,
            identity=self.identity,
        )

    def _fail(self, why: str) -> None:
        self.failed = why
        self.stop.set()

    def _lease_annotations(self) -> dict[str, str]:
        """What the leader keeps on the Lease: where the next leader replays pod events from."""
        if not self.acting.is_set():
            return {ANNOTATION: self.checkpoint.inherited} if self.checkpoint.inherited else {}
        return self.checkpoint.annotations(time.monotonic(), self.watcher.pods_version)

    def _lost(self) -> None:
        self.metrics.leader.set(0)
        self.exit_code = 1
        self.stop.set()

    def ready(self) -> tuple[bool, str]:
        """/readyz: a standby is ready while its elector runs; the leader once it has listed
        and finished what its predecessor left, and while every part runs and is ready (the
        watches listed, the intake serving, its pod labelled for the intake Service)."""
        waiting = [
            s.name for s in self.supervisor.statuses() if s.critical and not (s.up and s.ready)
        ]
        why = f"parts not ready: {', '.join(waiting)}"
        if self.elector is not None and not self.elector.leading:
            return (
                (False, f"standby, but {why}") if waiting else (True, f"standby ({self.identity})")
            )
        if not self.acting.is_set():
            return False, "starting"
        if not self.controller.recovered.is_set():
            return False, "listing pods, nodes and policies"
        if LeaderLabel.name in waiting:
            return False, "leading, but its pod is not labelled for the intake Service yet"
        if waiting:
            return False, why
        return True, f"acting ({self.identity})"


@dataclass
class IntakePart:
    """The intake's gRPC server as a supervised part: serving, ready, until the stop. A server
    that cannot bind (a port taken, a bad certificate) fails the process (`fail`), as a flag
    naming it would."""

    server: IntakeServer
    fail: Callable[[str], None]
    name: str = "intake"

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        try:
            self.server.start()
        except IntakeError as exc:
            self.fail(str(exc))
            return
        try:
            ready()
            stop.wait()
        finally:
            self.server.stop()


@dataclass
class LeaderLabel:
    """Labels the leader's pod for the intake Service until that works, then is ready and waits
    for the stop: without the label agents cannot reach this leader (their faults wait in their
    outboxes), and /readyz says so."""

    api: Any
    pod: tuple[str, str]
    name: str = "leader-label"

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        backoff = Backoff(LABEL_RETRY_SECONDS, LABEL_RETRY_MAX_SECONDS)
        while not stop.is_set():
            try:
                done = label_own_pod(self.api, *self.pod, leader=True)
            except Exception as exc:  # no answer at all (a connection refused): try again
                logger.warning("could not label the restarter's pod", error=str(exc))
                done = False
            if done:
                if backoff.failures:
                    logger.info("restarter pod labelled for the intake", tries=backoff.failures + 1)
                ready()
                stop.wait()
                return
            stop.wait(backoff.next_delay())
