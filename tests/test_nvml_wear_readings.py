"""The NVML readings that warn before a GPU fails — clocks-event reasons, the PCIe link against
its maximum, row remapping pending or failed, the recovery action — end to end: the fake
libnvidia-ml.so.1 read by the real pynvml bindings, its fault-file verbs (clocks, pcie, remap,
ecc_sbe count=), the telemetry reader, the Prometheus families and recordings of a node."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pynvml
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from edl_agent import cli
from edl_agent.config import load_settings
from edl_agent.devices import nvidia
from edl_agent.devices.discovery import discover_node
from edl_agent.devices.hostroot import HostRoot
from edl_agent.health.model import DeviceTelemetry
from edl_agent.health.nvml_telemetry import NvmlTelemetry, read_nvidia_telemetry
from edl_agent.health.state import DeviceState
from edl_agent.metrics.collectors import EdlCollector, build_registry
from edl_agent.sim import inject, nvidia_tree
from edl_agent.sim.profile import load_profile, stable_uuid
from edl_agent.sim.tree import build_tree

IDLE = pynvml.nvmlClocksEventReasonGpuIdle
HW_SLOWDOWN_AND_THERMAL = (
    pynvml.nvmlClocksEventReasonHwSlowdown | pynvml.nvmlClocksEventReasonHwThermalSlowdown
)
WEAR_FIELDS = (
    "clock_event_reasons",
    "pcie_generation",
    "pcie_generation_max",
    "pcie_width",
    "pcie_width_max",
    "rows_pending",
    "rows_failed",
    "recovery_action",
)


def simulate(root: Path, profile: str = "dgx-h100") -> Path:
    build_tree(load_profile(profile), root)
    return root


def gpu_uuid(index: int, profile: str = "dgx-h100") -> str:
    return "GPU-" + stable_uuid(profile, "gpu", index)


def readings(root: Path) -> dict[str, DeviceTelemetry]:
    return {t.device_id: t for t in read_nvidia_telemetry(HostRoot.at(root))}


def gpu(root: Path, index: int) -> DeviceTelemetry:
    return readings(root)[gpu_uuid(index)]


def link(reading: DeviceTelemetry) -> tuple[int | None, ...]:
    return (
        reading.pcie_generation,
        reading.pcie_generation_max,
        reading.pcie_width,
        reading.pcie_width_max,
    )


def append_faults(root: Path, *lines: str) -> None:
    with inject.fault_file(root).open("a") as faults:
        faults.write("".join(line + "\n" for line in lines))


def library(root: Path) -> str:
    return str(root / nvidia_tree.LIBRARY.lstrip("/"))


# ---- defaults ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "generation", "remaps_rows"),
    [("dgx-h100", 5, True), ("dgx-a100-mig", 4, True), ("cgpu-v100", 3, False)],
)
def test_defaults_follow_the_architecture(
    tmp_path: Path, profile: str, generation: int, remaps_rows: bool
) -> None:
    figures = list(readings(simulate(tmp_path, profile)).values())

    gpus = [t for t in figures if t.device_id.startswith("GPU-")]
    assert gpus
    for reading in gpus:
        assert link(reading) == (generation, generation, 16, 16)
        assert reading.clock_event_reasons == IDLE
        assert reading.recovery_action == 0
        # Row remapping came with Ampere; a V100 retires pages instead and does not answer.
        expected_rows = (0, 0) if remaps_rows else (None, None)
        assert (reading.rows_pending, reading.rows_failed) == expected_rows
    for mig in (t for t in figures if t.device_id.startswith("MIG-")):
        assert all(getattr(mig, name) is None for name in WEAR_FIELDS)


def test_the_data_file_sets_the_links_maximum(tmp_path: Path) -> None:
    root = simulate(tmp_path)
    data = root / nvidia_tree.DATA.lstrip("/")
    lines = data.read_text().splitlines()
    lines = [
        line + "\tpcie_gen_max=4\tpcie_width_max=8" if line.startswith("gpu\tindex=0\t") else line
        for line in lines
    ]
    data.write_text("\n".join(lines) + "\n")

    assert link(gpu(root, 0)) == (4, 4, 8, 8)
    assert link(gpu(root, 1)) == (5, 5, 16, 16)


def test_a_data_file_with_a_link_of_no_lanes_is_refused(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    root = simulate(tmp_path)
    data = root / nvidia_tree.DATA.lstrip("/")
    data.write_text(data.read_text().replace("\tindex=0\t", "\tindex=0\tpcie_width_max=0\t", 1))

    assert readings(root) == {}
    assert "pcie_gen_max and pcie_width_max must be at least 1" in capfd.readouterr().err


# ---- the fault-file verbs -----------------------------------------------------------------


def test_each_verb_changes_its_reading(tmp_path: Path) -> None:
    root = simulate(tmp_path)
    inject.set_clock_event_reasons(root, 1, HW_SLOWDOWN_AND_THERMAL)
    inject.set_pcie_link(root, 2, generation=3, width=8)
    inject.set_pcie_link(root, 3, width=4)
    inject.set_remapped_rows(root, 4, pending=2)
    inject.set_remapped_rows(root, 5, failed=1)
    inject.inject_ecc_sbe(root, 6, count=5)
    append_faults(
        root, "clocks gpu=7 reasons=0", "clocks gpu=0 reasons=0x4", "clocks gpu=0 reasons=32"
    )

    figures = readings(root)
    by_index = [figures[gpu_uuid(i)] for i in range(8)]

    assert by_index[0].clock_event_reasons == pynvml.nvmlClocksEventReasonSwThermalSlowdown
    assert by_index[1].clock_event_reasons == 0x48
    assert by_index[7].clock_event_reasons == 0
    assert link(by_index[2]) == (3, 5, 8, 16)
    assert link(by_index[3]) == (5, 5, 4, 16)
    assert (by_index[4].rows_pending, by_index[4].rows_failed) == (1, 0)
    assert (by_index[5].rows_pending, by_index[5].rows_failed) == (0, 1)
    assert (by_index[6].ecc_corrected_total, by_index[6].ecc_uncorrected_total) == (5, 0)
    untouched = [r for i, r in enumerate(by_index) if i not in (0, 1, 7)]
    assert {r.clock_event_reasons for r in untouched} == {IDLE}
    assert {link(r) for i, r in enumerate(by_index) if i not in (2, 3)} == {(5, 5, 16, 16)}
    # The readings do not make the agent think a GPU needs anything.
    assert {r.recovery_action for r in by_index} == {0}


def test_a_reset_retrains_the_link_and_applies_pending_rows_but_keeps_failed_ones(
    tmp_path: Path,
) -> None:
    root = simulate(tmp_path)
    inject.set_pcie_link(root, 0, generation=2, width=4)
    inject.set_remapped_rows(root, 0, pending=3, failed=2)
    inject.set_clock_event_reasons(root, 0, pynvml.nvmlClocksEventReasonHwThermalSlowdown)
    inject.inject_ecc_sbe(root, 0, count=5)
    inject.set_pcie_link(root, 1, width=8)

    before = gpu(root, 0)
    assert link(before) == (2, 5, 4, 16)
    assert (before.rows_pending, before.rows_failed, before.ecc_corrected_total) == (1, 1, 5)

    inject.reset_device(root, "nvidia", 0)

    after = gpu(root, 0)
    assert link(after) == (5, 5, 16, 16)
    assert (after.rows_pending, after.rows_failed) == (0, 1)  # failed stays: the InfoROM has it
    assert after.ecc_corrected_total == 0  # volatile counters start again
    assert after.clock_event_reasons == pynvml.nvmlClocksEventReasonHwThermalSlowdown
    assert link(gpu(root, 1)) == (5, 5, 8, 16)  # another GPU's reset is not this one's

    inject.reboot(root)

    rebooted = readings(root)
    assert link(rebooted[gpu_uuid(1)]) == (5, 5, 16, 16)
    assert rebooted[gpu_uuid(0)].rows_failed == 1
    assert rebooted[gpu_uuid(0)].clock_event_reasons == 0x40


def test_the_nvml_answers_behind_the_readings(tmp_path: Path) -> None:
    """What pynvml itself gets: the older throttle-reasons name, row counts as well as flags,
    one event for many corrected errors, and MIG devices that do not answer."""
    root = simulate(tmp_path, "dgx-a100-mig")
    inject.set_remapped_rows(root, 0, pending=3)
    inject.inject_ecc_dbe(root, 0)
    inject.set_clock_event_reasons(root, 1, 0x80)

    with nvidia.nvml_session(library(root)):
        first, second = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
        # (corrected rows, uncorrected rows, isPending, failureOccurred): one row per DBE
        # and the 3 rows of the remap line; the flags are 0 or 1.
        assert pynvml.nvmlDeviceGetRemappedRows(first) == (0, 4, 1, 0)
        assert pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(second) == 0x80
        assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(second) == 0x80
        assert pynvml.nvmlDeviceGetGpuMaxPcieLinkGeneration(first) == 4
        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(first, 0)
        for query in (
            pynvml.nvmlDeviceGetCurrPcieLinkGeneration,
            pynvml.nvmlDeviceGetMaxPcieLinkWidth,
            pynvml.nvmlDeviceGetCurrentClocksEventReasons,
        ):
            with pytest.raises(pynvml.NVMLError_NotSupported):
                query(mig)

        events = pynvml.nvmlEventSetCreate()
        try:
            pynvml.nvmlDeviceRegisterEvents(second, pynvml.nvmlEventTypeSingleBitEccError, events)
            inject.inject_ecc_sbe(root, 1, count=5)
            event = pynvml.nvmlEventSetWait(events, 5000)
            assert event.eventType == pynvml.nvmlEventTypeSingleBitEccError
            with pytest.raises(pynvml.NVMLError_Timeout):  # one event, not five
                pynvml.nvmlEventSetWait(events, 0)
        finally:
            pynvml.nvmlEventSetFree(events)
        assert (
            pynvml.nvmlDeviceGetTotalEccErrors(
                second, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC
            )
            == 5
        )

    inject.reset_device(root, "nvidia", 0)
    with nvidia.nvml_session(library(root)):
        rows = pynvml.nvmlDeviceGetRemappedRows(pynvml.nvmlDeviceGetHandleByIndex(0))
        assert rows == (0, 4, 0, 0)  # applied: still remapped, no longer pending


def test_malformed_lines_are_skipped_and_say_why(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    root = simulate(tmp_path)
    append_faults(
        root,
        "pcie gpu=0 gen=6",  # an H100 tops out at generation 5
        "pcie gpu=0 width=0",
        "pcie gpu=0",
        "pcie gpu=0 speed=3",
        "clocks gpu=0",
        "clocks gpu=0 reasons=0xZZ",
        "clocks gpu=0 reasons=-1",
        "remap gpu=0",
        "ecc_sbe gpu=0 count=0",
        "ecc_dbe gpu=0 count=2",
        "pcie gpu=1 gen=4",  # a good line after them is still read
    )

    figures = readings(root)

    assert link(figures[gpu_uuid(0)]) == (5, 5, 16, 16)
    assert figures[gpu_uuid(0)].clock_event_reasons == IDLE
    assert figures[gpu_uuid(0)].ecc_corrected_total == 0
    assert figures[gpu_uuid(1)].pcie_generation == 4
    err = capfd.readouterr().err
    for why in (
        "pcie on GPU 0: gen must be between 1 and the GPU's pcie_gen_max",
        "pcie on GPU 0: width must be between 1 and the GPU's pcie_width_max",
        "pcie on GPU 0: needs gen= or width=",
        "unknown key speed",
        "clocks on GPU 0: needs reasons=",
        "bad bit mask for reasons: 0xZZ",
        "bad bit mask for reasons: -1",
        "remap on GPU 0: needs pending= or failed=",
        "ecc_sbe on GPU 0: count must be at least 1",
        "unknown key count",
    ):
        assert why in err


# ---- the injector -------------------------------------------------------------------------


def test_the_injector_writes_the_lines(tmp_path: Path) -> None:
    root = simulate(tmp_path)
    inject.inject_ecc_sbe(root, 3)
    inject.inject_ecc_sbe(root, 3, count=5)
    inject.set_clock_event_reasons(root, 1, 0x48)
    inject.set_clock_event_reasons(root, 1, 0)
    inject.set_pcie_link(root, 2, generation=4)
    inject.set_pcie_link(root, 2, generation=3, width=8)
    inject.set_remapped_rows(root, 4, pending=2, failed=1)
    inject.set_remapped_rows(root, 4, failed=0)

    assert inject.fault_file(root).read_text().splitlines() == [
        "ecc_sbe gpu=3",
        "ecc_sbe gpu=3 count=5",
        "clocks gpu=1 reasons=0x48",
        "clocks gpu=1 reasons=0x0",
        "pcie gpu=2 gen=4",
        "pcie gpu=2 gen=3 width=8",
        "remap gpu=4 pending=2 failed=1",
        "remap gpu=4 failed=0",
    ]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda root: inject.inject_ecc_sbe(root, 0, count=0), "count must be between 1 and"),
        (lambda root: inject.set_clock_event_reasons(root, 0, -1), "a 64-bit mask"),
        (lambda root: inject.set_pcie_link(root, 0), "give a PCIe generation, a link width"),
        (lambda root: inject.set_pcie_link(root, 0, generation=7), "between 1 and 6, got 7"),
        (lambda root: inject.set_pcie_link(root, 0, width=0), "between 1 and 32 lanes"),
        (lambda root: inject.set_remapped_rows(root, 0), "give rows pending, rows failed"),
        (lambda root: inject.set_remapped_rows(root, 0, failed=-1), "between 0 and"),
        (lambda root: inject.set_pcie_link(root, 8, width=8), "no NVIDIA GPU 8"),
    ],
)
def test_the_injector_refuses_bad_values(
    tmp_path: Path, call: Callable[[Path], object], message: str
) -> None:
    root = simulate(tmp_path)
    with pytest.raises(ValueError, match=message):
        call(root)
    assert not inject.fault_file(root).exists()


def test_the_cli_sets_the_readings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = simulate(tmp_path)

    def inject_cli(*args: str) -> int:
        return cli.main(["simulate", "inject", str(root), "--device", "2", *args])

    for args in (
        ("--ecc-sbe",),
        ("--ecc-sbe", "5"),
        ("--clocks", "0x48"),
        ("--pcie", "4x8"),
        ("--pcie", "3"),
        ("--pcie", "x4"),
        ("--rows-pending", "2"),
        ("--rows-failed", "1"),
    ):
        assert inject_cli(*args) == 0, args
    assert inject.fault_file(root).read_text().splitlines() == [
        "ecc_sbe gpu=2",
        "ecc_sbe gpu=2 count=5",
        "clocks gpu=2 reasons=0x48",
        "pcie gpu=2 gen=4 width=8",
        "pcie gpu=2 gen=3",
        "pcie gpu=2 width=4",
        "remap gpu=2 pending=2",
        "remap gpu=2 failed=1",
    ]
    assert "injected: PCIe link x4 on GPU 2" in capsys.readouterr().out
    assert inject_cli("--pcie", "fast") == 2
    assert "is not GENxWIDTH" in capsys.readouterr().err
    reading = gpu(root, 2)
    assert (reading.clock_event_reasons, link(reading)) == (0x48, (3, 5, 4, 16))


# ---- metrics ------------------------------------------------------------------------------


def test_the_metrics(tmp_path: Path) -> None:
    root = simulate(tmp_path)
    state = DeviceState(discover_node(load_settings(overrides={"host_root": str(root)})))
    inject.set_clock_event_reasons(root, 1, HW_SLOWDOWN_AND_THERMAL | 0x400)
    inject.set_pcie_link(root, 2, generation=3, width=8)
    inject.set_remapped_rows(root, 3, pending=1, failed=1)

    with NvmlTelemetry(HostRoot.at(root)) as telemetry:
        extra = DeviceTelemetry("GPU-gone")  # reports none of the readings: no series
        collector = EdlCollector(
            snapshot=state.snapshot, telemetry=lambda: [*telemetry.read(), extra]
        )
        text = generate_latest(build_registry(collector)).decode()

    found: dict[tuple[str, str, str], float] = {}
    helps = {}
    for family in text_string_to_metric_families(text):
        helps[family.name] = family.documentation
        for sample in family.samples:
            labels = dict(sample.labels)
            device = labels.pop("device_id", "")
            assert labels.pop("vendor", None) in ("nvidia", "", None)
            labels.pop("index", None)
            key = (sample.name, device, ",".join(f"{k}={v}" for k, v in sorted(labels.items())))
            assert key not in found, key
            found[key] = sample.value

    def value(name: str, index: int, label: str) -> float:
        return found[(name, gpu_uuid(index), label)]

    reasons = "edl_device_clock_event_reasons"
    assert value(reasons, 0, "reason=idle") == 1
    assert value(reasons, 0, "reason=hw_slowdown") == 0
    assert value(reasons, 0, "reason=other") == 0
    active = {key[2] for key, v in found.items() if key[:2] == (reasons, gpu_uuid(1)) and v == 1}
    assert active == {"reason=hw_slowdown", "reason=hw_thermal", "reason=other"}
    assert len([key for key in found if key[:2] == (reasons, gpu_uuid(1))]) == 10

    assert value("edl_device_pcie_link_generation", 2, "of=current") == 3
    assert value("edl_device_pcie_link_generation", 2, "of=max") == 5
    assert value("edl_device_pcie_link_width", 2, "of=current") == 8
    assert value("edl_device_pcie_link_width", 2, "of=max") == 16
    assert value("edl_device_pcie_link_width", 0, "of=current") == 16
    assert value("edl_device_remapped_rows", 3, "state=pending") == 1
    assert value("edl_device_remapped_rows", 3, "state=failed") == 1
    assert value("edl_device_remapped_rows", 0, "state=pending") == 0

    assert not [key for key in found if key[1] == "GPU-gone" and "pcie" in key[0]]
    for name in (
        reasons,
        "edl_device_pcie_link_generation",
        "edl_device_pcie_link_width",
        "edl_device_remapped_rows",
    ):
        assert helps[name]
    described = {m.name for m in collector.describe()}
    assert {reasons, "edl_device_pcie_link_generation", "edl_device_remapped_rows"} <= described


# ---- recordings ---------------------------------------------------------------------------


def test_a_recording_keeps_the_links_maximum(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original = simulate(tmp_path / "original")
    data = original / nvidia_tree.DATA.lstrip("/")
    data.write_text(
        data.read_text().replace("\tindex=0\t", "\tindex=0\tpcie_gen_max=4\tpcie_width_max=8\t", 1)
    )
    inject.set_clock_event_reasons(original, 0, 0x20)
    inject.set_pcie_link(original, 1, generation=2)
    recording = tmp_path / "recording"

    assert cli.main(["simulate", "record", str(recording), "--host-root", str(original)]) == 0
    replayed = tmp_path / "replayed"
    assert cli.main(["simulate", "replay", str(recording), str(replayed)]) == 0
    capsys.readouterr()

    answers = json.loads((recording / "nvml.json").read_text())
    first, second = answers["gpus"][:2]
    assert first["clock_event_reasons"] == 0x20
    assert first["pcie_link"] == {
        "generation": 4,
        "generation_max": 4,
        "gpu_generation_max": 4,
        "width": 8,
        "width_max": 8,
    }
    assert second["pcie_link"]["generation"] == 2
    replayed_figures = list(read_nvidia_telemetry(HostRoot.at(replayed)))
    assert link(replayed_figures[0]) == (4, 4, 8, 8)
    assert link(replayed_figures[1]) == (5, 5, 16, 16)  # the replay starts without faults
