"""What a container gets for the ids kubelet hands to Allocate. Pure: ids, units, devices and the
node's live state in; device nodes, environment, annotations and CDI names out.

Every vendor's conventions live in `VENDOR_SPECS`. Beside the vendor's visible-devices variable
(`NVIDIA_VISIBLE_DEVICES`, `XPU_VISIBLE_DEVICES`, `HIP_VISIBLE_DEVICES`,
`ASCEND_VISIBLE_DEVICES`), a container granted shares learns what it holds from:

- `EDL_SHARE_DEVICES`: comma-joined ids of the physical devices behind its share units.
- `EDL_SHARE_MEMORY_MIB`: total MiB of its memory units.
- `EDL_SHARE_CORE_PERCENT`: total percent of one device's compute of its core units.
- `EDL_SHARE_REPLICAS`: number of time-slicing replica ids it got.
- `EDL_VNPU_TEMPLATE`: the vNPU template name (`Ascend910-5c`; comma-joined if several), and
  `EDL_VNPU_AICORE`: the total AI cores of its template units.

Each is set only when a unit of that kind was granted. Every container also gets the annotation
`edl.io/allocated-devices`: the comma-joined physical device ids, for later fault attribution.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from edl_agent.config import PluginSettings
from edl_agent.devices import names as dra_names
from edl_agent.devices.model import Device, ResourceUnit, UnitKind, Vendor

ALLOCATED_ANNOTATION = "edl.io/allocated-devices"

ErrorKind = Literal["invalid_argument", "failed_precondition"]
# id: the device id (an NVIDIA uuid, MIG uuids included); index: host index (`<gpu>:<mig>` for
# a MIG device); local: 0..n-1 in the container; strategy: settings.nvidia_device_id_strategy.
Naming = Literal["id", "index", "local", "strategy"]


@dataclass(frozen=True)
class DeviceNode:
    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class MountSpec:
    container_path: str
    host_path: str
    read_only: bool = True


@dataclass(frozen=True)
class ContainerAllocation:
    envs: Mapping[str, str]
    devices: tuple[DeviceNode, ...] = ()
    mounts: tuple[MountSpec, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()


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


def paths_to_check(devices: Collection[Device], settings: PluginSettings) -> set[str]:
    """The host paths whose presence `allocate` reads for `devices` (MIG parents included by
    the caller): device and control nodes of each vendor that hands out device specs, and
    nothing for NVIDIA unless `nvidia_device_specs` is on."""
    paths: set[str] = set()
    for vendor in {d.vendor for d in devices}:
        spec = VENDOR_SPECS[vendor]
        if _passes_device_specs(spec, settings):
            paths.update(spec.control_nodes)
    for device in devices:
        if _passes_device_specs(VENDOR_SPECS[device.vendor], settings):
            paths.update(device.device_nodes)
    return paths


def _passes_device_specs(spec: VendorSpec, settings: PluginSettings) -> bool:
    return spec.always_device_specs or settings.nvidia_device_specs


def allocate(
    *,
    requested_ids: Sequence[str],
    units: Mapping[str, ResourceUnit],
    devices: Mapping[str, Device],
    unhealthy: Collection[str],
    existing_paths: Collection[str],
    settings: PluginSettings,
) -> ContainerAllocation:
    """The response for one container; raises AllocationError naming the ids it cannot grant.

    `unhealthy` holds the ids of physical devices that are unhealthy now (a MIG device also counts
    as unhealthy when its parent GPU is listed); `Device.health` is not consulted.
    """
    ids = tuple(dict.fromkeys(requested_ids))
    if not ids:
        raise AllocationError("invalid_argument", "no device ids requested")
    unknown = [i for i in ids if i not in units]
    if unknown:
        raise AllocationError("invalid_argument", f"unknown device id(s): {', '.join(unknown)}")
    granted = [units[i] for i in ids]
    gone = [u.id for u in granted if u.device_id not in devices]
    if gone:
        msg = f"the device behind id(s) {', '.join(gone)} is no longer on the node"
        raise AllocationError("failed_precondition", msg)
    sick = [u.id for u in granted if _is_unhealthy(devices[u.device_id], unhealthy)]
    if sick:
        raise AllocationError("failed_precondition", f"unhealthy device id(s): {', '.join(sick)}")

    physical = sorted(
        (devices[i] for i in dict.fromkeys(u.device_id for u in granted)),
        key=lambda d: host_order(d, devices),
    )
    names = visible_names(physical, devices, settings)
    envs = visible_envs(names)
    nodes: list[DeviceNode] = []
    cdi: list[str] = []
    for vendor, vendor_names in names.items():
        spec = VENDOR_SPECS[vendor]
        if _passes_device_specs(spec, settings):
            members = [d for d in physical if d.vendor is vendor]
            nodes += _device_nodes(vendor, members, existing_paths)
        if spec.cdi_kind is not None and settings.nvidia_cdi:
            cdi += [f"{spec.cdi_kind}={name}" for name in vendor_names]
        if settings.cdi:
            cdi += [dra_names.device_cdi_id(d, devices) for d in physical if d.vendor is vendor]
    envs.update(share_envs(granted, [d.id for d in physical]))
    return ContainerAllocation(
        envs=envs,
        devices=tuple(dict.fromkeys(nodes)),  # MIG devices of one GPU share its node
        annotations={ALLOCATED_ANNOTATION: ",".join(d.id for d in physical)},
        cdi_devices=tuple(cdi),
    )


def _is_unhealthy(device: Device, unhealthy: Collection[str]) -> bool:
    return device.id in unhealthy or (device.parent is not None and device.parent in unhealthy)


def host_order(device: Device, devices: Mapping[str, Device]) -> tuple[int, int, int, str]:
    """Sort key: vendor, then host index; a MIG device sorts under its GPU."""
    parent = devices.get(device.parent) if device.parent is not None else None
    major, minor = (parent.index, device.index) if parent is not None else (device.index, -1)
    return _VENDOR_ORDER.get(device.vendor, len(_VENDOR_ORDER)), major, minor, device.id


def visible_names(
    physical: Sequence[Device], devices: Mapping[str, Device], settings: PluginSettings
) -> dict[Vendor, list[str]]:
    """How each vendor's visible-devices variable names its devices among `physical` (given in
    host order). Raises AllocationError for a MIG device named by index whose GPU is not in
    `devices`."""
    names: dict[Vendor, list[str]] = {}
    for vendor in dict.fromkeys(d.vendor for d in physical):
        members = [d for d in physical if d.vendor is vendor]
        spec = VENDOR_SPECS[vendor]
        names[vendor] = [_name(spec, d, i, devices, settings) for i, d in enumerate(members)]
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
    settings: PluginSettings,
) -> str:
    naming = spec.naming
    if naming == "strategy":
        naming = "id" if settings.nvidia_device_id_strategy == "uuid" else "index"
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


def _device_nodes(
    vendor: Vendor, members: Sequence[Device], existing_paths: Collection[str]
) -> list[DeviceNode]:
    paths = present_control_nodes(vendor, existing_paths)
    for device in members:
        own = own_device_nodes(device)
        missing = [node for node in own if node not in existing_paths]
        if missing:
            # Passing a node that is gone makes the runtime fail the container with a far less
            # readable error, and health polling may not have noticed yet.
            msg = f"{device.id}: device node(s) {', '.join(missing)} missing on the host"
            raise AllocationError("failed_precondition", msg)
        paths += own
    return [DeviceNode(path, path) for path in paths]


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
