"""Hygon DCU discovery: DRM cards with PCI vendor 0x1d94, KFD topology, facts from `hy-smi` (or,
on older DTK nodes without it, DTK's `rocm-smi`), read per field by `hygon_smi`.

A DCU's index is its position among the Hygon cards in DRM card order (what hy-smi calls
`HCU[i]`/`card<i>`), not the card number: servers usually have a BMC VGA adapter as `card0`.
Ids are `hygon-dcu-<pci bus id>`, read from sysfs, so they do not depend on hy-smi working and do
not shift when another card disappears. Where DTK's rocm_smi library reads health, the tool runs
again only when the cards change (`_reports`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from edl_agent.devices import rocm_smi
from edl_agent.devices.hostroot import HostRoot, ToolError, parse_numa_node
from edl_agent.devices.hygon_smi import (
    STATE_KEY,
    DcuRecord,
    DcuStatus,
    HySmiParseError,
    HySmiReport,
    parse_hy_smi_json,
    parse_hy_smi_status,
    parse_kfd_properties,
)
from edl_agent.devices.model import Device, Health, Vendor, VendorReport
from edl_agent.devices.unreadable import warn_unreadable

__all__ = [
    "FALLBACK_TOOL",
    "KFD_NODES",
    "PCI_VENDOR",
    "QUERY_ARGS",
    "STATE_KEY",
    "STATUS_ARGS",
    "TOOL",
    "DcuRecord",
    "DcuStatus",
    "HySmiParseError",
    "HySmiReport",
    "device_id",
    "discover",
    "health_source",
    "kfd_location_key",
    "parse_hy_smi_json",
    "parse_hy_smi_status",
    "parse_kfd_properties",
    "smi_tool",
]

TOOL = "hy-smi"
# Older DTK nodes have no hy-smi, only DTK's rocm-smi (same flags, same JSON). It is used only
# where sysfs shows Hygon cards: on an AMD node the same tool would list AMD GPUs.
FALLBACK_TOOL = "rocm-smi"
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

_CARD = re.compile(r"^card(\d+)$")  # a DRM card's name
_BUS_ID = re.compile(r"^([0-9a-fA-F]{4}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_MIB = 1024 * 1024


def smi_tool(root: HostRoot, *, hygon_cards: bool) -> Path | None:
    """hy-smi under the root; else DTK's rocm-smi, but only where sysfs shows Hygon cards."""
    tool = root.which(TOOL)
    if tool is None and hygon_cards:
        tool = root.which(FALLBACK_TOOL)
    return tool


def device_id(bus_id: str) -> str:
    """A DCU's id: its PCI address, which does not shift when another card disappears."""
    return f"hygon-dcu-{bus_id}"


def health_source(root: HostRoot, tool: Path | None) -> str:
    """What DCU health is read through: DTK's rocm_smi library where it is usable (no process
    per poll), else the tool (`hy-smi`, or DTK's `rocm-smi`)."""
    if rocm_smi.usable(root) is not None:
        return rocm_smi.HEALTH_SOURCE
    return tool.name if tool is not None else TOOL


# The tool's facts (product names, memory, driver version) change only with the cards. Where the
# rocm_smi library reads health, a rediscovery that finds the same cards reuses the tool's last
# report instead of starting it again, so an idle node starts no process; new, gone or moved
# cards, or a library that stops answering, run the tool again. One report per host root.
_reports: dict[Path, dict[tuple[str, ...], HySmiReport]] = {}


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
    tool = smi_tool(root, hygon_cards=bool(cards))
    if not cards and tool is None:
        return None
    report: HySmiReport | None = None
    error: str | None = None
    source = health_source(root, tool)
    seen = tuple(sorted(card.bus_id or f"card{card.number}" for card in cards.values()))
    if tool is not None and source == rocm_smi.HEALTH_SOURCE:
        report = _reports.get(root.root, {}).get(seen)
    if tool is not None and report is None:
        try:
            report = root.read_tool(tool, QUERY_ARGS, parse_hy_smi_json)
        except ToolError as exc:
            error = str(exc)
        else:
            if source == rocm_smi.HEALTH_SOURCE:
                _reports[root.root] = {seen: report}
    if not cards and report is None:
        log.debug("hygon tool without devices", error=error)
        return None
    if error is not None:
        log.warning("hygon tool failed; listing devices from sysfs only", error=error)
    if report is not None and tool is not None:
        warn_unreadable(log, f"{tool.name} --json", report.problems)

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
    driver["health_source"] = source
    log.debug("hygon discovered", count=len(devices), health_source=driver["health_source"])
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
        attributes["problem"] = f"the tool lists card{index} but sysfs has no Hygon DRM card for it"
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
            attributes["problem"] = f"card{card.number} is in sysfs but the tool does not list it"
    simd, per_cu = topology.get("simd_count", 0), topology.get("simd_per_cu", 0)
    if simd > 0 and per_cu > 0:
        attributes["compute_units"] = str(simd // per_cu)
    memory = record.memory_mib if record is not None else None
    if memory is None:  # hy-smi did not say (or could not be read): the KFD memory bank does
        memory = topology.get("memory_bytes", 0) // _MIB
    return Device(
        vendor=Vendor.HYGON,
        kind="dcu",
        index=index,
        id=device_id(bus_id) if bus_id is not None else f"hygon-dcu{index}",
        product=(record.product if record is not None else None) or "unknown",
        memory_mib=memory,
        numa_node=card.numa_node if card is not None else None,
        pci_bus_id=bus_id,
        device_nodes=nodes,
        health=health,
        attributes=attributes,
    )
