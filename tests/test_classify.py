"""Fault classification tables: NVIDIA XIDs, Ascend fault codes and health words, XPU/DCU states."""

from __future__ import annotations

import pytest

from edl_agent.config import HealthSettings, load_settings
from edl_agent.fault_codes import format_ascend_code, parse_ascend_code
from edl_agent.health.classify import (
    ASCEND_CODE_TYPES,
    ASCEND_FAULT_TYPE_LEVELS,
    XID_LEVELS,
    AscendFaultType,
    ascend_code_level,
    classify_device_state,
    classify_ecc_dbe,
    classify_npu_fault,
    classify_npu_health,
    classify_row_remap_failure,
    classify_xid,
    most_severe,
    xid_clears_by,
)
from edl_agent.health.model import ClearsBy, Level
from edl_agent.settings_loader import ConfigError

# --- NVIDIA XIDs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 68])
def test_application_xids_are_ignored(xid: int) -> None:
    assert classify_xid(xid) is Level.IGNORE


@pytest.mark.parametrize("xid", [48, 64, 74, 95, 109, 119, 120])
def test_reset_class_xids_make_the_device_fatal(xid: int) -> None:
    assert classify_xid(xid) is Level.DEVICE_FATAL
    assert classify_xid(xid).unhealthy


@pytest.mark.parametrize("xid", [63, 92, 94])
def test_xids_that_warn_of_a_reset_degrade_the_device(xid: int) -> None:
    # Row remapping pending, a high corrected-error rate, a contained error: the GPU works until
    # it is reset, so it keeps its pod and takes no new one.
    assert classify_xid(xid) is Level.DEGRADED
    assert not classify_xid(xid).unhealthy
    assert xid_clears_by(xid, Level.DEGRADED) is ClearsBy.RESET


def test_gpu_off_the_bus_needs_the_node() -> None:
    assert classify_xid(79) is Level.NODE_FATAL


@pytest.mark.parametrize("xid", [0, 8, 154, 999, 100_000])
def test_unknown_xids_warn(xid: int) -> None:
    assert classify_xid(xid) is Level.WARN


def test_every_fatal_xid_of_the_aws_list_that_the_catalog_resets_is_fatal() -> None:
    aws_fatal = {46, 48, 54, 62, 63, 64, 74, 79, 95, 109, 110, 119, 120, 136, 140, 143, 151, 155}
    aws_fatal |= {156, 158}
    # 63 (a row remapping recorded, applied at the next reset) is Degraded here: kept from new
    # work, like AWS's fatal, but its pod is not taken away.
    assert {xid for xid in aws_fatal if not XID_LEVELS[xid].unhealthy} == {63}
    assert XID_LEVELS[63] is Level.DEGRADED


def test_xid_overrides_take_string_keys() -> None:
    overrides = {"31": "device_fatal", "94": "warn", "79": "device_fatal", "200": "ignore"}
    assert classify_xid(31, overrides) is Level.DEVICE_FATAL
    assert classify_xid(94, overrides) is Level.WARN
    assert classify_xid(79, overrides) is Level.DEVICE_FATAL
    assert classify_xid(200, overrides) is Level.IGNORE
    assert classify_xid(13, overrides) is Level.IGNORE  # not overridden
    assert classify_xid(13, {}) is Level.IGNORE
    assert classify_xid(13, None) is Level.IGNORE


def test_xid_overrides_from_settings() -> None:
    settings = load_settings(environ={"EDL_HEALTH__XID_LEVELS": '{"43": node_fatal}'})
    assert classify_xid(43, settings.health.xid_levels) is Level.NODE_FATAL
    assert classify_xid(43, HealthSettings().xid_levels) is Level.IGNORE


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"x31": "warn"}, "health.xid_levels: 'x31' is not an XID number"),
        (
            {"31": "fatal"},
            r"health.xid_levels.31: expected one of ignore, warn, degraded, device_fatal",
        ),
    ],
)
def test_xid_override_check(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(overrides={"health": {"xid_levels": overrides}})
    load_settings(overrides={"health": {"xid_levels": {"31": "warn", " 94 ": "ignore"}}})


def test_memory_faults_make_the_device_fatal() -> None:
    assert classify_ecc_dbe() is Level.DEVICE_FATAL
    assert classify_row_remap_failure() is Level.DEVICE_FATAL


# --- Ascend --------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["0x80E01801", "80E01801", "80e01801", " 0X80e01801 "])
def test_ascend_code_spellings(text: str) -> None:
    assert parse_ascend_code(text) == 0x80E01801
    assert format_ascend_code(parse_ascend_code(text)) == "0x80E01801"


@pytest.mark.parametrize("text", ["", "0x", "80E0180100", "NA", "0x80G01801", "-1"])
def test_ascend_code_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not an Ascend fault code"):
        parse_ascend_code(text)


def test_every_plugin_level_has_one_of_ours() -> None:
    assert set(ASCEND_FAULT_TYPE_LEVELS) == set(AscendFaultType)
    assert ASCEND_FAULT_TYPE_LEVELS[AscendFaultType.NOT_HANDLE] is Level.IGNORE
    assert {
        ASCEND_FAULT_TYPE_LEVELS[t]
        for t in (AscendFaultType.RESTART_REQUEST, AscendFaultType.RESTART_BUSINESS)
    } == {Level.WARN}
    assert {
        ASCEND_FAULT_TYPE_LEVELS[t]
        for t in (AscendFaultType.RESTART_NPU, AscendFaultType.FREE_RESTART_NPU)
    } == {Level.DEVICE_FATAL}
    assert ASCEND_FAULT_TYPE_LEVELS[AscendFaultType.PRE_SEPARATE_NPU] is Level.DEGRADED
    assert ASCEND_FAULT_TYPE_LEVELS[AscendFaultType.SUB_HEALTH] is Level.DEGRADED
    separate = (
        AscendFaultType.SEPARATE_NPU,
        AscendFaultType.MANUALLY_SEPARATE_NPU,
    )
    assert {ASCEND_FAULT_TYPE_LEVELS[t] for t in separate} == {Level.NODE_FATAL}


@pytest.mark.parametrize(
    ("code", "level"),
    [
        (0x80E21007, Level.IGNORE),  # NotHandleFault
        (0x80CB800A, Level.WARN),  # RestartRequest
        (0x80E01801, Level.WARN),  # RestartBusiness
        (0x8C0E4E00, Level.DEVICE_FATAL),  # FreeRestartNPU
        (0x8C03A000, Level.DEVICE_FATAL),  # RestartNPU
        (0x80E18402, Level.NODE_FATAL),  # SeparateNPU
        (0x12345678, None),
    ],
)
def test_ascend_code_table(code: int, level: Level | None) -> None:
    assert ascend_code_level(code) is level
    assert ASCEND_CODE_TYPES.get(code) is None or level is not None


def test_ascend_overrides_take_any_spelling() -> None:
    overrides = {"0x80E01801": "node_fatal", "12345678": "device_fatal", "nonsense": "ignore"}
    assert ascend_code_level(0x80E01801, overrides) is Level.NODE_FATAL
    assert ascend_code_level(0x12345678, overrides) is Level.DEVICE_FATAL
    assert ascend_code_level(0x80E18402, overrides) is Level.NODE_FATAL  # table
    settings = load_settings(overrides={"health": {"ascend_code_levels": {"80e01801": "ignore"}}})
    assert ascend_code_level(0x80E01801, settings.health.ascend_code_levels) is Level.IGNORE


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"0x8": "sure"}, "expected one of ignore, warn"),
        ({"80E0180G": "warn"}, "health.ascend_code_levels: '80E0180G' is not an Ascend fault"),
    ],
)
def test_ascend_override_check(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(overrides={"health": {"ascend_code_levels": overrides}})
    load_settings(overrides={"health": {"ascend_code_levels": {"0x80E01801": "node_fatal"}}})


@pytest.mark.parametrize(
    ("word", "level"),
    [
        ("OK", None),
        ("ok", None),
        ("Warning", Level.WARN),
        ("Alarm", Level.DEVICE_FATAL),
        ("Critical", Level.DEVICE_FATAL),
        ("UNKNOWN", Level.WARN),
    ],
)
def test_npu_health_words(word: str, level: Level | None) -> None:
    assert classify_npu_health(word) is level


@pytest.mark.parametrize(
    ("health", "codes", "expected"),
    [
        ("Critical", (), (Level.DEVICE_FATAL, None)),
        ("OK", (), (None, None)),
        # Known codes decide, even against the word, so that operators' overrides count.
        ("Critical", (0x80E01801,), (Level.WARN, 0x80E01801)),
        ("Warning", (0x80E21007,), (Level.IGNORE, 0x80E21007)),
        ("Warning", (0x80E01801, 0x80E18402), (Level.NODE_FATAL, 0x80E18402)),
        # Unknown codes count as the word says, at least a warning.
        ("Critical", (0x12345678,), (Level.DEVICE_FATAL, 0x12345678)),
        ("OK", (0x12345678,), (Level.WARN, 0x12345678)),
        ("Warning", (0x80E21007, 0x12345678), (Level.WARN, 0x12345678)),
        # The first code of the highest level decides.
        ("Alarm", (0x8C03A000, 0x8C0E4E00), (Level.DEVICE_FATAL, 0x8C03A000)),
    ],
)
def test_npu_fault(
    health: str, codes: tuple[int, ...], expected: tuple[Level | None, int | None]
) -> None:
    assert classify_npu_fault(health, codes) == expected


def test_npu_fault_honours_overrides() -> None:
    overrides = {"0x80E18402": "warn"}
    assert classify_npu_fault("Critical", (0x80E18402,), overrides) == (Level.WARN, 0x80E18402)


# --- XPU / DCU states ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "level"),
    [
        ("Normal", None),
        ("NORMAL", None),
        ("Warning", Level.DEGRADED),
        ("Fault", Level.DEVICE_FATAL),
        ("Lost", Level.NODE_FATAL),
        ("Rebooting", Level.WARN),
    ],
)
def test_device_states(state: str, level: Level | None) -> None:
    assert classify_device_state(state) is level


def test_most_severe() -> None:
    assert most_severe([Level.WARN, Level.NODE_FATAL, Level.IGNORE]) is Level.NODE_FATAL
    assert most_severe([Level.IGNORE]) is Level.IGNORE
