"""NVIDIA discovery against simulated nodes: the real pynvml bindings over the fake NVML library."""

from __future__ import annotations

import os
import stat
from collections import Counter
from pathlib import Path

import pynvml
import pytest

from edl_agent.devices import nvidia
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, LinkKind, Vendor, VendorReport
from edl_agent.sim import fake_lib_build, nvidia_tree
from edl_agent.sim.files import write_file
from edl_agent.sim.profile import load_profile, stable_uuid
from edl_agent.sim.tree import build_tree

LIBRARY = nvidia_tree.LIBRARY


def simulate(name: str, root: Path) -> HostRoot:
    build_tree(load_profile(name), root)
    return HostRoot.at(root)


def discover(root: HostRoot) -> VendorReport:
    report = nvidia.discover(root)
    assert report is not None
    return report


def gpus(report: VendorReport) -> list[Device]:
    return [d for d in report.devices if d.kind == "gpu"]


def migs(report: VendorReport) -> list[Device]:
    return [d for d in report.devices if d.kind == "mig"]


def test_dgx_h100(tmp_path: Path) -> None:
    report = discover(simulate("dgx-h100", tmp_path))

    assert report.error is None
    assert report.vendor is Vendor.NVIDIA
    assert report.driver == {
        "driver_version": "550.90.07",
        "cuda_driver_version": "12.4",
        "nvml_version": "12.550.90.07",
    }
    found = gpus(report)
    assert [g.index for g in found] == list(range(8))
    assert [g.id for g in found] == ["GPU-" + stable_uuid("dgx-h100", "gpu", i) for i in range(8)]
    assert len({g.id for g in found}) == 8
    assert {g.product for g in found} == {"NVIDIA H100 80GB HBM3"}
    assert {g.memory_mib for g in found} == {81559}
    assert Counter(g.numa_node for g in found) == {0: 4, 1: 4}
    assert [g.numa_node for g in found[:4]] == [0, 0, 0, 0]
    assert found[0].pci_bus_id == "0000:18:00.0"
    assert found[1].pci_bus_id == "0000:20:00.0"
    assert found[3].device_nodes == ("/dev/nvidia3",)
    assert migs(report) == []
    attributes = found[0].attributes
    assert attributes["compute_capability"] == "9.0"
    assert attributes["architecture"] == "hopper"
    assert attributes["minor"] == "0"
    assert attributes["mig_mode"] == "disabled"
    assert len(attributes["serial"]) == 13


def test_dgx_h100_nvlink_connects_every_pair(tmp_path: Path) -> None:
    found = gpus(discover(simulate("dgx-h100", tmp_path)))

    for gpu in found:
        peers = {link.peer for link in gpu.links}
        assert peers == {g.id for g in found} - {gpu.id}
        assert {(link.kind, link.count) for link in gpu.links} == {(LinkKind.NVLINK, 2)}
    assert [link.peer for link in found[0].links] == [g.id for g in found[1:]]


def test_dgx_a100_mig(tmp_path: Path) -> None:
    report = discover(simulate("dgx-a100-mig", tmp_path))

    assert report.error is None
    assert report.driver["cuda_driver_version"] == "12.2"
    found = gpus(report)
    assert [g.attributes["mig_mode"] for g in found] == ["enabled"] * 6 + ["disabled"] * 2
    assert Counter(m.attributes["mig_profile"] for m in migs(report)) == {
        "3g.40gb": 4,
        "1g.10gb": 16,
        "4g.40gb": 2,
        "2g.20gb": 2,
    }
    by_parent = Counter(m.parent for m in migs(report))
    assert [by_parent[g.id] for g in found] == [2, 2, 7, 7, 3, 3, 0, 0]

    first = migs(report)[0]
    parent = found[0]
    assert first.parent == parent.id
    assert first.id.startswith("MIG-")
    assert first.product == "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    assert first.memory_mib == 40192
    assert first.index == 0
    assert (first.numa_node, first.pci_bus_id) == (parent.numa_node, parent.pci_bus_id)
    assert first.device_nodes == parent.device_nodes
    assert first.attributes["compute_instance_id"] == "0"
    on_gpu_4 = [m for m in migs(report) if m.parent == found[4].id]
    assert [(m.index, m.attributes["mig_profile"]) for m in on_gpu_4] == [
        (0, "4g.40gb"),
        (1, "2g.20gb"),
        (2, "1g.10gb"),
    ]
    assert len({m.attributes["gpu_instance_id"] for m in on_gpu_4}) == 3
    assert len({m.id for m in migs(report)}) == len(migs(report)) == 24


def test_cgpu_v100(tmp_path: Path) -> None:
    report = discover(simulate("cgpu-v100", tmp_path))

    assert report.error is None
    assert report.driver["driver_version"] == "470.239.06"
    assert report.driver["cuda_driver_version"] == "11.4"
    found = gpus(report)
    assert len(found) == 8
    assert {g.attributes["mig_mode"] for g in found} == {"unsupported"}
    assert {g.attributes["architecture"] for g in found} == {"volta"}
    assert {g.attributes["compute_capability"] for g in found} == {"7.0"}
    # nvlink: pairs -> (0,1), (2,3), ...
    assert [[link.peer for link in g.links] for g in found[:4]] == [
        [found[1].id],
        [found[0].id],
        [found[3].id],
        [found[2].id],
    ]


def test_trees_discovered_one_after_another(tmp_path: Path) -> None:
    h100 = simulate("dgx-h100", tmp_path / "h100")
    v100 = simulate("cgpu-v100", tmp_path / "v100")
    a100 = simulate("dgx-a100-mig", tmp_path / "a100")

    for _ in range(2):
        assert {g.product for g in gpus(discover(h100))} == {"NVIDIA H100 80GB HBM3"}
        assert {g.product for g in gpus(discover(v100))} == {"Tesla V100-SXM2-32GB"}
        assert len(migs(discover(a100))) == 24
    assert pynvml.nvmlLib is None  # the session handed the bindings back


def test_rebuilt_tree_is_reread(tmp_path: Path) -> None:
    root = simulate("dgx-h100", tmp_path)
    assert len(gpus(discover(root))) == 8

    build_tree(load_profile("cgpu-v100"), tmp_path)

    assert {g.product for g in gpus(discover(root))} == {"Tesla V100-SXM2-32GB"}


def test_corrupted_data_file_is_an_error(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    root = simulate("dgx-h100", tmp_path)
    data = root.path(nvidia_tree.DATA)
    data.write_text(data.read_text().replace("memory_mib=81559", "memory_mib=lots", 1))

    report = discover(root)

    assert report.devices == ()
    assert report.error is not None
    assert "NVML initialisation failed" in report.error
    assert "\n" not in report.error
    assert "bad number for memory_mib" in capfd.readouterr().err


def test_one_lost_gpu_does_not_hide_the_others(tmp_path: Path) -> None:
    root = simulate("dgx-h100", tmp_path)
    data = root.path(nvidia_tree.DATA)
    lines = data.read_text().splitlines()
    lines = [f"{line}\tlost=1" if line.startswith("gpu\tindex=3\t") else line for line in lines]
    data.write_text("\n".join(lines) + "\n")

    report = discover(root)

    assert report.error == "GPU 3: GPU is lost"
    found = gpus(report)
    assert [g.index for g in found] == [0, 1, 2, 4, 5, 6, 7]
    assert len(found[0].links) == 6  # the lost GPU is no longer a peer


def test_missing_data_file_reads_as_driver_not_loaded(tmp_path: Path) -> None:
    root = simulate("dgx-h100", tmp_path)
    root.path(nvidia_tree.DATA).unlink()

    report = discover(root)

    assert report.devices == ()
    assert report.error is not None
    assert "Driver Not Loaded" in report.error


def test_device_nodes_without_library_is_an_error(tmp_path: Path) -> None:
    write_file(tmp_path, "/dev/nvidia0")

    report = discover(HostRoot.at(tmp_path))

    assert report.devices == ()
    assert report.error == (
        f"/dev/nvidia0 exists but libnvidia-ml.so.1 was not found under {tmp_path}"
    )


def test_unloadable_library_is_an_error(tmp_path: Path) -> None:
    write_file(tmp_path, LIBRARY, "not an ELF file\n")

    report = discover(HostRoot.at(tmp_path))

    assert report.error is not None
    assert report.error.startswith("cannot load ")


def test_absent_vendor(tmp_path: Path) -> None:
    write_file(tmp_path, "/dev/nvidiactl")  # control nodes alone are not GPUs

    assert nvidia.discover(HostRoot.at(tmp_path)) is None


def test_fake_library_through_pynvml(tmp_path: Path) -> None:
    root = simulate("dgx-a100-mig", tmp_path)
    with nvidia.nvml_session(str(root.path(LIBRARY))):
        first = pynvml.nvmlDeviceGetHandleByIndex(0)
        last = pynvml.nvmlDeviceGetHandleByIndex(7)
        uuid = pynvml.nvmlDeviceGetUUID(first)
        assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByUUID(uuid)) == uuid
        by_pci = pynvml.nvmlDeviceGetHandleByPciBusId("0000:18:00.0")
        assert pynvml.nvmlDeviceGetIndex(by_pci) == 0
        pci = pynvml.nvmlDeviceGetPciInfo(first)
        assert (pci.busId, pci.busIdLegacy, pci.bus) == ("00000000:18:00.0", "0000:18:00.0", 0x18)

        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(first, 1)
        assert pynvml.nvmlDeviceIsMigDeviceHandle(mig)
        assert not pynvml.nvmlDeviceIsMigDeviceHandle(first)
        parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
        assert pynvml.nvmlDeviceGetUUID(parent) == uuid
        mig_uuid = pynvml.nvmlDeviceGetUUID(mig)
        assert pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByUUID(mig_uuid)).endswith(
            "MIG 3g.40gb"
        )
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(first, 2)
        assert pynvml.nvmlDeviceGetMigMode(last) == [0, 0]

        memory = pynvml.nvmlDeviceGetMemoryInfo(first, version=pynvml.nvmlMemory_v2)
        assert memory.total == 81920 * 2**20
        assert memory.free + memory.reserved + memory.used == memory.total
        assert pynvml.nvmlDeviceGetTopologyCommonAncestor(first, first) == 0
        assert (
            pynvml.nvmlDeviceGetTopologyCommonAncestor(first, pynvml.nvmlDeviceGetHandleByIndex(1))
            == pynvml.NVML_TOPOLOGY_NODE
        )
        assert pynvml.nvmlDeviceGetTopologyCommonAncestor(first, last) == (
            pynvml.NVML_TOPOLOGY_SYSTEM
        )
        assert 20 <= pynvml.nvmlDeviceGetTemperature(first, pynvml.NVML_TEMPERATURE_GPU) <= 90
        assert pynvml.nvmlDeviceGetEnforcedPowerLimit(first) == 400_000
        assert 0 < pynvml.nvmlDeviceGetPowerUsage(first) < 400_000
        assert pynvml.nvmlDeviceGetUtilizationRates(first).gpu == 0
        assert pynvml.nvmlDeviceGetBrand(first) == pynvml.NVML_BRAND_NVIDIA
        assert pynvml.nvmlSystemGetCudaDriverVersion_v2() == 12020

        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetHandleByIndex(8)
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetPciInfo(mig)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_tree_layout(tmp_path: Path) -> None:
    root = simulate("dgx-h100", tmp_path)

    library = root.path(LIBRARY)
    assert library.stat().st_mode & stat.S_IXUSR
    assert root.path(f"{LIBRARY}.sim").read_text().startswith("# fake NVML data")
    for node in ("/dev/nvidia7", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"):
        assert root.exists(node)
    assert root.read_text("/sys/bus/pci/devices/0000:50:00.0/numa_node") == "1\n"
    assert root.read_text("/sys/bus/pci/devices/0000:18:00.0/vendor") == "0x10de\n"
    assert "550.90.07" in root.read_text("/proc/driver/nvidia/version")


def test_build_is_cached(tmp_path: Path) -> None:
    environ = {**os.environ, "EDL_CACHE_DIR": str(tmp_path)}
    first = fake_lib_build.library_path(environ=environ)
    built_at = first.stat().st_mtime_ns

    again = fake_lib_build.library_path(environ=environ)

    assert again == first
    assert again.stat().st_mtime_ns == built_at
    assert first.is_relative_to(tmp_path / "fake-nvml")
    assert [p.name for p in first.parent.iterdir()] == ["libnvidia-ml.so.1"]


def test_cache_dir_defaults() -> None:
    assert fake_lib_build.cache_dir({"EDL_CACHE_DIR": "/c"}) == Path("/c")
    assert fake_lib_build.cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/edl-agent")
    assert fake_lib_build.cache_dir({}) == Path.home() / ".cache" / "edl-agent"


def test_missing_compiler_is_a_clear_error(tmp_path: Path) -> None:
    environ = {"EDL_CACHE_DIR": str(tmp_path), "CC": "no-such-cc", "PATH": str(tmp_path)}

    with pytest.raises(
        fake_lib_build.FakeLibraryBuildError, match="'no-such-cc' not found on PATH"
    ):
        fake_lib_build.library_path(environ=environ)


def test_failed_compile_is_a_clear_error(tmp_path: Path) -> None:
    compiler = write_file(
        tmp_path,
        "/bin/cc",
        '#!/bin/sh\n[ "$1" = --version ] && { echo "broken cc 1.0"; exit 0; }\n'
        'echo "fake_nvml.c:1:1: error: simulated failure" >&2\nexit 1\n',
        mode=0o755,
    )
    environ = {"EDL_CACHE_DIR": str(tmp_path / "cache"), "CC": str(compiler)}

    with pytest.raises(fake_lib_build.FakeLibraryBuildError) as failure:
        fake_lib_build.library_path(environ=environ)

    assert str(failure.value) == (
        "building the simulated libnvidia-ml.so.1 failed: cc exited 1: "
        "fake_nvml.c:1:1: error: simulated failure"
    )
    leftovers = [p for p in (tmp_path / "cache").rglob("*") if not p.is_dir()]
    assert leftovers == []  # no half-built library, no build directory


def test_mig_profile_from_name() -> None:
    assert nvidia.mig_profile("NVIDIA A100-SXM4-80GB MIG 3g.40gb") == "3g.40gb"
    assert nvidia.mig_profile("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me") == "1g.10gb+me"
    assert nvidia.mig_profile("NVIDIA A100-SXM4-80GB") is None


def test_bus_id_forms() -> None:
    assert nvidia.sysfs_bus_id("00000000:1B:00.0") == "0000:1b:00.0"
    assert nvidia_tree.nvml_bus_id("0000:1b:00.0") == "00000000:1B:00.0"
