"""The `edl-agent` command: discovery of every shipped profile, and bad input as one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from edl_agent.cli import main
from edl_agent.sim import ascend_dcmi
from edl_agent.sim.profile import ProfileError, load_profile, parse_profile, profile_names


def discover_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["discover", "--format", "json", "--log-level", "error", *args]) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


def vendor_kinds(inventory: dict[str, Any]) -> Counter[tuple[str, str]]:
    return Counter((d["vendor"], d["kind"]) for d in inventory["devices"])


def resource_counts(inventory: dict[str, Any]) -> dict[str, int]:
    return {r["name"]: len(r["devices"]) for r in inventory["resources"]}


EXPECTED = {
    "dgx-h100": (
        {("nvidia", "gpu"): 8},
        {"nvidia.com/gpu": 8},
    ),
    "dgx-a100-mig": (
        {("nvidia", "gpu"): 8, ("nvidia", "mig"): 2 * 2 + 2 * 7 + 2 * 3},
        {
            "nvidia.com/gpu": 2,
            "nvidia.com/mig-3g.40gb": 4,
            "nvidia.com/mig-1g.10gb": 14 + 2,
            "nvidia.com/mig-2g.20gb": 2,
            "nvidia.com/mig-4g.40gb": 2,
        },
    ),
    "kunlun-p800x8": ({("kunlunxin", "xpu"): 8}, {"kunlunxin.com/xpu": 8}),
    "hygon-k100x8": ({("hygon", "dcu"): 8}, {"hygon.com/dcunum": 8}),
    "ascend-910bx8": ({("ascend", "npu"): 8}, {"huawei.com/Ascend910": 8}),
    "ascend-a3-910c": ({("ascend", "npu"): 16}, {"huawei.com/Ascend910": 16}),
    "ascend-300i-duo": ({("ascend", "npu"): 8}, {"huawei.com/Ascend310P": 8}),
    "hygon-bw": ({("hygon", "dcu"): 8}, {"hygon.com/dcunum": 8}),
    "kunlun-p800-oam": ({("kunlunxin", "xpu"): 8}, {"kunlunxin.com/xpu": 8}),
    "mixed-gpu-npu": (
        {("nvidia", "gpu"): 4, ("ascend", "npu"): 4},
        {"nvidia.com/gpu": 4, "huawei.com/Ascend910": 4},
    ),
    "cgpu-v100": (
        {("nvidia", "gpu"): 8},
        {
            "baidu.com/v100_32g_cgpu": 8 * 4,
            "baidu.com/v100_32g_cgpu_core": 8 * 20,
            "baidu.com/v100_32g_cgpu_memory": 8 * 32,
        },
    ),
}


def test_every_shipped_profile_is_covered() -> None:
    assert sorted(EXPECTED) == profile_names()


@pytest.mark.parametrize("profile", sorted(EXPECTED))
def test_simulated_profile_discovery(profile: str, capsys: pytest.CaptureFixture[str]) -> None:
    inventory = discover_json(capsys, "--simulate", profile)
    kinds, resources = EXPECTED[profile]
    assert vendor_kinds(inventory) == kinds
    assert resource_counts(inventory) == resources
    assert all(v["error"] is None for v in inventory["vendors"])
    assert inventory["node"].startswith("sim-")
    numa_nodes = range(load_profile(profile).node.numa_nodes)
    ids = [d["id"] for d in inventory["devices"]]
    assert len(ids) == len(set(ids))
    for device in inventory["devices"]:
        assert device["health"] == "Healthy"
        assert device["memory_mib"] > 0
        if device["kind"] != "mig":
            assert device["numa_node"] in numa_nodes
            assert device["pci_bus_id"]


def test_build_then_discover_host_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree = tmp_path / "node"
    assert main(["simulate", "build", "dgx-h100", str(tree)]) == 0
    capsys.readouterr()
    inventory = discover_json(capsys, "--host-root", str(tree), "--node-name", "gpu-7")
    assert inventory["node"] == "gpu-7"
    assert resource_counts(inventory) == {"nvidia.com/gpu": 8}
    products = {d["product"] for d in inventory["devices"]}
    assert products == {"NVIDIA H100 80GB HBM3"}
    assert Counter(d["numa_node"] for d in inventory["devices"]) == {0: 4, 1: 4}


@pytest.mark.parametrize("profile", ["dgx-a100-mig", "dgx-h100"])
def test_nodes_built_with_their_names_share_no_gpu_uuid(
    profile: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A simulated fleet: each node's GPUs and MIG devices have uuids of their own; the same
    name builds the same uuids again, and no name gives the profile's. (XPUs and DCUs are named
    by PCI address, which nodes of one model share on real hardware too.)"""

    def ids(*build: str) -> set[str]:
        tree = tmp_path / f"node-{len(list(tmp_path.iterdir()))}"
        assert main(["simulate", "build", profile, str(tree), *build]) == 0
        capsys.readouterr()
        return {str(d["id"]) for d in discover_json(capsys, "--host-root", str(tree))["devices"]}

    a, b = ids("--node-name", "node-a"), ids("--node-name", "node-b")
    plain = ids()
    assert len(a) == len(b) == len(plain) > 0
    assert not a & b, "two nodes of one profile must not share a device id"
    assert not (a | b) & plain
    assert ids("--node-name", "node-a") == a
    assert ids() == plain


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["discover", "--simulate", "mixed-gpu-npu", "--log-level", "error"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("node sim-mixed: 4 GPUs, 4 NPUs")
    assert "NVIDIA A100-PCIE-40GB" in out
    assert "huawei.com/Ascend910  4" in out


def test_sharing_flags_override_profile_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    inventory = discover_json(
        capsys, "--simulate", "dgx-a100-mig", "--set", "nvidia.mig_strategy=none"
    )
    assert resource_counts(inventory) == {"nvidia.com/gpu": 8}


def test_empty_host_root_has_no_devices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inventory = discover_json(capsys, "--host-root", str(tmp_path), "--node-name", "bare")
    assert inventory == {"node": "bare", "devices": [], "resources": [], "vendors": []}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edl_agent.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["discover", "--simulate", "dgx-h999"], {}, "unknown profile 'dgx-h999'"),
        (["discover", "--host-root", "/nonexistent/root"], {}, "not a directory"),
        (["discover", "--set", "nvidia.mig_strategy=all"], {}, "nvidia.mig_strategy: expected"),
        (["discover", "--set", "novalue"], {}, "expected KEY=VALUE"),
        (["discover"], {"EDL_LOG_LEVEL": "loud"}, "log_level: expected one of"),
        (["discover", "--config", "/nonexistent.yaml"], {}, "config file /nonexistent.yaml"),
        (["simulate", "build", "nope", "/tmp/x"], {}, "unknown profile 'nope'"),
        (
            ["run", "--host-root", "/", "--kubelet-dir", "/k" * 60],
            {},
            "too long for unix sockets: its socket paths would be 142 bytes, the limit is 107",
        ),
        (["restarter", "--storm-max-share", "0"], {}, "storm.max_share: expected a share > 0"),
        (
            ["restarter", "--renew-deadline-seconds", "20"],
            {},
            "leader election needs 0 < retry_period_seconds < renew_deadline_seconds",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2(args: list[str], env: dict[str, str], message: str) -> None:
    done = run_cli(*args, env=env)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert message in done.stderr
    assert done.stderr.count("\n") == 1


def test_simulate_build_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    done = run_cli("simulate", "build", "dgx-h100", str(tmp_path))
    assert done.returncode == 2
    assert "not an empty directory" in done.stderr
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_simulate_list_names_every_profile() -> None:
    done = run_cli("simulate", "list")
    assert done.returncode == 0
    assert [line.split()[0] for line in done.stdout.splitlines()] == profile_names()


def test_help_explains_every_command() -> None:
    for args in (["--help"], ["discover", "--help"], ["simulate", "build", "--help"]):
        done = run_cli(*args)
        assert done.returncode == 0
        assert "usage: edl-agent" in done.stdout
    assert "--simulate PROFILE" in run_cli("discover", "--help").stdout


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node: [oops\n", "profile bad: line 2"),
        ("description: x\n", "profile bad: node: required key is missing"),
        ("description: x\nnode: {hostname: h}\nnvidia: {driver_version: 1}\n", "driver_version"),
        ("description: x\nnode: {hostname: h}\ngpus: 3\n", "gpus: unknown key"),
        (
            "description: x\nnode: {hostname: h}\nnvidia: {driver_version: '1', "
            "cuda_driver_version: 1, gpus: [{name: g, memory_mib: 1, count: 0}]}\n",
            "nvidia.gpus[0].count: must be at least 1",
        ),
    ],
)
def test_malformed_profiles(text: str, message: str) -> None:
    with pytest.raises(ProfileError) as caught:
        parse_profile("bad", text)
    assert message in str(caught.value)


def test_garbled_vendor_tool_spoils_only_its_vendor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = tmp_path / "node"
    assert main(["simulate", "build", "mixed-gpu-npu", str(tree)]) == 0
    ascend_dcmi.remove(tree)  # the NPUs read through npu-smi alone
    recorded = tree / "usr/local/Ascend/driver/tools/npu-smi.info.txt"
    assert recorded.is_file()
    recorded.write_text("+----+\n| this is not a table\n")
    capsys.readouterr()
    inventory = discover_json(capsys, "--host-root", str(tree))
    errors = {v["vendor"]: v["error"] for v in inventory["vendors"]}
    assert errors["nvidia"] is None
    assert "npu-smi" in errors["ascend"]
    assert resource_counts(inventory)["nvidia.com/gpu"] == 4
