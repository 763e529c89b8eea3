"""Fault injection into simulated nodes: the fault-file lines, removed device nodes, and errors."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from edl_agent import cli
from edl_agent.devices import hygon, kunlunxin, nvidia
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Health, Vendor
from edl_agent.sim import ascend_tree, inject
from edl_agent.sim import inject_cli as inject_cli_module
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree


def simulate(profile: str, root: Path) -> Path:
    build_tree(load_profile(profile), root)
    return root


def fault_lines(root: Path) -> list[str]:
    return inject.fault_file(root).read_text().splitlines()


def test_fault_lines(tmp_path: Path) -> None:
    root = simulate("dgx-a100-mig", tmp_path)

    inject.inject_xid(root, 3, 79)
    inject.inject_xid(root, 0, 31, mig_index=1)
    inject.inject_ecc_dbe(root, 3)
    inject.inject_ecc_sbe(root, 3)
    inject.inject_lost(root, 3)
    inject.inject_recover(root, 3)
    inject.set_nvml_init_failure(root, on=True)
    inject.set_nvml_init_failure(root, on=False)
    inject.set_gpu_telemetry(root, 2, temperature_c=80, utilization_percent=5)
    inject.inject_xid(root, 1, 95)
    inject.reset_device(root, "nvidia", 1)
    inject.reboot(root)

    assert inject.fault_file(root) == root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1.faults"
    assert fault_lines(root) == [
        "xid gpu=3 code=79 action=2",  # the catalog's RESTART_BM: NODE_REBOOT
        "xid gpu=0 code=31 mig=1",  # RESTART_APP: no recovery action
        "ecc_dbe gpu=3",
        "ecc_sbe gpu=3",
        "lost gpu=3",
        "recover gpu=3",
        "init_fail on",
        "init_fail off",
        "telemetry gpu=2 temperature_c=80 utilization=5",
        "xid gpu=1 code=95 action=1",  # RESET_GPU
        "reset gpu=1",
        "reboot",
    ]


def test_lost_gpu_is_seen_by_a_later_process_state(tmp_path: Path) -> None:
    root = simulate("dgx-h100", tmp_path)

    inject.inject_lost(root, 2)
    report = nvidia.discover(HostRoot.at(root))
    assert report is not None
    assert report.error == "GPU 2: GPU is lost"

    inject.inject_recover(root, 2)
    report = nvidia.discover(HostRoot.at(root))
    assert report is not None
    assert report.error is None


def test_init_failure_breaks_discovery_until_off(tmp_path: Path) -> None:
    root = simulate("dgx-h100", tmp_path)

    inject.set_nvml_init_failure(root, on=True)
    report = nvidia.discover(HostRoot.at(root))
    assert report is not None
    assert report.error is not None
    assert "Driver Not Loaded" in report.error

    inject.set_nvml_init_failure(root, on=False)
    report = nvidia.discover(HostRoot.at(root))
    assert report is not None
    assert report.error is None


def test_rebuilding_a_tree_forgets_its_faults(tmp_path: Path) -> None:
    root = simulate("dgx-h100", tmp_path)
    inject.inject_lost(root, 1)

    simulate("dgx-h100", tmp_path)

    assert not inject.fault_file(root).exists()


def test_malformed_fault_lines_are_skipped(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    root = simulate("dgx-h100", tmp_path)
    with inject.fault_file(root).open("a") as faults:
        faults.write("explode gpu=1\nlost gpu=99\nlost\nxid gpu=1\n\n# a comment\nlost gpu=5\n")

    report = nvidia.discover(HostRoot.at(root))

    assert report is not None
    assert report.error == "GPU 5: GPU is lost"
    err = capfd.readouterr().err
    for why in ("unknown fault explode", "no GPU 99", "lost needs gpu=", "xid needs code="):
        assert why in err


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (lambda root: inject.inject_xid(root, 8, 79), r"no NVIDIA GPU 8 \(the node has GPUs 0-7\)"),
        (lambda root: inject.inject_lost(root, -1), r"no NVIDIA GPU -1"),
        (lambda root: inject.inject_xid(root, 0, 0), r"XID code must be between 1 and"),
        (lambda root: inject.inject_xid(root, 0, 2**32), r"XID code must be between 1 and"),
        (
            lambda root: inject.inject_xid(root, 0, 31, mig_index=0),
            r"GPU 0 has no MIG device 0 \(no MIG devices\)",
        ),
        (
            lambda root: inject.set_gpu_telemetry(root, 0, utilization_percent=101),
            r"utilization is a percentage",
        ),
        (lambda root: inject.set_gpu_telemetry(root, 0), r"no telemetry value given"),
        (lambda root: inject.remove_device_node(root, "amd", 0), r"unknown vendor 'amd'"),
        (
            lambda root: inject.remove_device_node(root, Vendor.ASCEND, 0),
            r"the simulated node has no ascend devices",
        ),
        (
            lambda root: inject.remove_device_node(root, Vendor.NVIDIA, 8),
            r"/dev/nvidia8 does not exist",
        ),
    ],
)
def test_errors_on_an_nvidia_node(
    tmp_path: Path, action: Callable[[Path], object], message: str
) -> None:
    root = simulate("dgx-h100", tmp_path)

    with pytest.raises(ValueError, match=message) as raised:
        action(root)

    assert "\n" not in str(raised.value)
    assert not inject.fault_file(root).exists()


def test_a_missing_tree(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=re.escape(f"no simulated node at {missing}")):
        inject.inject_xid(missing, 0, 79)
    with pytest.raises(ValueError, match="no simulated node at"):
        inject.remove_device_node(missing, "nvidia", 0)


def test_a_tree_without_nvidia(tmp_path: Path) -> None:
    root = simulate("kunlun-p800x8", tmp_path)

    with pytest.raises(ValueError, match="the simulated node has no NVIDIA GPUs"):
        inject.inject_ecc_dbe(root, 0)
    with pytest.raises(ValueError, match="the simulated node has no NVIDIA GPUs"):
        inject.set_nvml_init_failure(root, on=True)


def test_a_mig_index_beyond_the_gpus_mig_devices(tmp_path: Path) -> None:
    root = simulate("dgx-a100-mig", tmp_path)

    with pytest.raises(ValueError, match=r"GPU 0 has no MIG device 2 \(MIG devices 0-1\)"):
        inject.inject_xid(root, 0, 31, mig_index=2)


def test_remove_nvidia_node(tmp_path: Path) -> None:
    root = simulate("dgx-h100", tmp_path)

    assert inject.remove_device_node(root, "nvidia", 3) == ["/dev/nvidia3"]

    assert not (root / "dev/nvidia3").exists()
    assert (root / "dev/nvidiactl").exists()
    with pytest.raises(ValueError, match="already removed"):
        inject.remove_device_node(root, "nvidia", 3)


def test_remove_kunlunxin_node(tmp_path: Path) -> None:
    root = simulate("kunlun-p800x8", tmp_path)

    assert inject.remove_device_node(root, Vendor.KUNLUNXIN, 5) == ["/dev/xpu5"]

    report = kunlunxin.discover(HostRoot.at(root))
    assert report is not None
    assert (root / "dev/xpuctrl").exists()
    assert "/dev/xpu5" not in {n for d in report.devices for n in d.device_nodes}


def test_remove_ascend_node(tmp_path: Path) -> None:
    root = simulate("ascend-910bx8", tmp_path)

    assert inject.remove_device_node(root, "ascend", 0) == ["/dev/davinci0"]
    assert (root / "dev/davinci_manager").exists()


def test_remove_hygon_nodes(tmp_path: Path) -> None:
    root = simulate("hygon-k100x8", tmp_path)

    # card0 is the BMC's VGA adapter, so DCU 2 is card3 / renderD130.
    assert inject.remove_device_node(root, "hygon", 2) == ["/dev/dri/card3", "/dev/dri/renderD130"]

    report = hygon.discover(HostRoot.at(root))
    assert report is not None
    assert [d.index for d in report.devices if d.health is Health.UNHEALTHY] == [2]
    with pytest.raises(ValueError, match=r"no Hygon DCU 8 \(the node has DCUs 0-7\)"):
        inject.remove_device_node(root, "hygon", 8)


def test_remove_on_a_mixed_node(tmp_path: Path) -> None:
    root = simulate("mixed-gpu-npu", tmp_path)

    assert inject.remove_device_node(root, "nvidia", 0) == ["/dev/nvidia0"]
    assert inject.remove_device_node(root, "ascend", 0) == ["/dev/davinci0"]
    with pytest.raises(ValueError, match="no kunlunxin devices"):
        inject.remove_device_node(root, "kunlunxin", 0)


def test_the_cli_injects_a_reset_and_a_reboot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = simulate("mixed-gpu-npu", tmp_path)
    boot_id = (root / "proc/sys/kernel/random/boot_id").read_text()

    def inject_cli(*args: str) -> int:
        return cli.main(["simulate", "inject", str(root), *args])

    assert inject_cli("--device", "1", "--reset") == 2
    assert "--vendor" in capsys.readouterr().err  # two vendors: say which
    assert inject_cli("--device", "1", "--reset", "--vendor", "nvidia") == 0
    assert fault_lines(root)[-1] == "reset gpu=1"
    ascend_tree.set_npu_health(root, 2, "Critical", fault_codes=(0x8C03A000,))
    assert inject_cli("--device", "2", "--reset", "--vendor", "ascend") == 0
    health = root / ascend_tree.HEALTH_OUTPUT.format(npu=2).lstrip("/")
    assert "Health Status                  : OK" in health.read_text()
    assert inject_cli("--reboot") == 0
    assert fault_lines(root)[-1] == "reboot"
    assert (root / "proc/sys/kernel/random/boot_id").read_text() != boot_id
    assert "new boot id" in capsys.readouterr().out
    assert inject_cli("--reset") == 2
    assert "--device N is required" in capsys.readouterr().err


def test_the_cli_names_a_gpu_by_its_uuid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As kubelet and a pod's allocatedResourcesStatus name it."""
    root = simulate("dgx-h100", tmp_path)
    [gpu5] = [g.id for g in nvidia.discover(HostRoot.at(root)).devices if g.index == 5]
    assert cli.main(["simulate", "inject", str(root), "--device", gpu5, "--xid", "79"]) == 0
    assert fault_lines(root)[-1].startswith("xid gpu=5 code=79")
    assert cli.main(["simulate", "inject", str(root), "--device", "GPU-nope", "--xid", "79"]) == 2
    assert "no NVIDIA GPU has the uuid 'GPU-nope'" in capsys.readouterr().err
    assert cli.main(["simulate", "inject", str(root), "--device", "gpu5", "--xid", "79"]) == 2
    assert "neither a device index nor a GPU uuid" in capsys.readouterr().err


def test_the_simulated_npu_smi_resets_a_chip(tmp_path: Path) -> None:
    root = simulate("ascend-910bx8", tmp_path)
    ascend_tree.set_npu_health(root, 3, "Critical", fault_codes=(0x8C03A000,))
    tool = root / ascend_tree.TOOL.lstrip("/")
    done = subprocess.run(
        [str(tool), "set", "-t", "reset", "-i", "3", "-c", "0"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert "OK" in done.stdout
    info = subprocess.run([str(tool), "info"], check=True, capture_output=True, text=True).stdout
    row = next(line for line in info.splitlines() if line.startswith("| 3 "))
    assert "OK" in row
    assert "Critical" not in info


@pytest.mark.parametrize(
    ("present", "polled", "says"),
    [
        ([Vendor.NVIDIA], True, "/t has nvidia GPUs only; --health is for ascend, hygon and"),
        ([], True, "/t: no simulated devices found"),
        ([], False, "/t: no simulated devices found"),
        ([Vendor.NVIDIA, Vendor.ASCEND], False, "/t has devices of nvidia, ascend: say which"),
        ([Vendor.ASCEND, Vendor.HYGON], True, "/t has devices of ascend, hygon: say which"),
    ],
)
def test_a_fault_without_vendor_names_what_the_tree_has(
    present: list[Vendor], polled: bool, says: str
) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(says)):
        inject_cli_module.pick_vendor(Path("/t"), present, polled=polled)


@pytest.mark.parametrize(
    ("present", "polled", "vendor"),
    [
        ([Vendor.NVIDIA, Vendor.ASCEND], True, Vendor.ASCEND),
        ([Vendor.NVIDIA], False, Vendor.NVIDIA),
    ],
)
def test_the_one_vendor_a_fault_can_be_for_is_chosen(
    present: list[Vendor], polled: bool, vendor: Vendor
) -> None:
    assert inject_cli_module.pick_vendor(Path("/t"), present, polled=polled) is vendor


def test_health_on_a_gpu_only_tree_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = simulate("dgx-h100", tmp_path)
    assert cli.main(["simulate", "inject", str(root), "--device", "0", "--health", "Critical"]) == 2
    err = capsys.readouterr().err
    assert "has nvidia GPUs only; --health is for ascend, hygon and kunlunxin devices" in err
