"""Discovery checked against `nvidia-smi -q`: NVIDIA's own tool and our NVML reading must agree.

`parse_query` reads the GPUs of `nvidia-smi -q` (sections `GPU <bus id>`, nested `Key : Value`
lines indented by four spaces per level); `cross_check` compares each with what discovery found at
the same PCI address and lists every fact that differs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from edl_agent.devices.nvidia import sysfs_bus_id

INDENT = 4
# nvidia-smi -q key path -> the fact it gives
FACTS = {
    ("Product Name",): "product",
    ("GPU UUID",): "id",
    ("Minor Number",): "minor",
    ("PCI", "Bus Id"): "pci_bus_id",
    ("FB Memory Usage", "Total"): "memory_mib",
    ("MIG Mode", "Current"): "mig_mode",
}


@dataclass(frozen=True)
class SmiGpu:
    bus_id: str  # as the section header writes it, 00000000:18:00.0
    facts: Mapping[str, str] = field(default_factory=dict)


def parse_query(text: str) -> tuple[dict[str, str], list[SmiGpu]]:
    """The top-level facts (Driver Version, CUDA Version, ...) and each GPU's wanted facts."""
    header: dict[str, str] = {}
    gpus: list[SmiGpu] = []
    current: dict[str, str] | None = None
    path: list[str] = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("="):
            continue
        if line.startswith("GPU ") and ":" in line and " : " not in line:
            current = {}
            gpus.append(SmiGpu(bus_id=line[4:].strip(), facts=current))
            path = []
            continue
        key, colon, value = line.strip().partition(":")
        depth = (len(line) - len(line.lstrip(" "))) // INDENT
        key = key.strip()
        if current is None:
            if colon and depth == 0:
                header[key] = value.strip()
            continue
        level = max(depth - 1, 0)
        del path[level:]
        if not colon or not value.strip():
            path.append(key)  # a section such as `PCI` or `FB Memory Usage`
            continue
        fact = FACTS.get((*path, key))
        if fact is not None:
            current[fact] = value.strip()
    return header, gpus


def cross_check(smi_text: str, devices: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """How many GPUs were compared, and each fact where discovery and nvidia-smi disagree."""
    header, gpus = parse_query(smi_text)
    found = {
        d.get("pci_bus_id"): d
        for d in devices
        if d.get("vendor") == "nvidia" and d["kind"] == "gpu"
    }
    mismatches: list[str] = []
    for gpu in gpus:
        bus_id = sysfs_bus_id(gpu.bus_id)
        device = found.pop(bus_id, None)
        if device is None:
            mismatches.append(f"{bus_id}: nvidia-smi shows a GPU discovery did not find")
            continue
        ours = _our_facts(device)
        for fact, theirs in sorted(gpu.facts.items()):
            expected = _normalise(fact, theirs)
            if ours.get(fact) != expected:
                mismatches.append(
                    f"{bus_id} {fact}: discovery {ours.get(fact)!r}, nvidia-smi {expected!r}"
                )
    mismatches.extend(
        f"{bus_id}: discovery found a GPU nvidia-smi does not show" for bus_id in found
    )
    return {
        "driver_version": header.get("Driver Version"),
        "gpus_compared": len(gpus),
        "facts_compared": sum(len(gpu.facts) for gpu in gpus),
        "mismatches": mismatches,
    }


def _our_facts(device: Mapping[str, Any]) -> dict[str, str]:
    attributes = device.get("attributes", {})
    return {
        "product": str(device["product"]),
        "id": str(device["id"]),
        "minor": str(attributes.get("minor")),
        "pci_bus_id": str(device["pci_bus_id"]),
        "memory_mib": str(device["memory_mib"]),
        "mig_mode": str(attributes.get("mig_mode")),
    }


def _normalise(fact: str, value: str) -> str:
    if fact == "pci_bus_id":
        return sysfs_bus_id(value)
    if fact == "memory_mib":
        return value.removesuffix("MiB").strip()
    if fact == "mig_mode":
        return {"Enabled": "enabled", "Disabled": "disabled", "N/A": "unsupported"}.get(
            value, value
        )
    return value
