"""Hygon DCU events through the rocm_smi event API: the simulated node's fake library delivers
injected events to `RocmSmiWatcher` running under a supervisor, as the agent runs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from edl_agent.devices import hygon
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, Vendor
from edl_agent.devices.tool_runs import TOOL_RUNS
from edl_agent.health.model import ClearsBy, Level
from edl_agent.health.rocm_smi_watch import EVENTS_FAILED, RocmSmiWatcher
from edl_agent.sim import hygon_tree
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree
from tests.health_events import Events
from tests.parts import supervised
from tests.waiting import wait_until


def node(tmp_path: Path) -> list[Device]:
    build_tree(load_profile("hygon-k100x8"), tmp_path)
    report = hygon.discover(HostRoot.at(tmp_path))
    assert report is not None
    return list(report.devices)


def test_injected_events_reach_on_event(tmp_path: Path) -> None:
    devices = node(tmp_path)
    hygon_tree.inject_dcu_event(tmp_path, 0, "thermal_throttle", "before the watcher")
    events = Events()
    watcher = RocmSmiWatcher(HostRoot.at(tmp_path), events, wait_ms=100)
    before = TOOL_RUNS.snapshot()
    with supervised(watcher):
        wait_until(lambda: watcher.ready, what="the event loop running")
        hygon_tree.inject_dcu_event(tmp_path, 2, "thermal_throttle", "temperature 101 C")
        hygon_tree.inject_dcu_event(tmp_path, 4, "pre_reset", "reset begins")
        hygon_tree.inject_dcu_event(tmp_path, 4, "post_reset", "reset done")
        hygon_tree.inject_dcu_event(tmp_path, 1, "vmfault", "pid 42 bad address")
        got = events.wait(4)
    assert [(e.device_id, e.reason, e.level, e.cleared, e.detail) for e in got] == [
        (devices[2].id, "DCU_THERMAL_THROTTLE", Level.WARN, False, "temperature 101 C"),
        (devices[4].id, "DCU_RESET", Level.WARN, False, "reset begins"),
        (devices[4].id, "DCU_RESET", Level.WARN, True, "reset done"),
        (devices[1].id, "DCU_VM_FAULT", Level.IGNORE, False, "pid 42 bad address"),
    ]
    assert {e.vendor for e in got} == {Vendor.HYGON}
    assert [e.clears_by for e in got] == [
        ClearsBy.NOTHING,
        ClearsBy.CONDITION,
        ClearsBy.CONDITION,
        ClearsBy.NOTHING,
    ]
    assert TOOL_RUNS.snapshot() == before  # no process started


def test_missing_library_is_one_event_until_it_is_back(tmp_path: Path) -> None:
    node(tmp_path)
    library = tmp_path / hygon_tree.LIBRARY.lstrip("/")
    library.rename(library.with_name("moved-away.so"))
    events = Events()
    watcher = RocmSmiWatcher(HostRoot.at(tmp_path), events, wait_ms=100)
    with supervised(watcher):
        (failed,) = events.wait(1)
        assert (failed.device_id, failed.reason, failed.level, failed.cleared) == (
            None,
            EVENTS_FAILED,
            Level.WARN,
            False,
        )
        assert "librocm_smi64.so not found" in failed.detail
        library.with_name("moved-away.so").rename(library)
        wait_until(lambda: watcher.ready, what="the event loop running again")
        got = events.wait(2)
    assert [(e.reason, e.cleared) for e in got] == [(EVENTS_FAILED, False), (EVENTS_FAILED, True)]


def test_inject_rejects_bad_events(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no simulated Hygon DCUs"):
        hygon_tree.inject_dcu_event(tmp_path, 0, "pre_reset")
    node(tmp_path)
    with pytest.raises(ValueError, match="expected one of vmfault"):
        hygon_tree.inject_dcu_event(tmp_path, 0, "meltdown")
    with pytest.raises(ValueError, match="no simulated DCU 8"):
        hygon_tree.inject_dcu_event(tmp_path, 8, "pre_reset")
