"""CDI spec documents, as JSON-ready dicts. Pure: devices in, specs and CDI ids out.

- One static spec per vendor (`vendor_spec`), kind `nvidia.edl.io/gpu` and the like, with one CDI
  device per discovered device, named by its DRA device name. A device's edits add its own device
  nodes; the spec's edits add the vendor's shared control nodes found on the host, which the
  runtime applies once whichever of the vendor's devices a container gets.
- One spec per prepared claim (`claim_spec`), kind `claim.edl.io/env`, whose single device sets
  the environment the device plugin's Allocate would set for the same devices (visible-devices
  variables, share variables), plus `EDL_CLAIM_UID`.

A container that holds a claim is given the static id of each granted device
(`names.device_cdi_id`) and, once, the claim's id (`claim_cdi_id`). Device nodes are host paths,
passed at the same path in the container.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edl_agent.config import PluginSettings
from edl_agent.devices import names
from edl_agent.devices.container import (
    DeviceNode,
    host_order,
    own_device_nodes,
    present_control_nodes,
    share_envs,
    visible_envs,
    visible_names,
)
from edl_agent.devices.model import Device, ResourceUnit, UnitKind, Vendor

CDI_VERSION = "0.6.0"
CLAIM_UID_ENV = "EDL_CLAIM_UID"
# Kubernetes UIDs are UUIDs; the uid ends up in a CDI device name and in a file name, so nothing
# that could leave the directory or break either is let through.
_CLAIM_UID = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,126}[A-Za-z0-9])?$")

Spec = dict[str, Any]


@dataclass(frozen=True)
class Grant:
    """A device a claim got. `memory_mib` and `core_percent` are set when the claim consumed only
    a share of the device's capacity: MiB of its memory, percent of its compute."""

    device: Device
    memory_mib: int | None = None
    core_percent: int | None = None

    def __post_init__(self) -> None:
        if self.memory_mib is not None and self.memory_mib <= 0:
            raise ValueError(
                f"{self.device.id}: memory_mib must be positive, not {self.memory_mib}"
            )
        if self.core_percent is not None and not 0 < self.core_percent <= 100:
            msg = f"{self.device.id}: core_percent must be 1 to 100, not {self.core_percent}"
            raise ValueError(msg)


def check_claim_uid(claim_uid: str) -> str:
    """The uid, when it is safe in a CDI device name and a file name; ValueError otherwise."""
    if not _CLAIM_UID.match(claim_uid):
        raise ValueError(f"claim uid {claim_uid!r}: expected letters, digits and inner dashes")
    return claim_uid


def vendor_spec(
    vendor: Vendor, devices: Iterable[Device], present_paths: Collection[str]
) -> Spec | None:
    """The static spec for `vendor`'s devices among `devices` (others are ignored); None when it
    has none. `present_paths` are the host paths that exist, for the control nodes."""
    members = [d for d in devices if d.vendor is vendor]
    named = names.device_names(members)  # leaves out a MIG device whose GPU is not in `members`
    by_id = {d.id: d for d in members}
    listed = sorted((by_id[i] for i in named), key=lambda d: host_order(d, by_id))
    if not listed:
        return None
    spec: Spec = {"cdiVersion": CDI_VERSION, "kind": names.cdi_kind(vendor)}
    if control := present_control_nodes(vendor, present_paths):
        spec["containerEdits"] = {"deviceNodes": _device_nodes(control)}
    spec["devices"] = [
        {"name": named[d.id], "containerEdits": {"deviceNodes": _device_nodes(own_device_nodes(d))}}
        for d in listed
    ]
    return spec


def claim_spec(
    claim_uid: str,
    grants: Sequence[Grant],
    *,
    node_devices: Iterable[Device] = (),
    settings: PluginSettings | None = None,
) -> Spec:
    """The spec for one prepared claim.

    `node_devices` is where a granted MIG device's GPU is looked up when NVIDIA devices are named
    by index (`settings.nvidia_device_id_strategy`); without it there, AllocationError is raised.
    """
    check_claim_uid(claim_uid)
    known = _by_id([*node_devices, *(g.device for g in grants)])
    physical = _granted_devices(grants, known)
    strategy = (settings or PluginSettings()).nvidia_device_id_strategy
    env = visible_envs(visible_names(physical, known, strategy))
    env.update(share_envs(_share_units(grants), [d.id for d in physical]))
    env[CLAIM_UID_ENV] = claim_uid
    return {
        "cdiVersion": CDI_VERSION,
        "kind": names.CLAIM_CDI_KIND,
        "devices": [
            {
                "name": names.claim_cdi_name(claim_uid),
                "containerEdits": {"env": [f"{key}={value}" for key, value in env.items()]},
            }
        ],
    }


def claim_cdi_id(claim_uid: str) -> str:
    return f"{names.CLAIM_CDI_KIND}={names.claim_cdi_name(check_claim_uid(claim_uid))}"


def _by_id(devices: Iterable[Device]) -> dict[str, Device]:
    return {d.id: d for d in devices}


def _granted_devices(grants: Sequence[Grant], known: Mapping[str, Device]) -> list[Device]:
    """Each granted device once, in host order."""
    unique = _by_id(g.device for g in grants).values()
    return sorted(unique, key=lambda d: host_order(d, known))


def _share_units(grants: Sequence[Grant]) -> list[ResourceUnit]:
    """The grants' consumed capacity as the device plugin's share units, so that the share
    variables are computed by the same rules as Allocate's."""
    units = []
    for grant in grants:
        device_id = grant.device.id
        if grant.memory_mib is not None:
            units.append(
                ResourceUnit(f"{device_id}::memory", device_id, UnitKind.MEMORY, grant.memory_mib)
            )
        if grant.core_percent is not None:
            units.append(
                ResourceUnit(f"{device_id}::core", device_id, UnitKind.CORE, grant.core_percent)
            )
    return units


def _device_nodes(paths: Iterable[str]) -> list[dict[str, str]]:
    nodes = [DeviceNode(path, path) for path in paths]
    return [{"path": node.container_path, "permissions": node.permissions} for node in nodes]
