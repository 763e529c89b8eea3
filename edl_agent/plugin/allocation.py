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

from edl_agent.config import PluginSettings
from edl_agent.devices import names as dra_names
from edl_agent.devices.container import (
    VENDOR_SPECS,
    AllocationError,
    DeviceNode,
    VendorSpec,
    host_order,
    own_device_nodes,
    present_control_nodes,
    share_envs,
    visible_envs,
    visible_names,
)
from edl_agent.devices.model import Device, ResourceUnit, Vendor

ALLOCATED_ANNOTATION = "edl.io/allocated-devices"


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
    names = visible_names(physical, devices, settings.nvidia_device_id_strategy)
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
