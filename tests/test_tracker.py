"""The health lifecycle: pure tracker tests with explicit time and evidence."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edl_agent.devices.model import Device, Vendor
from edl_agent.health.model import ClearsBy, Evidence, HealthEvent, Level
from edl_agent.health.tracker import HealthTracker

GPUS = [Device(Vendor.NVIDIA, "gpu", i, f"GPU-{i}", "H100", 81559) for i in range(4)]
NPU = Device(Vendor.ASCEND, "npu", 0, "npu-0", "Ascend910B3", 65536)
ALL = [*GPUS, NPU]


def event(device: str | None, reason: str, level: Level, at: float, **kw: object) -> HealthEvent:
    vendor = Vendor.ASCEND if device == "npu-0" else Vendor.NVIDIA
    return HealthEvent(vendor, device, reason, level, at, **kw)  # type: ignore[arg-type]


def test_ignored_and_warning_events_are_counted_only() -> None:
    tracker = HealthTracker(quiet_seconds=60)
    assert tracker.observe(event("GPU-1", "XID13", Level.IGNORE, 1, code=13), ALL) == []
    assert tracker.observe(event("GPU-1", "XID13", Level.IGNORE, 2, code=13), ALL) == []
    assert tracker.unhealthy(ALL) == {}
    assert tracker.counts.xid_errors[("GPU-1", 13)] == 2


def tracker_with(**clears: ClearsBy) -> HealthTracker:
    """A tracker whose events clear as `clears` says by reason (else as the event says)."""
    return HealthTracker(
        quiet_seconds=60,
        clears_by=lambda e: clears.get(e.reason, e.clears_by or ClearsBy.CONDITION),
    )


def test_time_alone_clears_nothing_severe() -> None:
    tracker = tracker_with(XID48=ClearsBy.RESET, GPU_LOST=ClearsBy.REBOOT, XID54=ClearsBy.RELEASE)
    tracker.observe(event("GPU-0", "XID48", Level.DEVICE_FATAL, 0, code=48), ALL)
    tracker.observe(event("GPU-1", "GPU_LOST", Level.NODE_FATAL, 0), ALL)
    tracker.observe(event("GPU-2", "XID54", Level.DEVICE_FATAL, 0, code=54), ALL)
    assert tracker.expire(1e9) == []
    assert set(tracker.unhealthy(ALL)) == {"GPU-0", "GPU-1", "GPU-2"}


def test_quiet_conditions_end_after_the_quiet_period_only() -> None:
    tracker = tracker_with(XID31=ClearsBy.QUIET)
    changes = tracker.observe(event("GPU-3", "XID31", Level.DEVICE_FATAL, 100, code=31), ALL)
    assert [(c.device_id, c.to, c.reason) for c in changes] == [("GPU-3", "Unhealthy", "XID31")]
    assert tracker.expire(159) == []
    tracker.observe(event("GPU-3", "XID31", Level.DEVICE_FATAL, 150, code=31), ALL)
    assert tracker.expire(209) == []  # the repeat restarted the quiet period
    changes = tracker.expire(210)
    assert [(c.device_id, c.to, c.evidence) for c in changes] == [
        ("GPU-3", "Healthy", Evidence.QUIET)
    ]
    assert tracker.counts.transitions[("GPU-3", "Healthy", "XID31")] == 1


def test_next_quiet_end_is_when_expire_is_due() -> None:
    tracker = tracker_with(XID31=ClearsBy.QUIET, XID48=ClearsBy.RESET)
    tracker.observe(event("GPU-0", "XID48", Level.DEVICE_FATAL, 10, code=48), ALL)
    assert tracker.next_quiet_end() is None, "a reset-class condition has no quiet end"
    tracker.observe(event("GPU-3", "XID31", Level.DEVICE_FATAL, 100, code=31), ALL)
    tracker.observe(event("GPU-2", "XID31", Level.DEVICE_FATAL, 120, code=31), ALL)
    assert tracker.next_quiet_end() == 160
    tracker.observe(event("GPU-3", "XID31", Level.DEVICE_FATAL, 130, code=31), ALL)
    assert tracker.next_quiet_end() == 180, "a repeat moves its end"
    assert tracker.expire(179.9) == []
    assert [c.device_id for c in tracker.expire(180)] == ["GPU-2"]
    assert tracker.next_quiet_end() == 190
    tracker.expire(190)
    assert tracker.next_quiet_end() is None


@pytest.mark.parametrize(
    ("clears_by", "ended_by"),
    [
        (ClearsBy.CONDITION, {Evidence.GONE, Evidence.RESET, Evidence.REBOOT, Evidence.RELEASE}),
        (ClearsBy.RESET, {Evidence.RESET, Evidence.REBOOT, Evidence.RELEASE}),
        (ClearsBy.REBOOT, {Evidence.REBOOT, Evidence.RELEASE}),
        (ClearsBy.RELEASE, {Evidence.RELEASE}),
    ],
)
def test_each_class_ends_on_its_evidence_only(clears_by: ClearsBy, ended_by: set[Evidence]) -> None:
    for evidence in Evidence:
        tracker = tracker_with(F=clears_by)
        tracker.observe(event("GPU-1", "F", Level.DEVICE_FATAL, 0), ALL)
        changes = tracker.clear(["GPU-1"], evidence)
        assert bool(changes) == (evidence in ended_by), evidence
        assert ("GPU-1" in tracker.unhealthy(ALL)) == (evidence not in ended_by)


def test_a_device_turns_healthy_only_when_its_last_condition_ends() -> None:
    tracker = tracker_with(XID95=ClearsBy.RESET, GPU_LOST=ClearsBy.REBOOT)
    tracker.observe(event("GPU-0", "XID95", Level.DEVICE_FATAL, 0, code=95), ALL)
    tracker.observe(event("GPU-0", "GPU_LOST", Level.NODE_FATAL, 1), ALL)
    assert tracker.unhealthy(ALL)["GPU-0"].reason == "GPU_LOST"  # the stricter one shows
    assert tracker.clear(["GPU-0"], Evidence.RESET) == []  # XID95 ended, GPU_LOST stays
    assert [c.reason for c in tracker.conditions("GPU-0")] == ["GPU_LOST"]
    changes = tracker.reboot()
    assert [(c.device_id, c.to, c.evidence) for c in changes] == [
        ("GPU-0", "Healthy", Evidence.REBOOT)
    ]


def test_a_cleared_event_ends_only_what_lasts_while_reported() -> None:
    tracker = tracker_with(NPU_HEALTH_Critical=ClearsBy.CONDITION, XPU=ClearsBy.RESET)
    tracker.observe(event("npu-0", "NPU_HEALTH_Critical", Level.DEVICE_FATAL, 0), ALL)
    tracker.observe(event("GPU-1", "XPU", Level.DEVICE_FATAL, 0), ALL)
    cleared = tracker.observe(
        event("npu-0", "NPU_HEALTH_Critical", Level.DEVICE_FATAL, 1, cleared=True), ALL
    )
    assert [(c.device_id, c.to) for c in cleared] == [("npu-0", "Healthy")]
    assert tracker.observe(event("GPU-1", "XPU", Level.DEVICE_FATAL, 1, cleared=True), ALL) == []
    assert "GPU-1" in tracker.unhealthy(ALL)


def test_escalation_turns_a_reset_wait_into_a_release_wait() -> None:
    tracker = tracker_with(XID95=ClearsBy.RESET)
    tracker.observe(event("GPU-2", "XID95", Level.DEVICE_FATAL, 0, code=95), ALL)
    assert tracker.escalate("GPU-2")
    assert tracker.clear(["GPU-2"], Evidence.RESET) == []
    assert tracker.reboot() == []
    assert [c.to for c in tracker.clear(["GPU-2"], Evidence.RELEASE)] == ["Healthy"]


def test_quarantined_lists_what_outlives_a_restart_and_restore_reopens_it() -> None:
    tracker = tracker_with(XID95=ClearsBy.RESET, NODE_VANISHED=ClearsBy.CONDITION)
    tracker.observe(event("GPU-0", "XID95", Level.DEVICE_FATAL, 5, code=95), ALL)
    tracker.observe(event("GPU-1", "NODE_VANISHED", Level.NODE_FATAL, 5), ALL)
    saved = tracker.quarantined()
    assert list(saved) == ["GPU-0"]  # a missing /dev node is looked at again after a restart
    fresh = tracker_with()
    for device_id, conditions in saved.items():
        fresh.restore(device_id, conditions)
    assert fresh.unhealthy(ALL)["GPU-0"].clears_by is ClearsBy.RESET
    assert fresh.clear(["GPU-0"], Evidence.GONE) == []


def test_a_flood_of_one_fault_is_one_transition() -> None:
    tracker = tracker_with(XID95=ClearsBy.RESET)
    changes = []
    for at in range(100_000):
        changes += tracker.observe(event("GPU-1", "XID95", Level.DEVICE_FATAL, at, code=95), ALL)
    assert len(changes) == 1
    assert tracker.counts.xid_errors[("GPU-1", 95)] == 100_000
    assert tracker.conditions("GPU-1")[0].count == 100_000


def test_vendor_monitor_failure_marks_only_that_vendor() -> None:
    tracker = HealthTracker(quiet_seconds=1)
    changes = tracker.observe(event(None, "NVML_INIT_FAILED", Level.NODE_FATAL, 0), ALL)
    assert sorted(c.device_id for c in changes) == [g.id for g in GPUS]
    assert "npu-0" not in tracker.unhealthy(ALL)
    assert tracker.expire(1e9) == []
    changes = tracker.observe(
        event(None, "NVML_INIT_FAILED", Level.NODE_FATAL, 5, cleared=True), ALL
    )
    assert {c.to for c in changes} == {"Healthy"}
    assert tracker.unhealthy(ALL) == {}


def test_a_failing_tool_marks_the_monitor_not_the_devices() -> None:
    tracker = HealthTracker(quiet_seconds=1)
    assert tracker.observe(event(None, "NPU_SMI_FAILED", Level.WARN, 0), [NPU]) == []
    assert tracker.unhealthy(ALL) == {}
    assert tracker.monitor_failures()[Vendor.NVIDIA].reason == "NPU_SMI_FAILED"
    tracker.monitor_ok(Vendor.NVIDIA)
    assert tracker.monitor_failures() == {}


levels = st.sampled_from(list(Level))
events = st.lists(
    st.tuples(st.sampled_from([g.id for g in GPUS]), levels, st.floats(0, 1000)), max_size=30
)


@given(events)
def test_ignore_and_warn_never_make_a_device_unhealthy(
    seen: list[tuple[str, Level, float]],
) -> None:
    tracker = HealthTracker(quiet_seconds=5)
    for device_id, level, at in seen:
        tracker.observe(event(device_id, f"R{level}", level, at), ALL)
    fatal = {d for d, level, _ in seen if level.unhealthy}
    assert set(tracker.unhealthy(ALL)) == fatal


@given(events, st.floats(0, 5000))
def test_transitions_alternate_per_device(
    seen: list[tuple[str, Level, float]], later: float
) -> None:
    tracker = HealthTracker(quiet_seconds=5)
    changes = []
    for device_id, level, at in sorted(seen, key=lambda e: e[2]):
        changes += tracker.observe(event(device_id, "R", level, at), ALL)
    changes += tracker.expire(later)
    changes += tracker.clear([g.id for g in GPUS], Evidence.GONE)
    for gpu in GPUS:
        states = [c.to for c in changes if c.device_id == gpu.id]
        assert all(a != b for a, b in itertools.pairwise(states))
        assert states[:1] in ([], ["Unhealthy"], ["Degraded"])
    assert tracker.unhealthy(ALL) == {} or later < 1000 + 5
