"""Hygon DCU discovery: DRM cards with PCI vendor 0x1d94, KFD topology, facts from `hy-smi`.

A DCU's index is its position among the Hygon cards in DRM card order (what hy-smi calls
`HCU[i]`/`card<i>`), not the card number: servers usually have a BMC VGA adapter as `card0`.
Ids are `hygon-dcu-<pci bus id>`, read from sysfs, so they do not depend on hy-smi working and do
not shift when another card disappears.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from edl_agent.devices.hostroot import HostRoot, ToolError, parse_numa_node
from edl_agent.devices.model import Device, Health, Vendor, VendorReport

TOOL = "hy-smi"
QUERY_ARGS = ("--showproductname", "--showmeminfo", "vram", "--showdriverversion", "--json")
# Live figures for the health poller: rocm-smi's flags, which hy-smi keeps.
STATUS_ARGS = (
    "--showbus",
    "--showtemp",
    "--showpower",
    "--showuse",
    "--showmeminfo",
    "vram",
    "--json",
)
PCI_VENDOR = "0x1d94"
SHARED_NODES = ("/dev/kfd", "/dev/mkfd")  # KFD compute interface; mkfd exists on newer drivers
KFD_NODES = "/sys/class/kfd/kfd/topology/nodes"

_CARD = re.compile(r"^card(\d+)$")  # a DRM card's name, and hy-smi's JSON key for a DCU
_BUS_ID = re.compile(r"^([0-9a-fA-F]{4}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_MIB = 1024 * 1024

# hy-smi follows rocm-smi's JSON (`{"card0": {...}, "system": {...}}`) but reports memory in MiB
# with lower-case `vram` keys; both spellings are accepted. Key names from public hy-smi parsers
# (`Card Series`, `vram Total Memory (MiB)`) and rocm-smi's documented output.
_PRODUCT_KEYS = ("Card Series", "Card series", "Card Model", "Card model")
_MEMORY_MIB_KEYS = ("vram Total Memory (MiB)", "VRAM Total Memory (MiB)")
_MEMORY_BYTES_KEYS = ("VRAM Total Memory (B)", "vram Total Memory (B)")
_DRIVER_KEYS = ("Driver version", "Driver Version")
# Status keys as rocm-smi spells them and public hy-smi collectors read them (HCU is hy-smi's name
# for a DCU). `DCU State` is designed for the simulated tool: real hy-smi has no health field.
_TEMPERATURE_KEYS = ("Temperature (Sensor junction) (C)", "Temperature (Sensor edge) (C)")
_POWER_KEYS = (
    "Average Graphics Package Power (W)",
    "Current Socket Graphics Package Power (W)",
)
_USE_KEYS = ("HCU use (%)", "DCU use (%)", "GPU use (%)")
_USED_MIB_KEYS = ("vram Total Used Memory (MiB)", "VRAM Total Used Memory (MiB)")
_USED_BYTES_KEYS = ("VRAM Total Used Memory (B)", "vram Total Used Memory (B)")
STATE_KEY = "DCU State"


class HySmiParseError(ValueError):
    """`hy-smi --json` printed something this parser does not understand."""


@dataclass(frozen=True)
class DcuRecord:
    """One `card<i>` entry of hy-smi's JSON."""

    index: int
    product: str
    memory_mib: int
    bus_id: str | None = None  # only when hy-smi was asked for (or printed) `PCI Bus`


@dataclass(frozen=True)
class HySmiReport:
    driver_version: str | None
    dcus: tuple[DcuRecord, ...]


@dataclass(frozen=True)
class DcuStatus:
    """Live figures of one `card<i>` entry; None where hy-smi printed nothing usable."""

    index: int
    bus_id: str | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    utilization_percent: float | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    state: str | None = None


def parse_hy_smi_json(text: str) -> HySmiReport:
    data, cards = _cards(text)
    dcus = [_dcu_record(index, key, fields) for index, key, fields in cards]
    system = data.get("system")
    driver = _first(system, _DRIVER_KEYS) if isinstance(system, dict) else None
    return HySmiReport(driver_version=driver, dcus=tuple(sorted(dcus, key=lambda d: d.index)))


def parse_hy_smi_status(text: str) -> dict[int, DcuStatus]:
    """The live figures of `hy-smi <STATUS_ARGS>` by DCU index; every figure is optional."""
    statuses = {}
    for index, _key, fields in _cards(text)[1]:
        bus = _first(fields, ("PCI Bus",))
        statuses[index] = DcuStatus(
            index=index,
            bus_id=bus.lower() if bus and _BUS_ID.match(bus) else None,
            temperature_c=_float(_first(fields, _TEMPERATURE_KEYS)),
            power_w=_float(_first(fields, _POWER_KEYS)),
            utilization_percent=_float(_first(fields, _USE_KEYS)),
            memory_used_mib=_mib(fields, _USED_MIB_KEYS, _USED_BYTES_KEYS),
            memory_total_mib=_mib(fields, _MEMORY_MIB_KEYS, _MEMORY_BYTES_KEYS),
            state=_first(fields, (STATE_KEY,)) or None,
        )
    return statuses


def _cards(text: str) -> tuple[dict[str, Any], list[tuple[int, str, Mapping[str, Any]]]]:
    """The JSON object and its `card<N>` entries in index order; HySmiParseError when garbled."""
    try:
        data: object = json.loads(text)
    except json.JSONDecodeError as exc:
        msg = f"not JSON ({exc.msg} at line {exc.lineno})"
        raise HySmiParseError(msg) from None
    if not isinstance(data, dict):
        msg = f"expected a JSON object, got {type(data).__name__}"
        raise HySmiParseError(msg)
    cards: list[tuple[int, str, Mapping[str, Any]]] = []
    for key, value in data.items():
        match = _CARD.match(key)
        if match is None:
            continue
        if not isinstance(value, dict):
            msg = f"{key}: expected an object"
            raise HySmiParseError(msg)
        cards.append((int(match.group(1)), key, value))
    if not cards:
        raise HySmiParseError("no card<N> entries")
    return data, cards


def _float(text: str | None) -> float | None:
    """A figure as hy-smi prints it (`45.0`, `12`); None for N/A and the like."""
    if text is None:
        return None
    try:
        value = float(text.rstrip("%CW ").strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _mib(
    fields: Mapping[str, Any], mib_keys: tuple[str, ...], byte_keys: tuple[str, ...]
) -> float | None:
    mib = _float(_first(fields, mib_keys))
    if mib is not None:
        return mib
    in_bytes = _float(_first(fields, byte_keys))
    return in_bytes / _MIB if in_bytes is not None else None


def _dcu_record(index: int, key: str, fields: Mapping[str, Any]) -> DcuRecord:
    product = _first(fields, _PRODUCT_KEYS)
    if not product:
        msg = f"{key}: no Card Series"
        raise HySmiParseError(msg)
    mib, in_bytes = _first(fields, _MEMORY_MIB_KEYS), _first(fields, _MEMORY_BYTES_KEYS)
    if mib is not None and mib.isdigit():
        memory = int(mib)
    elif in_bytes is not None and in_bytes.isdigit():
        memory = int(in_bytes) // _MIB
    else:
        msg = f"{key}: no numeric vram Total Memory"
        raise HySmiParseError(msg)
    bus = _first(fields, ("PCI Bus",))
    if bus is not None and _BUS_ID.match(bus) is None:
        msg = f"{key}: bad PCI Bus {bus!r}"
        raise HySmiParseError(msg)
    return DcuRecord(
        index=index, product=product, memory_mib=memory, bus_id=bus.lower() if bus else None
    )


def _first(fields: Mapping[str, Any], keys: tuple[str, ...]) -> str | None:
    for key in keys:
        value = fields.get(key)
        if value is not None:
            return str(value).strip()
    return None


def parse_kfd_properties(text: str) -> dict[str, int]:
    """A KFD topology `properties` file: one `name value` pair per line, values integers."""
    properties = {}
    for line in text.splitlines():
        name, _, value = line.strip().partition(" ")
        value = value.strip()
        if name and value.lstrip("-").isdigit():
            properties[name] = int(value)
    return properties


@dataclass(frozen=True)
class _Card:
    """A Hygon DRM card as sysfs shows it."""

    number: int  # N of /dev/dri/card<N>
    bus_id: str | None
    numa_node: int | None
    render_node: str | None  # /dev/dri/renderD<M>


def discover(root: HostRoot) -> VendorReport | None:
    log = structlog.get_logger().bind(vendor=Vendor.HYGON.value)
    cards = _hygon_cards(root)
    tool = root.which(TOOL)
    if not cards and tool is None:
        return None
    report: HySmiReport | None = None
    error: str | None = None
    if tool is not None:
        try:
            report = root.read_tool(tool, QUERY_ARGS, parse_hy_smi_json)
        except ToolError as exc:
            error = str(exc)
    if not cards and report is None:
        log.debug("hygon tool without devices", error=error)
        return None
    if error is not None:
        log.warning("hygon tool failed; listing devices from sysfs only", error=error)

    records = _match_records(cards, report.dcus if report is not None else ())
    kfd = _kfd_gpu_nodes(root)
    shared = tuple(node for node in SHARED_NODES if root.exists(node))
    devices = tuple(
        _device(
            root,
            index,
            card=cards.get(index),
            record=records.get(index),
            kfd=kfd,
            shared=shared,
            tool_ok=report is not None,
        )
        for index in sorted(cards.keys() | records.keys())
    )
    driver = {}
    if report is not None and report.driver_version:
        driver["driver_version"] = report.driver_version
    log.debug("hygon discovered", count=len(devices))
    return VendorReport(vendor=Vendor.HYGON, devices=devices, driver=driver, error=error)


def _hygon_cards(root: HostRoot) -> dict[int, _Card]:
    """Hygon cards by DCU index (position among Hygon cards in card-number order)."""
    cards: dict[int, _Card] = {}
    for path in root.glob("/sys/class/drm", "card*"):
        match = _CARD.match(path.rsplit("/", 1)[-1])
        vendor = root.read_optional(f"{path}/device/vendor")
        if match is None or vendor is None or vendor.lower() != PCI_VENDOR:
            continue
        renders = root.glob(f"{path}/device/drm", "renderD*")
        cards[len(cards)] = _Card(
            number=int(match.group(1)),
            bus_id=_card_bus_id(root, path),
            numa_node=parse_numa_node(root.read_optional(f"{path}/device/numa_node")),
            render_node=f"/dev/dri/{renders[0].rsplit('/', 1)[-1]}" if renders else None,
        )
    return cards


def _card_bus_id(root: HostRoot, card: str) -> str | None:
    """The card's PCI address: its `device` link points at the PCI device directory."""
    try:
        name = root.path(f"{card}/device").readlink().name
    except OSError:
        name = ""
    if _BUS_ID.match(name):
        return name.lower()
    for line in (root.read_optional(f"{card}/device/uevent") or "").splitlines():
        key, _, value = line.partition("=")
        if key == "PCI_SLOT_NAME" and _BUS_ID.match(value.strip()):
            return value.strip().lower()
    return None


def _match_records(cards: Mapping[int, _Card], dcus: tuple[DcuRecord, ...]) -> dict[int, DcuRecord]:
    """hy-smi entries by DCU index: by PCI address when hy-smi printed one, else by position."""
    by_bus = {card.bus_id: index for index, card in cards.items() if card.bus_id}
    matched = {}
    for record in dcus:
        index = by_bus.get(record.bus_id, record.index) if record.bus_id else record.index
        matched[index] = record
    return matched


def _kfd_gpu_nodes(root: HostRoot) -> dict[tuple[int, int], dict[str, int]]:
    """KFD GPU nodes keyed by (PCI domain, location id); CPU nodes (simd_count 0) are skipped."""
    nodes = {}
    for node in root.glob(KFD_NODES, "*"):
        properties = parse_kfd_properties(root.read_optional(f"{node}/properties") or "")
        if properties.get("simd_count", 0) <= 0 or "location_id" not in properties:
            continue
        memory = parse_kfd_properties(root.read_optional(f"{node}/mem_banks/0/properties") or "")
        if "size_in_bytes" in memory:
            properties["memory_bytes"] = memory["size_in_bytes"]
        nodes[(properties.get("domain", 0), properties["location_id"])] = properties
    return nodes


def kfd_location_key(bus_id: str) -> tuple[int, int]:
    """KFD's `location_id` packs the address as bus << 8 | device << 3 | function."""
    domain, bus, rest = bus_id.split(":")
    slot, function = rest.split(".")
    return int(domain, 16), int(bus, 16) << 8 | int(slot, 16) << 3 | int(function)


def _device(
    root: HostRoot,
    index: int,
    *,
    card: _Card | None,
    record: DcuRecord | None,
    kfd: Mapping[tuple[int, int], Mapping[str, int]],
    shared: tuple[str, ...],
    tool_ok: bool,
) -> Device:
    bus_id = card.bus_id if card is not None else (record.bus_id if record is not None else None)
    topology = kfd.get(kfd_location_key(bus_id), {}) if bus_id is not None else {}
    attributes: dict[str, str] = {}
    health = Health.HEALTHY
    nodes: tuple[str, ...] = shared
    if card is None:
        health = Health.UNHEALTHY
        attributes["problem"] = f"{TOOL} lists card{index} but sysfs has no Hygon DRM card for it"
    else:
        attributes["drm_card"] = f"card{card.number}"
        own = (f"/dev/dri/card{card.number}", card.render_node or "/dev/dri/renderD?")
        missing = [node for node in own if not root.exists(node)]
        nodes = tuple(node for node in own if node not in missing) + shared
        if missing:
            # Compute work goes through the render node; without it the DCU is unusable.
            health = Health.UNHEALTHY
            attributes["problem"] = f"missing device node {', '.join(missing)}"
        elif record is None and tool_ok:
            health = Health.UNHEALTHY
            attributes["problem"] = f"card{card.number} is in sysfs but {TOOL} does not list it"
    simd, per_cu = topology.get("simd_count", 0), topology.get("simd_per_cu", 0)
    if simd > 0 and per_cu > 0:
        attributes["compute_units"] = str(simd // per_cu)
    memory = record.memory_mib if record is not None else topology.get("memory_bytes", 0) // _MIB
    return Device(
        vendor=Vendor.HYGON,
        kind="dcu",
        index=index,
        id=f"hygon-dcu-{bus_id}" if bus_id is not None else f"hygon-dcu{index}",
        product=record.product if record is not None else "unknown",
        memory_mib=memory,
        numa_node=card.numa_node if card is not None else None,
        pci_bus_id=bus_id,
        device_nodes=nodes,
        health=health,
        attributes=attributes,
    )
