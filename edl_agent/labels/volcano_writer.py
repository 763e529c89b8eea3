"""Keeps the node's `mindx-dl-deviceinfo-<node>` ConfigMap (`volcano_deviceinfo`) up to date for
Volcano's Ascend scheduling: a supervised part, opt-in (`node.volcano_device_info`).

It writes at start, when the report changes (an NPU turns unhealthy or healthy, a fault's codes or
level change, NPUs come or go) and every `refresh_seconds` (300) even without a change, and never
otherwise. The refresh matters to the reader: Volcano's Ascend plugin takes a ConfigMap only when
its `UpdateTime` is newer than the last one it took, and restarts its informer when a node's
ConfigMap has not changed for 600 s; so `UpdateTime` rises by at least one second per write. A node
without an Ascend NPU of a known chip gets no ConfigMap. A failed API call is logged and retried
with backoff; the part is ready once the first write (or the finding that there is nothing to
write) is done.

A degraded NPU (SubHealth, PreSeparateNPU) is listed with the unhealthy ones and among the faults
at its level (`SubHealthFault`, or its code's): it takes no new pod from kubelet, so Volcano is not
to place one there either. In shadow mode (`health.shadow`) every NPU is listed healthy and no
fault is listed: nothing is withdrawn, and Volcano is given nothing to act on.

It also keeps the Node's `baseDeviceInfos` annotation (the node's NPUs, which the plugin reads
beside the ConfigMap): written at start and whenever the NPUs discovered change, never removed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from edl_agent.health.state import DeviceState, Snapshot
from edl_agent.health.tracker import Condition
from edl_agent.kube import ApiError, NodeApi
from edl_agent.labels.publisher import StatePoke
from edl_agent.labels.volcano_deviceinfo import (
    BASE_DEVICE_INFOS,
    NAMESPACE,
    NpuReport,
    base_device_infos,
    configmap,
    configmap_data,
    configmap_name,
    npu_report,
)
from edl_agent.runtime.backoff import Backoff
from edl_agent.runtime.supervisor import on_stop

REFRESH_SECONDS = 300.0  # MindCluster rewrites every 5 min; its reader's limit is 600 s
MAX_BACKOFF_SECONDS = 30.0
NOT_FOUND = 404
COLLECTION = f"/api/v1/namespaces/{NAMESPACE}/configmaps"


def next_update_time(now: float, last: int | None) -> int:
    """The `UpdateTime` (Unix seconds) of the next write: now, but always after the last one (the
    reader ignores a ConfigMap whose time is not newer than the one it has)."""
    seconds = int(now)
    return seconds if last is None or seconds > last else last + 1


def write_due(
    report: NpuReport, written: NpuReport | None, *, now: float, refresh_at: float
) -> bool:
    """Write when the report differs from the one written, or the refresh is due."""
    return report != written or now >= refresh_at


class VolcanoDeviceInfo:
    name = "volcano-device-info"

    def __init__(
        self,
        *,
        api: NodeApi,
        state: DeviceState,
        conditions: Callable[[], Mapping[str, Condition]],
        prefix: str = "huawei.com/",
        overrides: Mapping[str, str] | None = None,
        refresh_seconds: float = REFRESH_SECONDS,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api = api
        self._state = state
        self._conditions = conditions
        self._prefix = prefix
        self._overrides = overrides
        self._refresh_seconds = refresh_seconds
        self._wall = wall
        self._monotonic = monotonic
        self.poke_event: threading.Event = StatePoke(state)
        self._node = state.snapshot().inventory.node
        self._written: NpuReport | None = None
        self._annotated: str | None = None
        self._update_time: int | None = None
        self._refresh_at = 0.0
        self.writes = 0
        self.failures = 0
        self._log = structlog.get_logger().bind(part=self.name, configmap=self.configmap_name)

    @property
    def configmap_name(self) -> str:
        return configmap_name(self._node)

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        """Write until `stop` (a `StopSignal`: it ends the wait for the next change)."""
        forget = on_stop(stop, self.poke_event.set)
        backoff = Backoff(initial=2.0, maximum=MAX_BACKOFF_SECONDS)
        try:
            while not stop.is_set():
                self.poke_event.clear()  # a poke while writing comes round again
                try:
                    version = self.sync()
                except ApiError as exc:
                    self.failures += 1
                    delay = backoff.next_delay()
                    self._log.warning(
                        "device info write failed", error=str(exc), retry_in=round(delay, 2)
                    )
                    stop.wait(delay)
                    continue
                backoff.reset()
                ready()
                wait = max(0.0, self._refresh_at - self._monotonic())
                self._state.wait_newer(version, wait, self.poke_event)
        finally:
            forget()

    def sync(self) -> int:
        """Compute the report and write it when due, then the node's annotation when it changed
        (the ConfigMap first: it is what scheduling around faults needs); returns the state
        version it read."""
        snapshot = self._state.snapshot()
        self._write_report(snapshot)
        self._annotate(base_device_infos(snapshot.inventory.devices))
        return snapshot.version

    def _write_report(self, snapshot: Snapshot) -> None:
        report = npu_report(
            devices=snapshot.inventory.devices,
            unhealthy=snapshot.withdrawn | snapshot.withdrawn_degraded,
            conditions=self._conditions(),
            prefix=self._prefix,
            overrides=self._overrides,
        )
        now = self._monotonic()
        if report is None:
            if self._refresh_at == 0.0:
                self._log.info("no Ascend NPU of a known chip here: no device info to write")
            self._refresh_at = now + self._refresh_seconds  # look again then, or on a change
            return
        if not write_due(report, self._written, now=now, refresh_at=self._refresh_at):
            return
        wall = self._wall()
        update_time = next_update_time(wall, self._update_time)
        data = configmap_data(report, update_time=update_time, wall_offset=wall - now)
        created = self._write(configmap(self._node, data))
        changed = report != self._written
        self._written, self._update_time = report, update_time
        self._refresh_at = now + self._refresh_seconds
        self.writes += 1
        self._log.info(
            "device info created" if created else "device info written",
            update_time=update_time,
            unhealthy=[name for family in report.families for name in family.unhealthy],
            reason="changed" if changed else "refresh",
        )

    def _annotate(self, value: str | None) -> None:
        """The Node's `baseDeviceInfos` annotation set to `value`, when it differs from the last
        value set (None: no NPU to list, nothing written)."""
        if value is None or value == self._annotated:
            return
        self._api.patch_node(self._node, {"metadata": {"annotations": {BASE_DEVICE_INFOS: value}}})
        self._annotated = value
        self._log.info("node annotation written", annotation=BASE_DEVICE_INFOS)

    def _write(self, body: Mapping[str, Any]) -> bool:
        """Replace the ConfigMap, or create it where there is none; True when created."""
        try:
            self._api.request("PUT", f"{COLLECTION}/{self.configmap_name}", body)
        except ApiError as exc:
            if exc.status != NOT_FOUND:
                raise
        else:
            return False
        # Made meanwhile by someone else (409): the retry replaces it.
        self._api.request("POST", COLLECTION, body)
        return True
