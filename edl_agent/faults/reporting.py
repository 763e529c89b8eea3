"""The node's fault reporting, wired: the durable outbox under `faults.state_dir` and its sender
to the restarter (when `faults.restarter_address` is set; otherwise faults are only logged), and
the watcher of this node's pods that adds CONTAINER_EXIT faults (when there is an API client).
`report` is the one way in, from any thread: device faults and container exits alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from edl_agent.config import FaultSettings
from edl_agent.faults.model import Fault
from edl_agent.runtime.supervisor import Supervisor

if TYPE_CHECKING:
    from edl_agent.faults.outbox import Outbox
    from edl_agent.faults.pod_exits import PodExitWatcher
    from edl_agent.faults.sender import Sender
    from edl_agent.kube import NodeApi


class FaultReporting:
    def __init__(self, settings: FaultSettings, node: str) -> None:
        self._settings = settings
        self._node = node
        self.outbox: Outbox | None = None
        self.sender: Sender | None = None
        self.pod_exits: PodExitWatcher | None = None
        self._log = structlog.get_logger().bind(part="faults")

    def start(self, api: NodeApi | None, supervisor: Supervisor) -> None:
        """Open the outbox and hand `supervisor` its sender (when a restarter is configured) and
        the watch of this node's pods for container exits (when `api` is given). Raises
        OutboxError when the state directory cannot be used, ValueError for unusable sender
        settings."""
        from edl_agent.faults.outbox import Outbox
        from edl_agent.faults.sender import Sender, SenderSettings

        settings = self._settings
        if settings.restarter_address:
            outbox = Outbox(Path(settings.state_dir) / "outbox")
            try:
                sender = Sender(outbox, SenderSettings.from_settings(settings))
            except ValueError:
                outbox.close()
                raise
            self.outbox, self.sender = outbox, sender
            supervisor.add(sender, critical=False)
            self._log.info(
                "reporting faults to the restarter",
                address=settings.restarter_address,
                outbox=str(outbox.directory),
                pending=len(outbox),
            )
        else:
            self._log.info("no faults.restarter_address: faults are only logged")
        if api is not None:
            from edl_agent.faults.pod_exits import PodExitWatcher

            self.pod_exits = PodExitWatcher(api, self._node, self.report)
            supervisor.add(self.pod_exits, critical=False)

    def stop(self) -> None:
        """Once the supervisor's parts (the sender, the pod watch) ended: close the outbox;
        pending faults stay in it on disk."""
        self.pod_exits = None
        self.sender = None
        if self.outbox is not None:
            self.outbox.close()
            self.outbox = None

    def pod(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The pod as the pod watcher last saw it, if it did."""
        watcher = self.pod_exits
        return watcher.pod(namespace, name) if watcher is not None else None

    def report(self, fault: Fault) -> None:
        """Log `fault` and keep it in the outbox for the restarter (any thread)."""
        self._log.warning(
            "fault observed",
            fault_id=fault.id,
            kind=str(fault.kind),
            pods=[f"{p.namespace}/{p.name}" for p in fault.pods],
            container=fault.container,
            exit_code=fault.exit_code,
            devices=list(fault.device_ids) or None,
            reason=fault.reason,
        )
        outbox = self.outbox
        if outbox is None:
            return
        from edl_agent.faults.outbox import OutboxError  # loaded with the outbox

        try:
            outbox.enqueue(fault)
        except OutboxError as exc:  # closed while stopping: the fault is seen again next run
            self._log.warning("fault not kept", fault_id=fault.id, error=str(exc))
