"""Ascend NPUs through the driver's DCMI library (the simulated node's fake libdcmi.so, through
the real ctypes bindings): discovery and polled health find what npu-smi finds, with no process
started; npu-smi is the fallback."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from edl_agent.config import HealthSettings, load_settings
from edl_agent.devices import ascend, dcmi
from edl_agent.devices.discovery import discover_node
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, Health, Vendor
from edl_agent.devices.tool_runs import TOOL_RUNS
from edl_agent.health.ascend_library import (
    FAILED,
    library_usable,
    poll_ascend_auto,
    poll_ascend_library,
)
from edl_agent.health.hub import HealthHub
from edl_agent.health.model import Level
from edl_agent.health.state import DeviceState
from edl_agent.health.vendor_polls import VendorPolls
from edl_agent.health.vendor_readings import PollResult, clears, poll_ascend
from edl_agent.sim import ascend_dcmi, ascend_tree, inject
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree

SETTINGS = HealthSettings()
RESTART_NPU = 0x8C03A000  # RestartNPU in the fault-code table: the chip is out until reset
PROFILES = ["ascend-910bx8", "ascend-a3-910c", "ascend-300i-duo"]


def node(tmp_path: Path, profile: str = "ascend-910bx8") -> tuple[HostRoot, list[Device]]:
    build_tree(load_profile(profile), tmp_path)
    root = HostRoot.at(tmp_path)
    report = ascend.discover(root)
    assert report is not None
    return root, list(report.devices)


def findings(result: PollResult) -> list[tuple[str, str, str, int | None]]:
    return sorted((e.device_id or "", e.reason, e.level.value, e.code) for e in result.events)


def npu_smi_runs() -> int:
    cost = TOOL_RUNS.snapshot().get(ascend.TOOL)
    return cost.runs if cost is not None else 0


@pytest.mark.parametrize("profile", PROFILES)
def test_discovery_through_the_library_matches_npu_smi(profile: str, tmp_path: Path) -> None:
    root, _ = node(tmp_path / "library", profile)
    before = npu_smi_runs()
    by_library = ascend.discover(root)
    assert npu_smi_runs() == before  # nothing started
    tool_tree = tmp_path / "tool"
    build_tree(load_profile(profile), tool_tree)
    ascend_dcmi.remove(tool_tree)
    by_tool = ascend.discover(HostRoot.at(tool_tree))
    assert by_library is not None
    assert by_tool is not None
    assert by_library.driver["health_source"] == dcmi.HEALTH_SOURCE
    assert by_tool.driver["health_source"] == ascend.TOOL
    assert by_library.error is None

    def comparable(device: Device) -> Device:
        """The device without its tree's path and its RoCE address (the table has none)."""
        facts = {k: v for k, v in device.attributes.items() if k != "device_ip"}
        nodes = tuple(n.replace(str(tmp_path), "") for n in device.device_nodes)
        return dataclasses.replace(device, device_nodes=nodes, attributes=facts)

    assert len(by_library.devices) == ascend_tree.count_npus(tmp_path / "library") > 0
    assert [comparable(d) for d in by_library.devices] == [comparable(d) for d in by_tool.devices]


def test_discovery_reads_each_training_chips_roce_address(tmp_path: Path) -> None:
    _, devices = node(tmp_path / "910b")
    assert [d.attributes["device_ip"] for d in devices[:3]] == [
        "192.168.100.1",
        "192.168.100.2",
        "192.168.100.3",
    ]
    _, inference = node(tmp_path / "duo", "ascend-300i-duo")
    assert all("device_ip" not in d.attributes for d in inference)  # no RoCE port


def test_bindings_read_ids_addresses_and_figures(tmp_path: Path) -> None:
    root, devices = node(tmp_path, "ascend-a3-910c")
    path = dcmi.find_library(root)
    assert path == str(tmp_path / ascend_dcmi.LIBRARY.lstrip("/"))
    chips = dcmi.open_library(path).chips()
    assert [(c.card, c.device) for c in chips[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [c.phy_id for c in chips] == [d.index for d in devices]
    assert [c.bus_id for c in chips] == [d.pci_bus_id for d in devices]
    third = chips[2]
    assert (third.chip_name, third.health_word, third.error_codes) == ("Ascend910", "OK", ())
    assert (third.temperature_c, third.power_w, third.memory_mib) == (42.0, 90.5, 65536)
    assert dcmi.open_library(path).phy_ids() == {c.logic_id: c.phy_id for c in chips}


def test_inference_chips_report_ddr_not_hbm(tmp_path: Path) -> None:
    root, devices = node(tmp_path, "ascend-300i-duo")
    path = dcmi.find_library(root)
    assert path is not None
    chips = dcmi.open_library(path).chips()
    assert [c.memory_mib for c in chips] == [d.memory_mib for d in devices]
    assert chips[0].bus_id == chips[1].bus_id  # both chips of a card behind one address


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize(
    ("health", "codes"),
    [
        ("Critical", [0x80E01801]),  # RestartBusiness
        ("Alarm", [0x80E01801, 0x80E18402]),
        ("Warning", []),
        ("Critical", []),
        ("Critical", [0x8C03A000]),
    ],
)
def test_library_poll_finds_what_the_tool_poll_finds(
    profile: str, health: str, codes: list[int], tmp_path: Path
) -> None:
    root, devices = node(tmp_path, profile)
    assert poll_ascend_library(root, devices, SETTINGS).events == []
    ascend_tree.set_npu_health(tmp_path, 3, health, codes)
    by_tool = poll_ascend(root, devices, SETTINGS)
    by_library = poll_ascend_library(root, devices, SETTINGS)
    assert findings(by_library) == findings(by_tool)
    assert by_library.checked == by_tool.checked == {d.id for d in devices}
    if health != "Warning":
        assert [e.device_id for e in by_library.events] == [devices[3].id]

    ascend_tree.set_npu_health(tmp_path, 3, "OK")
    over = poll_ascend_library(root, devices, SETTINGS, clock=lambda: 9.0)
    assert over.events == poll_ascend(root, devices, SETTINGS).events == []
    for event in by_library.events:
        (cleared,) = clears({event.device_id: event}, over)
        assert (cleared.cleared, cleared.at) == (True, 9.0)


def test_library_poll_honours_the_operators_code_levels(tmp_path: Path) -> None:
    root, devices = node(tmp_path)
    ascend_tree.set_npu_health(tmp_path, 1, "Critical", [RESTART_NPU])
    (event,) = poll_ascend_library(root, devices, SETTINGS).events
    assert (event.reason, event.level) == ("NPU_FAULT_0x8C03A000", Level.DEVICE_FATAL)
    relaxed = HealthSettings(ascend_code_levels={"0x8C03A000": "warn"})
    (event,) = poll_ascend_library(root, devices, relaxed).events
    assert (event.reason, event.level) == ("NPU_FAULT_0x8C03A000", Level.WARN)
    assert findings(poll_ascend(root, devices, relaxed)) == findings(
        poll_ascend_library(root, devices, relaxed)
    )


def test_library_poll_starts_no_tool_and_reports_telemetry(tmp_path: Path) -> None:
    root, devices = node(tmp_path)
    ascend_tree.set_npu_health(tmp_path, 2, "Critical", [0x80E01801])
    before = npu_smi_runs()
    for _ in range(3):
        result = poll_ascend_library(root, devices, SETTINGS)
        (event,) = result.events
        assert event.detail == "health Critical, fault codes 0x80E01801 (RestartBusiness)"
    assert npu_smi_runs() == before
    by_tool = poll_ascend(root, devices, SETTINGS).telemetry
    assert [t.device_id for t in result.telemetry] == [t.device_id for t in by_tool]
    assert result.telemetry[1].memory_total_mib == by_tool[1].memory_total_mib == 65536.0
    assert result.telemetry[1].temperature_c == 41.0


def test_injected_reset_reaches_the_library(tmp_path: Path) -> None:
    root, devices = node(tmp_path)
    ascend_tree.set_npu_health(tmp_path, 5, "Critical", [RESTART_NPU])
    (event,) = poll_ascend_library(root, devices, SETTINGS).events
    assert (event.device_id, event.level) == (devices[5].id, Level.DEVICE_FATAL)
    inject.reset_device(tmp_path, "ascend", 5)
    assert poll_ascend_library(root, devices, SETTINGS).events == []


def test_npu_smi_reset_clears_the_library_too(tmp_path: Path) -> None:
    """The stand-in's `npu-smi set -t reset` (what remediation runs) clears what DCMI reports."""
    root, devices = node(tmp_path, "ascend-a3-910c")
    ascend_tree.set_npu_health(tmp_path, 2, "Critical", [0x80E01801])
    ascend_tree.set_npu_health(tmp_path, 3, "Critical", [0x80E01801])
    assert len(poll_ascend_library(root, devices, SETTINGS).events) == 2
    npu_id = devices[2].attributes["npu_id"]
    tool = root.which(ascend.TOOL)
    assert tool is not None
    root.run_tool(tool, ["set", "-t", "reset", "-i", npu_id, "-c", "0"])
    assert poll_ascend_library(root, devices, SETTINGS).events == []


def test_chip_the_library_does_not_list(tmp_path: Path) -> None:
    root, devices = node(tmp_path)
    ghost = dataclasses.replace(devices[0], index=12, id="ghost")
    result = poll_ascend_library(root, [*devices, ghost], SETTINGS)
    (event,) = result.events
    assert (event.device_id, event.reason, event.level) == (
        "ghost",
        "NPU_NOT_REPORTED",
        Level.DEVICE_FATAL,
    )


def test_tool_is_the_fallback_without_the_library(tmp_path: Path) -> None:
    root, devices = node(tmp_path)
    ascend_tree.set_npu_health(tmp_path, 6, "Critical", [0x80E01801])
    assert library_usable(root)
    runs = npu_smi_runs()
    by_library = poll_ascend_auto(root, devices, SETTINGS)
    assert npu_smi_runs() == runs

    ascend_dcmi.remove(tmp_path)
    assert not library_usable(root)
    report = ascend.discover(root)
    assert report is not None
    assert report.driver["health_source"] == ascend.TOOL
    runs = npu_smi_runs()
    by_tool = poll_ascend_auto(root, devices, SETTINGS)
    assert npu_smi_runs() == runs + 2  # the table, and the unhealthy chip's codes
    assert findings(by_tool) == findings(by_library)
    failed = poll_ascend_library(root, devices, SETTINGS)
    assert not failed.ok
    assert [(e.device_id, e.reason, e.level) for e in failed.events] == [(None, FAILED, Level.WARN)]
    assert "libdcmi.so not found" in failed.events[0].detail


def test_unloadable_library_falls_back_to_the_tool(tmp_path: Path) -> None:
    build_tree(load_profile("ascend-910bx8"), tmp_path)
    root = HostRoot.at(tmp_path)
    library = root.path(ascend_dcmi.LIBRARY)
    library.unlink()  # replaced before anything loaded it: a loaded file is never rewritten
    library.write_bytes(b"not a shared object\n")
    assert not library_usable(root)
    report = ascend.discover(root)
    assert report is not None
    assert (report.driver["health_source"], report.error, len(report.devices)) == (
        ascend.TOOL,
        None,
        8,
    )
    result = poll_ascend_library(root, list(report.devices), SETTINGS)
    assert [(e.reason, e.level) for e in result.events] == [(FAILED, Level.WARN)]
    assert result.events[0].detail.startswith(f"cannot load: {library}: ")
    fallback = poll_ascend_auto(root, list(report.devices), SETTINGS)
    assert (fallback.ok, fallback.events, len(fallback.checked)) == (True, [], 8)


def test_without_library_or_tool_devices_come_from_dev(tmp_path: Path) -> None:
    build_tree(load_profile("ascend-910bx8"), tmp_path)
    root = HostRoot.at(tmp_path)
    library = root.path(ascend_dcmi.LIBRARY)
    library.unlink()
    library.write_bytes(b"not a shared object\n")
    root.path(ascend_tree.TOOL).unlink()
    report = ascend.discover(root)
    assert report is not None
    assert report.error is not None
    assert report.error.startswith("libdcmi.so: ")
    assert "health_source" not in report.driver
    assert [d.health for d in report.devices] == [Health.HEALTHY] * 8


def test_the_agents_ascend_poll_reads_the_library(tmp_path: Path) -> None:
    """What the agent runs: its `poll-ascend` part reads the NPUs through the library (no tool
    started) and a fault read there quarantines the chip."""
    build_tree(load_profile("ascend-910bx8"), tmp_path)
    settings = load_settings(overrides={"host_root": str(tmp_path)})
    before = npu_smi_runs()
    state = DeviceState(discover_node(settings))
    hub = HealthHub(state, settings.health, boot_id="boot-1")
    polls = VendorPolls(hub, state, HostRoot.at(tmp_path), settings.health)
    ascend_tree.set_npu_health(tmp_path, 2, "Critical", [RESTART_NPU])

    polls.poll(Vendor.ASCEND)

    assert npu_smi_runs() == before  # neither discovery nor the poll started npu-smi
    faulty = [d.id for d in state.snapshot().inventory.devices if d.index == 2]
    assert list(hub.unhealthy()) == faulty
