"""What a node advertises to kubelet's device-plugin API: whole devices per vendor, MIG devices by
strategy, vNPU templates, then shares (time-slicing replicas, memory units, core units). Vendors
served only through DRA (`serve: dra`) advertise nothing here. Pure: devices and settings in,
resources out."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from edl_agent.devices.model import Device, Resource, ResourceUnit, UnitKind, Vendor
from edl_agent.devices.settings import DeviceSettings, SharingRule

VENDOR_WORDS = re.compile(
    r"^(nvidia|tesla|geforce|quadro|kunlunxin|hygon|huawei)\s+", re.IGNORECASE
)


def advertised_resources(
    devices: Sequence[Device], settings: DeviceSettings
) -> tuple[Resource, ...]:
    """Every resource with its unit ids, sorted by name; unit ids keep device order."""
    devices = [d for d in devices if settings.serve(d.vendor.value) != "dra"]
    units: dict[str, list[ResourceUnit]] = {}
    whole = _whole_device_resources(devices, settings)
    for name, members in whole.items():
        rule = next((r for r in settings.sharing if r.resource == name), None)
        if rule is None or rule.keep_whole:
            units.setdefault(name, []).extend(ResourceUnit(d.id, d.id) for d in members)
        if rule is not None:
            for share_name, unit in _shares(name, members, rule):
                units.setdefault(share_name, []).append(unit)
    for template in settings.ascend.vnpu_templates:
        for device in devices:
            if device.vendor is Vendor.ASCEND and device.parent is None:
                units.setdefault(template.resource, []).extend(
                    ResourceUnit(
                        f"{device.id}::{template.resource.rsplit('/', 1)[-1]}-{i}",
                        device.id,
                        UnitKind.TEMPLATE,
                        template.aicore,
                    )
                    for i in range(template.per_device)
                )
    return tuple(Resource(name, tuple(members)) for name, members in sorted(units.items()))


def _whole_device_resources(
    devices: Sequence[Device], settings: DeviceSettings
) -> dict[str, list[Device]]:
    groups: dict[str, list[Device]] = {}
    for device in devices:
        name = _whole_resource_name(device, devices, settings)
        if name is not None:
            groups.setdefault(name, []).append(device)
    return groups


def _whole_resource_name(
    device: Device, devices: Sequence[Device], settings: DeviceSettings
) -> str | None:
    match device.vendor:
        case Vendor.NVIDIA:
            return _nvidia_resource_name(device, devices, settings)
        case Vendor.KUNLUNXIN:
            return settings.kunlunxin.resource_name
        case Vendor.HYGON:
            return settings.hygon.resource_name
        case Vendor.ASCEND:
            family = ascend_family(device.product)
            # Without npu-smi the chip is unknown: advertising a made-up family would be worse
            # than advertising nothing until the tool answers.
            return None if family is None else settings.ascend.resource_prefix + family
    return None


def _nvidia_resource_name(
    device: Device, devices: Sequence[Device], settings: DeviceSettings
) -> str | None:
    strategy = settings.nvidia.mig_strategy
    if device.kind == "mig":
        if strategy == "mixed":
            return f"nvidia.com/mig-{device.attributes.get('mig_profile', 'unknown')}"
        return settings.nvidia.resource_name if strategy == "single" else None
    if strategy != "none" and any(d.parent == device.id for d in devices):
        return None  # a GPU split into MIG devices is advertised through them
    return settings.nvidia.resource_name


def ascend_family(product: str) -> str | None:
    """Ascend plugin family names: `Ascend910B3`, `910B3` → `Ascend910`; `310P3` → `Ascend310P`."""
    chip = product.removeprefix("Ascend").strip()
    match = re.match(r"(\d{3})(P?)", chip)
    if match is None:
        return None
    return f"Ascend{match.group(1)}{match.group(2)}"


def _shares(
    base: str, devices: Iterable[Device], rule: SharingRule
) -> Iterable[tuple[str, ResourceUnit]]:
    for device in devices:
        names = {
            "{resource}": base,
            "{model}": product_model(device.product),
            "{memory}": f"{round(device.memory_mib / 1024)}g",
        }
        for i in range(rule.replicas):
            yield (
                _render(rule.replica_resource, names),
                ResourceUnit(f"{device.id}::{i}", device.id, UnitKind.REPLICA),
            )
        if rule.memory_unit_mib:
            for i in range(device.memory_mib // rule.memory_unit_mib):
                yield (
                    _render(rule.memory_resource, names),
                    ResourceUnit(
                        f"{device.id}::m{i}", device.id, UnitKind.MEMORY, rule.memory_unit_mib
                    ),
                )
        if rule.core_unit_percent:
            for i in range(100 // rule.core_unit_percent):
                yield (
                    _render(rule.core_resource, names),
                    ResourceUnit(
                        f"{device.id}::c{i}", device.id, UnitKind.CORE, rule.core_unit_percent
                    ),
                )


def product_model(product: str) -> str:
    """A short lower-case model: `Tesla V100-SXM2-32GB` → `v100`, `NVIDIA H100 80GB` → `h100`."""
    name = VENDOR_WORDS.sub("", product.strip())
    token = re.split(r"[\s\-_]+", name, maxsplit=1)[0] if name else "unknown"
    return re.sub(r"[^a-z0-9]", "", token.lower()) or "unknown"


def _render(template: str, names: dict[str, str]) -> str:
    for placeholder, value in names.items():
        template = template.replace(placeholder, value)
    return template
