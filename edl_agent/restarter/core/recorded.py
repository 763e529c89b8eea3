"""What the policies' status records and a restarter must carry out: at a start (or on becoming
leader) the pendingRestarts found are finished and the pendingBackoffs scheduled, so a
restarter killed at any moment delays a restart and never loses one nor makes one twice
(replacement names are deterministic, deletes are conditional on the pod's uid). While running,
`check` carries out again a recorded restart whose pods are still there well after it was
decided, and writes a tidy status for a policy quiet for a while whose finished pending restarts
would otherwise stay."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

import structlog

from edl_agent.faults.model import Fault
from edl_agent.kube_errors import ApiError
from edl_agent.restarter.core.plan import tidy
from edl_agent.restarter.core.policies import PolicyCache
from edl_agent.restarter.core.port import ClusterPort, Conflict
from edl_agent.restarter.core.replacer import Replacer
from edl_agent.restarter.core.status import pending_backoffs, pending_restarts
from edl_agent.restarter.core.templates import GoneTemplates

log = structlog.get_logger(__name__)


class Recorded:
    def __init__(
        self,
        *,
        port: ClusterPort,
        policies: PolicyCache,
        templates: GoneTemplates,
        replacer: Replacer,
        schedule: Callable[[Fault, datetime], None],
        resume_after: float,
        tidy_after: float,
        attempts: int,
    ) -> None:
        self._port = port
        self._policies, self._templates, self._replacer = policies, templates, replacer
        self._schedule = schedule
        self._resume_after = timedelta(seconds=resume_after)
        self._tidy_after = tidy_after
        self._attempts = attempts

    def recover(self) -> None:
        """Finish the restarts and schedule the backoffs a previous run left."""
        for namespace, name in self._policies.valid():
            try:
                obj = self._policies.object(namespace, name, fresh=False)  # just listed
            except ApiError as exc:
                log.warning("cannot read a policy to finish its restarts", error=str(exc))
                continue
            for pending in pending_restarts(obj):
                self._templates.learn(pending.templates)
                log.info(
                    "finishing a restart recorded before this start",
                    policy=f"{namespace}/{name}",
                    job=pending.job,
                    fault_id=pending.fault_id,
                    pods=[p.name for p in pending.pods],
                )
                self._replacer.replace_all(pending, namespace)
            for backoff in pending_backoffs(obj):
                log.info(
                    "resuming a backoff recorded before this start",
                    policy=f"{namespace}/{name}",
                    fault_id=backoff.fault.id,
                    until=backoff.until.isoformat(),
                )
                if backoff.template is not None and backoff.fault.pods:
                    self._templates.learn({backoff.fault.pods[0].uid: backoff.template})
                self._schedule(backoff.fault, backoff.until)

    def check(self, now: datetime) -> None:
        """Carry out again the recorded restarts whose pods are still there well after they were
        decided; drop the finished ones of policies that have been quiet for a while."""
        for obj in self._policies.with_pending_restarts():
            meta = obj["metadata"]
            namespace = str(meta["namespace"])
            for pending in pending_restarts(obj):
                if self._replacer.busy(namespace, pending):
                    continue
                if now - pending.at >= self._resume_after and not all(
                    map(self._templates.done, pending.pods)
                ):
                    log.info("carrying out a recorded restart again", fault_id=pending.fault_id)
                    self._replacer.replace_all(pending, namespace)
            if self._policies.quiet_for((namespace, str(meta["name"]))) >= self._tidy_after:
                self._write_tidy(namespace, str(meta["name"]))

    def _write_tidy(self, namespace: str, name: str) -> None:
        for attempt in range(self._attempts):
            obj = self._policies.object(namespace, name, fresh=attempt > 0)
            status = tidy(obj, replaced=self._templates.done)
            if status is None:
                return
            try:
                self._policies.written(self._port.write_status(obj, status))
                return
            except Conflict:
                continue
            except ApiError as exc:
                log.info("could not tidy a policy's status; later", policy=name, error=str(exc))
                return
