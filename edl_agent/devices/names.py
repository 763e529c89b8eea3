"""Names shared by everything DRA and CDI: one driver per vendor under our domain, the device
names that ResourceSlices, claims, CDI specs and kubelet's health stream all use, and the CDI
kinds. Pure.

- Driver (`resourceslice.spec.driver`, the DeviceClass selector, kubelet's registration name):
  `gpu.nvidia.edl.io`, `xpu.kunlunxin.edl.io`, `dcu.hygon.edl.io`, `npu.ascend.edl.io`.
- Pool: the node's name (one pool per driver per node).
- Device name (a DNS label, unique in the pool): `gpu-3`, `xpu-0`, `dcu-7`, `npu-2`, and for a
  MIG device `gpu-3-mig-<gpu instance>-<compute instance>`.
- CDI: kind `<vendor>.edl.io/<class>` (`nvidia.edl.io/gpu`), the device's CDI name is its DRA
  device name, so `nvidia.edl.io/gpu=gpu-3`. Per prepared claim, kind `claim.edl.io/env` names
  one device per claim whose edits carry the environment for all of the claim's devices.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from edl_agent.devices.model import Device, Inventory, Vendor

DOMAIN = "edl.io"
CLASSES: Mapping[Vendor, str] = {
    Vendor.NVIDIA: "gpu",
    Vendor.KUNLUNXIN: "xpu",
    Vendor.HYGON: "dcu",
    Vendor.ASCEND: "npu",
}
CLAIM_CDI_KIND = f"claim.{DOMAIN}/env"
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def driver_name(vendor: Vendor) -> str:
    return f"{CLASSES[vendor]}.{vendor.value}.{DOMAIN}"


def vendor_of_driver(driver: str) -> Vendor | None:
    return next((v for v in CLASSES if driver_name(v) == driver), None)


def cdi_kind(vendor: Vendor) -> str:
    return f"{vendor.value}.{DOMAIN}/{CLASSES[vendor]}"


def device_name(device: Device, parent: Device | None = None) -> str:
    """The device's name in its pool; a MIG device needs its parent GPU (for the GPU's index)."""
    base = f"{CLASSES[device.vendor]}-{device.index}"
    if device.parent is None:
        return base
    if parent is None or parent.id != device.parent:
        raise ValueError(f"{device.id}: its parent {device.parent} is needed for its name")
    gi = device.attributes.get("gpu_instance_id", str(device.index))
    ci = device.attributes.get("compute_instance_id", "0")
    return f"{CLASSES[parent.vendor]}-{parent.index}-mig-{gi}-{ci}"


def device_names(devices: tuple[Device, ...] | list[Device]) -> dict[str, str]:
    """Device id → device name for every device (MIG devices named through their parents)."""
    by_id = {d.id: d for d in devices}
    names = {}
    for device in devices:
        parent = by_id.get(device.parent) if device.parent else None
        if device.parent is not None and parent is None:
            continue  # a MIG device whose GPU was not discovered cannot be named
        names[device.id] = device_name(device, parent)
    return names


def cdi_id(vendor: Vendor, name: str) -> str:
    return f"{cdi_kind(vendor)}={name}"


def device_cdi_id(device: Device, by_id: Mapping[str, Device]) -> str:
    """The device's id in its vendor's static CDI spec (a MIG device's GPU looked up in
    `by_id`)."""
    parent = by_id.get(device.parent) if device.parent else None
    return cdi_id(device.vendor, device_name(device, parent))


def claim_cdi_name(claim_uid: str) -> str:
    return f"claim-{claim_uid}"


def is_device_name(name: str) -> bool:
    return bool(_LABEL.match(name))


def claimable(
    inventory: Inventory, serves_dra: Callable[[Vendor], bool]
) -> dict[tuple[str, str, str], str]:
    """(driver, pool, device name) → device id for every device this node publishes through DRA:
    what kubelet's pod-resources API names for a container's claims."""
    names = device_names(inventory.devices)
    return {
        (driver_name(device.vendor), inventory.node, names[device.id]): device.id
        for device in inventory.devices
        if device.id in names and serves_dra(device.vendor)
    }
