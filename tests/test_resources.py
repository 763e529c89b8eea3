"""What a node advertises: pure resource computation from devices and settings."""

from __future__ import annotations

from collections import Counter

import pytest

from edl_agent.config import load_settings
from edl_agent.devices.model import Device, UnitKind, Vendor
from edl_agent.devices.resources import advertised_resources, ascend_family, product_model


def gpu(i: int, product: str = "Tesla V100-SXM2-32GB", memory: int = 32768) -> Device:
    return Device(Vendor.NVIDIA, "gpu", i, f"GPU-{i}", product, memory)


def mig(parent: int, i: int, profile: str) -> Device:
    return Device(
        Vendor.NVIDIA,
        "mig",
        i,
        f"MIG-{parent}-{i}",
        f"NVIDIA A100-SXM4-80GB MIG {profile}",
        9728,
        parent=f"GPU-{parent}",
        attributes={"mig_profile": profile},
    )


MIG_NODE = [gpu(0), mig(0, 0, "3g.40gb"), mig(0, 1, "1g.10gb"), mig(0, 2, "1g.10gb"), gpu(1)]


def counts(devices: list[Device], **settings: object) -> dict[str, int]:
    resources = advertised_resources(devices, load_settings(overrides=settings))
    return {r.name: len(r.units) for r in resources}


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("none", {"nvidia.com/gpu": 2}),
        ("single", {"nvidia.com/gpu": 4}),
        ("mixed", {"nvidia.com/gpu": 1, "nvidia.com/mig-3g.40gb": 1, "nvidia.com/mig-1g.10gb": 2}),
    ],
)
def test_mig_strategies(strategy: str, expected: dict[str, int]) -> None:
    assert counts(MIG_NODE, nvidia={"mig_strategy": strategy}) == expected


def test_vendor_resource_names() -> None:
    devices = [
        Device(Vendor.KUNLUNXIN, "xpu", 0, "xpu-0", "P800", 98304),
        Device(Vendor.HYGON, "dcu", 0, "dcu-0", "K100_AI", 65536),
        Device(Vendor.ASCEND, "npu", 0, "npu-0", "Ascend910B3", 65536),
        Device(Vendor.ASCEND, "npu", 1, "npu-1", "Ascend310P3", 24576),
    ]
    assert counts(devices) == {
        "kunlunxin.com/xpu": 1,
        "hygon.com/dcunum": 1,
        "huawei.com/Ascend910": 1,
        "huawei.com/Ascend310P": 1,
    }
    assert counts(devices, kunlunxin={"resource_name": "baidu.com/xpu"})["baidu.com/xpu"] == 1


CGPU_RULE = {
    "resource": "nvidia.com/gpu",
    "replicas": 4,
    "replica_resource": "baidu.com/{model}_{memory}_cgpu",
    "memory_unit_mib": 1024,
    "memory_resource": "baidu.com/{model}_{memory}_cgpu_memory",
    "core_unit_percent": 5,
    "core_resource": "baidu.com/{model}_{memory}_cgpu_core",
}


def test_cgpu_style_sharing() -> None:
    devices = [gpu(i) for i in range(8)]
    resources = advertised_resources(devices, load_settings(overrides={"sharing": [CGPU_RULE]}))
    by_name = {r.name: r for r in resources}
    assert set(by_name) == {
        "baidu.com/v100_32g_cgpu",
        "baidu.com/v100_32g_cgpu_memory",
        "baidu.com/v100_32g_cgpu_core",
    }
    memory = by_name["baidu.com/v100_32g_cgpu_memory"]
    assert len(memory.units) == 8 * 32
    assert {u.kind for u in memory.units} == {UnitKind.MEMORY}
    assert Counter(u.device_id for u in memory.units) == {f"GPU-{i}": 32 for i in range(8)}
    assert len(by_name["baidu.com/v100_32g_cgpu_core"].units) == 8 * 20
    replicas = by_name["baidu.com/v100_32g_cgpu"].device_ids
    assert replicas[:4] == ("GPU-0::0", "GPU-0::1", "GPU-0::2", "GPU-0::3")
    assert len({u for r in resources for u in r.device_ids}) == 32 + 256 + 160


def test_sharing_keeps_whole_devices_when_asked_and_splits_models() -> None:
    devices = [gpu(0), gpu(1, "NVIDIA A100-SXM4-80GB", 81920)]
    rule = {
        "resource": "nvidia.com/gpu",
        "keep_whole": True,
        "memory_unit_mib": 10240,
        "memory_resource": "example.com/{model}-mem",
    }
    assert counts(devices, sharing=[rule]) == {
        "nvidia.com/gpu": 2,
        "example.com/v100-mem": 3,
        "example.com/a100-mem": 8,
    }


def test_time_slicing_default_name_replaces_whole_devices() -> None:
    rule = {"resource": "nvidia.com/gpu", "replicas": 3}
    assert counts([gpu(0), gpu(1)], sharing=[rule]) == {"nvidia.com/gpu": 6}


def test_vnpu_templates() -> None:
    npu = Device(Vendor.ASCEND, "npu", 0, "npu-0", "Ascend910B3", 65536)
    template = {
        "resource": "huawei.com/Ascend910-5c",
        "per_device": 4,
        "aicore": 5,
        "memory_mib": 16384,
    }
    resources = advertised_resources(
        [npu], load_settings(overrides={"ascend": {"vnpu_templates": [template]}})
    )
    template_units = {r.name: r for r in resources}["huawei.com/Ascend910-5c"].units
    assert [u.id for u in template_units][:2] == ["npu-0::Ascend910-5c-0", "npu-0::Ascend910-5c-1"]
    assert {u.device_id for u in template_units} == {"npu-0"}


@pytest.mark.parametrize(
    ("product", "model"),
    [
        ("Tesla V100-SXM2-32GB", "v100"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("P800", "p800"),
        ("", "unknown"),
        ("NVIDIA ", "nvidia"),
    ],
)
def test_product_model(product: str, model: str) -> None:
    assert product_model(product) == model


@pytest.mark.parametrize(
    ("product", "family"),
    [
        ("Ascend910B3", "Ascend910"),
        ("910B", "Ascend910"),
        ("Ascend310P3", "Ascend310P"),
        ("Ascend310", "Ascend310"),
        ("", None),
        ("unknown", None),
    ],
)
def test_ascend_family(product: str, family: str | None) -> None:
    assert ascend_family(product) == family


def test_unknown_ascend_chip_is_not_advertised() -> None:
    npu = Device(Vendor.ASCEND, "npu", 0, "npu-0", "unknown", 0)
    assert counts([npu]) == {}


def npu(i: int) -> Device:
    return Device(Vendor.ASCEND, "npu", i, f"NPU-{i}", "Ascend910B3", 65536)


@pytest.mark.parametrize(
    ("serve", "expected"),
    [
        ("device-plugin", {"nvidia.com/gpu": 2, "huawei.com/Ascend910": 1}),
        ("both", {"nvidia.com/gpu": 2, "huawei.com/Ascend910": 1}),
        ("dra", {"huawei.com/Ascend910": 1}),
    ],
)
def test_a_vendor_served_only_through_dra_advertises_nothing_to_the_device_plugin(
    serve: str, expected: dict[str, int]
) -> None:
    assert counts([gpu(0), gpu(1), npu(0)], nvidia={"serve": serve}) == expected
