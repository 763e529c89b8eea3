"""Simulated nodes whose tools print the real layouts (tests/fixtures/real/): an Atlas A3 with two
dies per NPU, a 310P inference node, a Hygon BW node with hy-smi's malformed JSON, a DTK node with
rocm-smi and no hy-smi, and a Kunlunxin P800 OAM node whose /dev/xpu<N> numbers are not
xpu-smi's order. Discovery, topology, the health pollers and fault injection on each."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from edl_agent.cli import main
from edl_agent.config import HealthSettings
from edl_agent.devices import ascend, hygon, kunlunxin
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.kunlunxin_smi import parse_xpu_smi_list
from edl_agent.devices.model import Device, VendorReport
from edl_agent.health.model import Level
from edl_agent.health.remediation_rules import Remediator, command_for, validate_reset
from edl_agent.health.vendor_readings import poll_ascend, poll_hygon, poll_kunlunxin
from edl_agent.health_settings import RemediationSettings
from edl_agent.sim import ascend_tree, hygon_tree, inject, kunlunxin_tree
from edl_agent.sim.profile import Profile, load_profile, parse_profile, pci_bus_id
from edl_agent.sim.tree import build_tree

SETTINGS = HealthSettings()


def built(profile: Profile, tmp_path: Path, discover: Any) -> tuple[HostRoot, list[Device]]:
    build_tree(profile, tmp_path)
    root = HostRoot.at(tmp_path)
    report: VendorReport | None = discover(root)
    assert report is not None
    assert report.error is None
    return root, list(report.devices)


def events(result: Any) -> dict[str | None, tuple[str, Level]]:
    return {event.device_id: (event.reason, event.level) for event in result.events}


# --- Atlas A3 (910C): two dies per NPU ---------------------------------------------------------


def test_a3_lists_every_die_once_with_its_npu_and_chip(tmp_path: Path) -> None:
    root, devices = built(load_profile("ascend-a3-910c"), tmp_path, ascend.discover)
    info = root.path(ascend_tree.INFO_OUTPUT).read_text()
    assert "| Chip  Phy-ID " in info  # the A3 header, as npu-smi 25.2.1 prints it
    assert [d.index for d in devices] == list(range(16))
    assert {d.product for d in devices} == {"Ascend910"}  # not AscendAscend910
    assert [(d.attributes["npu_id"], d.attributes["chip_id"]) for d in devices] == [
        (str(npu), str(chip)) for npu in range(8) for chip in range(2)
    ]
    assert len({d.pci_bus_id for d in devices}) == 16  # every die has its own address
    assert {d.memory_mib for d in devices} == {65536}


def test_a3_topology_sio_within_an_npu_hccs_sw_between(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["discover", "--simulate", "ascend-a3-910c", "--topology", "--format", "json"]
    assert main([*argv, "--log-level", "error"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["pairs"]) == 16 * 15 // 2
    for pair in data["pairs"]:
        a, b = (int(label[3:]) for label in pair["devices"])
        cell, kind = ("SIO", "sio") if a // 2 == b // 2 else ("HCCS_SW", "hccs-sw")
        assert pair["link"] == {"kind": kind, "count": None, "source": "npu-smi"}, pair
        assert pair["cell"] == cell


def test_a3_health_is_per_die_and_a_reset_clears_both_dies(tmp_path: Path) -> None:
    root, devices = built(load_profile("ascend-a3-910c"), tmp_path, ascend.discover)
    ascend_tree.set_npu_health(tmp_path, 3, "Critical", ["0x80E18402"])  # NPU 1, die 1
    ascend_tree.set_npu_health(tmp_path, 2, "Warning")  # NPU 1, die 0
    assert events(poll_ascend(root, devices, SETTINGS)) == {
        "ascend-npu3": ("NPU_FAULT_0x80E18402", Level.NODE_FATAL),
        "ascend-npu2": ("NPU_HEALTH_Warning", Level.WARN),
    }
    tool = root.path(ascend_tree.TOOL)
    subprocess.run([str(tool), "set", "-t", "reset", "-i", "1", "-c", "0"], check=True)
    assert poll_ascend(root, devices, SETTINGS).events == []


def test_a3_reboot_clears_every_die(tmp_path: Path) -> None:
    root, devices = built(load_profile("ascend-a3-910c"), tmp_path, ascend.discover)
    for index in (0, 9, 15):
        ascend_tree.set_npu_health(tmp_path, index, "Critical")
    assert set(events(poll_ascend(root, devices, SETTINGS))) == {
        "ascend-npu0",
        "ascend-npu9",
        "ascend-npu15",
    }
    assert "16 ascend devices reset" in inject.reboot(tmp_path)
    assert poll_ascend(root, devices, SETTINGS).events == []


# --- Atlas 300I Duo: two 310P3 chips per card, NPU ids not consecutive -------------------------


def test_300i_duo_chips_share_their_card(tmp_path: Path) -> None:
    root, devices = built(load_profile("ascend-300i-duo"), tmp_path, ascend.discover)
    info = root.path(ascend_tree.INFO_OUTPUT).read_text()
    assert "| Chip    Device " in info
    assert "HBM" not in info  # 310P: no HBM column
    assert {d.product for d in devices} == {"Ascend310P3"}
    assert [d.attributes["npu_id"] for d in devices] == ["1", "1", "2", "2", "4", "4", "5", "5"]
    buses = [d.pci_bus_id for d in devices]
    assert buses[0::2] == buses[1::2]  # both chips of a card at the card's address
    assert len(set(buses)) == 4


def test_300i_duo_health_reaches_the_right_chip(tmp_path: Path) -> None:
    root, devices = built(load_profile("ascend-300i-duo"), tmp_path, ascend.discover)
    assert ascend_tree.set_health(tmp_path, 5, "Critical") == (4, 1)
    ascend_tree.set_npu_health(tmp_path, 5, "Critical", [0x80E18402])
    assert events(poll_ascend(root, devices, SETTINGS)) == {
        "ascend-npu5": ("NPU_FAULT_0x80E18402", Level.NODE_FATAL)
    }
    health = root.path(ascend_tree.CHIP_HEALTH_OUTPUT.format(npu=4, chip=1)).read_text()
    assert "80E18402" in health


def test_a_reset_reaches_the_card_npu_smi_names(tmp_path: Path) -> None:
    """`/dev/davinci5` is chip 1 of NPU 4: the default command resets `-i 4 -c 1` (with the
    device index it would have reset NPU 5, another card)."""
    root, devices = built(load_profile("ascend-300i-duo"), tmp_path, ascend.discover)
    ascend_tree.set_npu_health(tmp_path, 5, "Critical", [0x80E18402])
    ascend_tree.set_npu_health(tmp_path, 6, "Critical", [0x80E18402])  # NPU 5, chip 0
    settings = RemediationSettings(enabled=True)
    chip = next(d for d in devices if d.index == 5)
    assert command_for(chip, settings) == ["npu-smi", "set", "-t", "reset", "-i", "4", "-c", "1"]
    outcome = Remediator(
        root, settings, validate=lambda d: validate_reset(root, d, SETTINGS)
    ).reset(chip)
    assert outcome.ok, outcome.detail
    assert set(events(poll_ascend(root, devices, SETTINGS))) == {"ascend-npu6"}


def test_300i_duo_topology_is_unsupported_not_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["discover", "--simulate", "ascend-300i-duo", "--topology", "--format", "json"]
    assert main([*argv, "--log-level", "error"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {json.dumps(pair["link"]) for pair in data["pairs"]} == {"null"}
    assert data["vendors"][0]["error"] is None


# --- Hygon BW: hy-smi's malformed JSON ---------------------------------------------------------


def test_bw_json_stays_malformed_and_is_read(tmp_path: Path) -> None:
    root, devices = built(load_profile("hygon-bw"), tmp_path, hygon.discover)
    path = root.path(hygon_tree.JSON_OUTPUT)
    hygon_tree.set_dcu_state(tmp_path, 6, "Fault")
    text = path.read_text()
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert '"": ""' in text
    assert '--> OAM ID: 7"' in text
    assert {(d.product, d.memory_mib) for d in devices} == {("BW", 65520)}
    assert events(poll_hygon(root, devices, SETTINGS)) == {
        devices[6].id: ("DCU_STATE_Fault", Level.DEVICE_FATAL)
    }
    assert "8 hygon devices reset" in inject.reboot(tmp_path)
    assert poll_hygon(root, devices, SETTINGS).events == []


def test_bw_poll_matches_dcus_by_bus_id_not_position(tmp_path: Path) -> None:
    root, devices = built(load_profile("hygon-bw"), tmp_path, hygon.discover)
    hygon_tree.set_dcu_state(tmp_path, 2, "Lost")
    path = root.path(hygon_tree.JSON_OUTPUT)
    # hy-smi numbering its cards apart from sysfs order: swap the entries' names.
    text = path.read_text().replace('"card2"', '"cardX"').replace('"card5"', '"card2"')
    path.write_text(text.replace('"cardX"', '"card5"'))
    assert events(poll_hygon(root, devices, SETTINGS)) == {
        devices[2].id: ("DCU_STATE_Lost", Level.NODE_FATAL)
    }


# --- older DTK node: rocm-smi, no hy-smi -------------------------------------------------------

DTK_NODE = """
description: DTK node without hy-smi
node: {hostname: sim-dtk, numa_nodes: 2}
hygon:
  driver_version: "5.16.29"
  tool: rocm-smi
  dcus: [{count: 4, product: Z100L, memory_mib: 32768, compute_units: 64}]
"""


def test_dtk_node_is_read_with_rocm_smi(tmp_path: Path) -> None:
    root, devices = built(parse_profile("dtk", DTK_NODE), tmp_path, hygon.discover)
    assert not root.exists(hygon_tree.TOOL)
    assert {(d.product, d.memory_mib) for d in devices} == {("Z100L", 32768)}
    hygon_tree.set_dcu_state(tmp_path, 1, "Fault")
    result = poll_hygon(root, devices, SETTINGS)
    assert events(result) == {devices[1].id: ("DCU_STATE_Fault", Level.DEVICE_FATAL)}
    assert [t.memory_total_mib for t in result.telemetry] == [32768.0] * 4


# --- Kunlunxin P800 OAM: real `-L`, minor numbers apart from xpu-smi's order -----------------


def test_p800_oam_xpus_are_keyed_by_minor_number(tmp_path: Path) -> None:
    profile = load_profile("kunlun-p800-oam")
    assert profile.kunlunxin is not None
    minors = profile.kunlunxin.minor_numbers
    root, devices = built(profile, tmp_path, kunlunxin.discover)
    assert [d.id for d in devices] == [f"kunlunxin-xpu{n}" for n in range(8)]
    for smi_index, minor in enumerate(minors):
        device = devices[minor]
        assert device.pci_bus_id == pci_bus_id(1, smi_index)
        assert device.device_nodes[0] == f"/dev/xpu{minor}"
    assert {d.product for d in devices} == {"P800 OAM"}
    kunlunxin_tree.set_xpu_state(tmp_path, minors[0], "Fault")
    assert events(poll_kunlunxin(root, devices, SETTINGS)) == {
        f"kunlunxin-xpu{minors[0]}": ("XPU_STATE_Fault", Level.DEVICE_FATAL)
    }


def test_p800_oam_list_is_printed_as_the_real_tool_prints_it(tmp_path: Path) -> None:
    root, devices = built(load_profile("kunlun-p800-oam"), tmp_path, kunlunxin.discover)
    text = root.path(kunlunxin_tree.LIST_OUTPUT).read_text()
    assert text.splitlines()[0].startswith("XPU 0: P800 OAM  GPU-")
    listed = parse_xpu_smi_list(text)
    assert [entry.name for entry in listed] == ["P800 OAM"] * 8
    assert {entry.uuid for entry in listed} == {d.attributes["uuid"] for d in devices}
