"""Polled health of Kunlunxin, Hygon and Ascend devices on simulated nodes, fault injection into
the simulated tools, and the parsers of the tools' live figures."""

from __future__ import annotations

import dataclasses
import json
import resource
import time
from pathlib import Path

import pytest

from edl_agent.config import HealthSettings
from edl_agent.devices import ascend, hygon, kunlunxin
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, Vendor, VendorReport
from edl_agent.health.model import HealthEvent, Level
from edl_agent.health.vendor_readings import (
    POLLERS,
    PollResult,
    clears,
    poll,
    poll_ascend,
    poll_hygon,
    poll_kunlunxin,
)
from edl_agent.sim import ascend_tree, hygon_tree, kunlunxin_tree
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree
from tests.test_vendor_parsers import NPU_SMI_910B

SETTINGS = HealthSettings()

PROFILES = {
    Vendor.KUNLUNXIN: ("kunlun-p800x8", kunlunxin.discover),
    Vendor.HYGON: ("hygon-k100x8", hygon.discover),
    Vendor.ASCEND: ("ascend-910bx8", ascend.discover),
}


def node(vendor: Vendor, tmp_path: Path) -> tuple[HostRoot, list[Device]]:
    profile, discover = PROFILES[vendor]
    build_tree(load_profile(profile), tmp_path)
    root = HostRoot.at(tmp_path)
    report: VendorReport | None = discover(root)
    assert report is not None
    assert len(report.devices) == 8
    return root, list(report.devices)


def only_event(result: PollResult) -> tuple[str | None, str, Level]:
    (event,) = result.events
    return event.device_id, event.reason, event.level


# --- Ascend --------------------------------------------------------------------------------------


def test_ascend_all_ok(tmp_path: Path) -> None:
    root, devices = node(Vendor.ASCEND, tmp_path)
    result = poll_ascend(root, devices, SETTINGS, clock=lambda: 42.0)
    assert (result.vendor, result.ok, result.at, result.events) == (Vendor.ASCEND, True, 42.0, [])
    assert result.checked == {d.id for d in devices}
    assert [t.device_id for t in result.telemetry] == [d.id for d in devices]
    first = result.telemetry[0]
    assert (first.power_w, first.temperature_c, first.utilization_percent) == (90.0, 40.0, 0.0)
    assert (first.memory_used_mib, first.memory_total_mib) == (3400, 65536)


def test_ascend_critical_npu_is_fatal_until_cleared(tmp_path: Path) -> None:
    root, devices = node(Vendor.ASCEND, tmp_path)
    ascend_tree.set_npu_health(tmp_path, 2, "Critical")
    result = poll_ascend(root, devices, SETTINGS)
    device_id, reason, level = only_event(result)
    assert (device_id, reason) == ("ascend-npu2", "NPU_HEALTH_Critical")
    assert level.unhealthy
    assert result.events[0].vendor is Vendor.ASCEND
    assert "ascend-npu2" in result.checked

    ascend_tree.set_npu_health(tmp_path, 2, "OK")
    cleared = poll_ascend(root, devices, SETTINGS, clock=lambda: 7.0)
    assert cleared.events == []
    (over,) = clears({"ascend-npu2": result.events[0]}, cleared)
    assert (over.device_id, over.reason, over.cleared, over.at) == (
        "ascend-npu2",
        "NPU_HEALTH_Critical",
        True,
        7.0,
    )


def test_ascend_fault_codes_decide(tmp_path: Path) -> None:
    root, devices = node(Vendor.ASCEND, tmp_path)
    ascend_tree.set_npu_health(tmp_path, 2, "Critical", ["0x80E01801"])
    ascend_tree.set_npu_health(tmp_path, 5, "Alarm", [0x80E01801, 0x80E18402])
    result = poll_ascend(root, devices, SETTINGS)
    by_id = {event.device_id: event for event in result.events}
    assert set(by_id) == {"ascend-npu2", "ascend-npu5"}
    assert (by_id["ascend-npu2"].reason, by_id["ascend-npu2"].level) == (
        "NPU_FAULT_0x80E01801",
        Level.WARN,  # RestartBusiness: the job retries, the chip stays
    )
    assert by_id["ascend-npu2"].code == 0x80E01801
    assert (by_id["ascend-npu5"].reason, by_id["ascend-npu5"].level) == (
        "NPU_FAULT_0x80E18402",
        Level.NODE_FATAL,  # SeparateNPU
    )
    assert "0x80E01801 (RestartBusiness)" in by_id["ascend-npu5"].detail

    strict = HealthSettings(ascend_code_levels={"0x80E01801": "node_fatal"})
    result = poll_ascend(root, devices, strict)
    assert {e.device_id: e.level for e in result.events}["ascend-npu2"] is Level.NODE_FATAL


def test_ascend_without_fault_codes_falls_back_on_the_health_word(tmp_path: Path) -> None:
    root, devices = node(Vendor.ASCEND, tmp_path)
    ascend_tree.set_npu_health(tmp_path, 1, "Alarm", ["80E01801"])
    root.path(ascend_tree.HEALTH_OUTPUT.format(npu=1)).unlink()
    device_id, reason, level = only_event(poll_ascend(root, devices, SETTINGS))
    assert (device_id, reason, level) == ("ascend-npu1", "NPU_HEALTH_Alarm", Level.DEVICE_FATAL)


def test_ascend_warning_is_a_warning(tmp_path: Path) -> None:
    root, devices = node(Vendor.ASCEND, tmp_path)
    ascend_tree.set_npu_health(tmp_path, 0, "Warning")
    assert only_event(poll_ascend(root, devices, SETTINGS)) == (
        "ascend-npu0",
        "NPU_HEALTH_Warning",
        Level.WARN,
    )


# --- Kunlunxin and Hygon -------------------------------------------------------------------------


STATE_CASES = {
    "kunlunxin": (Vendor.KUNLUNXIN, kunlunxin_tree.set_xpu_state, "kunlunxin-xpu3", "XPU_STATE"),
    "hygon": (Vendor.HYGON, hygon_tree.set_dcu_state, "hygon-dcu-0002:30:00.0", "DCU_STATE"),
}


@pytest.mark.parametrize("case", list(STATE_CASES))
@pytest.mark.parametrize(
    ("state", "level"),
    [("Warning", Level.DEGRADED), ("Fault", Level.DEVICE_FATAL), ("Lost", Level.NODE_FATAL)],
)
def test_device_state(case: str, state: str, level: Level, tmp_path: Path) -> None:
    vendor, inject, device_id, prefix = STATE_CASES[case]
    root, devices = node(vendor, tmp_path)
    assert poll(vendor, root, devices, SETTINGS).events == []
    inject(tmp_path, 3, state)
    result = poll(vendor, root, devices, SETTINGS)
    assert only_event(result) == (device_id, f"{prefix}_{state}", level)
    inject(tmp_path, 3, "Normal")
    result = poll(vendor, root, devices, SETTINGS)
    assert result.events == []
    assert device_id in result.checked


def test_kunlunxin_uncorrectable_ecc(tmp_path: Path) -> None:
    root, devices = node(Vendor.KUNLUNXIN, tmp_path)
    path = root.path(kunlunxin_tree.QUERY_OUTPUT)
    text = path.read_text()
    block = text.index("Minor Number                          : 6")
    at = text.index("DRAM Uncorrectable", block)
    line_end = text.index("\n", at)
    path.write_text(text[:at] + text[at:line_end].replace(": 0", ": 2") + text[line_end:])
    result = poll_kunlunxin(root, devices, SETTINGS)
    assert only_event(result) == ("kunlunxin-xpu6", "XPU_ECC_DBE", Level.DEVICE_FATAL)
    assert result.telemetry[6].ecc_uncorrected_total == 2
    kunlunxin_tree.set_xpu_state(tmp_path, 6, "Lost")
    (event,) = poll_kunlunxin(root, devices, SETTINGS).events
    assert (event.reason, event.level) == ("XPU_STATE_Lost", Level.NODE_FATAL)
    assert event.detail == "state Lost; 2 uncorrectable DRAM ECC errors since driver load"


def test_kunlunxin_telemetry(tmp_path: Path) -> None:
    root, devices = node(Vendor.KUNLUNXIN, tmp_path)
    telemetry = poll_kunlunxin(root, devices, SETTINGS).telemetry
    assert [t.device_id for t in telemetry] == [d.id for d in devices]
    t = telemetry[1]
    assert (t.temperature_c, t.power_w, t.utilization_percent) == (41.0, 85.5, 0.0)
    assert (t.memory_used_mib, t.memory_total_mib) == (0.0, 98304.0)
    assert (t.ecc_corrected_total, t.ecc_uncorrected_total) == (0, 0)


def test_hygon_telemetry(tmp_path: Path) -> None:
    root, devices = node(Vendor.HYGON, tmp_path)
    telemetry = poll_hygon(root, devices, SETTINGS).telemetry
    assert [t.device_id for t in telemetry] == [d.id for d in devices]
    t = telemetry[2]
    assert (t.temperature_c, t.power_w, t.utilization_percent) == (40.0, 60.0, 0.0)
    assert (t.memory_used_mib, t.memory_total_mib) == (3.0, 65536.0)


# --- tool failures and devices the tool does not list --------------------------------------------

GARBLE = {
    Vendor.KUNLUNXIN: (kunlunxin_tree.QUERY_OUTPUT, kunlunxin_tree.TOOL, "XPU_SMI_FAILED"),
    Vendor.HYGON: (hygon_tree.JSON_OUTPUT, hygon_tree.TOOL, "HY_SMI_FAILED"),
    Vendor.ASCEND: (ascend_tree.INFO_OUTPUT, ascend_tree.TOOL, "NPU_SMI_FAILED"),
}


@pytest.mark.parametrize("vendor", list(GARBLE), ids=[v.value for v in GARBLE])
def test_garbled_tool_output_is_one_vendor_event(vendor: Vendor, tmp_path: Path) -> None:
    root, devices = node(vendor, tmp_path)
    data, _tool, reason = GARBLE[vendor]
    earlier = HealthEvent(vendor, devices[0].id, "EARLIER", Level.DEVICE_FATAL, at=0.0)
    root.path(data).write_text("dcmi module initialize failed. ret is -8005\n\x00\x01")
    result = poll(vendor, root, devices, SETTINGS)
    assert not result.ok
    assert only_event(result) == (None, reason, Level.WARN)
    assert ": unexpected output: " in result.events[0].detail
    assert (result.checked, result.telemetry) == (frozenset(), [])
    assert clears({devices[0].id: earlier}, result) == []  # the devices keep their last state


@pytest.mark.parametrize("vendor", list(GARBLE), ids=[v.value for v in GARBLE])
def test_failing_or_missing_tool(vendor: Vendor, tmp_path: Path) -> None:
    root, devices = node(vendor, tmp_path)
    data, tool, reason = GARBLE[vendor]
    root.path(data).unlink()  # the stand-in's `cat` fails: the tool exits non-zero
    failed = poll(vendor, root, devices, SETTINGS)
    assert only_event(failed) == (None, reason, Level.WARN)
    assert "exited" in failed.events[0].detail
    root.path(tool).unlink()
    missing = poll(vendor, root, devices, SETTINGS)
    assert only_event(missing) == (None, reason, Level.WARN)
    assert "not found under the host root" in missing.events[0].detail


def test_tool_event_clears_when_the_tool_works_again(tmp_path: Path) -> None:
    root, devices = node(Vendor.ASCEND, tmp_path)
    info = root.path(ascend_tree.INFO_OUTPUT)
    good = info.read_text()
    info.write_text("garbage\n")
    broken = poll_ascend(root, devices, SETTINGS)
    info.write_text(good)
    working = poll_ascend(root, devices, SETTINGS)
    (over,) = clears({None: broken.events[0]}, working)
    assert (over.device_id, over.reason, over.cleared) == (None, "NPU_SMI_FAILED", True)


@pytest.mark.parametrize("vendor", list(GARBLE), ids=[v.value for v in GARBLE])
def test_device_the_tool_does_not_list(vendor: Vendor, tmp_path: Path) -> None:
    root, devices = node(vendor, tmp_path)
    ghost = dataclasses.replace(devices[0], index=12, id="ghost", pci_bus_id="0009:99:00.0")
    result = poll(vendor, root, [*devices, ghost], SETTINGS)
    (event,) = result.events
    assert (event.device_id, event.level) == ("ghost", Level.DEVICE_FATAL)
    assert event.reason.endswith("_NOT_REPORTED")
    assert "ghost" in result.checked
    assert len(result.telemetry) == 8


def test_poll_takes_only_its_vendors_devices(tmp_path: Path) -> None:
    root, devices = node(Vendor.ASCEND, tmp_path)
    other = dataclasses.replace(devices[0], vendor=Vendor.HYGON, id="dcu", index=30)
    assert poll_ascend(root, [*devices, other], SETTINGS).checked == {d.id for d in devices}
    assert set(POLLERS) == {Vendor.KUNLUNXIN, Vendor.HYGON, Vendor.ASCEND}
    with pytest.raises(ValueError, match="no polled health for nvidia"):
        poll(Vendor.NVIDIA, root, devices, SETTINGS)


# --- fault injection -----------------------------------------------------------------------------


def test_inject_rejects_bad_arguments(tmp_path: Path) -> None:
    build_tree(load_profile("ascend-910bx8"), tmp_path)
    with pytest.raises(ValueError, match="no simulated NPU 8"):
        ascend_tree.set_npu_health(tmp_path, 8, "Critical")
    with pytest.raises(ValueError, match="no simulated NPU -1"):
        ascend_tree.set_npu_health(tmp_path, -1, "Critical")
    with pytest.raises(ValueError, match="expected one word"):
        ascend_tree.set_npu_health(tmp_path, 0, "Very Critical")
    with pytest.raises(ValueError, match="expected hex"):
        ascend_tree.set_npu_health(tmp_path, 0, "Critical", ["bogus"])
    with pytest.raises(ValueError, match="no simulated Kunlunxin XPUs"):
        kunlunxin_tree.set_xpu_state(tmp_path, 0, "Fault")
    with pytest.raises(ValueError, match="no simulated Hygon DCUs"):
        hygon_tree.set_dcu_state(tmp_path, 0, "Fault")
    build_tree(load_profile("kunlun-p800x8"), tmp_path)
    build_tree(load_profile("hygon-k100x8"), tmp_path)
    with pytest.raises(ValueError, match="no simulated XPU 9"):
        kunlunxin_tree.set_xpu_state(tmp_path, 9, "Fault")
    with pytest.raises(ValueError, match="no simulated DCU 8"):
        hygon_tree.set_dcu_state(tmp_path, 8, "Fault")
    with pytest.raises(ValueError, match="expected one word"):
        hygon_tree.set_dcu_state(tmp_path, 0, "a: b")
    with pytest.raises(ValueError, match="no simulated Ascend NPUs"):
        ascend_tree.set_npu_health(tmp_path / "empty", 0, "OK")


def test_injected_npu_health_is_what_npu_smi_prints(tmp_path: Path) -> None:
    build_tree(load_profile("ascend-910bx8"), tmp_path)
    root = HostRoot.at(tmp_path)
    tool = root.path(ascend_tree.TOOL)
    ascend_tree.set_npu_health(tmp_path, 4, "Critical", [0x80E01801, "80e18402"])
    text = root.run_tool(tool, ["info", "-t", "health", "-i", "4", "-c", "0"])
    detail = ascend.parse_npu_smi_health(text)
    assert (detail.health, detail.codes) == ("Critical", (0x80E01801, 0x80E18402))
    info = ascend.parse_npu_smi_info(root.run_tool(tool, ["info"]))
    assert [r.health for r in info.npus] == ["OK"] * 4 + ["Critical"] + ["OK"] * 3
    assert ascend.discover(root) is not None  # discovery still reads the rewritten table
    with pytest.raises(Exception, match="does not exist"):
        root.run_tool(tool, ["info", "-t", "health", "-i", "9"])


# --- parsers of live figures ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "health", "codes", "information"),
    [
        (
            " Health Status : OK\n Error Code : NA\n Error Information : NA\n",
            "OK",
            (),
            "",
        ),
        (
            "Health Status : Warning\nError Code : 80E01801\nError Information : node type=SOC\n",
            "Warning",
            (0x80E01801,),
            "node type=SOC",
        ),
        ("Health Status : Alarm\nError Code : 80E01801, 0x80E18402;80cb8009\n", "Alarm", None, ""),
        ("Health : Critical\n", "Critical", (), ""),
    ],
)
def test_npu_smi_health(
    text: str, health: str, codes: tuple[int, ...] | None, information: str
) -> None:
    parsed = ascend.parse_npu_smi_health(text)
    assert parsed.health == health
    assert parsed.codes == (codes if codes is not None else (0x80E01801, 0x80E18402, 0x80CB8009))
    assert parsed.information == information


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no `Health Status"),
        ("Error Code : 80E01801\n", "no `Health Status"),
        ("Health Status : OK\nError Code : 80E0180G\n", "'80E0180G' is not a hex fault code"),
    ],
)
def test_npu_smi_health_rejects(text: str, message: str) -> None:
    with pytest.raises(ascend.NpuSmiParseError, match=message):
        ascend.parse_npu_smi_health(text)


def test_npu_smi_info_live_figures() -> None:
    text = NPU_SMI_910B.replace("| 91.1        50  ", "| NA          NA  ")
    first, second = ascend.parse_npu_smi_info(text).npus
    assert (first.power_w, first.temperature_c, first.aicore_percent) == (96.2, 39.0, 0.0)
    assert (first.memory_used_mib, first.memory_mib) == (58626, 65536)
    assert (second.power_w, second.temperature_c) == (None, None)
    assert (second.memory_used_mib, second.aicore_percent) == (3436, 0.0)


def test_xpu_smi_live_figures() -> None:
    text = """\
Attached XPUs                             : 1
XPU 00000000:01:00.0
    Product Name                          : P800 OAM
    Minor Number                          : 0
    Memory Usage
        Total                             : 98304 MiB
        Used                              : 1024 MiB
    ECC Errors
        Volatile
            DRAM Correctable              : 3
            DRAM Uncorrectable            : N/A
    Temperature
        XPU Current Temp                  : 51 C
    Power Readings
        Power Draw                        : N/A
    Utilization
        Xpu                               : 87 %
"""
    (xpu,) = kunlunxin.parse_xpu_smi_query(text).xpus
    assert (xpu.temperature_c, xpu.power_w, xpu.utilization_percent) == (51.0, None, 87.0)
    assert (xpu.memory_used_mib, xpu.ecc_corrected, xpu.ecc_uncorrected) == (1024.0, 3, None)
    assert xpu.state is None  # real xpu-smi prints no state: no state, no state events


def test_hy_smi_status() -> None:
    text = json.dumps(
        {
            "card0": {
                "PCI Bus": "0000:1A:00.0",
                "Temperature (Sensor junction) (C)": "45.0",
                "Average Graphics Package Power (W)": "N/A",
                "HCU use (%)": "12",
                "VRAM Total Memory (B)": str(64 * 1024**3),
                "VRAM Total Used Memory (B)": "0",
            },
            "card1": {"Temperature (Sensor edge) (C)": "nan", "DCU State": "Fault"},
            "system": {"Driver version": "6.3.8"},
        }
    )
    statuses = hygon.parse_hy_smi_status(text)
    first, second = statuses[0], statuses[1]
    assert (first.bus_id, first.temperature_c, first.power_w) == ("0000:1a:00.0", 45.0, None)
    assert (first.utilization_percent, first.memory_used_mib, first.memory_total_mib) == (
        12.0,
        0.0,
        65536.0,
    )
    assert (second.temperature_c, second.state, second.bus_id) == (None, "Fault", None)
    with pytest.raises(hygon.HySmiParseError, match="no card<N> entries"):
        hygon.parse_hy_smi_status('{"system": {}}')


# --- cost ----------------------------------------------------------------------------------------


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _cost(vendor: Vendor, root: HostRoot, devices: list[Device]) -> tuple[float, float]:
    """(CPU, wall) seconds of 100 polls, the tool processes included."""
    poll(vendor, root, devices, SETTINGS)  # warm caches
    cpu, wall = _cpu_seconds(), time.perf_counter()
    for _ in range(100):
        poll(vendor, root, devices, SETTINGS)
    return _cpu_seconds() - cpu, time.perf_counter() - wall


def _report(label: str, cpu: float, wall: float) -> float:
    per_poll_ms = cpu * 1000 / 100
    share = per_poll_ms / (SETTINGS.poll_seconds * 1000) * 100
    print(
        f"\n{label}: 100 polls took {cpu * 1000:.0f} ms CPU ({wall * 1000:.0f} ms wall),"
        f" {per_poll_ms:.2f} ms per poll = {share:.2f}% of a core at one poll per"
        f" {SETTINGS.poll_seconds:g}s"
    )
    return share


@pytest.mark.parametrize("vendor", list(POLLERS), ids=[v.value for v in POLLERS])
def test_poll_cost(vendor: Vendor, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """100 polls of a simulated 8-device node at 1 Hz cost < 1% of a core (stand-in tools: the
    real tools cost what they cost on top). A faulty Ascend chip adds one health query a poll."""
    root, devices = node(vendor, tmp_path)
    with capsys.disabled():
        share = _report(f"{vendor.value}, all healthy", *_cost(vendor, root, devices))
        assert share < 1.0
        if vendor is Vendor.ASCEND:
            ascend_tree.set_npu_health(tmp_path, 2, "Critical", [0x80E01801])
            faulty = _report("ascend, one chip Critical", *_cost(vendor, root, devices))
            assert faulty < 2.0
