"""Node labels from the inventory: one schema for every vendor, plus GFD's `nvidia.com/*`. Pure.

Every value is a valid label value (at most 63 characters of `[A-Za-z0-9._-]`, alphanumeric at
both ends): names are sanitised — accents dropped, spaces and other characters turned into `-`,
long names cut — and a name with nothing left reads `unknown`.

Vendor-neutral labels, for each vendor with at least one device (`<vendor>`: `nvidia`,
`kunlunxin`, `hygon`, `ascend`):

| key | value |
|---|---|
| `edl.io/accelerator.vendors` | the vendors, sorted, joined by `.`: `ascend.nvidia` |
| `edl.io/accelerator.count` | physical devices of every vendor |
| `edl.io/accelerator.healthy` | of those, the ones neither unhealthy, degraded nor cordoned |
| `edl.io/accelerator.degraded` | of those, the degraded ones (serving their pods, no new ones) |
| `edl.io/<vendor>.product` | the vendor's most common product: `NVIDIA-H100-80GB-HBM3` |
| `edl.io/<vendor>.count` | physical devices (MIG devices and shares are not counted) |
| `edl.io/<vendor>.healthy` | physical devices neither unhealthy, degraded nor cordoned |
| `edl.io/<vendor>.degraded` | physical devices degraded (a fault is coming; not unhealthy) |
| `edl.io/<vendor>.memory-mib` | memory of one device of that product in MiB (the smallest) |
| `edl.io/<vendor>.driver` | the driver version, when the vendor reports one |
| `edl.io/<vendor>.sharing` | how devices are split: `none`, or a `.`-joined list (below) |

`sharing` lists what applies, in this order: `mig` (MIG devices advertised), `vnpu` (Ascend vNPU
templates), `replicas` (time-slicing), `memory`, `core` (memory and core units); Baidu cGPU
reads `replicas.memory.core`.

NVIDIA labels as GPU Feature Discovery writes them, when the node has NVIDIA GPUs:
`nvidia.com/gpu.product` (`-SHARED` appended when time-slicing replicas replace the GPUs under
the same resource name), `gpu.count`, `gpu.memory` (MiB), `gpu.replicas`,
`gpu.sharing-strategy` (`none` or `time-slicing`), `gpu.family`, `gpu.compute.major`,
`gpu.compute.minor`, `gpu.machine`, `gpu.mode`, `cuda.driver-version.{major,minor,revision,full}`,
`cuda.runtime-version.{major,minor,full}`, GFD's older names for the same versions
`cuda.driver.{major,minor,rev}` and `cuda.runtime.{major,minor}`, `mig.capable`, `mig.strategy`,
`mps.capable`, `vgpu.present`; with the `single` MIG strategy `gpu.product` names the MIG profile
(`...-MIG-1g.10gb`, or `...-MIG-INVALID` with count 0 when the GPUs do not form one profile), with
`mixed` each profile gets `nvidia.com/mig-<profile>.{product,count,memory,replicas}`. As in GFD,
`gpu.*` describe the most common GPU model and `gpu.count` counts the GPUs of that model, while
`gpu.mode`, `mig.capable` and `vgpu.present` look at every GPU:

- `gpu.mode`: from the GPUs' PCI class codes, `compute` when all are 3D controllers (`0x030200`),
  `graphics` when all are VGA controllers (`0x030000`), `unknown` when they differ, are something
  else or could not be read.
- `mps.capable`: GFD writes `true` only when MPS sharing is configured; this agent offers no MPS
  sharing, so it is always `false`.
- `vgpu.present`: `true` when a GPU's PCI configuration space carries the vGPU signature,
  `false` when none does; not written when a GPU's configuration space could not be read whole
  (sysfs shows readers without CAP_SYS_ADMIN only its first 64 bytes), as GFD then writes none.

GFD's `gfd.timestamp` is left out on purpose: it would change the Node on every resync for no
scheduling value; so are `vgpu.host-driver-version` and `vgpu.host-driver-branch`, the
hypervisor's driver as a vGPU guest sees it, which no scheduling decision needs.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Collection, Mapping, Sequence

from edl_agent.config import Settings
from edl_agent.devices.model import Device, Health, Inventory, Vendor, VendorReport
from edl_agent.devices.resources import ascend_family
from edl_agent.devices.settings import SharingRule
from edl_agent.health.tracker import Condition

EDL = "edl.io/"
NVIDIA = "nvidia.com/"
MAX_VALUE = 63
UNKNOWN = "unknown"
_INVALID_RUN = re.compile(r"[^A-Za-z0-9._-]+")
_EDGE = re.compile(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$")
# Compute capability major → GFD's family names (7 and 8 also depend on the minor).
_FAMILIES = {
    1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal",
    9: "hopper", 10: "blackwell", 12: "blackwell",
}  # fmt: skip
# PCI class codes (base class, subclass, programming interface) → GFD's `gpu.mode`.
_GPU_MODES = {0x030200: "compute", 0x030000: "graphics"}


def label_value(text: str, *, limit: int = MAX_VALUE, default: str = UNKNOWN) -> str:
    """`text` as a valid label value: ASCII, runs of other characters as one `-`, trimmed."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    value = _EDGE.sub("", _INVALID_RUN.sub("-", ascii_text.strip()))
    value = _EDGE.sub("", value[:limit])
    return value or default


def node_labels(
    *,
    inventory: Inventory,
    unhealthy: Mapping[str, Condition],
    settings: Settings,
    machine: str | None,
    cordoned: Collection[str] = (),
    degraded: Collection[str] = (),
) -> dict[str, str]:
    """Every label this agent owns for the node, from what was discovered and what is unhealthy
    (`unhealthy`, `cordoned` and `degraded` are device ids; a MIG device's parent decides its
    health)."""
    reports = [r for r in inventory.reports if _physical(r.devices)]
    labels: dict[str, str] = {}
    if not reports:
        return labels
    down = set(unhealthy) | set(cordoned) | set(degraded)
    total = healthy = worn = 0
    for report in reports:
        devices = _physical(report.devices)
        fine = sum(d.health is Health.HEALTHY and d.id not in down for d in devices)
        warned = sum(d.id in degraded and d.id not in unhealthy for d in devices)
        total, healthy, worn = total + len(devices), healthy + fine, worn + warned
        labels.update(_vendor_labels(report, devices, fine, settings))
        labels[f"{EDL}{report.vendor.value}.degraded"] = str(warned)
    labels[f"{EDL}accelerator.vendors"] = ".".join(sorted(r.vendor.value for r in reports))
    labels[f"{EDL}accelerator.count"] = str(total)
    labels[f"{EDL}accelerator.healthy"] = str(healthy)
    labels[f"{EDL}accelerator.degraded"] = str(worn)
    nvidia = next((r for r in reports if r.vendor is Vendor.NVIDIA), None)
    if nvidia is not None:
        labels.update(nvidia_labels(nvidia, settings=settings, machine=machine))
    return labels


def _physical(devices: Sequence[Device]) -> list[Device]:
    return [d for d in devices if d.parent is None]


def _most_common(devices: Sequence[Device]) -> tuple[str, list[Device]]:
    counts = Counter(d.product for d in devices)
    product = min(counts, key=lambda name: (-counts[name], name))
    return product, [d for d in devices if d.product == product]


def _vendor_labels(
    report: VendorReport, devices: list[Device], healthy: int, settings: Settings
) -> dict[str, str]:
    prefix = f"{EDL}{report.vendor.value}."
    product, members = _most_common(devices)
    labels = {
        f"{prefix}product": label_value(product),
        f"{prefix}count": str(len(devices)),
        f"{prefix}healthy": str(healthy),
        f"{prefix}memory-mib": str(min(d.memory_mib for d in members)),
        f"{prefix}sharing": _sharing_kinds(report, devices, settings),
    }
    driver = report.driver.get("driver_version")
    if driver:
        labels[f"{prefix}driver"] = label_value(driver)
    return labels


def _sharing_kinds(report: VendorReport, devices: list[Device], settings: Settings) -> str:
    names = {_whole_resource(d, settings) for d in devices}
    rules = [r for r in settings.sharing if r.resource in names]
    kinds = {
        "mig": settings.nvidia.mig_strategy != "none"
        and any(d.kind == "mig" for d in report.devices),
        "vnpu": report.vendor is Vendor.ASCEND and bool(settings.ascend.vnpu_templates),
        "replicas": any(r.replicas for r in rules),
        "memory": any(r.memory_unit_mib for r in rules),
        "core": any(r.core_unit_percent for r in rules),
    }
    return ".".join(kind for kind, present in kinds.items() if present) or "none"


def _whole_resource(device: Device, settings: Settings) -> str:
    match device.vendor:
        case Vendor.NVIDIA:
            return settings.nvidia.resource_name
        case Vendor.KUNLUNXIN:
            return settings.kunlunxin.resource_name
        case Vendor.HYGON:
            return settings.hygon.resource_name
        case Vendor.ASCEND:
            return settings.ascend.resource_prefix + (ascend_family(device.product) or "")
    return ""


def nvidia_labels(
    report: VendorReport, *, settings: Settings, machine: str | None
) -> dict[str, str]:
    """GFD's labels for the NVIDIA GPUs of `report` (empty without GPUs)."""
    gpus = [d for d in report.devices if d.kind == "gpu"]
    if not gpus:
        return {}
    strategy = settings.nvidia.mig_strategy
    product, members = _most_common(gpus)
    rule = _rule(settings.sharing, settings.nvidia.resource_name)
    # As GFD: GPUs split into MIG devices carry no sharing information.
    whole = any(d.attributes.get("mig_mode") != "enabled" for d in members)
    labels = {
        f"{NVIDIA}gpu.machine": label_value(machine or UNKNOWN),
        f"{NVIDIA}mig.capable": str(any(_mig_capable(d) for d in gpus)).lower(),
        f"{NVIDIA}mig.strategy": strategy,
        f"{NVIDIA}gpu.mode": gpu_mode([d.attributes.get("pci_class") for d in gpus]),
        f"{NVIDIA}mps.capable": "false",  # no MPS sharing here: what GFD writes without it
        **_vgpu_labels(gpus),
        f"{NVIDIA}gpu.sharing-strategy": "time-slicing" if rule and rule.replicas else "none",
        **_driver_labels(report.driver),
        **_compute_labels(members[0].attributes.get("compute_capability", "")),
        **_resource_labels(
            "gpu",
            parts=[product],
            count=len(members),
            memory_mib=members[0].memory_mib,
            rule=rule if whole else None,
            sharable=whole,
        ),
    }
    migs = [d for d in report.devices if d.kind == "mig"]
    if strategy == "single" and any(d.attributes.get("mig_mode") == "enabled" for d in gpus):
        labels.update(_single_mig_labels(gpus, migs, product, settings))
    elif strategy == "mixed":
        for profile, group in sorted(_by_profile(migs).items()):
            name = label_value(f"mig-{profile}")
            parent = next((g.product for g in gpus if g.id == group[0].parent), product)
            mig_rule = _rule(settings.sharing, f"{NVIDIA}mig-{profile}")
            labels.update(
                _resource_labels(
                    name,
                    parts=[parent, "MIG", profile],
                    count=len(group),
                    memory_mib=group[0].memory_mib,
                    rule=mig_rule,
                )
            )
    return labels


def gpu_mode(pci_classes: Sequence[str | None]) -> str:
    """GFD's `gpu.mode` from the PCI class codes of every GPU (`0x030200`, as sysfs writes them;
    None for one that could not be read)."""
    codes = {_pci_class(text) for text in pci_classes}
    if len(codes) != 1:
        return UNKNOWN
    (code,) = codes
    return _GPU_MODES.get(code, UNKNOWN) if code is not None else UNKNOWN


def _pci_class(text: str | None) -> int | None:
    try:
        return int(text.strip(), 0) if text else None
    except ValueError:
        return None


def _vgpu_labels(gpus: Sequence[Device]) -> dict[str, str]:
    """`vgpu.present`, when every GPU's configuration space could be read."""
    found = [gpu.attributes.get("vgpu") for gpu in gpus]
    if not all(value in ("true", "false") for value in found):
        return {}
    return {f"{NVIDIA}vgpu.present": str("true" in found).lower()}


def _mig_capable(gpu: Device) -> bool:
    return gpu.attributes.get("mig_mode") in ("enabled", "disabled")


def _rule(rules: Sequence[SharingRule], resource: str) -> SharingRule | None:
    return next((r for r in rules if r.resource == resource), None)


def _resource_labels(
    name: str,
    *,
    parts: list[str],
    count: int,
    memory_mib: int,
    rule: SharingRule | None,
    sharable: bool = True,
) -> dict[str, str]:
    replicas = rule.replicas if rule is not None and rule.replicas > 1 else 1
    renamed = rule is not None and rule.replica_resource not in ("{resource}", rule.resource)
    suffix = "-SHARED" if replicas > 1 and not renamed else ""
    product = label_value("-".join(parts), limit=MAX_VALUE - len(suffix)) + suffix
    return {
        f"{NVIDIA}{name}.product": product,
        f"{NVIDIA}{name}.count": str(count),
        f"{NVIDIA}{name}.memory": str(memory_mib),
        f"{NVIDIA}{name}.replicas": str(replicas if sharable else 0),
    }


def _by_profile(migs: Sequence[Device]) -> dict[str, list[Device]]:
    groups: dict[str, list[Device]] = {}
    for mig in migs:
        groups.setdefault(mig.attributes.get("mig_profile", UNKNOWN), []).append(mig)
    return groups


def _single_mig_labels(
    gpus: Sequence[Device], migs: Sequence[Device], product: str, settings: Settings
) -> dict[str, str]:
    enabled = [g for g in gpus if g.attributes.get("mig_mode") == "enabled"]
    profiles = _by_profile(migs)
    empty = any(not any(m.parent == g.id for m in migs) for g in enabled)
    if empty or len(enabled) != len(gpus) or len(profiles) != 1:
        invalid = label_value(f"{product}-MIG-INVALID")
        keys = ("product", "count", "memory", "replicas")
        return {f"{NVIDIA}gpu.{k}": v for k, v in zip(keys, (invalid, "0", "0", "0"), strict=True)}
    (profile, group), *_ = profiles.items()
    rule = _rule(settings.sharing, settings.nvidia.resource_name)
    return _resource_labels(
        "gpu",
        parts=[product, "MIG", profile],
        count=len(group),
        memory_mib=group[0].memory_mib,
        rule=rule,
    )


def _driver_labels(driver: Mapping[str, str]) -> dict[str, str]:
    labels: dict[str, str] = {}
    version = driver.get("driver_version", "")
    parts = version.split(".")
    if 2 <= len(parts) <= 3 and all(re.fullmatch(r"[A-Za-z0-9]+", p) for p in parts):
        major, minor, revision = [*parts, ""][:3]
        prefix = f"{NVIDIA}cuda.driver-version."
        labels |= {f"{prefix}major": major, f"{prefix}minor": minor}
        labels |= {f"{prefix}revision": revision, f"{prefix}full": version}
        old = f"{NVIDIA}cuda.driver."  # GFD's older names, still written beside the new ones
        labels |= {f"{old}major": major, f"{old}minor": minor, f"{old}rev": revision}
    cuda = re.fullmatch(r"(\d+)\.(\d+)", driver.get("cuda_driver_version", ""))
    if cuda is not None:
        major, minor = str(int(cuda.group(1))), str(int(cuda.group(2)))
        prefix = f"{NVIDIA}cuda.runtime-version."
        labels |= {f"{prefix}major": major, f"{prefix}minor": minor}
        labels[f"{prefix}full"] = f"{major}.{minor}"
        old = f"{NVIDIA}cuda.runtime."
        labels |= {f"{old}major": major, f"{old}minor": minor}
    return labels


def _compute_labels(capability: str) -> dict[str, str]:
    found = re.fullmatch(r"(\d+)\.(\d+)", capability)
    if found is None or int(found.group(1)) == 0:
        return {}
    major, minor = int(found.group(1)), int(found.group(2))
    return {
        f"{NVIDIA}gpu.family": gpu_family(major, minor),
        f"{NVIDIA}gpu.compute.major": str(major),
        f"{NVIDIA}gpu.compute.minor": str(minor),
    }


def gpu_family(major: int, minor: int) -> str:
    """GFD's architecture family from a CUDA compute capability."""
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ada-lovelace" if minor == 9 else "ampere"
    return _FAMILIES.get(major, "undefined")
