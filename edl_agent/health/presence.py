"""A device whose /dev nodes vanished cannot be given to a container: it is unhealthy."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from edl_agent.devices.model import Device


def vanished(devices: Iterable[Device], exists: Callable[[str], bool]) -> frozenset[str]:
    """Ids of devices with at least one missing device node (shared nodes count: a container
    needs them all). `exists` answers for host paths; each path is asked once."""
    seen: dict[str, bool] = {}
    missing: set[str] = set()
    for device in devices:
        for node in device.device_nodes:
            if node not in seen:
                seen[node] = exists(node)
            if not seen[node]:
                missing.add(device.id)
                break
    return frozenset(missing)
