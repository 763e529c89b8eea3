"""Discover every vendor under a host root and assemble the node's inventory.

A vendor backend that raises is a bug, not a node fault: it is logged with its traceback and
recorded as that vendor's error, and the other vendors are still discovered.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping

import structlog

from edl_agent.devices import ascend, hygon, kunlunxin, nvidia
from edl_agent.devices.host_facts import host_facts
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Inventory, Vendor, VendorReport
from edl_agent.devices.resources import advertised_resources
from edl_agent.devices.settings import DeviceSettings

Backend = Callable[[HostRoot], VendorReport | None]

BACKENDS: Mapping[Vendor, Backend] = {
    Vendor.NVIDIA: nvidia.discover,
    Vendor.KUNLUNXIN: kunlunxin.discover,
    Vendor.HYGON: hygon.discover,
    Vendor.ASCEND: ascend.discover,
}


def discover_node(
    settings: DeviceSettings, *, environ: Mapping[str, str] | None = None
) -> Inventory:
    root = HostRoot.at(settings.host_root)
    log = structlog.get_logger().bind(host_root=str(root.root))
    started = time.monotonic()
    reports = tuple(
        report
        for vendor, backend in BACKENDS.items()
        if _enabled(settings, vendor)
        and (report := _run_backend(vendor, backend, root)) is not None
    )
    devices = [device for report in reports for device in report.devices]
    node = node_name(settings, root, os.environ if environ is None else environ)
    disabled = [vendor for vendor in BACKENDS if not _enabled(settings, vendor)]
    inventory = Inventory(
        node=node,
        reports=reports,
        resources=advertised_resources(devices, settings),
        host=host_facts(root, disabled=disabled),
    )
    log.info(
        "discovered",
        node=node,
        vendors=[r.vendor.value for r in reports],
        devices=len(devices),
        resources={r.name: len(r.units) for r in inventory.resources},
        errors=inventory.errors or None,
        seconds=round(time.monotonic() - started, 3),
    )
    return inventory


def node_name(settings: DeviceSettings, root: HostRoot, environ: Mapping[str, str]) -> str:
    """The configured name, else $NODE_NAME (the downward API), else the host's hostname."""
    if settings.node_name:
        return settings.node_name
    if environ.get("NODE_NAME"):
        return environ["NODE_NAME"]
    return root.read_optional("/etc/hostname") or socket.gethostname()


def _enabled(settings: DeviceSettings, vendor: Vendor) -> bool:
    section: object = getattr(settings, vendor.value)
    return bool(getattr(section, "enabled", True))


def _run_backend(vendor: Vendor, backend: Backend, root: HostRoot) -> VendorReport | None:
    log = structlog.get_logger().bind(vendor=vendor.value)
    try:
        report = backend(root)
    except Exception as exc:
        log.exception("discovery backend failed")
        return VendorReport(vendor=vendor, error=f"discovery failed: {type(exc).__name__}: {exc}")
    if report is not None and report.error:
        log.error("vendor discovery error", error=report.error, devices=len(report.devices))
    return report
