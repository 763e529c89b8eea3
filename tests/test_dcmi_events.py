"""Ascend NPU fault events through DCMI's subscription: the simulated node's fake libdcmi.so
calls back from its own thread, as the driver's library does, and `DcmiWatcher` running under a
supervisor turns each event into a health event; in the agent, a chip is withdrawn from kubelet
on the event, not at the next poll."""

from __future__ import annotations

from pathlib import Path

from edl_agent.config import HealthSettings
from edl_agent.devices import ascend
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, Vendor
from edl_agent.devices.tool_runs import TOOL_RUNS
from edl_agent.health.dcmi_watch import EVENTS_FAILED, DcmiWatcher
from edl_agent.health.model import Level
from edl_agent.sim import ascend_dcmi, ascend_tree
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree
from tests.health_events import Events
from tests.parts import supervised
from tests.test_health_agent import health_of
from tests.test_plugin import running_node
from tests.waiting import wait_until

RESOURCE = "huawei.com/Ascend910"
RESTART_NPU = 0x8C03A000
RESTART_BUSINESS = 0x80E01801
SEPARATE_NPU = 0x80E18402
NOT_HANDLE = 0x4C1F8608  # NotHandleFault


def node(tmp_path: Path, profile: str = "ascend-910bx8") -> list[Device]:
    build_tree(load_profile(profile), tmp_path)
    report = ascend.discover(HostRoot.at(tmp_path))
    assert report is not None
    return list(report.devices)


def watcher(tmp_path: Path, events: Events, settings: HealthSettings | None = None) -> DcmiWatcher:
    health = settings or HealthSettings()
    return DcmiWatcher(HostRoot.at(tmp_path), events, lambda: health, wait_seconds=0.05)


def test_raised_and_recovered_faults_reach_on_event(tmp_path: Path) -> None:
    devices = node(tmp_path, "ascend-a3-910c")
    events = Events()
    watch = watcher(tmp_path, events)
    before = TOOL_RUNS.snapshot()
    with supervised(watch):
        wait_until(lambda: watch.ready, what="the subscription running")
        ascend_tree.set_npu_health(tmp_path, 3, "Critical", [RESTART_NPU])
        ascend_tree.set_npu_health(tmp_path, 5, "Alarm", [RESTART_BUSINESS, SEPARATE_NPU])
        ascend_tree.set_npu_health(tmp_path, 3, "OK")
        got = events.wait(4)
    assert [(e.device_id, e.reason, e.level, e.cleared, e.code) for e in got] == [
        (devices[3].id, "NPU_FAULT_0x8C03A000", Level.DEVICE_FATAL, False, RESTART_NPU),
        (devices[5].id, "NPU_FAULT_0x80E01801", Level.WARN, False, RESTART_BUSINESS),
        (devices[5].id, "NPU_FAULT_0x80E18402", Level.NODE_FATAL, False, SEPARATE_NPU),
        (devices[3].id, "NPU_FAULT_0x8C03A000", Level.DEVICE_FATAL, True, RESTART_NPU),
    ]
    assert {e.vendor for e in got} == {Vendor.ASCEND}
    assert got[0].detail == (
        "health Critical, fault codes 0x8C03A000 (RestartNPU): simulated event 8C03A000"
    )
    assert TOOL_RUNS.snapshot() == before  # no process started


def test_codes_the_table_ignores_are_not_reported_and_overrides_apply(tmp_path: Path) -> None:
    devices = node(tmp_path)
    events = Events()
    relaxed = HealthSettings(ascend_code_levels={"0x8C03A000": "warn"})
    watch = watcher(tmp_path, events, relaxed)
    with supervised(watch):
        wait_until(lambda: watch.ready, what="the subscription running")
        ascend_tree.set_npu_health(tmp_path, 1, "Warning", [NOT_HANDLE])
        ascend_tree.set_npu_health(tmp_path, 2, "Critical", [RESTART_NPU])
        (event,) = events.wait(1)
    assert (event.device_id, event.level) == (devices[2].id, Level.WARN)
    assert events.seen() == [event]


def test_event_for_a_chip_without_a_device_names_its_logic_id(tmp_path: Path) -> None:
    node(tmp_path)
    events = Events()
    watch = watcher(tmp_path, events)
    with supervised(watch):
        wait_until(lambda: watch.ready, what="the subscription running")
        ascend_dcmi.append_events(tmp_path, [(42, RESTART_NPU, 3, 1)], name="card hot")
        (event,) = events.wait(1)
    assert (event.device_id, event.level) == (None, Level.DEVICE_FATAL)
    assert event.detail.startswith("logic id 42: health Critical")
    assert event.detail.endswith(": card hot")


def test_a_restarted_watcher_reads_the_same_subscription(tmp_path: Path) -> None:
    devices = node(tmp_path)
    events = Events()
    first = watcher(tmp_path, events)
    with supervised(first):
        wait_until(lambda: first.ready, what="the subscription running")
    ascend_tree.set_npu_health(tmp_path, 4, "Critical", [RESTART_NPU])  # while none watches
    second = watcher(tmp_path, events)
    with supervised(second):
        (event,) = events.wait(1)
    assert (event.device_id, event.reason) == (devices[4].id, "NPU_FAULT_0x8C03A000")


def test_missing_library_is_one_event_until_it_is_back(tmp_path: Path) -> None:
    node(tmp_path)
    library = tmp_path / ascend_dcmi.LIBRARY.lstrip("/")
    library.rename(library.with_name("moved-away.so"))
    events = Events()
    watch = watcher(tmp_path, events)
    with supervised(watch):
        (failed,) = events.wait(1)
        assert (failed.device_id, failed.reason, failed.level, failed.cleared) == (
            None,
            EVENTS_FAILED,
            Level.WARN,
            False,
        )
        assert "libdcmi.so not found" in failed.detail
        library.with_name("moved-away.so").rename(library)
        wait_until(lambda: watch.ready, what="the subscription running again")
        got = events.wait(2)
    assert [(e.reason, e.cleared) for e in got] == [(EVENTS_FAILED, False), (EVENTS_FAILED, True)]


def test_the_agent_withdraws_a_chip_on_its_fault_event(tmp_path: Path) -> None:
    """Polls an hour apart: only the event can take the chip out of ListAndWatch."""
    hourly = {"health": {"poll_seconds": 3600}}
    with running_node(tmp_path, "ascend-910bx8", extra=hourly) as node_:
        node_.kubelet.wait_registered({RESOURCE})
        wait_until(lambda: node_.agent.ready()[0])
        statuses = node_.agent.supervisor.statuses
        wait_until(
            lambda: any(s.name == "dcmi-watch" and s.ready for s in statuses()),
            what="the agent's DCMI watcher subscribed",
        )
        watch = node_.kubelet.watch(RESOURCE)
        watch.next()
        ascend_tree.set_npu_health(node_.tree, 6, "Critical", [RESTART_NPU])
        update = watch.until(lambda u: health_of(u)["ascend-npu6"] == "Unhealthy")
        watch.cancel()
        assert [i for i, h in health_of(update).items() if h != "Healthy"] == ["ascend-npu6"]
        condition = node_.agent.unhealthy()["ascend-npu6"]
        assert condition.reason == "NPU_FAULT_0x8C03A000"
        assert "simulated event" in condition.detail  # the event's words, not a poll's
