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
from edl_agent.dra.api import KubeDraApi
from edl_agent.dra.node import DraNode, dra_vendors
from edl_agent.health.state import DeviceState
from edl_agent.kubelet.podresources import PodResourcesClient
from edl_agent.runtime.supervisor import Supervisor

if TYPE_CHECKING:
    from edl_agent.kube import NodeApi


def start_dra(
    settings: Settings,
    *,
    state: DeviceState,
    root: HostRoot,
    api: NodeApi | None,
    reasons: Callable[[], Mapping[str, str]],
    pods: PodResourcesClient,
    supervisor: Supervisor,
) -> DraNode | None:
    """The DRA node, started and supervised (None when no vendor is served through DRA).
    Raises OSError when the plugin socket or the CDI directory cannot be made."""
    if not dra_vendors(settings) and not settings.plugin.cdi:
        if api is not None:  # in the background: one list call when there are none
            from edl_agent.dra.publisher import remove_stale_slices

            args = (KubeDraApi(api), state.snapshot().inventory.node)
            cleanup = threading.Thread(target=remove_stale_slices, args=args, name="dra-cleanup")
            cleanup.daemon = True
            cleanup.start()
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
    structlog.get_logger().info(
        "serving through DRA",
        drivers=sorted(dra.servers),
        registry=settings.dra.plugins_registry_dir,
        cdi_dir=settings.dra.cdi_dir,
    )
    return dra
