"""The Degraded state, pure: tracker transitions, the device state the plugin reads, the node
condition and events, and what the restarter's rules match."""

from __future__ import annotations

from datetime import UTC, datetime

from edl_agent.devices.model import Device, Inventory, Vendor, VendorReport
from edl_agent.faults.model import Fault, FaultKind
from edl_agent.health.model import ClearsBy, Evidence, HealthEvent, Level
from edl_agent.health.state import DeviceState
from edl_agent.health.tracker import Condition, HealthTracker
from edl_agent.labels.condition import DEGRADED_REASON, accelerator_health
from edl_agent.labels.events import DEGRADED_REASON as DEGRADED_EVENT
from edl_agent.labels.events import RECOVERED_REASON, UNHEALTHY_REASON, health_events
from edl_agent.restarter.core.policy import RestartPolicy, Rule
from edl_agent.restarter.core.spec import parse_events

GPUS = [Device(Vendor.NVIDIA, "gpu", i, f"GPU-{i}", "H100", 81559) for i in range(4)]
MIG = Device(Vendor.NVIDIA, "mig", 0, "MIG-0", "1g.10gb", 9856, parent="GPU-1")


def event(device: str, reason: str, level: Level, at: float, **kw: object) -> HealthEvent:
    return HealthEvent(Vendor.NVIDIA, device, reason, level, at, **kw)  # type: ignore[arg-type]


def moves(changes: list) -> list[tuple[str, str, str]]:  # type: ignore[type-arg]
    return [(c.device_id, c.to, c.reason) for c in changes]


def test_a_warning_degrades_a_fault_makes_unhealthy_and_evidence_walks_back() -> None:
    tracker = HealthTracker(quiet_seconds=60)
    warned = event("GPU-0", "XID94", Level.DEGRADED, 1, code=94, clears_by=ClearsBy.RESET)
    assert moves(tracker.observe(warned, GPUS)) == [("GPU-0", "Degraded", "XID94")]
    assert tracker.observe(warned, GPUS) == []  # a repeat changes nothing
    assert set(tracker.degraded(GPUS)) == {"GPU-0"}
    assert tracker.unhealthy(GPUS) == {}

    fatal = event("GPU-0", "XID79", Level.NODE_FATAL, 2, code=79, clears_by=ClearsBy.REBOOT)
    assert moves(tracker.observe(fatal, GPUS)) == [("GPU-0", "Unhealthy", "XID79")]
    assert tracker.degraded(GPUS) == {}  # unhealthy wins

    # A reboot ends both; a reset only the warning (the fault waits for a reboot).
    assert tracker.clear(["GPU-0"], Evidence.RESET) == []
    assert moves(tracker.reboot()) == [("GPU-0", "Healthy", "XID79")]


def test_a_fault_that_clears_leaves_the_device_degraded() -> None:
    tracker = HealthTracker(quiet_seconds=60)
    tracker.observe(event("GPU-1", "ROWS_PENDING", Level.DEGRADED, 1), GPUS)
    tracker.observe(event("GPU-1", "XID31", Level.DEVICE_FATAL, 2, clears_by=ClearsBy.QUIET), GPUS)
    changes = tracker.expire(100)
    assert [(c.device_id, c.to, c.reason, c.evidence) for c in changes] == [
        ("GPU-1", "Degraded", "ROWS_PENDING", Evidence.QUIET)
    ]
    cleared = event("GPU-1", "ROWS_PENDING", Level.DEGRADED, 3, cleared=True)
    assert moves(tracker.observe(cleared, GPUS)) == [("GPU-1", "Healthy", "ROWS_PENDING")]


def test_the_same_reason_turning_severe_is_a_transition() -> None:
    tracker = HealthTracker(quiet_seconds=60)
    tracker.observe(event("GPU-2", "DCU_STATE", Level.DEGRADED, 1), GPUS)
    changes = tracker.observe(event("GPU-2", "DCU_STATE", Level.DEVICE_FATAL, 2), GPUS)
    assert moves(changes) == [("GPU-2", "Unhealthy", "DCU_STATE")]
    # ... and a milder repeat does not lower it.
    assert tracker.observe(event("GPU-2", "DCU_STATE", Level.DEGRADED, 3), GPUS) == []
    assert set(tracker.unhealthy(GPUS)) == {"GPU-2"}


def test_a_vendor_wide_failure_over_leaves_degraded_devices_degraded() -> None:
    tracker = HealthTracker(quiet_seconds=60)
    tracker.observe(event("GPU-3", "THROTTLED", Level.DEGRADED, 1), GPUS)
    down = HealthEvent(Vendor.NVIDIA, None, "NVML_INIT_FAILED", Level.NODE_FATAL, 2)
    assert {c.to for c in tracker.observe(down, GPUS)} == {"Unhealthy"}
    back = HealthEvent(Vendor.NVIDIA, None, "NVML_INIT_FAILED", Level.NODE_FATAL, 3, cleared=True)
    states = {c.device_id: c.to for c in tracker.observe(back, GPUS)}
    assert states == {"GPU-0": "Healthy", "GPU-1": "Healthy", "GPU-2": "Healthy"} | {
        "GPU-3": "Degraded"
    }


def test_degraded_devices_are_advertised_unavailable_but_not_refused() -> None:
    state = DeviceState(Inventory("n", (VendorReport(Vendor.NVIDIA, (*GPUS, MIG)),), ()))
    assert state.set_unhealthy({"GPU-0"}, {"GPU-1"})
    snapshot = state.snapshot()
    assert snapshot.degraded_all == {"GPU-1", "MIG-0"}
    assert snapshot.unavailable == {"GPU-0", "GPU-1", "MIG-0"}
    assert snapshot.unhealthy_all == {"GPU-0"}
    # A race (kubelet allocating what it had just been told is unavailable) is no DRA hold.
    assert state.hand_out({"GPU-1"}, now=1.0) == frozenset()
    assert not state.set_unhealthy({"GPU-0"})  # degraded kept when not given
    assert state.set_unhealthy({"GPU-0"}, ())
    assert state.snapshot().unavailable == {"GPU-0"}


def condition(reason: str, level: Level, since: float = 1.0) -> Condition:
    return Condition(reason, level, since, since, detail="", clears_by=ClearsBy.RESET)


def test_the_node_condition_stays_true_and_names_degraded_devices() -> None:
    inventory = Inventory("n", (VendorReport(Vendor.NVIDIA, tuple(GPUS)),), ())
    degraded = {"GPU-2": condition("XID94", Level.DEGRADED)}

    health = accelerator_health(inventory=inventory, unhealthy={}, degraded=degraded)
    assert (health.status, health.reason) == ("True", DEGRADED_REASON)
    assert health.message == (
        "all 4 accelerators in service; 1 degraded: nvidia 2 (GPU-2) XID94 (waits for a reset)"
    )

    both = accelerator_health(
        inventory=inventory,
        unhealthy={"GPU-0": condition("XID48", Level.DEVICE_FATAL)},
        degraded=degraded,
    )
    assert (both.status, both.reason) == ("False", "XID48")
    assert both.message.endswith("; 1 degraded: nvidia 2 (GPU-2) XID94 (waits for a reset)")


def test_events_for_degrading_failing_and_recovering() -> None:
    inventory = Inventory("n", (VendorReport(Vendor.NVIDIA, tuple(GPUS)),), ())

    def health(unhealthy: dict[str, Condition], degraded: dict[str, Condition]):  # type: ignore[no-untyped-def]
        return accelerator_health(inventory=inventory, unhealthy=unhealthy, degraded=degraded)

    quiet = health({}, {})
    warned = health({}, {"GPU-2": condition("XID94", Level.DEGRADED)})
    failed = health({"GPU-2": condition("XID95", Level.DEVICE_FATAL)}, {})

    def events(a, b):  # type: ignore[no-untyped-def]
        return [
            (e.reason, e.message) for e in health_events(a.faults, b.faults, a.degraded, b.degraded)
        ]

    assert events(quiet, warned) == [(DEGRADED_EVENT, "nvidia 2 (GPU-2) degraded: XID94")]
    assert events(warned, warned) == []
    assert events(warned, failed) == [(UNHEALTHY_REASON, "nvidia 2 (GPU-2) unhealthy: XID95")]
    assert events(failed, warned) == [(DEGRADED_EVENT, "nvidia 2 (GPU-2) degraded: XID94")]
    assert events(warned, quiet) == [
        (RECOVERED_REASON, "nvidia 2 (GPU-2) healthy again (was XID94)")
    ]


def degraded_fault() -> Fault:
    return Fault(
        id="degraded/n/GPU-2/XID94/1",
        kind=FaultKind.DEVICE_DEGRADED,
        node="n",
        observed_at=datetime(2026, 11, 29, tzinfo=UTC),
        reason="XID94",
        device_ids=("GPU-2",),
    )


def test_only_a_rule_that_names_device_degraded_matches_it() -> None:
    fault = degraded_fault()
    assert not Rule(RestartPolicy.ON_NODE_FAIL).matches(fault)  # "all events": the four
    assert not Rule(RestartPolicy.ALWAYS).matches(fault)
    assert not Rule(RestartPolicy.ON_FAILURE).matches(fault)  # not an exit, whatever its code
    named = Rule(RestartPolicy.ON_NODE_FAIL, events=parse_events("deviceDegraded"))
    assert named.matches(fault)
    assert not Rule(RestartPolicy.ON_NODE_FAIL, events=parse_events("deviceUnhealthy")).matches(
        fault
    )


def test_shadow_mode_knows_the_health_and_withdraws_nothing() -> None:
    inventory = Inventory("n", (VendorReport(Vendor.NVIDIA, (*GPUS, MIG)),), ())
    state = DeviceState(inventory, shadow=True)
    state.set_unhealthy({"GPU-0"}, {"GPU-1"})
    snapshot = state.snapshot()
    assert snapshot.unhealthy_all == {"GPU-0"}  # known (metrics, labels, the condition)
    assert snapshot.degraded_all == {"GPU-1", "MIG-0"}
    assert snapshot.unavailable == frozenset()  # kubelet is told every device is healthy
    assert snapshot.withdrawn == snapshot.withdrawn_degraded == frozenset()  # DRA, Volcano too
    assert state.set_withheld({"GPU-2"})  # a DRA claim still holds what it holds
    assert state.snapshot().unavailable == {"GPU-2"}
