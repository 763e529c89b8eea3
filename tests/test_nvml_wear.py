"""Which NVIDIA GPUs are Degraded from their readings: thresholds, holds and hysteresis, on
explicit time (pure)."""

from __future__ import annotations

import dataclasses

import pytest

from edl_agent.health.model import DeviceTelemetry
from edl_agent.health.nvml_wear import (
    CLOCKS_THROTTLED,
    ECC_SBE_RATE,
    PCIE_DOWNGRADED,
    RECOVERY_DRAIN,
    ROWS_PENDING,
    Wear,
    changes,
)
from edl_agent.health_settings import DegradedSettings

SETTINGS = DegradedSettings(
    ecc_corrected_errors=10, ecc_window_seconds=100, throttle_seconds=30, pcie_seconds=30
)


def gpu(**kw: object) -> DeviceTelemetry:
    fine = {
        "device_id": "GPU-0",
        "ecc_corrected_total": 0,
        "clock_event_reasons": 0x1,
        "pcie_generation": 5,
        "pcie_generation_max": 5,
        "pcie_width": 16,
        "pcie_width_max": 16,
        "rows_pending": 0,
        "rows_failed": 0,
        "recovery_action": 0,
        "utilization_percent": 90.0,
    }
    return DeviceTelemetry(**{**fine, **kw})  # type: ignore[arg-type]


def reasons(wear: Wear, reading: DeviceTelemetry, now: float) -> set[str]:
    return set(wear.read([reading], now).get(reading.device_id, {}))


def test_a_healthy_gpu_and_a_mig_device_warn_of_nothing() -> None:
    wear = Wear(SETTINGS)
    assert wear.read([gpu(), DeviceTelemetry("MIG-0", memory_used_mib=1.0)], 0) == {}


def test_corrected_errors_over_the_window_degrade_with_hysteresis() -> None:
    wear = Wear(SETTINGS)
    assert reasons(wear, gpu(ecc_corrected_total=100), 0) == set()  # history before we looked
    assert reasons(wear, gpu(ecc_corrected_total=109), 50) == set()
    found = wear.read([gpu(ecc_corrected_total=110)], 60)
    assert found["GPU-0"][ECC_SBE_RATE].startswith("10 corrected ECC errors within 100 s")
    # The count runs from the last reading at or before the window's start: at t=155 from 109
    # (t=50), 5 errors, half the threshold: still degraded; at t=161 from 110 (t=60), 4: over.
    assert reasons(wear, gpu(ecc_corrected_total=114), 155) == {ECC_SBE_RATE}
    assert reasons(wear, gpu(ecc_corrected_total=114), 161) == set()
    assert reasons(wear, gpu(ecc_corrected_total=0), 170) == set()  # a reset restarts the count
    assert reasons(wear, gpu(ecc_corrected_total=10), 171) == {ECC_SBE_RATE}


def test_rows_pending_and_a_drain_warn_at_once() -> None:
    wear = Wear(SETTINGS)
    found = wear.read([gpu(rows_pending=1, recovery_action=4)], 0)["GPU-0"]
    assert set(found) == {ROWS_PENDING, RECOVERY_DRAIN}
    assert found[RECOVERY_DRAIN] == "the driver's recovery action is DRAIN_AND_RESET"
    assert reasons(wear, gpu(recovery_action=1), 1) == set()  # GPU_RESET is a fault's, not ours
    off = Wear(dataclasses.replace(SETTINGS, rows_pending=False, recovery_actions=False))
    assert reasons(off, gpu(rows_pending=1, recovery_action=3), 0) == set()


def test_throttling_counts_after_it_held_and_ends_after_as_long_without() -> None:
    wear = Wear(SETTINGS)
    hot = gpu(clock_event_reasons=0x40 | 0x1)
    assert reasons(wear, hot, 0) == set()
    assert reasons(wear, hot, 29) == set()
    found = wear.read([hot], 30)["GPU-0"]
    assert found == {CLOCKS_THROTTLED: "clocks held down by hw_thermal"}
    assert reasons(wear, gpu(), 40) == {CLOCKS_THROTTLED}  # a short break ends nothing
    assert reasons(wear, hot, 50) == {CLOCKS_THROTTLED}
    assert reasons(wear, gpu(), 60) == {CLOCKS_THROTTLED}
    assert reasons(wear, gpu(), 90) == set()


def test_a_break_in_throttling_restarts_its_hold() -> None:
    wear = Wear(SETTINGS)
    hot = gpu(clock_event_reasons=0x8)
    assert reasons(wear, hot, 0) == set()
    assert reasons(wear, gpu(), 20) == set()
    assert reasons(wear, hot, 25) == set()
    assert reasons(wear, hot, 54) == set()
    assert reasons(wear, hot, 55) == {CLOCKS_THROTTLED}


def test_the_power_cap_alone_is_no_warning_unless_asked_for() -> None:
    capped = gpu(clock_event_reasons=0x4)
    assert reasons(Wear(SETTINGS), capped, 0) == set()
    wear = Wear(dataclasses.replace(SETTINGS, throttle_reasons=["sw_power_cap"]))
    assert reasons(wear, capped, 0) == set()
    assert reasons(wear, capped, 30) == {CLOCKS_THROTTLED}


@pytest.mark.parametrize(
    ("reading", "warns"),
    [
        (gpu(pcie_width=8), True),  # a lane group lost
        (gpu(pcie_generation=3), True),  # slower while busy
        (gpu(pcie_generation=1, utilization_percent=0.0), False),  # idle power saving
        (gpu(pcie_generation=None), False),  # unknown
    ],
)
def test_a_link_below_its_maximum(reading: DeviceTelemetry, warns: bool) -> None:
    wear = Wear(SETTINGS)
    assert reasons(wear, reading, 0) == set()
    assert reasons(wear, reading, 30) == ({PCIE_DOWNGRADED} if warns else set())


def test_an_idle_reading_neither_starts_nor_ends_a_slow_link() -> None:
    wear = Wear(SETTINGS)
    slow = gpu(pcie_generation=3)
    wear.read([slow], 0)
    assert reasons(wear, slow, 30) == {PCIE_DOWNGRADED}
    idle = gpu(pcie_generation=1, utilization_percent=0.0)
    assert reasons(wear, idle, 100) == {PCIE_DOWNGRADED}
    assert reasons(wear, gpu(), 110) == {PCIE_DOWNGRADED}
    assert reasons(wear, gpu(), 140) == set()


def test_a_gpu_no_longer_read_is_forgotten() -> None:
    wear = Wear(SETTINGS)
    hot = gpu(clock_event_reasons=0x8)
    wear.read([hot], 0)
    wear.read([], 10)
    assert reasons(wear, hot, 30) == set()  # its hold started again at 30


def test_changes_against_what_the_hub_holds() -> None:
    found = {"GPU-0": {ROWS_PENDING: "rows", CLOCKS_THROTTLED: "hot"}}
    held = {"GPU-0": [CLOCKS_THROTTLED, "XID94"], "GPU-1": [PCIE_DOWNGRADED, "XID48"]}
    opened, ended = changes(found, held)
    assert opened == [("GPU-0", ROWS_PENDING, "rows")]
    assert ended == [("GPU-1", PCIE_DOWNGRADED)]  # never another part's XID
