"""The Ascend fault-code table shipped as data: what it holds, how a MindCluster faultCode.json is
taken in (scripts/ascend-fault-codes), and what each level does."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from edl_agent.health import ascend_fault_codes as codes
from edl_agent.health.ascend_fault_codes import Action, AscendFaultType, TableError
from edl_agent.health.classify import (
    ASCEND_CODE_TYPES,
    ascend_code_clears_by,
    ascend_code_level,
    classify_npu_fault,
)
from edl_agent.health.model import ClearsBy, Level

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "ascend-fault-codes"
SHIPPED = REPO / "edl_agent" / "health" / codes.DATA_FILE
# MindCluster's default table as read (22bb3d98): 804 entries, 802 codes; B4060011 is listed twice
# as RestartBusiness, A2301001 as RestartBusiness and SeparateNPU.
PER_LEVEL = {
    AscendFaultType.NOT_HANDLE: 132,
    AscendFaultType.SUB_HEALTH: 13,
    AscendFaultType.RESTART_REQUEST: 33,
    AscendFaultType.RESTART_BUSINESS: 24,
    AscendFaultType.FREE_RESTART_NPU: 23,
    AscendFaultType.RESTART_NPU: 162,
    AscendFaultType.PRE_SEPARATE_NPU: 200,
    AscendFaultType.SEPARATE_NPU: 215,
}


def test_the_shipped_table_is_mindclusters_whole_table() -> None:
    table = codes.table()
    assert len(table) == 802
    assert Counter(table.values()) == PER_LEVEL
    assert table == ASCEND_CODE_TYPES
    document = json.loads(SHIPPED.read_text())
    assert document["source"]["repository"] == "https://github.com/Ascend/mind-cluster"
    assert len(document["source"]["commit"]) == 40


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (0x80E21007, AscendFaultType.NOT_HANDLE),
        (0x80CB8009, AscendFaultType.RESTART_REQUEST),
        (0x80E01801, AscendFaultType.RESTART_BUSINESS),
        (0x8C0E4E00, AscendFaultType.FREE_RESTART_NPU),
        (0x8C03A000, AscendFaultType.RESTART_NPU),
        (0x80E18402, AscendFaultType.SEPARATE_NPU),
        (0xA2301001, AscendFaultType.SEPARATE_NPU),  # also listed as RestartBusiness
        (0x200001002, AscendFaultType.NOT_HANDLE),  # nine hex digits
        (0x12345678, None),
    ],
)
def test_codes(code: int, kind: AscendFaultType | None) -> None:
    assert codes.ascend_fault_type(code) is kind


def test_every_level_has_a_rule_and_the_order_is_mindclusters() -> None:
    assert set(codes.RULES) == set(AscendFaultType)
    assert list(AscendFaultType)[:2] == [AscendFaultType.NOT_HANDLE, AscendFaultType.SUB_HEALTH]
    assert list(AscendFaultType)[-1] is AscendFaultType.MANUALLY_SEPARATE_NPU
    # Degraded types warn (the chip keeps its pod); among the others a more severe type never
    # has a milder level.
    warned = [kind for kind in AscendFaultType if codes.RULES[kind].level is Level.DEGRADED]
    assert warned == [AscendFaultType.SUB_HEALTH, AscendFaultType.PRE_SEPARATE_NPU]
    ranks = [codes.RULES[kind].level.rank for kind in AscendFaultType if kind not in warned]
    assert ranks == sorted(ranks)


@pytest.mark.parametrize(
    ("code", "level", "clears_by", "action"),
    [
        (0x80E21007, Level.IGNORE, ClearsBy.NOTHING, Action.ADVERTISE),
        (
            next(c for c, k in codes.table().items() if k is AscendFaultType.SUB_HEALTH),
            Level.DEGRADED,
            ClearsBy.CONDITION,
            Action.DEGRADED,
        ),
        (0x80E01801, Level.WARN, ClearsBy.NOTHING, Action.RERUN_JOB),
        (0x8C0E4E00, Level.DEVICE_FATAL, ClearsBy.RESET, Action.RESET_WHEN_IDLE),
        (0x8C03A000, Level.DEVICE_FATAL, ClearsBy.RESET, Action.RESET),
        (
            next(c for c, k in codes.table().items() if k is AscendFaultType.PRE_SEPARATE_NPU),
            Level.DEGRADED,
            ClearsBy.RELEASE,
            Action.SEPARATE_WHEN_IDLE,
        ),
        (0x80E18402, Level.NODE_FATAL, ClearsBy.RELEASE, Action.SEPARATE),
    ],
)
def test_what_each_level_does(code: int, level: Level, clears_by: ClearsBy, action: Action) -> None:
    kind = codes.ascend_fault_type(code)
    assert kind is not None
    assert codes.RULES[kind].action is action
    assert ascend_code_level(code) is level
    assert ascend_code_clears_by(code, level) is clears_by
    assert classify_npu_fault("Critical", (0x80E21007, code)) == (
        max([Level.IGNORE, level], key=list(Level).index),
        code if level is not Level.IGNORE else 0x80E21007,
    )


def test_operator_overrides_still_win() -> None:
    overrides = {"0x8C03A000": "warn"}
    assert ascend_code_level(0x8C03A000, overrides) is Level.WARN
    assert ascend_code_clears_by(0x8C03A000, Level.DEVICE_FATAL, {"8c03a000": "release"}) is (
        ClearsBy.RELEASE
    )


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_script_takes_in_a_table(tmp_path: Path) -> None:
    source = tmp_path / "faultCode.json"
    source.write_text(
        json.dumps(
            {
                "NotHandleFaultCodes": ["80E21007", "0x1"],
                "RestartNPUCodes": ["8C03A000", "00000001"],
                "SubHealthFaultCodes": ["80E18005"],
            }
        )
    )
    output = tmp_path / "table.json"
    done = run_script(str(source), "--commit", "abc", "--output", str(output))
    assert done.returncode == 0, done.stderr
    assert "00000001 listed as NotHandleFault, RestartNPU: taken as RestartNPU" in done.stdout
    table = codes.parse_table(output.read_text())
    assert table == {
        0x80E21007: AscendFaultType.NOT_HANDLE,
        0x1: AscendFaultType.RESTART_NPU,
        0x8C03A000: AscendFaultType.RESTART_NPU,
        0x80E18005: AscendFaultType.SUB_HEALTH,
    }
    assert json.loads(output.read_text())["source"]["commit"] == "abc"
    assert (
        run_script(str(source), "--commit", "abc", "--output", str(output), "--check").returncode
        == 0
    )
    assert run_script(str(source), "--commit", "abc", "--check").returncode == 1  # not shipped's


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"NewLevelCodes": ["1"]}, "unknown fault-code list(s): NewLevelCodes"),
        ({"RestartNPUCodes": "8C03A000"}, "RestartNPUCodes: a list of hex codes, not str"),
        ({"RestartNPUCodes": ["xyz"]}, "RestartNPUCodes: 'xyz' is not a hex code"),
        ([], "a fault-code table is a JSON object of code lists"),
    ],
)
def test_a_table_that_cannot_be_read_is_refused_by_name(document: object, message: str) -> None:
    with pytest.raises(TableError) as refused:
        codes.read_source(document)
    assert str(refused.value) == message


def test_the_script_says_why_it_cannot_read(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"RestartNPUCodes": 5}')
    done = run_script(str(bad), "--commit", "x", "--output", str(tmp_path / "out.json"))
    assert done.returncode == 2
    assert "RestartNPUCodes: a list of hex codes, not int" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out.json").exists()
