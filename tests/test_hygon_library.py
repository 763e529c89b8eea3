"""Hygon DCU health through DTK's rocm_smi library (the simulated node's fake library, through the
real ctypes bindings): the same findings as the hy-smi poll, no process started, the tool as
fallback. Also: Kunlunxin's poll starts xpu-smi once a round for all XPUs."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest

from edl_agent.config import HealthSettings, load_settings
from edl_agent.devices import hygon, kunlunxin, rocm_smi
from edl_agent.devices.discovery import discover_node
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, Vendor
from edl_agent.devices.tool_runs import TOOL_RUNS
from edl_agent.health.hub import HealthHub
from edl_agent.health.hygon_library import (
    HEALTH_SOURCE_LIBRARY,
    library_usable,
    poll_hygon_auto,
    poll_hygon_library,
)
from edl_agent.health.model import Level
from edl_agent.health.state import DeviceState
from edl_agent.health.vendor_polls import VendorPolls
from edl_agent.health.vendor_readings import PollResult, clears, poll_hygon, poll_kunlunxin
from edl_agent.sim import hygon_tree, inject
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree

SETTINGS = HealthSettings()


def node(tmp_path: Path, profile: str = "hygon-k100x8") -> tuple[HostRoot, list[Device]]:
    build_tree(load_profile(profile), tmp_path)
    root = HostRoot.at(tmp_path)
    report = hygon.discover(root)
    assert report is not None
    return root, list(report.devices)


def findings(result: PollResult) -> list[tuple[str, str, str]]:
    return sorted((e.device_id or "", e.reason, e.level.value) for e in result.events)


def test_bindings_read_the_fake_library(tmp_path: Path) -> None:
    root, devices = node(tmp_path)
    path = rocm_smi.find_library(root)
    assert path == str(tmp_path / hygon_tree.LIBRARY.lstrip("/"))
    readings = rocm_smi.open_library(path).read_all()
    assert [r.bus_id for r in readings] == [d.pci_bus_id for d in devices]
    third = readings[2]
    assert (third.temperature_c, third.temperature_max_c, third.power_w) == (40.0, 100.0, 60.0)
    assert (third.utilization_percent, third.memory_used_mib, third.memory_total_mib) == (
        0.0,
        3.0,
        65536.0,
    )
    assert (third.ecc_corrected, third.ecc_uncorrected, third.gone) == (0, 0, False)


def test_bus_id_packing() -> None:
    assert rocm_smi.bus_id_of(0x2 << 32 | 0x30 << 8 | 0x1F << 3 | 0x7) == "0002:30:1f.7"


@pytest.mark.parametrize("profile", ["hygon-k100x8", "hygon-bw"])
@pytest.mark.parametrize("state", ["Warning", "Fault", "Lost"])
def test_library_poll_finds_what_the_tool_poll_finds(
    profile: str, state: str, tmp_path: Path
) -> None:
    root, devices = node(tmp_path, profile)
    assert poll_hygon_library(root, devices, SETTINGS).events == []
    hygon_tree.set_dcu_state(tmp_path, 3, state)
    by_tool = poll_hygon(root, devices, SETTINGS)
    by_library = poll_hygon_library(root, devices, SETTINGS)
    assert findings(by_library) == findings(by_tool)
    assert len(by_library.events) == 1
    assert by_library.events[0].reason == f"DCU_STATE_{state}"
    assert by_library.events[0].detail.startswith(f"state {state} (")
    assert by_library.checked == by_tool.checked == {d.id for d in devices}

    hygon_tree.set_dcu_state(tmp_path, 3, "Normal")
    over = poll_hygon_library(root, devices, SETTINGS, clock=lambda: 9.0)
    assert over.events == poll_hygon(root, devices, SETTINGS).events == []
    (cleared,) = clears({devices[3].id: by_library.events[0]}, over)
    assert (cleared.device_id, cleared.cleared, cleared.at) == (devices[3].id, True, 9.0)


def test_injected_reset_reaches_the_library(tmp_path: Path) -> None:
    root, devices = node(tmp_path)
    hygon_tree.set_dcu_state(tmp_path, 5, "Fault")
    (event,) = poll_hygon_library(root, devices, SETTINGS).events
    assert (event.device_id, event.level) == (devices[5].id, Level.DEVICE_FATAL)
    inject.reset_device(tmp_path, "hygon", 5)
    assert poll_hygon_library(root, devices, SETTINGS).events == []


def test_library_telemetry(tmp_path: Path) -> None:
    root, devices = node(tmp_path)
    by_library = poll_hygon_library(root, devices, SETTINGS).telemetry
    by_tool = poll_hygon(root, devices, SETTINGS).telemetry
    strip = {"ecc_corrected_total": None, "ecc_uncorrected_total": None}
    assert [dataclasses.replace(t, **strip) for t in by_library] == by_tool  # type: ignore[arg-type]
    assert by_library[0].ecc_uncorrected_total == 0


def test_library_poll_starts_no_tool(tmp_path: Path) -> None:
    root, devices = node(tmp_path)
    hygon_tree.set_dcu_state(tmp_path, 1, "Lost")
    before = TOOL_RUNS.snapshot()
    for _ in range(3):
        (event,) = poll_hygon_library(root, devices, SETTINGS).events
        assert event.detail == (
            "state Lost (rsmi_dev_busy_percent_get returned RSMI_STATUS_UNKNOWN_ERROR)"
        )
    assert TOOL_RUNS.snapshot() == before


def test_device_the_library_does_not_list(tmp_path: Path) -> None:
    root, devices = node(tmp_path)
    ghost = dataclasses.replace(devices[0], index=12, id="ghost", pci_bus_id="0009:99:00.0")
    other = dataclasses.replace(devices[0], vendor=Vendor.ASCEND, id="npu")
    result = poll_hygon_library(root, [*devices, ghost, other], SETTINGS)
    (event,) = result.events
    assert (event.device_id, event.reason, event.level) == (
        "ghost",
        "DCU_NOT_REPORTED",
        Level.DEVICE_FATAL,
    )
    assert "npu" not in result.checked


def hy_smi_runs() -> int:
    cost = TOOL_RUNS.snapshot().get(hygon.TOOL)
    return cost.runs if cost is not None else 0


def test_tool_is_the_fallback_without_the_library(tmp_path: Path) -> None:
    root, devices = node(tmp_path)
    hygon_tree.set_dcu_state(tmp_path, 6, "Fault")
    assert library_usable(root)
    report = hygon.discover(root)
    assert report is not None
    assert report.driver["health_source"] == HEALTH_SOURCE_LIBRARY
    runs = hy_smi_runs()
    by_library = poll_hygon_auto(root, devices, SETTINGS)
    assert hy_smi_runs() == runs
    assert by_library.events[0].detail == "state Fault (1 uncorrectable ECC errors)"

    root.path(hygon_tree.LIBRARY).unlink()
    assert not library_usable(root)
    report = hygon.discover(root)
    assert report is not None
    assert report.driver["health_source"] == "hy-smi"
    runs = hy_smi_runs()
    by_tool = poll_hygon_auto(root, devices, SETTINGS)
    assert hy_smi_runs() == runs + 1
    assert findings(by_tool) == findings(by_library)
    assert by_tool.events[0].detail == "state Fault"
    failed = poll_hygon_library(root, devices, SETTINGS)
    assert not failed.ok
    assert [(e.device_id, e.reason, e.level) for e in failed.events] == [
        (None, "ROCM_SMI_FAILED", Level.WARN)
    ]
    assert failed.checked == frozenset()


def test_rocm_smi_node_without_hy_smi_says_so(tmp_path: Path) -> None:
    build_tree(load_profile("hygon-k100x8"), tmp_path)
    root = HostRoot.at(tmp_path)
    root.path(hygon_tree.LIBRARY).unlink()
    assert hygon.health_source(root, root.path(hygon_tree.ROCM_TOOL)) == "rocm-smi"
    assert hygon.health_source(root, None) == "hy-smi"


def test_unloadable_library_is_not_usable(tmp_path: Path) -> None:
    build_tree(load_profile("hygon-k100x8"), tmp_path)
    root = HostRoot.at(tmp_path)
    library = root.path(hygon_tree.LIBRARY)
    library.unlink()  # replaced before anything loaded it: a loaded file is never rewritten
    library.write_bytes(b"not a shared object\n")
    assert not library_usable(root)
    report = hygon.discover(root)
    assert report is not None
    assert report.driver["health_source"] == "hy-smi"
    result = poll_hygon_library(root, list(report.devices), SETTINGS)
    assert [(e.reason, e.level) for e in result.events] == [("ROCM_SMI_FAILED", Level.WARN)]
    assert result.events[0].detail.startswith(f"cannot load: {library}: ")
    fallback = poll_hygon_auto(root, list(report.devices), SETTINGS)
    assert (fallback.ok, fallback.events, len(fallback.checked)) == (True, [], 8)


def test_kunlunxin_poll_runs_xpu_smi_once_for_all_xpus(tmp_path: Path) -> None:
    build_tree(load_profile("kunlun-p800x8"), tmp_path)
    root = HostRoot.at(tmp_path)
    report = kunlunxin.discover(root)
    assert report is not None
    devices = list(report.devices)
    assert len(devices) == 8
    for round_number in range(1, 4):
        before = TOOL_RUNS.snapshot().get(kunlunxin.TOOL)
        result = poll_kunlunxin(root, devices, SETTINGS)
        after = TOOL_RUNS.snapshot()[kunlunxin.TOOL]
        assert result.checked == {d.id for d in devices}, round_number
        assert after.runs == (before.runs if before is not None else 0) + 1


def test_the_agents_hygon_poll_reads_the_library(tmp_path: Path) -> None:
    """What the agent runs: its `poll-hygon` part reads the DCUs through the library (no tool
    started) and a fault read there quarantines the device."""
    build_tree(load_profile("hygon-k100x8"), tmp_path)
    settings = load_settings(overrides={"host_root": str(tmp_path)})
    state = DeviceState(discover_node(settings))
    hub = HealthHub(state, settings.health, boot_id="boot-1")
    polls = VendorPolls(hub, state, HostRoot.at(tmp_path), settings.health)
    hygon_tree.set_dcu_state(tmp_path, 2, "Fault")
    before = hy_smi_runs()

    polls.poll(Vendor.HYGON)

    assert hy_smi_runs() == before
    faulty = [d.id for d in state.snapshot().inventory.devices if d.index == 2]
    assert list(hub.unhealthy()) == faulty


def test_a_vendor_may_have_a_poll_period_of_its_own(tmp_path: Path) -> None:
    build_tree(load_profile("kunlun-p800x8"), tmp_path)
    own = {"vendor_poll_seconds": {"kunlunxin": 5}}
    settings = load_settings(overrides={"host_root": str(tmp_path), "health": own})
    state = DeviceState(discover_node(settings))
    hub = HealthHub(state, settings.health, boot_id="boot-1")
    polls = VendorPolls(hub, state, HostRoot.at(tmp_path), settings.health)
    (part,) = polls.parts(threading.Event)
    assert (part.name, part.interval()) == ("poll-kunlunxin", 5.0)
    assert settings.health.poll_seconds_of("hygon") == settings.health.poll_seconds == 1.0


def test_rediscovery_with_the_library_starts_hy_smi_only_when_the_cards_change(
    tmp_path: Path,
) -> None:
    root, devices = node(tmp_path)
    runs = hy_smi_runs()
    for _ in range(3):
        report = hygon.discover(root)
        assert report is not None
        assert [d.id for d in report.devices] == [d.id for d in devices]
        assert report.devices[0].product == devices[0].product != "unknown"
    assert hy_smi_runs() == runs  # the first discovery's report, reused

    card = root.path("/sys/class/drm/card8")  # the last DCU's card (card0 is the BMC's)
    card.rename(card.with_name("gone"))
    report = hygon.discover(root)
    assert report is not None
    assert hy_smi_runs() == runs + 1  # the cards changed: the tool runs again
    assert len(report.devices) == len(devices)  # hy-smi still lists it: advertised Unhealthy

    root.path(hygon_tree.LIBRARY).unlink()  # without the library the tool runs every time
    hygon.discover(root)
    hygon.discover(root)
    assert hy_smi_runs() == runs + 3
