"""Vendor-neutral device model: pure data shared by discovery, device plugin, health, labels."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class Vendor(enum.StrEnum):
    NVIDIA = "nvidia"
    KUNLUNXIN = "kunlunxin"
    HYGON = "hygon"
    ASCEND = "ascend"


class Health(enum.StrEnum):
    """Kubelet's two health strings, used as they are on the wire."""

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


class LinkKind(enum.StrEnum):
    NVLINK = "nvlink"
    HCCS = "hccs"  # Ascend's chip-to-chip interconnect
    HCCS_SW = "hccs-sw"  # HCCS through an HCCS switch (Atlas A3 / 910C)
    SIO = "sio"  # the die-to-die bus between the two dies of one Ascend A3 NPU
    UB = "ub"  # Ascend's unified bus (Atlas 350)
    XGMI = "xgmi"  # Hygon/AMD-style GPU fabric
    XPU_LINK = "xpulink"


@dataclass(frozen=True)
class Link:
    """A direct link from a device to a peer device (by id); `count` is the number of links."""

    peer: str
    kind: LinkKind
    count: int = 1


@dataclass(frozen=True)
class Device:
    """One accelerator, or one partition of it (a MIG instance has `parent` set to its GPU's id).

    `device_nodes` are host paths (`/dev/nvidia0`), never prefixed by the host root: they are what a
    container gets. `attributes` holds vendor facts that only some consumers need (compute
    capability, MIG profile, serial number), as strings so that they serialise unchanged.
    """

    vendor: Vendor
    kind: str
    index: int
    id: str
    product: str
    memory_mib: int
    numa_node: int | None = None
    pci_bus_id: str | None = None
    device_nodes: tuple[str, ...] = ()
    health: Health = Health.HEALTHY
    parent: str | None = None
    links: tuple[Link, ...] = ()
    attributes: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "vendor": self.vendor.value,
            "kind": self.kind,
            "index": self.index,
            "id": self.id,
            "product": self.product,
            "memory_mib": self.memory_mib,
            "numa_node": self.numa_node,
            "pci_bus_id": self.pci_bus_id,
            "health": self.health.value,
            "parent": self.parent,
            "device_nodes": list(self.device_nodes),
            "links": [
                {"peer": link.peer, "kind": link.kind.value, "count": link.count}
                for link in self.links
            ],
            "attributes": dict(sorted(self.attributes.items())),
        }


@dataclass(frozen=True)
class VendorReport:
    """What discovering one vendor produced.

    `error` is set when the vendor's library or tool exists but failed; `devices` then holds what
    could still be read (often nothing). `driver` carries versions (`driver_version`, ...).
    """

    vendor: Vendor
    devices: tuple[Device, ...] = ()
    driver: Mapping[str, str] = field(default_factory=dict)
    error: str | None = None


class UnitKind(enum.StrEnum):
    WHOLE = "whole"  # the device itself
    REPLICA = "replica"  # a time-slicing replica of the device
    MEMORY = "memory"  # one memory unit of the device
    CORE = "core"  # one compute-share unit of the device
    TEMPLATE = "template"  # a fixed partition such as an Ascend vNPU template


@dataclass(frozen=True)
class ResourceUnit:
    """One id advertised to kubelet, and the physical device it stands for."""

    id: str
    device_id: str
    kind: UnitKind = UnitKind.WHOLE
    amount: int = 1  # MiB for memory units, percent for core units, 1 otherwise


@dataclass(frozen=True)
class Resource:
    """An extended resource (`nvidia.com/gpu`, `baidu.com/v100_32g_cgpu`) and its unit ids."""

    name: str
    units: tuple[ResourceUnit, ...]

    @property
    def device_ids(self) -> tuple[str, ...]:
        return tuple(unit.id for unit in self.units)


# PCI vendor ids of the accelerators we discover (sysfs `vendor`, NFD's `pci-<id>` labels).
PCI_VENDORS: Mapping[Vendor, str] = {
    Vendor.NVIDIA: "10de",
    Vendor.ASCEND: "19e5",  # Huawei
    Vendor.HYGON: "1d94",
    Vendor.KUNLUNXIN: "1d22",
}


@dataclass(frozen=True)
class HostFacts:
    """What discovery saw of the host besides devices: the clues to why it found none."""

    host_root: str
    missing: tuple[str, ...] = ()
    """Of `/dev` and `/sys`, those missing under the host root (a root not mounted)."""
    disabled: tuple[Vendor, ...] = ()
    """Vendors turned off in the settings (`<vendor>.enabled: false`)."""
    pci: Mapping[Vendor, int] = field(default_factory=dict)
    """Accelerator-class PCI functions in sysfs by vendor (display, co-processor and
    processing-accelerator classes, as Node Feature Discovery counts them)."""


@dataclass(frozen=True)
class Inventory:
    """Everything discovered on one node, and what would be advertised to kubelet."""

    node: str
    reports: tuple[VendorReport, ...]
    resources: tuple[Resource, ...]
    host: HostFacts | None = None
    """The host's clues, when discovery looked (not for inventories made by hand)."""

    @property
    def devices(self) -> tuple[Device, ...]:
        return tuple(device for report in self.reports for device in report.devices)

    @property
    def errors(self) -> dict[str, str]:
        return {r.vendor.value: r.error for r in self.reports if r.error is not None}

    def device(self, device_id: str) -> Device | None:
        return next((d for d in self.devices if d.id == device_id), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "devices": [device.to_json() for device in self.devices],
            "resources": [
                {"name": resource.name, "devices": list(resource.device_ids)}
                for resource in self.resources
            ],
            "vendors": [
                {
                    "vendor": report.vendor.value,
                    "count": len(report.devices),
                    "driver": dict(sorted(report.driver.items())),
                    "error": report.error,
                }
                for report in self.reports
            ],
        }
