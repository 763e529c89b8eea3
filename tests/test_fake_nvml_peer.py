"""The fake libnvidia-ml.so.1's MIG instance API (GPU and compute instances, profiles, device
attributes): what NVIDIA's k8s-device-plugin reads, through go-nvlib, to name MIG resources under
the mixed strategy (bench/nvidia_peer.py runs that plugin against the fake). Checked here through
the real pynvml bindings."""

from __future__ import annotations

from pathlib import Path

import pynvml
import pytest

from edl_agent.devices import nvidia
from edl_agent.devices.hostroot import HostRoot
from edl_agent.sim import inject, nvidia_tree
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree

# nvml.h profile ids by slice count (GPU and compute instance profiles alike)
PROFILE_OF_SLICES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}
NOT_SUPPORTED_PROFILES = (5, 6, 7, 8, 16)  # 8 and 6 slices, and the REV/GFX/ME variants


def simulate(profile: str, tmp_path: Path) -> HostRoot:
    build_tree(load_profile(profile), tmp_path)
    return HostRoot.at(tmp_path)


@pytest.fixture
def a100_mig(tmp_path: Path) -> HostRoot:
    return simulate("dgx-a100-mig", tmp_path)


def gpu_profile(handle: object, profile: int) -> pynvml.c_nvmlGpuInstanceProfileInfo_t:
    return pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile, version=1)


def test_gpu_instance_profiles(a100_mig: HostRoot) -> None:
    with nvidia.nvml_session(str(a100_mig.path(nvidia_tree.LIBRARY))):
        gpu = pynvml.nvmlDeviceGetHandleByIndex(0)  # two 3g.40gb instances
        for slices, profile in PROFILE_OF_SLICES.items():
            info = gpu_profile(gpu, profile)
            assert (info.id, info.sliceCount) == (profile, slices)
            assert info.instanceCount >= 1
            assert info.multiprocessorCount == 14 * slices
        assert gpu_profile(gpu, 2).memorySizeMB == 40192  # an existing 3g.40gb tells its size
        assert gpu_profile(gpu, 0).memorySizeMB == 81920 // 8
        assert gpu_profile(gpu, 4).memorySizeMB == 81920
        for profile in NOT_SUPPORTED_PROFILES:
            with pytest.raises(pynvml.NVMLError_NotSupported):
                gpu_profile(gpu, profile)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            gpu_profile(gpu, 17)


def test_gpu_profiles_need_a_mig_capable_gpu(tmp_path: Path) -> None:
    root = simulate("cgpu-v100", tmp_path)  # V100s: no MIG
    with nvidia.nvml_session(str(root.path(nvidia_tree.LIBRARY))):
        gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            gpu_profile(gpu, 0)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetGpuInstanceById(gpu, 1)


def test_gpu_and_compute_instances_of_mig_devices(a100_mig: HostRoot) -> None:
    with nvidia.nvml_session(str(a100_mig.path(nvidia_tree.LIBRARY))):
        gpu = pynvml.nvmlDeviceGetHandleByIndex(4)  # 4g.40gb, 2g.20gb, 1g.10gb
        starts = []
        for index, (slices, memory) in enumerate([(4, 40192), (2, 19968), (1, 9728)]):
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, index)
            gi_id = pynvml.nvmlDeviceGetGpuInstanceId(mig)
            ci_id = pynvml.nvmlDeviceGetComputeInstanceId(mig)
            instance = pynvml.nvmlDeviceGetGpuInstanceById(gpu, gi_id)
            info = pynvml.nvmlGpuInstanceGetInfo(instance)
            assert pynvml.nvmlDeviceGetUUID(info.device) == pynvml.nvmlDeviceGetUUID(gpu)
            assert (info.id, info.profileId) == (gi_id, PROFILE_OF_SLICES[slices])
            assert info.placement.size == slices
            starts.append(info.placement.start)

            compute = pynvml.nvmlGpuInstanceGetComputeInstanceById(instance, ci_id)
            ci_info = pynvml.nvmlComputeInstanceGetInfo(compute)
            assert (ci_info.id, ci_info.profileId) == (ci_id, PROFILE_OF_SLICES[slices])
            assert pynvml.nvmlGpuInstanceGetInfo(ci_info.gpuInstance).id == gi_id
            with pytest.raises(pynvml.NVMLError_NotFound):
                pynvml.nvmlGpuInstanceGetComputeInstanceById(instance, ci_id + 1)

            ci_profile = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                instance, PROFILE_OF_SLICES[slices], 0, version=1
            )
            assert (ci_profile.sliceCount, ci_profile.instanceCount) == (slices, 1)
            if slices < 4:
                with pytest.raises(pynvml.NVMLError_NotSupported):
                    pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                        instance, PROFILE_OF_SLICES[4], 0, version=1
                    )

            attributes = pynvml.nvmlDeviceGetAttributes(mig)
            assert attributes.gpuInstanceSliceCount == slices
            assert attributes.computeInstanceSliceCount == slices
            assert attributes.memorySizeMB == memory
        assert starts == [0, 4, 6]  # packed in index order
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlDeviceGetGpuInstanceById(gpu, 99)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetAttributes(gpu)  # as in NVML: MIG device handles only


def test_instances_of_a_lost_gpu_fail(a100_mig: HostRoot, tmp_path: Path) -> None:
    with nvidia.nvml_session(str(a100_mig.path(nvidia_tree.LIBRARY))):
        gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
        instance = pynvml.nvmlDeviceGetGpuInstanceById(gpu, 1)
        inject.inject_lost(tmp_path, 0)
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlGpuInstanceGetInfo(instance)
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            gpu_profile(gpu, 0)
        inject.inject_recover(tmp_path, 0)
        assert pynvml.nvmlGpuInstanceGetInfo(instance).id == 1
