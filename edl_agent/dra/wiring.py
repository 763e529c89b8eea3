"""DRA on this node, started: the vendors whose `serve` is `dra` or `both` are served through
DRA (kubelet plugins, CDI specs, ResourceSlices; only logged without an API client). With none,
the ResourceSlices of this node that an earlier configuration left are removed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import structlog

from edl_agent.config import Settings
from edl_agent.devices.hostroot import HostRoot
from edl_agent.dra.api import DraApi, KubeDraApi
from edl_agent.dra.node import DraNode, dra_vendors
from edl_agent.health.hub import HealthHub
from edl_agent.health.state import DeviceState
from edl_agent.kubelet.podresources import PodResourcesClient
from edl_agent.runtime.supervisor import Supervisor

if TYPE_CHECKING:
    from edl_agent.kube import NodeApi


class StaleSliceCleanup:
    """A part that removes this node's ResourceSlices once, tried again (the supervisor's
    backoff) while the API server cannot be reached, then rests until the agent stops."""

    name = "dra-cleanup"

    def __init__(self, api: DraApi, node: str) -> None:
        self._api = api
        self._node = node

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        from edl_agent.dra.publisher import remove_stale_slices

        remove_stale_slices(self._api, self._node)
        ready()
        stop.wait()


def start_dra(
    settings: Settings,
    *,
    state: DeviceState,
    root: HostRoot,
    api: NodeApi | None,
    reasons: Callable[[], Mapping[str, str]],
    pods: PodResourcesClient,
    supervisor: Supervisor,
    hub: HealthHub,
    wake: threading.Event,
) -> DraNode | None:
    """The DRA node, started and supervised (None when no vendor is served through DRA), and
    with an API server the writer of its claims' device status, woken by `wake` (a waker of the
    agent's stop signal) on claim and health changes. Raises OSError when the plugin socket or
    the CDI directory cannot be made."""
    if not dra_vendors(settings) and not settings.plugin.cdi:
        if api is not None:  # in the background: one list call when there are none
            node = state.snapshot().inventory.node
            supervisor.add(StaleSliceCleanup(KubeDraApi(api), node), critical=False)
        return None
    dra = DraNode(
        settings,
        state,
        root,
        api=KubeDraApi(api) if api is not None else None,
        reasons=reasons,
        pods=pods,
    )
    dra.start()
    supervisor.add(dra, critical=False)
    if api is not None and dra.vendors:
        from edl_agent.dra.claim_status import ClaimStatusWriter

        writer = ClaimStatusWriter(
            api=KubeDraApi(api),
            claims=dra.checkpoint.claims,
            health=dra.driver_health,
            wake=wake,
        )
        hub.subscribe(wake, lambda change: bool(change.transitions or change.shown), keep=False)
        dra.claims_changed = writer.poke
        supervisor.add(writer, critical=False)
    structlog.get_logger().info(
        "serving through DRA",
        drivers=sorted(dra.servers),
        registry=settings.dra.plugins_registry_dir,
        cdi_dir=settings.dra.cdi_dir,
    )
    return dra
