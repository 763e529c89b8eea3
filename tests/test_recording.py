"""Recordings of real NVIDIA nodes (`simulate record`) and their replay as simulated nodes: a
node recorded and replayed is discovered as it was, and the committed recording of a real H100
agrees with the `nvidia-smi -q` printed on that node."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from edl_agent.cli import main
from edl_agent.devices.hostroot import HostRoot
from edl_agent.sim.profile import load_profile
from edl_agent.sim.record import Scrubber
from edl_agent.sim.smi_check import cross_check, parse_query
from edl_agent.sim.tree import build_tree

H100 = Path(__file__).parent / "fixtures" / "recorded" / "h100-80gb-hbm3"
MIXED = ("--set", "nvidia.mig_strategy=mixed")


def discover(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["discover", "--format", "json", "--log-level", "error", *args]) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def test_a_recorded_node_replays_as_it_was_discovered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original = tmp_path / "original"
    build_tree(load_profile("dgx-a100-mig"), original)  # MIG devices and NVLinks
    before = discover(capsys, "--host-root", str(original), *MIXED)
    recording = tmp_path / "recording"
    assert main(["simulate", "record", str(recording), "--host-root", str(original), *MIXED]) == 0
    capsys.readouterr()
    recorded = read_json(recording / "discover.json")
    replayed_root = tmp_path / "replayed"
    assert main(["simulate", "replay", str(recording), str(replayed_root)]) == 0
    capsys.readouterr()
    replayed = discover(capsys, "--host-root", str(replayed_root), *MIXED)
    assert replayed == recorded
    # The same node, with stand-ins for its identities, links and MIG parents included.
    assert len(replayed["devices"]) == len(before["devices"]) == 32
    stand_in = dict(
        zip(
            (d["id"] for d in before["devices"]),
            (d["id"] for d in replayed["devices"]),
            strict=True,
        )
    )
    assert all(real != new for real, new in stand_in.items())
    for old, new in zip(before["devices"], replayed["devices"], strict=True):
        assert new["product"] == old["product"]
        assert new["memory_mib"] == old["memory_mib"]
        assert new["pci_bus_id"] == old["pci_bus_id"]
        assert new["numa_node"] == old["numa_node"]
        assert new["parent"] == (stand_in[old["parent"]] if old["parent"] else None)
        assert [(stand_in[link["peer"]], link["count"]) for link in old["links"]] == [
            (link["peer"], link["count"]) for link in new["links"]
        ]
    assert replayed["node"] == "recorded-node"


def test_a_recording_holds_no_identity_of_the_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original = tmp_path / "original"
    build_tree(load_profile("dgx-a100-mig"), original)
    before = discover(capsys, "--host-root", str(original))
    secrets = {d["id"] for d in before["devices"]}
    secrets |= {d["attributes"]["serial"] for d in before["devices"] if "serial" in d["attributes"]}
    secrets.add(before["node"])
    recording = tmp_path / "recording"
    assert main(["simulate", "record", str(recording), "--host-root", str(original)]) == 0
    texts = [p.read_text(encoding="utf-8") for p in recording.rglob("*") if p.is_file()]
    assert len(texts) > 10
    leaked = {secret for secret in secrets for text in texts if secret in text}
    assert leaked == set()


def test_the_host_name_is_replaced_only_where_it_stands_alone() -> None:
    scrub = Scrubber()
    scrub.host("vm")
    assert scrub.text("nvml_version node=vm vm.example x-vm") == (
        "nvml_version node=recorded-node recorded-node.example x-vm"
    )


def test_nvidia_smi_private_lines_are_masked() -> None:
    scrub = Scrubber()
    text = "    GPU PDI                   : 0x1234abcd\n    Serial Number             : N/A\n"
    assert scrub.text(text) == (
        "    GPU PDI                   : REDACTED\n    Serial Number             : N/A\n"
    )


def test_recording_a_node_without_nvml_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node = tmp_path / "node"
    build_tree(load_profile("ascend-910bx8"), node)
    assert main(["simulate", "record", str(tmp_path / "out"), "--host-root", str(node)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(
        "libnvidia-ml.so.1 not found under " + str(node) + ": nothing to record"
    )
    assert not (tmp_path / "out").exists()


def test_a_real_h100_replays_as_recorded(capsys: pytest.CaptureFixture[str]) -> None:
    replayed = discover(capsys, "--simulate", str(H100))
    assert replayed == read_json(H100 / "discover.json")
    (gpu,) = replayed["devices"]
    assert (gpu["product"], gpu["memory_mib"], gpu["pci_bus_id"]) == (
        "NVIDIA H100 80GB HBM3",
        81559,
        "0000:00:06.0",
    )
    assert gpu["attributes"]["compute_capability"] == "9.0"
    assert replayed["vendors"][0]["driver"]["driver_version"] == "580.159.04"


def test_a_real_h100_discovery_agrees_with_its_nvidia_smi() -> None:
    smi = (H100 / "tools" / "nvidia-smi-q.txt").read_text(encoding="utf-8")
    header, gpus = parse_query(smi)
    assert header["Driver Version"] == "580.159.04"
    assert [gpu.bus_id for gpu in gpus] == ["00000000:00:06.0"]
    assert dict(gpus[0].facts) == {
        "product": "NVIDIA H100 80GB HBM3",
        "id": "GPU-3a29cbde-18db-4c5e-955c-246d5f690026",
        "minor": "0",
        "pci_bus_id": "00000000:00:06.0",
        "memory_mib": "81559 MiB",
        "mig_mode": "Disabled",
    }
    devices = read_json(H100 / "discover.json")["devices"]
    check = cross_check(smi, devices)
    assert check == {
        "driver_version": "580.159.04",
        "gpus_compared": 1,
        "facts_compared": 6,
        "mismatches": [],
    }
    assert read_json(H100 / "recording.json")["nvidia_smi_check"] == check


def test_the_check_names_each_fact_that_differs() -> None:
    smi = (H100 / "tools" / "nvidia-smi-q.txt").read_text(encoding="utf-8")
    (device,) = read_json(H100 / "discover.json")["devices"]
    wrong = {
        **device,
        "memory_mib": 80000,
        "attributes": {**device["attributes"], "mig_mode": "enabled"},
    }
    assert cross_check(smi, [wrong])["mismatches"] == [
        "0000:00:06.0 memory_mib: discovery '80000', nvidia-smi '81559'",
        "0000:00:06.0 mig_mode: discovery 'enabled', nvidia-smi 'disabled'",
    ]
    assert cross_check(smi, [])["mismatches"] == [
        "0000:00:06.0: nvidia-smi shows a GPU discovery did not find"
    ]


def test_the_replayed_nvidia_smi_prints_what_the_node_printed(tmp_path: Path) -> None:
    assert main(["simulate", "replay", str(H100), str(tmp_path / "node")]) == 0
    root = HostRoot.at(tmp_path / "node")
    smi = root.which("nvidia-smi")
    assert smi is not None
    for args, name in ((["-q"], "q"), (["topo", "-m"], "topo-m"), (["-L"], "L")):
        expected = (H100 / "tools" / f"nvidia-smi-{name}.txt").read_text(encoding="utf-8")
        assert root.run_tool(smi, args) == expected
    assert root.run_tool(smi, ["--gpu-reset", "-i", "0"]).startswith("GPU ")


def test_replaying_something_that_is_not_a_recording_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "replay", str(tmp_path), str(tmp_path / "node")]) == 2
    assert "not a recording" in capsys.readouterr().err
