"""Device → pod faults: a device that turns Unhealthy while pods hold it is one DEVICE_UNHEALTHY
fault per pod holding it; one that turns Degraded (it still serves them, a fault is coming) is one
DEVICE_DEGRADED fault per pod, for a policy that moves pods off a degraded device gracefully.

A part of its own (`device-faults`), fed by the health hub's subscription: it asks kubelet's
pod-resources API who holds the device (shares count for their physical device; the pod's uid and
creation time from the pod watcher when it has seen the pod, `pod_faults.per_pod_faults`), on its
own thread. A device no pod holds gives the restarter nothing to restart, so it is only logged.
"No answer" from kubelet is not "no pods": the faults wait and are asked for again every
`retry_seconds` until kubelet answers. A kubelet that hangs holds up only this part: the NVML
event thread that reported the XID has long moved on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog

from edl_agent.faults.ids import device_degraded_id, device_unhealthy_id
from edl_agent.faults.model import Fault, FaultKind
from edl_agent.faults.pod_faults import per_pod_faults
from edl_agent.health.hub import HealthChange, HealthHub
from edl_agent.health.state import DeviceState, Snapshot
from edl_agent.health.tracker import Condition
from edl_agent.kubelet.podresources import Claimable, PodResourcesClient

PodLookup = Callable[[str, str], Mapping[str, Any] | None]


def _turned(change: HealthChange) -> bool:
    return bool(change.turned or change.degraded)


_ID_OF = {
    FaultKind.DEVICE_UNHEALTHY: device_unhealthy_id,
    FaultKind.DEVICE_DEGRADED: device_degraded_id,
}


class DeviceFaults:
    name = "device-faults"

    def __init__(
        self,
        *,
        hub: HealthHub,
        state: DeviceState,
        pods: PodResourcesClient,
        claimable: Callable[[Snapshot], Claimable],
        report: Callable[[Fault], None],
        pod: PodLookup,
        wake: threading.Event,
        retry_seconds: float,
    ) -> None:
        self._state = state
        self._pods = pods
        self._claimable = claimable
        self._report = report
        self._pod = pod
        self._wake = wake
        self._subscription = hub.subscribe(wake, _turned)
        # Not faster than kubelet's own timeout: each retry is one List call.
        self.retry_seconds = retry_seconds
        # (device id, kind) → the condition of a fault waiting for kubelet's pod-resources API.
        self.pending: dict[tuple[str, FaultKind], Condition] = {}
        self._waiting = False  # kubelet did not answer the last ask (logged once)
        self._log = structlog.get_logger().bind(part=self.name)

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        ready()
        while not stop.is_set():
            for change in self._subscription.take():
                for device_id, condition in change.turned:
                    self.pending[device_id, FaultKind.DEVICE_UNHEALTHY] = condition
                for device_id, condition in change.degraded:
                    self.pending[device_id, FaultKind.DEVICE_DEGRADED] = condition
            if self.pending:
                self.attribute()
            # Nothing pending: nothing to do until a device turns Unhealthy (or the stop).
            self._wake.wait(self.retry_seconds if self.pending else None)
            self._wake.clear()

    def attribute(self) -> None:
        """Report the pending faults, one per pod holding the device, if kubelet answers."""
        snapshot = self._state.snapshot()
        holders = self._pods.pod_devices_known(snapshot.units, self._claimable(snapshot))
        if holders is None:
            if not self._waiting:
                self._log.warning(
                    "kubelet's pod-resources API does not answer: device faults wait for it",
                    devices=sorted({device_id for device_id, _ in self.pending}),
                )
            self._waiting = True
            return
        self._waiting = False
        turned, self.pending = list(self.pending.items()), {}
        node = snapshot.inventory.node
        for (device_id, kind), condition in turned:
            held_by = holders.get(device_id, [])
            if not held_by:
                self._log.info(
                    "device held by no pod: no fault to report",
                    device=device_id,
                    kind=kind.value,
                    reason=condition.reason,
                )
                continue
            age = max(0.0, time.monotonic() - condition.since)
            containers = sorted({f"{p.namespace}/{p.pod}/{p.container}" for p in held_by})
            held = f"held by {', '.join(containers)}"
            detail = f"{condition.detail}; {held}" if condition.detail else held
            spell = Fault(
                id=_ID_OF[kind](node, device_id, condition.reason, condition.since),
                kind=kind,
                node=node,
                observed_at=datetime.now(UTC) - timedelta(seconds=age),
                reason=condition.reason,
                device_ids=(device_id,),
                detail=detail,
            )
            names = sorted({(p.namespace, p.pod) for p in held_by})
            for fault in per_pod_faults(spell, [self._pod_object(*name) for name in names]):
                self._report(fault)

    def _pod_object(self, namespace: str, name: str) -> Mapping[str, Any]:
        """The pod as the pod watcher last saw it (uid, creation time); else its name alone,
        which is all kubelet's pod-resources API tells."""
        pod = self._pod(namespace, name)
        return pod if pod is not None else {"metadata": {"namespace": namespace, "name": name}}
