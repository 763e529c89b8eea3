"""Discovery, topology and the pollers over the reconstructed outputs in
tests/fixtures/reconstructed/: formats no public sample shows in full (README.md there). They are
ours, not a real node's; the real corpus is tests/test_real_vendor_outputs.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from edl_agent.config import HealthSettings
from edl_agent.devices import hygon
from edl_agent.devices.hostroot import HostRoot
from edl_agent.health.vendor_readings import poll_hygon
from tests.real_nodes import REAL, ascend_node, hygon_node, sample
from tests.test_real_vendor_outputs import _devices, cells, topology

RECONSTRUCTED = REAL.parent / "reconstructed"
SETTINGS = HealthSettings()


def test_every_reconstructed_file_is_listed_and_marked() -> None:
    readme = (RECONSTRUCTED / "README.md").read_text(encoding="utf-8")
    assert "NOT real" in readme
    files = sorted(
        str(p.relative_to(RECONSTRUCTED)) for p in RECONSTRUCTED.rglob("*") if p.is_file()
    )
    assert [f for f in files if f != "README.md" and f"`{f}`" not in readme] == []


def test_a3_whole_node_topology(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = ascend_node(
        tmp_path,
        range(16),
        sample("real/ascend/a3-910c-npu-smi-25.2.1-info.txt"),
        topo=sample("reconstructed/ascend/a3-npu-smi-topo-16die.txt"),
    )
    topo = topology(capsys, root)
    kinds = {tuple(p["devices"]): p["link"]["kind"] for p in topo["pairs"]}
    assert len(kinds) == 16 * 15 // 2
    for (a, b), kind in kinds.items():
        assert kind == ("sio" if int(a[3:]) // 2 == int(b[3:]) // 2 else "hccs-sw"), (a, b)


def test_ub_links(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = ascend_node(
        tmp_path,
        range(8),
        sample("real/ascend/910b4-npu-smi-24.1.rc3-info.txt"),
        topo=sample("reconstructed/ascend/atlas350-npu-smi-topo-ub.txt"),
    )
    topo = topology(capsys, root)
    assert {p["link"]["kind"] for p in topo["pairs"]} == {"ub"}
    assert cells(topo)[("NPU0", "NPU7")] == "UB"
    assert [d["cpu_affinity"] for d in topo["devices"]] == ["0-39"] * 4 + ["40-79"] * 4


K100_BUSES = ["0000:1b:00.0", "0000:3d:00.0", "0000:9c:00.0", "0000:bd:00.0"]
Z100_BUSES = ["0000:04:00.0", "0000:26:00.0", "0000:43:00.0", "0000:63:00.0"]


def test_k100_ai_dcu_use_key(tmp_path: Path) -> None:
    text = sample("reconstructed/hygon/k100-ai-hy-smi-json.json")
    root = hygon_node(tmp_path, list(reversed(K100_BUSES)), query=text, status=text)
    devices = _devices(root, hygon.discover)
    assert [(d.product, d.memory_mib) for d in devices] == [("K100_AI", 65520)] * 4
    result = poll_hygon(HostRoot.at(root), devices, SETTINGS)
    assert [t.utilization_percent for t in result.telemetry] == [12.0] * 4
    assert result.events == []


def test_dtk_rocm_smi_without_hy_smi(tmp_path: Path) -> None:
    text = sample("reconstructed/hygon/dtk-rocm-smi-json.json")
    root = hygon_node(tmp_path, Z100_BUSES, query=text, status=text, tool="/opt/dtk/bin/rocm-smi")
    devices = _devices(root, hygon.discover)
    assert [(d.product, d.memory_mib, d.pci_bus_id) for d in devices] == [
        ("Z100L", 32768, bus) for bus in Z100_BUSES
    ]
    telemetry = poll_hygon(HostRoot.at(root), devices, SETTINGS).telemetry
    assert [(t.memory_used_mib, t.memory_total_mib) for t in telemetry] == [(256.0, 32768.0)] * 4
