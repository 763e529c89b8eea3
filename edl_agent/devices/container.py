"""What a container is given for devices, vendor by vendor: the visible-devices variable and
how it names the devices, their device nodes (each device's own and the vendor's shared control
nodes), and the share variables for units of a device. Pure. The device plugin's Allocate
(`plugin.allocation`), the CDI specs (`cdi.spec`) and DRA's prepared claims all give a container
the same, from here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from edl_agent.devices.model import Device, ResourceUnit, UnitKind, Vendor

ErrorKind = Literal["invalid_argument", "failed_precondition"]
# id: the device id (an NVIDIA uuid, MIG uuids included); index: host index (`<gpu>:<mig>` for
# a MIG device); local: 0..n-1 in the container; strategy: settings.nvidia_device_id_strategy.
Naming = Literal["id", "index", "local", "strategy"]
IdStrategy = Literal["uuid", "index"]


@dataclass(frozen=True)
class DeviceNode:
    container_path: str
    host_path: str
    permissions: str = "rw"


class AllocationError(Exception):
    """Allocate must refuse: `kind` picks the gRPC status, the message names the ids."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind


@dataclass(frozen=True)
class VendorSpec:
    visible_env: str
    naming: Naming
    control_nodes: tuple[str, ...] = ()
    """Nodes shared by all of the vendor's devices, passed only when they exist on the host."""
    always_device_specs: bool = True
    """False: device nodes are passed only when settings.nvidia_device_specs is set."""
    cdi_kind: str | None = None
    """CDI device kind, named (as in the visible-devices variable) when settings.nvidia_cdi."""


VENDOR_SPECS: Mapping[Vendor, VendorSpec] = {
    Vendor.NVIDIA: VendorSpec(
        visible_env="NVIDIA_VISIBLE_DEVICES",
        naming="strategy",
        control_nodes=(
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools",
            "/dev/nvidia-modeset",
        ),
        always_device_specs=False,  # the NVIDIA container runtime hook normally adds them
        cdi_kind="nvidia.com/gpu",
    ),
    Vendor.KUNLUNXIN: VendorSpec(
        visible_env="XPU_VISIBLE_DEVICES", naming="index", control_nodes=("/dev/xpuctrl",)
    ),
    # The container sees only its own DRM cards, and ROCm numbers the cards it can open from 0:
    # host indexes would name cards that are not there.
    Vendor.HYGON: VendorSpec(
        visible_env="HIP_VISIBLE_DEVICES", naming="local", control_nodes=("/dev/kfd", "/dev/mkfd")
    ),
    Vendor.ASCEND: VendorSpec(
        visible_env="ASCEND_VISIBLE_DEVICES",
        naming="index",
        control_nodes=("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"),
    ),
}
_VENDOR_ORDER = {vendor: i for i, vendor in enumerate(VENDOR_SPECS)}


def optional_control_nodes() -> frozenset[str]:
    """Every shared node a vendor passes when present: what to look for in `existing_paths`."""
    return frozenset(node for spec in VENDOR_SPECS.values() for node in spec.control_nodes)


def host_order(device: Device, devices: Mapping[str, Device]) -> tuple[int, int, int, str]:
    """Sort key: vendor, then host index; a MIG device sorts under its GPU."""
    parent = devices.get(device.parent) if device.parent is not None else None
    major, minor = (parent.index, device.index) if parent is not None else (device.index, -1)
    return _VENDOR_ORDER.get(device.vendor, len(_VENDOR_ORDER)), major, minor, device.id


def visible_names(
    physical: Sequence[Device], devices: Mapping[str, Device], id_strategy: IdStrategy
) -> dict[Vendor, list[str]]:
    """How each vendor's visible-devices variable names its devices among `physical` (given in
    host order). Raises AllocationError for a MIG device named by index whose GPU is not in
    `devices`. `id_strategy`: `plugin.nvidia_device_id_strategy`."""
    names: dict[Vendor, list[str]] = {}
    for vendor in dict.fromkeys(d.vendor for d in physical):
        members = [d for d in physical if d.vendor is vendor]
        spec = VENDOR_SPECS[vendor]
        names[vendor] = [_name(spec, d, i, devices, id_strategy) for i, d in enumerate(members)]
    return names


def visible_envs(names: Mapping[Vendor, Sequence[str]]) -> dict[str, str]:
    """The visible-devices variables for `visible_names`' result."""
    return {VENDOR_SPECS[vendor].visible_env: ",".join(listed) for vendor, listed in names.items()}


def own_device_nodes(device: Device) -> tuple[str, ...]:
    """The device's nodes less the shared control nodes some vendors list with every device."""
    shared = VENDOR_SPECS[device.vendor].control_nodes
    return tuple(node for node in device.device_nodes if node not in shared)


def present_control_nodes(vendor: Vendor, existing_paths: Collection[str]) -> list[str]:
    return [node for node in VENDOR_SPECS[vendor].control_nodes if node in existing_paths]


def _name(
    spec: VendorSpec,
    device: Device,
    local_index: int,
    devices: Mapping[str, Device],
    id_strategy: IdStrategy,
) -> str:
    naming = spec.naming
    if naming == "strategy":
        naming = "id" if id_strategy == "uuid" else "index"
    if naming == "id":
        return device.id
    if naming == "local":
        return str(local_index)
    if device.parent is None:
        return str(device.index)
    parent = devices.get(device.parent)
    if parent is None:
        msg = f"{device.id}: its parent {device.parent} is not on the node, so it has no index"
        raise AllocationError("failed_precondition", msg)
    return f"{parent.index}:{device.index}"


def share_envs(granted: Sequence[ResourceUnit], physical_ids: Sequence[str]) -> dict[str, str]:
    """The share variables for the units granted; `physical_ids` in host order."""

    def of(kind: UnitKind) -> list[ResourceUnit]:
        return [u for u in granted if u.kind is kind]

    envs: dict[str, str] = {}
    if memory := of(UnitKind.MEMORY):
        envs["EDL_SHARE_MEMORY_MIB"] = str(sum(u.amount for u in memory))
    if cores := of(UnitKind.CORE):
        envs["EDL_SHARE_CORE_PERCENT"] = str(sum(u.amount for u in cores))
    if replicas := of(UnitKind.REPLICA):
        envs["EDL_SHARE_REPLICAS"] = str(len(replicas))
    if templates := of(UnitKind.TEMPLATE):
        envs["EDL_VNPU_TEMPLATE"] = ",".join(dict.fromkeys(map(_template_name, templates)))
        envs["EDL_VNPU_AICORE"] = str(sum(u.amount for u in templates))
    if envs:
        shared = {u.device_id for u in granted if u.kind is not UnitKind.WHOLE}
        envs["EDL_SHARE_DEVICES"] = ",".join(i for i in physical_ids if i in shared)
    return envs


def _template_name(unit: ResourceUnit) -> str:
    """Template units are `<device id>::<template>-<i>` (see devices.resources)."""
    suffix = unit.id.rpartition("::")[2]
    return suffix.rpartition("-")[0] or suffix
