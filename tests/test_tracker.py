"""Health hysteresis: pure tracker tests with explicit time."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from edl_agent.devices.model import Device, Vendor
from edl_agent.health.model import HealthEvent, Level
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


def test_device_fatal_recovers_after_quiet_period() -> None:
    tracker = HealthTracker(quiet_seconds=60)
    changes = tracker.observe(event("GPU-3", "XID48", Level.DEVICE_FATAL, 100, code=48), ALL)
    assert [(c.device_id, c.to, c.reason) for c in changes] == [("GPU-3", "Unhealthy", "XID48")]
    assert tracker.expire(159, ALL) == []
    tracker.observe(event("GPU-3", "XID48", Level.DEVICE_FATAL, 150, code=48), ALL)
    assert tracker.expire(209, ALL) == []  # the second fault restarted the quiet period
    changes = tracker.expire(210, ALL)
    assert [(c.device_id, c.to) for c in changes] == [("GPU-3", "Healthy")]
    assert tracker.counts.transitions[("GPU-3", "Healthy", "XID48")] == 1


def test_node_fatal_waits_for_rediscovery() -> None:
    tracker = HealthTracker(quiet_seconds=1)
    tracker.observe(event("GPU-2", "GPU_LOST", Level.NODE_FATAL, 0), ALL)
    assert tracker.expire(10_000, ALL) == []
    assert "GPU-2" in tracker.unhealthy(ALL)
    changes = tracker.sound({"GPU-2"}, ALL)
    assert [(c.device_id, c.to, c.reason) for c in changes] == [("GPU-2", "Healthy", "GPU_LOST")]


def test_vendor_monitor_failure_marks_only_that_vendor() -> None:
    tracker = HealthTracker(quiet_seconds=1)
    changes = tracker.observe(event(None, "NVML_INIT_FAILED", Level.NODE_FATAL, 0), ALL)
    assert sorted(c.device_id for c in changes) == [g.id for g in GPUS]
    assert "npu-0" not in tracker.unhealthy(ALL)
    assert tracker.expire(1e9, ALL) == []
    changes = tracker.observe(
        event(None, "NVML_INIT_FAILED", Level.NODE_FATAL, 5, cleared=True), ALL
    )
    assert {c.to for c in changes} == {"Healthy"}
    assert tracker.unhealthy(ALL) == {}


def test_worst_condition_wins_and_outlives_the_lesser() -> None:
    tracker = HealthTracker(quiet_seconds=10)
    tracker.observe(event("GPU-0", "XID48", Level.DEVICE_FATAL, 0), ALL)
    tracker.observe(event("GPU-0", "GPU_LOST", Level.NODE_FATAL, 1), ALL)
    assert tracker.unhealthy(ALL)["GPU-0"].reason == "GPU_LOST"
    assert tracker.expire(100, ALL) == []  # XID48 expired, GPU_LOST remains
    assert tracker.unhealthy(ALL)["GPU-0"].reason == "GPU_LOST"


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
    changes += tracker.expire(later, ALL)
    changes += tracker.sound([g.id for g in GPUS], ALL)
    for gpu in GPUS:
        states = [c.to for c in changes if c.device_id == gpu.id]
        assert all(a != b for a, b in itertools.pairwise(states))
        assert states[:1] in ([], ["Unhealthy"])
    assert tracker.unhealthy(ALL) == {} or later < 1000 + 5
