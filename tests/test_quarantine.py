"""The pieces of the quarantine lifecycle that need no agent: the clearing column of the
catalogs, reset evidence from NVML readings, the quarantine file, the log limiter, and what the
node condition says a device waits for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog.testing

from edl_agent.devices.model import Device, Inventory, Vendor, VendorReport
from edl_agent.health.classify import (
    XID_CATALOG,
    ascend_code_clears_by,
    what_clears,
    xid_clears_by,
)
from edl_agent.health.model import ClearsBy, HealthEvent, Level
from edl_agent.health.nvml_reset import observable, was_reset
from edl_agent.health.quarantine_store import Quarantine, QuarantineStore
from edl_agent.health.reset_rules import check_resets, waiting_for_reset
from edl_agent.health.tracker import Condition
from edl_agent.labels.condition import accelerator_health
from edl_agent.log_limit import LogLimiter

GPU = Device(Vendor.NVIDIA, "gpu", 0, "GPU-0", "H100", 81559)
MIG = Device(Vendor.NVIDIA, "mig", 0, "MIG-0", "H100 1g", 9000, parent="GPU-0")


@pytest.mark.parametrize(
    ("xid", "clears_by"),
    [(13, "nothing"), (48, "reset"), (95, "reset"), (119, "reset"), (79, "reboot"),
     (151, "reboot"), (54, "release")],
)  # fmt: skip
def test_the_xid_catalog_says_what_clears_each_code(xid: int, clears_by: str) -> None:
    assert xid_clears_by(xid, XID_CATALOG[xid].level).value == clears_by


def test_overrides_of_level_and_clearing() -> None:
    assert xid_clears_by(31, Level.DEVICE_FATAL) is ClearsBy.RESET  # app error raised to severe
    assert xid_clears_by(999, Level.DEVICE_FATAL) is ClearsBy.RELEASE  # unknown made severe
    assert xid_clears_by(95, Level.WARN) is ClearsBy.NOTHING  # lowered: never quarantined
    assert xid_clears_by(31, Level.DEVICE_FATAL, {"31": "quiet"}) is ClearsBy.QUIET
    assert ascend_code_clears_by(0x8C03A000, Level.DEVICE_FATAL) is ClearsBy.RESET  # RestartNPU
    assert ascend_code_clears_by(0x80E18402, Level.NODE_FATAL) is ClearsBy.RELEASE  # SeparateNPU
    assert ascend_code_clears_by(0x12345678, Level.DEVICE_FATAL) is ClearsBy.RELEASE  # unknown


@pytest.mark.parametrize(
    ("reason", "code", "level", "clears_by"),
    [
        ("XID79", 79, Level.NODE_FATAL, ClearsBy.REBOOT),
        ("ECC_DBE", None, Level.DEVICE_FATAL, ClearsBy.RESET),
        ("GPU_LOST", None, Level.NODE_FATAL, ClearsBy.REBOOT),
        ("XPU_STATE_Fault", None, Level.DEVICE_FATAL, ClearsBy.RESET),
        ("DCU_STATE_Lost", None, Level.NODE_FATAL, ClearsBy.REBOOT),
        ("NPU_HEALTH_Critical", None, Level.DEVICE_FATAL, ClearsBy.CONDITION),
        ("NODE_VANISHED", None, Level.NODE_FATAL, ClearsBy.CONDITION),
        ("XID13", 13, Level.IGNORE, ClearsBy.NOTHING),
    ],
)
def test_what_clears_an_event(
    reason: str, code: int | None, level: Level, clears_by: ClearsBy
) -> None:
    event = HealthEvent(Vendor.NVIDIA, "GPU-0", reason, level, 0.0, code=code)
    assert what_clears(event) is clears_by


@pytest.mark.parametrize(
    ("before", "after", "reset"),
    [
        ({"ecc_uncorrected": 1}, {"ecc_uncorrected": 0}, True),
        ({"ecc_uncorrected": 1}, {"ecc_uncorrected": 2}, False),
        ({"remap_pending": 1}, {"remap_pending": 0}, True),
        ({"recovery_action": 1}, {"recovery_action": 0}, True),
        ({"recovery_action": 2}, {"recovery_action": 0}, False),  # a reboot was asked for
        ({"recovery_action": 1}, {"recovery_action": None}, False),  # cannot read it now
        ({"ecc_uncorrected": 3}, {"lost": 1}, False),
        ({"ecc_uncorrected": 0, "recovery_action": None}, {"ecc_uncorrected": 0}, False),
    ],
)
def test_was_reset(before: dict[str, int], after: dict[str, int | None], reset: bool) -> None:
    assert was_reset(before, after) is reset


def test_a_reset_is_observable_only_with_a_mark_to_lose() -> None:
    assert not observable({"ecc_uncorrected": 0, "remap_pending": 0, "recovery_action": None})
    assert observable({"recovery_action": 1})


def test_a_mig_device_is_read_through_its_gpu_and_the_first_reading_is_the_baseline() -> None:
    quarantined = {
        "MIG-0": [Condition("XID95", Level.DEVICE_FATAL, 0, 0, clears_by=ClearsBy.RESET)]
    }
    waiting = waiting_for_reset(quarantined, [GPU, MIG])
    assert waiting == {"MIG-0": "GPU-0"}
    first = check_resets(waiting, {}, {"GPU-0": {"recovery_action": 1}})
    assert first.reset == frozenset()
    later = check_resets(waiting, first.baselines, {"GPU-0": {"recovery_action": 0}})
    assert later.reset == {"MIG-0"}
    assert later.baselines == {}


def test_the_quarantine_file_round_trips_and_a_corrupt_one_is_set_aside(tmp_path: Path) -> None:
    clock = {"wall": 1_000_000.0, "mono": 500.0}
    store = QuarantineStore(tmp_path, wall=lambda: clock["wall"], monotonic=lambda: clock["mono"])
    condition = Condition("XID95", Level.DEVICE_FATAL, 400.0, 450.0, "d", ClearsBy.RESET, 3)
    saved = Quarantine("boot-1", {"GPU-0": (condition,)}, {"GPU-0": {"recovery_action": 1}})
    assert store.save(saved)
    assert not store.save(saved)  # unchanged: no write
    clock.update(wall=1_000_100.0, mono=10.0)  # a new process: another monotonic origin
    loaded = QuarantineStore(
        tmp_path, wall=lambda: clock["wall"], monotonic=lambda: clock["mono"]
    ).load()
    assert loaded is not None
    assert loaded.boot_id == "boot-1"
    [again] = loaded.conditions["GPU-0"]
    assert (again.reason, again.clears_by, again.count) == ("XID95", ClearsBy.RESET, 3)
    assert again.since == pytest.approx(400.0 - 500.0 - 100.0 + 10.0)  # 200 s before "now"
    assert loaded.baselines == {"GPU-0": {"recovery_action": 1}}

    (tmp_path / "quarantine.json").write_text(json.dumps({"format": 1, "devices": {"x": 1}}))
    with structlog.testing.capture_logs() as logs:
        assert QuarantineStore(tmp_path).load() is None
    assert [e["event"] for e in logs] == ["quarantine file corrupt; set aside, starting without it"]
    assert (tmp_path / "quarantine.json.corrupt").exists()
    assert not (tmp_path / "quarantine.json").exists()


def test_the_log_limiter_lets_one_line_through_per_interval_and_counts_the_rest() -> None:
    now = [0.0]
    limiter = LogLimiter(interval=10, clock=lambda: now[0])
    assert limiter.allow("a") == 0
    assert [limiter.allow("a") for _ in range(5)] == [None] * 5
    assert limiter.allow("b") == 0  # another kind is not held back
    now[0] = 10.0
    assert limiter.allow("a") == 5


def test_the_condition_says_what_each_device_waits_for_and_unknown_when_a_monitor_fails() -> None:
    inventory = Inventory("n", (VendorReport(Vendor.NVIDIA, (GPU,)),), ())
    reboot = Condition("XID79", Level.NODE_FATAL, 0, 0, "off the bus", ClearsBy.REBOOT)
    health = accelerator_health(inventory=inventory, unhealthy={"GPU-0": reboot})
    assert health.status == "False"
    assert "XID79: off the bus (waits for a reboot)" in health.message
    failing = {Vendor.ASCEND: Condition("NPU_SMI_FAILED", Level.WARN, 0, 0, "exited 1")}
    unknown = accelerator_health(inventory=inventory, unhealthy={}, monitors=failing)
    assert (unknown.status, unknown.reason) == ("Unknown", "NPUSmiFailed")
    assert "ascend health monitor failing: NPU_SMI_FAILED (exited 1)" in unknown.message
