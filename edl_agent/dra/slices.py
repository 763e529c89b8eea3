"""The ResourceSlices that describe this node's devices, as the API server takes them. Pure:
devices, health and settings in, plain dicts out.

Every vendor served by DRA (`serve: dra` or `both`) gets one pool per node: driver
`names.driver_name(vendor)`, pool name and `nodeName` the node. Its slices hold at most
`MAX_DEVICES_PER_SLICE` devices each, followed by the slices of shared counters (MIG).

Attributes (unqualified names belong to the driver's domain, e.g.
`device.attributes["gpu.nvidia.edl.io"].kind` in CEL):
- every device: `vendor`, `kind` (gpu, mig, xpu, dcu, npu), `product`, `model` (`h100`),
  `id` (the agent's device id, as in metrics and the device plugin), `index` (int), and where
  known `uuid`, `serial`, `numaNode` (int), `driverVersion` (version), and the standard
  attributes `resource.kubernetes.io/pciBusID` and `resource.kubernetes.io/numaNode` (KEP-6072,
  GA in Kubernetes 1.37: one name for every driver, so a claim can keep devices of several
  drivers on one NUMA node with `matchAttribute`);
- NVIDIA GPUs: `architecture`, `computeCapability` (version `9.0.0`), `cudaDriverVersion`
  (version); MIG devices also `migProfile`, `parentUUID`, `parentIndex`, `gpuInstance`,
  `computeInstance` (ints); Hygon DCUs `computeUnits` (int).
Capacities: `memory` (a binary quantity); devices under a sharing rule add `cores` (percent of
the device) and `replicas` (time-slices) as they apply.

MIG devices (strategy `single` or `mixed`) are partitions of their GPU: each GPU with MIG
devices has a counter set named after it with its `memory`, and each of its MIG devices
consumes its own memory from it. The GPU itself is not published then, as with the device
plugin. With strategy `none` only whole GPUs are published.

Sharing rules become consumable capacity: the device allows multiple allocations, and a claim
takes `memory` in steps of `memory_unit_mib`, `cores` in steps of `core_unit_percent` and one
of `replicas` time-slices unless it asks for more. Clusters without DRAConsumableCapacity drop
these fields; the publisher notices (`dropped_features`) and publishes such devices whole
(`without_features`), so that each goes to one claim at a time.

Unhealthy devices (a MIG device when its GPU is) carry the taint `edl.io/unhealthy` with the
reason as its value and `dra.unhealthy_taint` as its effect; degraded ones (a fault is coming,
their claims keep running) `edl.io/degraded` with `dra.degraded_taint` (NoSchedule or None).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import re
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from edl_agent.config import Settings
from edl_agent.devices import names
from edl_agent.devices.model import Device, Health, Inventory, UnitKind, Vendor
from edl_agent.devices.resources import advertised_resources, product_model
from edl_agent.dra.values import (
    int_value,
    mib_quantity,
    optional_string_value,
    semver,
    string_value,
    version_value,
)
from edl_agent.health.state import Snapshot
from edl_agent.kube_time import format_time
from edl_agent.labels.compute import label_value

Spec = dict[str, Any]
HealthSource = Snapshot | tuple[Inventory, Mapping[str, str] | Collection[str]]

UNHEALTHY_TAINT_KEY = f"{names.DOMAIN}/unhealthy"
DEGRADED_TAINT_KEY = f"{names.DOMAIN}/degraded"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
NUMA_NODE = "resource.kubernetes.io/numaNode"
# The API allows 128 devices in a slice, but only 64 once any of them has a taint or consumes
# counters. Always 64: a device turning unhealthy must not re-split the pool.
MAX_DEVICES_PER_SLICE = 64
MAX_COUNTER_SETS_PER_SLICE = 8
MAX_SLICE_NAME = 253
# Features whose fields an API server drops when they are off (their feature gates' names).
CONSUMABLE_CAPACITY = "DRAConsumableCapacity"
DEVICE_TAINTS = "DRADeviceTaints"
PARTITIONABLE_DEVICES = "DRAPartitionableDevices"


def desired_slices(
    source: HealthSource,
    settings: Settings,
    node: str,
    now: datetime,
    *,
    generation: int = 1,
    degraded: Mapping[str, str] | None = None,
) -> dict[str, list[Spec]]:
    """Driver → the specs of its pool's slices on `node`, for every vendor served by DRA that has
    devices. `source`: a Snapshot, or the inventory with the unhealthy device ids (a mapping
    gives each one's reason, which becomes the taint's value); `degraded`: degraded device id →
    reason (a Snapshot's own degraded devices when None). `now` stamps new taints."""
    inventory, reasons = _health_view(source)
    if degraded is None:
        listed = source.withdrawn_degraded if isinstance(source, Snapshot) else ()
        degraded = dict.fromkeys(listed, "true")
    worn = {key: label_value(why, default="true") for key, why in degraded.items()}
    for device in inventory.devices:
        if device.parent is not None and device.parent in worn:
            worn.setdefault(device.id, worn[device.parent])
    worn = {key: why for key, why in worn.items() if key not in reasons}
    devices = inventory.devices
    device_names = names.device_names(devices)
    shares = _shares_by_device(devices, settings)
    drivers = {r.vendor: r.driver for r in inventory.reports}
    taint_time = format_time(now)
    result: dict[str, list[Spec]] = {}
    for vendor in names.CLASSES:
        if settings.serve(vendor.value) == "device-plugin":
            continue
        published = _published(vendor, devices, device_names, settings)
        if not published:
            continue
        versions = drivers.get(vendor, {})
        context = _Context(
            by_id={d.id: d for d in devices},
            device_names=device_names,
            driver_version=semver(versions.get("driver_version", "")),
            cuda_version=semver(versions.get("cuda_driver_version", "")),
            shares=shares,
            reasons=reasons,
            taint=(settings.dra.unhealthy_taint, taint_time),
            degraded=worn,
            degraded_effect=settings.dra.degraded_taint,
        )
        entries = [_device_entry(device, context) for device in published]
        counters = _counter_sets(published, context)
        result[names.driver_name(vendor)] = _pool_specs(
            names.driver_name(vendor), node, generation, entries, counters
        )
    return result


def slice_name(node: str, driver: str, index: int) -> str:
    """The name of the pool's `index`th slice: `<node>-<class>-<vendor>-<index>`, the node's
    name shortened (with a hash of it) where the whole would be longer than a name may be."""
    vendor = names.vendor_of_driver(driver)
    tag = f"{names.CLASSES[vendor]}-{vendor.value}" if vendor else _dns_label(driver)
    suffix = f"-{tag}-{index}"
    if len(node) + len(suffix) <= MAX_SLICE_NAME:
        return node + suffix
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    kept = node[: MAX_SLICE_NAME - len(suffix) - len(digest) - 1].rstrip("-.")
    return f"{kept}-{digest}{suffix}"


def with_generation(specs: Sequence[Spec], generation: int) -> list[Spec]:
    """Copies of a pool's specs stamped with `generation`."""
    stamped = copy.deepcopy(list(specs))
    for spec in stamped:
        spec["pool"]["generation"] = generation
    return stamped


def same_content(desired: Spec, stored: Spec) -> bool:
    """Whether a stored slice says what `desired` says, whatever the pool generation of either
    and the time the server stamped on a taint that `desired` also has."""
    ours = carry_taint_times(desired, stored)
    theirs = copy.deepcopy(stored)
    ours["pool"].pop("generation", None)
    theirs.get("pool", {}).pop("generation", None)
    return bool(ours == theirs)


def carry_taint_times(desired: Spec, stored: Spec | None) -> Spec:
    """`desired` with the `timeAdded` of each taint the stored slice already has on the same
    device (same key, value and effect): a taint keeps the time it first appeared."""
    result = copy.deepcopy(desired)
    if not stored:
        return result
    stored_taints = {
        device.get("name"): device.get("taints") or [] for device in stored.get("devices") or []
    }
    for device in result.get("devices") or []:
        for taint in device.get("taints") or []:
            match = next(
                (t for t in stored_taints.get(device["name"], []) if _same_taint(t, taint)), None
            )
            if match is not None and "timeAdded" in match:
                taint["timeAdded"] = match["timeAdded"]
    return result


def dropped_features(sent: Spec, stored: Spec) -> frozenset[str]:
    """The features whose fields were in the spec sent but are missing from the one the API
    server stored: it drops the fields of features that are off, without an error."""
    dropped = set()
    if sent.get("sharedCounters") and not stored.get("sharedCounters"):
        dropped.add(PARTITIONABLE_DEVICES)
    kept = {device.get("name"): device for device in stored.get("devices") or []}
    for device in sent.get("devices") or []:
        other = kept.get(device["name"], {})
        if device.get("consumesCounters") and not other.get("consumesCounters"):
            dropped.add(PARTITIONABLE_DEVICES)
        if device.get("taints") and not other.get("taints"):
            dropped.add(DEVICE_TAINTS)
        if device.get("allowMultipleAllocations") and not other.get("allowMultipleAllocations"):
            dropped.add(CONSUMABLE_CAPACITY)
    return frozenset(dropped)


def without_features(specs: Sequence[Spec], features: Collection[str]) -> list[Spec]:
    """A pool's specs for a cluster without `features`: shared devices published whole, no
    counters, and without device taints no unhealthy devices (left out, not offered as
    healthy). Slices left empty go, and the rest are counted again."""
    if not features:
        return copy.deepcopy(list(specs))
    kept: list[Spec] = []
    for spec in copy.deepcopy(list(specs)):
        if PARTITIONABLE_DEVICES in features and "sharedCounters" in spec:
            continue
        if "devices" in spec:
            spec["devices"] = [
                _without(device, features)
                for device in spec["devices"]
                if not (DEVICE_TAINTS in features and device.get("taints"))
            ]
            if not spec["devices"]:
                continue
        kept.append(spec)
    for spec in kept:
        spec["pool"]["resourceSliceCount"] = len(kept)
    return kept


# --- devices ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Share:
    """How one device is shared: its memory and core units, and its time-slices."""

    memory_unit_mib: int = 0
    core_unit_percent: int = 0
    replicas: int = 0


@dataclass(frozen=True)
class _Context:
    """What building one vendor's device entries needs besides the device."""

    by_id: Mapping[str, Device]
    device_names: Mapping[str, str]
    driver_version: str | None
    cuda_version: str | None
    shares: Mapping[str, _Share]
    reasons: Mapping[str, str]
    taint: tuple[str, str]  # effect, time added
    degraded: Mapping[str, str]
    degraded_effect: str


def _health_view(source: HealthSource) -> tuple[Inventory, dict[str, str]]:
    """The inventory, and device id → taint value for every unhealthy device (MIG devices of
    an unhealthy GPU included)."""
    if isinstance(source, Snapshot):
        return source.inventory, dict.fromkeys(source.withdrawn, "true")
    inventory, unhealthy = source
    given = dict(unhealthy) if isinstance(unhealthy, Mapping) else dict.fromkeys(unhealthy, "")
    reasons = {key: label_value(str(why), default="true") for key, why in given.items()}
    devices = inventory.devices
    for device in devices:
        if device.health is Health.UNHEALTHY:
            reasons.setdefault(device.id, "true")
    for device in devices:
        if device.parent is not None and device.parent in reasons:
            reasons.setdefault(device.id, reasons[device.parent])
    return inventory, reasons


def _published(
    vendor: Vendor, devices: Sequence[Device], device_names: Mapping[str, str], settings: Settings
) -> list[Device]:
    """The vendor's devices a pool offers: MIG devices in place of their GPU unless the MIG
    strategy is `none`, as the device plugin advertises them."""
    ours = [d for d in devices if d.vendor is vendor and d.id in device_names]
    if vendor is not Vendor.NVIDIA:
        return ours
    if settings.nvidia.mig_strategy == "none":
        return [d for d in ours if d.parent is None]
    split = {d.parent for d in ours if d.parent is not None}
    return [d for d in ours if d.id not in split]


def _shares_by_device(devices: Sequence[Device], settings: Settings) -> dict[str, _Share]:
    """Device id → its share units. The rules name device-plugin resources (`nvidia.com/gpu`),
    so they are read from what the device plugin would advertise if it served every vendor:
    both APIs then share the same devices the same way."""
    if not settings.sharing:
        return {}
    as_plugin = dataclasses.replace(
        settings,
        **{
            vendor.value: dataclasses.replace(
                getattr(settings, vendor.value), serve="device-plugin"
            )
            for vendor in Vendor
        },
    )
    memory: dict[str, int] = {}
    cores: dict[str, int] = {}
    replicas: dict[str, int] = {}
    for resource in advertised_resources(devices, as_plugin):
        for unit in resource.units:
            if unit.kind is UnitKind.MEMORY:
                memory[unit.device_id] = unit.amount
            elif unit.kind is UnitKind.CORE:
                cores[unit.device_id] = unit.amount
            elif unit.kind is UnitKind.REPLICA:
                replicas[unit.device_id] = replicas.get(unit.device_id, 0) + 1
    return {
        device_id: _Share(
            memory.get(device_id, 0), cores.get(device_id, 0), replicas.get(device_id, 0)
        )
        for device_id in memory.keys() | cores.keys() | replicas.keys()
    }


def _device_entry(device: Device, context: _Context) -> Spec:
    entry: Spec = {
        "name": context.device_names[device.id],
        "attributes": _attributes(device, context),
    }
    capacity = _capacity(device, context.shares.get(device.id))
    if capacity:
        entry["capacity"] = capacity
    if device.id in context.shares:
        entry["allowMultipleAllocations"] = True
    if device.parent is not None and device.parent in context.by_id:
        entry["consumesCounters"] = [
            {
                "counterSet": context.device_names[device.parent],
                "counters": {"memory": {"value": mib_quantity(device.memory_mib)}},
            }
        ]
    effect, added = context.taint
    if device.id in context.reasons:
        taint = (UNHEALTHY_TAINT_KEY, context.reasons[device.id], effect)
    elif device.id in context.degraded:
        taint = (DEGRADED_TAINT_KEY, context.degraded[device.id], context.degraded_effect)
    else:
        return entry
    key, value, effect = taint
    entry["taints"] = [{"key": key, "value": value, "effect": effect, "timeAdded": added}]
    return entry


def _attributes(device: Device, context: _Context) -> dict[str, dict[str, Any]]:
    facts = device.attributes
    attributes: dict[str, dict[str, Any]] = {
        "vendor": string_value(device.vendor.value),
        "kind": string_value(device.kind),
        "product": string_value(device.product),
        "model": string_value(product_model(device.product)),
        "id": string_value(device.id),
        "index": {"int": device.index},
    }
    uuid = device.id if device.vendor is Vendor.NVIDIA else facts.get("uuid")
    optional: dict[str, dict[str, Any] | None] = {
        "uuid": string_value(uuid) if uuid else None,
        "serial": optional_string_value(facts.get("serial") or facts.get("serial_number")),
        "numaNode": {"int": device.numa_node} if _known(device.numa_node) else None,
        NUMA_NODE: {"int": device.numa_node} if _known(device.numa_node) else None,
        PCI_BUS_ID: optional_string_value(device.pci_bus_id),
        "driverVersion": version_value(context.driver_version),
        "architecture": optional_string_value(facts.get("architecture")),
        "computeCapability": version_value(semver(facts.get("compute_capability", ""))),
        "computeUnits": int_value(facts.get("compute_units")),
    }
    if device.vendor is Vendor.NVIDIA:
        optional["cudaDriverVersion"] = version_value(context.cuda_version)
    if device.parent is not None:
        for key, value in _mig_attributes(device, context.by_id.get(device.parent)).items():
            if optional.get(key) is None:
                optional[key] = value
    attributes |= {key: value for key, value in optional.items() if value is not None}
    return attributes


def _mig_attributes(device: Device, parent: Device | None) -> dict[str, dict[str, Any] | None]:
    """A MIG device's own facts, and its GPU's where it has none of its own (compute
    capability, architecture and serial hold for the GPU's partitions too)."""
    facts = device.attributes
    return {
        "migProfile": optional_string_value(facts.get("mig_profile")),
        "parentUUID": string_value(parent.id) if parent is not None else None,
        "parentIndex": {"int": parent.index} if parent is not None else None,
        "gpuInstance": int_value(facts.get("gpu_instance_id")),
        "computeInstance": int_value(facts.get("compute_instance_id")),
        "computeCapability": version_value(semver(_fact(parent, "compute_capability"))),
        "architecture": optional_string_value(_fact(parent, "architecture")),
        "serial": optional_string_value(_fact(parent, "serial")),
    }


def _capacity(device: Device, share: _Share | None) -> dict[str, Spec]:
    capacity: dict[str, Spec] = {}
    if device.memory_mib > 0:
        capacity["memory"] = {"value": mib_quantity(device.memory_mib)}
        if share is not None and share.memory_unit_mib:
            policy = _request_policy(device.memory_mib, share.memory_unit_mib, mib_quantity)
            if policy is not None:
                capacity["memory"]["requestPolicy"] = policy
    if share is not None and share.core_unit_percent:
        capacity["cores"] = {"value": "100"}
        policy = _request_policy(100, share.core_unit_percent, str)
        if policy is not None:
            capacity["cores"]["requestPolicy"] = policy
    if share is not None and share.replicas:
        capacity["replicas"] = {"value": str(share.replicas)}
        policy = _request_policy(share.replicas, 1, str)
        if policy is not None:
            capacity["replicas"]["requestPolicy"] = policy
    return capacity


def _request_policy(total: int, unit: int, quantity: Any) -> Spec | None:
    """Take `unit` unless more is asked, in steps of `unit`. The API wants the minimum within
    the capacity, and a step only where one more fits: a device smaller than two units gets no
    step, and one smaller than a unit no policy at all."""
    if unit > total:
        return None
    value_range: Spec = {"min": quantity(unit)}
    if 2 * unit <= total:
        value_range["step"] = quantity(unit)
    return {"default": quantity(unit), "validRange": value_range}


def _counter_sets(published: Sequence[Device], context: _Context) -> list[Spec]:
    """One counter set per GPU with published MIG devices, holding the GPU's memory."""
    members: dict[str, list[Device]] = {}
    for device in published:
        if device.parent is not None and device.parent in context.by_id:
            members.setdefault(device.parent, []).append(device)
    sets = []
    for parent_id, migs in members.items():
        parent = context.by_id[parent_id]
        # The MIG devices exist side by side, so the set must hold all of them even where the
        # GPU reports less memory than their sum.
        total = max(parent.memory_mib, sum(m.memory_mib for m in migs))
        sets.append(
            {
                "name": context.device_names[parent_id],
                "counters": {"memory": {"value": mib_quantity(total)}},
            }
        )
    return sets


def _pool_specs(
    driver: str, node: str, generation: int, entries: list[Spec], counters: list[Spec]
) -> list[Spec]:
    bodies: list[Spec] = [
        {"devices": chunk} for chunk in _chunks(entries, MAX_DEVICES_PER_SLICE)
    ] + [{"sharedCounters": chunk} for chunk in _chunks(counters, MAX_COUNTER_SETS_PER_SLICE)]
    pool = {"name": node, "generation": generation, "resourceSliceCount": len(bodies)}
    return [{"driver": driver, "pool": dict(pool), "nodeName": node, **body} for body in bodies]


def _chunks(items: list[Spec], size: int) -> Iterator[list[Spec]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _without(device: Spec, features: Collection[str]) -> Spec:
    if CONSUMABLE_CAPACITY in features:
        device.pop("allowMultipleAllocations", None)
        for capacity in (device.get("capacity") or {}).values():
            capacity.pop("requestPolicy", None)
    if PARTITIONABLE_DEVICES in features:
        device.pop("consumesCounters", None)
    return device


def _same_taint(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return all(a.get(key) == b.get(key) for key in ("key", "value", "effect"))


def _known(numa_node: int | None) -> bool:
    return numa_node is not None and numa_node >= 0


def _fact(device: Device | None, key: str) -> str:
    return "" if device is None else device.attributes.get(key, "")


def _dns_label(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "driver"
