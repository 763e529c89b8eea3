"""Node labels, the AcceleratorHealthy condition, events, owned keys and the cordon: pure tests,
plus the log-only updater and client building (no cluster)."""

from __future__ import annotations

import dataclasses
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from edl_agent.config import NodeSettings, Settings, load_settings
from edl_agent.devices import nvidia as nvidia_discovery
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, Health, Inventory, Vendor, VendorReport
from edl_agent.health.model import Level
from edl_agent.health.tracker import Condition
from edl_agent.kube import KubeConfigError, api_client
from edl_agent.labels.compute import gpu_family, gpu_mode, label_value, node_labels
from edl_agent.labels.condition import (
    MAX_MESSAGE,
    AcceleratorHealth,
    Unsaved,
    accelerator_health,
    condition_reason,
    node_condition,
)
from edl_agent.labels.cordon import cordoned_devices, parse_cordoned
from edl_agent.labels.events import (
    NORMAL,
    WARNING,
    Action,
    EventGate,
    EventSpec,
    health_events,
)
from edl_agent.labels.features import write_features_file
from edl_agent.labels.node import NodeUpdater
from edl_agent.labels.ownership import OUR_PREFIXES, OWNED_LABELS, label_patch
from edl_agent.rate_limit import TokenBucket
from edl_agent.sim.nvidia_tree import PCI_CLASS_3D, PCI_CLASS_VGA
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree

VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
KEY = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
NOW = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
NVIDIA_DRIVER = {"driver_version": "550.90.07", "cuda_driver_version": "12.4"}


def gpu(i: int, product: str = "NVIDIA H100 80GB HBM3", **attributes: str) -> Device:
    attrs = {"compute_capability": "9.0", "mig_mode": "disabled", "pci_class": "0x030200",
             "vgpu": "false", **attributes}  # fmt: skip
    return Device(Vendor.NVIDIA, "gpu", i, f"GPU-{i}", product, 81559, attributes=attrs)


def mig(i: int, parent: int, profile: str, memory: int = 9728) -> Device:
    name = f"NVIDIA A100-SXM4-80GB MIG {profile}"
    return Device(
        Vendor.NVIDIA, "mig", i, f"MIG-{parent}-{i}", name, memory, parent=f"GPU-{parent}",
        attributes={"mig_profile": profile},
    )  # fmt: skip


def npu(i: int) -> Device:
    return Device(Vendor.ASCEND, "npu", i, f"ascend-npu{i}", "Ascend910B3", 65536)


def inventory(*reports: VendorReport) -> Inventory:
    return Inventory("node-a", reports, ())


def nvidia(*devices: Device) -> VendorReport:
    return VendorReport(Vendor.NVIDIA, devices, NVIDIA_DRIVER)


def ascend(*devices: Device) -> VendorReport:
    return VendorReport(Vendor.ASCEND, devices, {"driver_version": "24.1.rc2"})


def labels_of(inv: Inventory, settings: Settings | None = None, **kw: object) -> dict[str, str]:
    unhealthy: dict[str, Condition] = kw.pop("unhealthy", {})  # type: ignore[assignment]
    return node_labels(
        inventory=inv,
        unhealthy=unhealthy,
        settings=settings or Settings(),
        machine="DGX H100",
        **kw,  # type: ignore[arg-type]
    )


def fault(reason: str = "XID79", level: Level = Level.NODE_FATAL, since: float = 1.0) -> Condition:
    return Condition(reason=reason, level=level, since=since, last_seen=since, detail="off the bus")


# --- label values ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3"),
        ("Tesla V100/32GB (PCIe)", "Tesla-V100-32GB-PCIe"),
        ("  Ascend   910B3  ", "Ascend-910B3"),
        ("Äpfel™ GPU", "ApfelTM-GPU"),
        ("昇腾910B", "910B"),
        ("昇腾", "unknown"),
        ("", "unknown"),
        ("-_.x._-", "x"),
        ("a" * 62 + "-b", "a" * 62),
    ],
)
def test_label_values_are_sanitised(text: str, value: str) -> None:
    assert label_value(text) == value


@given(st.text())
def test_any_text_becomes_a_valid_label_value(text: str) -> None:
    value = label_value(text)
    assert VALUE.match(value)
    assert 0 < len(value) <= 63


# --- labels -----------------------------------------------------------------------------------


def test_dgx_h100_labels() -> None:
    labels = labels_of(inventory(nvidia(*(gpu(i) for i in range(8)))))

    assert labels == {
        "edl.io/accelerator.vendors": "nvidia",
        "edl.io/accelerator.count": "8",
        "edl.io/accelerator.healthy": "8",
        "edl.io/accelerator.degraded": "0",
        "edl.io/nvidia.degraded": "0",
        "edl.io/nvidia.product": "NVIDIA-H100-80GB-HBM3",
        "edl.io/nvidia.count": "8",
        "edl.io/nvidia.healthy": "8",
        "edl.io/nvidia.memory-mib": "81559",
        "edl.io/nvidia.driver": "550.90.07",
        "edl.io/nvidia.sharing": "none",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.count": "8",
        "nvidia.com/gpu.memory": "81559",
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/gpu.family": "hopper",
        "nvidia.com/gpu.compute.major": "9",
        "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/gpu.machine": "DGX-H100",
        "nvidia.com/cuda.driver-version.major": "550",
        "nvidia.com/cuda.driver-version.minor": "90",
        "nvidia.com/cuda.driver-version.revision": "07",
        "nvidia.com/cuda.driver-version.full": "550.90.07",
        "nvidia.com/cuda.runtime-version.major": "12",
        "nvidia.com/cuda.runtime-version.minor": "4",
        "nvidia.com/cuda.runtime-version.full": "12.4",
        "nvidia.com/cuda.driver.major": "550",
        "nvidia.com/cuda.driver.minor": "90",
        "nvidia.com/cuda.driver.rev": "07",
        "nvidia.com/cuda.runtime.major": "12",
        "nvidia.com/cuda.runtime.minor": "4",
        "nvidia.com/gpu.mode": "compute",
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mig.strategy": "none",
        "nvidia.com/mps.capable": "false",
        "nvidia.com/vgpu.present": "false",
    }


def test_mixed_node_has_one_schema_per_vendor_and_gfd_labels_for_nvidia_only() -> None:
    inv = inventory(nvidia(*(gpu(i, "NVIDIA A100-PCIE-40GB") for i in range(4))), ascend(npu(0)))
    labels = labels_of(inv)

    assert labels["edl.io/accelerator.vendors"] == "ascend.nvidia"
    assert labels["edl.io/accelerator.count"] == "5"
    assert labels["edl.io/ascend.product"] == "Ascend910B3"
    assert labels["edl.io/ascend.count"] == "1"
    assert labels["edl.io/ascend.driver"] == "24.1.rc2"
    assert labels["edl.io/nvidia.count"] == "4"
    assert labels["nvidia.com/gpu.count"] == "4"
    assert not [k for k in labels if k.startswith("nvidia.com/") and "ascend" in labels[k].lower()]


def test_no_devices_no_labels() -> None:
    assert labels_of(inventory()) == {}
    assert labels_of(inventory(VendorReport(Vendor.NVIDIA, (), {}, error="NVML failed"))) == {}


def test_unhealthy_and_cordoned_devices_lower_the_healthy_counts_only() -> None:
    broken = dataclasses.replace(npu(1), health=Health.UNHEALTHY)
    inv = inventory(nvidia(*(gpu(i) for i in range(4))), ascend(npu(0), broken))

    labels = labels_of(inv, unhealthy={"GPU-3": fault()}, cordoned={"GPU-0"})

    assert labels["edl.io/nvidia.healthy"] == "2"
    assert labels["edl.io/nvidia.count"] == "4"
    assert labels["edl.io/ascend.healthy"] == "1"
    assert labels["edl.io/accelerator.healthy"] == "3"
    assert labels["nvidia.com/gpu.count"] == "4"


def test_degraded_devices_are_counted_and_leave_the_healthy_counts() -> None:
    inv = inventory(nvidia(*(gpu(i) for i in range(4))), ascend(npu(0), npu(1)))

    # GPU-2 is both degraded and unhealthy (a warning, then a fault): unhealthy wins.
    labels = labels_of(inv, unhealthy={"GPU-2": fault()}, degraded={"GPU-1", "GPU-2", npu(1).id})

    assert labels["edl.io/nvidia.degraded"] == "1"
    assert labels["edl.io/nvidia.healthy"] == "2"
    assert labels["edl.io/ascend.degraded"] == "1"
    assert labels["edl.io/ascend.healthy"] == "1"
    assert labels["edl.io/accelerator.degraded"] == "2"
    assert labels["edl.io/accelerator.healthy"] == "3"


def test_most_common_model_names_the_gpus_as_gfd_does() -> None:
    inv = inventory(nvidia(gpu(0, "NVIDIA L4"), gpu(1), gpu(2)))
    labels = labels_of(inv)
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert labels["nvidia.com/gpu.count"] == "2"
    assert labels["edl.io/nvidia.count"] == "3"


@pytest.mark.parametrize(
    ("rule", "product", "replicas", "strategy", "sharing"),
    [
        ({"replicas": 4}, "NVIDIA-H100-80GB-HBM3-SHARED", "4", "time-slicing", "replicas"),
        (
            {"replicas": 4, "replica_resource": "nvidia.com/gpu.shared"},
            "NVIDIA-H100-80GB-HBM3",
            "4",
            "time-slicing",
            "replicas",
        ),
        (
            {
                "replicas": 4,
                "replica_resource": "baidu.com/{model}_{memory}_cgpu",
                "memory_unit_mib": 1024,
                "core_unit_percent": 5,
            },
            "NVIDIA-H100-80GB-HBM3",
            "4",
            "time-slicing",
            "replicas.memory.core",
        ),
        ({"memory_unit_mib": 1024}, "NVIDIA-H100-80GB-HBM3", "1", "none", "memory"),
    ],
)
def test_sharing_labels(
    rule: dict[str, object], product: str, replicas: str, strategy: str, sharing: str
) -> None:
    settings = load_settings(overrides={"sharing": [{"resource": "nvidia.com/gpu", **rule}]})
    labels = labels_of(inventory(nvidia(gpu(0), gpu(1))), settings)
    assert labels["nvidia.com/gpu.product"] == product
    assert labels["nvidia.com/gpu.replicas"] == replicas
    assert labels["nvidia.com/gpu.sharing-strategy"] == strategy
    assert labels["edl.io/nvidia.sharing"] == sharing


def test_shared_product_stays_within_63_characters() -> None:
    settings = load_settings(overrides={"sharing": [{"resource": "nvidia.com/gpu", "replicas": 2}]})
    labels = labels_of(inventory(nvidia(gpu(0, "X" * 80))), settings)
    assert labels["nvidia.com/gpu.product"] == "X" * 56 + "-SHARED"


def test_vnpu_templates_show_in_ascend_sharing() -> None:
    template = {"resource": "huawei.com/Ascend910-5c", "per_device": 4, "aicore": 5,
                "memory_mib": 16384}  # fmt: skip
    settings = load_settings(overrides={"ascend": {"vnpu_templates": [template]}})
    assert labels_of(inventory(ascend(npu(0))), settings)["edl.io/ascend.sharing"] == "vnpu"


def a100_mig_node(*profiles: list[str], disabled: int = 0) -> Inventory:
    devices: list[Device] = []
    for g, names in enumerate(profiles):
        devices.append(
            gpu(g, "NVIDIA A100-SXM4-80GB", compute_capability="8.0", mig_mode="enabled")
        )
        devices += [mig(i, g, name) for i, name in enumerate(names)]
    start = len(profiles)
    devices += [gpu(start + i, "NVIDIA A100-SXM4-80GB", compute_capability="8.0")
                for i in range(disabled)]  # fmt: skip
    return inventory(nvidia(*devices))


def test_mig_mixed_strategy_labels_each_profile() -> None:
    settings = load_settings(overrides={"nvidia": {"mig_strategy": "mixed"}})
    labels = labels_of(a100_mig_node(["1g.10gb"] * 2, ["3g.40gb"]), settings)
    assert labels["nvidia.com/mig.strategy"] == "mixed"
    assert labels["nvidia.com/mig-1g.10gb.count"] == "2"
    assert labels["nvidia.com/mig-1g.10gb.product"] == "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb"
    assert labels["nvidia.com/mig-3g.40gb.count"] == "1"
    assert labels["nvidia.com/gpu.count"] == "2"
    assert labels["nvidia.com/gpu.replicas"] == "0"  # as GFD: MIG-enabled GPUs are not shared
    assert labels["edl.io/nvidia.sharing"] == "mig"
    assert labels["edl.io/nvidia.count"] == "2"


def test_mig_single_strategy_labels_the_profile_or_invalid() -> None:
    settings = load_settings(overrides={"nvidia": {"mig_strategy": "single"}})
    labels = labels_of(a100_mig_node(["1g.10gb"] * 7, ["1g.10gb"] * 7), settings)
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb"
    assert labels["nvidia.com/gpu.count"] == "14"
    assert labels["nvidia.com/gpu.memory"] == "9728"
    assert labels["nvidia.com/gpu.family"] == "ampere"

    for node in (a100_mig_node(["1g.10gb"], ["3g.40gb"]), a100_mig_node(["1g.10gb"], disabled=1)):
        labels = labels_of(node, settings)
        assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB-MIG-INVALID"
        assert labels["nvidia.com/gpu.count"] == "0"


@pytest.mark.parametrize(
    ("major", "minor", "family"),
    [(6, 1, "pascal"), (7, 0, "volta"), (7, 2, "volta"), (7, 5, "turing"), (8, 0, "ampere"),
     (8, 6, "ampere"), (8, 9, "ada-lovelace"), (9, 0, "hopper"), (10, 0, "blackwell"),
     (12, 0, "blackwell"), (11, 0, "undefined")],
)  # fmt: skip
def test_gpu_family(major: int, minor: int, family: str) -> None:
    assert gpu_family(major, minor) == family


@pytest.mark.parametrize(
    ("driver", "expected"),
    [
        ({"driver_version": "535.183"}, {"revision": "", "full": "535.183"}),
        ({"driver_version": "weird"}, {}),
        ({"driver_version": "550.90.07", "cuda_driver_version": "12.10"}, {"runtime": "12.10"}),
    ],
)
def test_driver_versions(driver: dict[str, str], expected: dict[str, str]) -> None:
    labels = labels_of(inventory(VendorReport(Vendor.NVIDIA, (gpu(0),), driver)))
    prefix = "nvidia.com/cuda.driver-version."
    if "full" in expected:
        assert labels[f"{prefix}revision"] == expected["revision"]
        assert labels[f"{prefix}full"] == expected["full"]
    elif "runtime" in expected:
        assert labels["nvidia.com/cuda.runtime-version.full"] == expected["runtime"]
    else:
        assert not [k for k in labels if k.startswith(prefix)]


@pytest.mark.parametrize(
    "driver",
    [
        {"driver_version": "550.90.07", "cuda_driver_version": "12.4"},
        {"driver_version": "535.183", "cuda_driver_version": "12.10"},
        {"driver_version": "weird"},
    ],
)
def test_gfd_older_version_labels_repeat_the_newer_ones(driver: dict[str, str]) -> None:
    labels = labels_of(inventory(VendorReport(Vendor.NVIDIA, (gpu(0),), driver)))
    older = {
        "cuda.driver.major": "cuda.driver-version.major",
        "cuda.driver.minor": "cuda.driver-version.minor",
        "cuda.driver.rev": "cuda.driver-version.revision",
        "cuda.runtime.major": "cuda.runtime-version.major",
        "cuda.runtime.minor": "cuda.runtime-version.minor",
    }
    assert {old: labels.get(f"nvidia.com/{old}") for old in older} == {
        old: labels.get(f"nvidia.com/{new}") for old, new in older.items()
    }
    assert ("nvidia.com/cuda.driver.rev" in labels) == ("." in driver["driver_version"])


# --- gpu.mode, mps.capable, vgpu.present ------------------------------------------------------


@pytest.mark.parametrize(
    ("classes", "mode"),
    [
        (["0x030200"] * 8, "compute"),
        (["0x030000", "0x030000"], "graphics"),
        (["0x30200"], "compute"),
        (["0x030200", "0x030000"], "unknown"),  # GPUs in both modes
        (["0x030200", None], "unknown"),  # one class file unreadable
        (["0x030201"], "unknown"),  # the whole class code counts, programming interface too
        (["0x068000"], "unknown"),  # another class (an NVSwitch's)
        (["3D controller"], "unknown"),
        ([None], "unknown"),
        ([], "unknown"),
    ],
)
def test_gpu_mode_from_pci_classes(classes: list[str | None], mode: str) -> None:
    assert gpu_mode(classes) == mode


def test_gpu_mode_looks_at_every_gpu_not_only_the_most_common_model() -> None:
    inv = inventory(nvidia(gpu(0), gpu(1), gpu(2, "NVIDIA RTX A6000", pci_class="0x030000")))
    assert labels_of(inv)["nvidia.com/gpu.mode"] == "unknown"
    assert labels_of(inventory(nvidia(gpu(0))))["nvidia.com/gpu.mode"] == "compute"


@pytest.mark.parametrize(
    ("found", "present"),
    [
        (["false", "false"], "false"),
        (["false", "true"], "true"),
        (["true", None], None),  # one configuration space not read whole: GFD writes nothing
        ([None, None], None),
    ],
)
def test_vgpu_present_needs_every_gpu_read(found: list[str | None], present: str | None) -> None:
    def one(i: int, vgpu: str | None) -> Device:
        device = gpu(i)
        attributes = {k: v for k, v in device.attributes.items() if k != "vgpu"}
        return dataclasses.replace(device, attributes=attributes | ({"vgpu": vgpu} if vgpu else {}))

    labels = labels_of(inventory(nvidia(*(one(i, v) for i, v in enumerate(found)))))
    assert labels.get("nvidia.com/vgpu.present") == present


def test_mps_is_never_capable_without_mps_sharing() -> None:
    for strategy in ("none", "single", "mixed"):
        settings = load_settings(overrides={"nvidia": {"mig_strategy": strategy}})
        assert labels_of(a100_mig_node(["1g.10gb"]), settings)["nvidia.com/mps.capable"] == "false"
    settings = load_settings(overrides={"sharing": [{"resource": "nvidia.com/gpu", "replicas": 4}]})
    assert labels_of(inventory(nvidia(gpu(0))), settings)["nvidia.com/mps.capable"] == "false"


def capability(kind: int, payload: bytes = b"") -> bytes:
    """A PCI capability: its id, a next pointer (filled in by `config_space`), its length."""
    return bytes([kind, 0, 3 + len(payload)]) + payload


def config_space(*capabilities: bytes, size: int = 256, pci_class: int = PCI_CLASS_3D) -> bytes:
    """A GPU's PCI configuration space with `capabilities` linked in order from 0x60, 0x20
    bytes apart."""
    space = bytearray(size)
    space[0:2] = (0x10DE).to_bytes(2, "little")
    space[9:12] = pci_class.to_bytes(3, "little")
    if capabilities:
        space[0x06] = 0x10
        space[0x34] = 0x60
    for i, body in enumerate(capabilities):
        at = 0x60 + 0x20 * i
        space[at : at + len(body)] = body
        space[at + 1] = at + 0x20 if i + 1 < len(capabilities) else 0
    return bytes(space)


POWER, MSI, EXPRESS, VENDOR = (capability(k, b"\x03\x00") for k in (0x01, 0x05, 0x10, 0x09))
VGPU = capability(0x09, b"VF\x01\x04\x00\x00")
LOOP = bytearray(config_space(POWER, MSI))
LOOP[0x81] = 0x60  # MSI points back to the first capability


@pytest.mark.parametrize(
    ("config", "vgpu"),
    [
        (config_space(POWER, MSI, EXPRESS, VGPU), True),
        (config_space(VGPU, size=4096), True),  # PCIe's extended space read too
        (config_space(POWER, MSI, EXPRESS, VENDOR), False),  # vendor-specific, not a vGPU's
        (config_space(POWER, MSI, EXPRESS), False),
        (config_space(), False),  # no capability list
        (config_space(VENDOR, VGPU), False),  # only the first vendor-specific one is read
        (config_space(capability(0xFF), VGPU), False),  # a broken chain ends the walk
        (bytes(LOOP), False),
        (config_space(POWER, VGPU)[:64], None),  # the header only: sysfs without CAP_SYS_ADMIN
        (b"", None),
    ],
)
def test_vgpu_signature_in_the_pci_configuration_space(config: bytes, vgpu: bool | None) -> None:
    assert nvidia_discovery.vgpu_signature(config) is vgpu


def simulated_labels(root: Path) -> dict[str, str]:
    report = nvidia_discovery.discover(HostRoot.at(root))
    assert report is not None
    assert report.error is None
    return labels_of(inventory(report))


def test_a_simulated_dgx_h100_reads_its_gpus_mode_and_vgpu_from_sysfs(tmp_path: Path) -> None:
    build_tree(load_profile("dgx-h100"), tmp_path)
    devices = sorted((tmp_path / "sys/bus/pci/devices").iterdir())
    assert len(devices) == 8
    labels = simulated_labels(tmp_path)
    assert labels["nvidia.com/gpu.mode"] == "compute"
    assert labels["nvidia.com/mps.capable"] == "false"
    # As the agent runs by default, sysfs shows it only the configuration space's header.
    assert "nvidia.com/vgpu.present" not in labels

    for device in devices:
        (device / "config").write_bytes(config_space(POWER, MSI, EXPRESS, VENDOR))
    assert simulated_labels(tmp_path)["nvidia.com/vgpu.present"] == "false"
    (devices[5] / "config").write_bytes(config_space(POWER, MSI, EXPRESS, VGPU))
    assert simulated_labels(tmp_path)["nvidia.com/vgpu.present"] == "true"
    (devices[5] / "config").unlink()
    assert "nvidia.com/vgpu.present" not in simulated_labels(tmp_path)

    for device in devices:
        (device / "class").write_text(f"0x{PCI_CLASS_VGA:06x}\n", encoding="utf-8")
    assert simulated_labels(tmp_path)["nvidia.com/gpu.mode"] == "graphics"
    (devices[2] / "class").write_text(f"0x{PCI_CLASS_3D:06x}\n", encoding="utf-8")
    assert simulated_labels(tmp_path)["nvidia.com/gpu.mode"] == "unknown"
    for device in devices:
        (device / "class").unlink()
    assert simulated_labels(tmp_path)["nvidia.com/gpu.mode"] == "unknown"


@given(
    st.lists(st.text(), min_size=1, max_size=4),
    st.text(),
    st.sampled_from(["none", "single", "mixed"]),
)
def test_every_key_and_value_is_valid(products: list[str], machine: str, strategy: str) -> None:
    devices = [gpu(i, name) for i, name in enumerate(products)]
    settings = load_settings(overrides={"nvidia": {"mig_strategy": strategy}})
    labels = node_labels(
        inventory=inventory(nvidia(*devices), ascend(npu(0))),
        unhealthy={},
        settings=settings,
        machine=machine,
    )
    for key, value in labels.items():
        assert KEY.match(key), key
        assert len(key.split("/")[1]) <= 63, key
        assert VALUE.match(value), (key, value)
        assert len(value) <= 63, (key, value)


# --- owned keys -------------------------------------------------------------------------------


def apply(labels: dict[str, str], patch: dict[str, object] | None) -> dict[str, str]:
    changes = ((patch or {}).get("metadata") or {}).get("labels") or {}  # type: ignore[attr-defined]
    merged = {**labels, **changes}
    return {k: v for k, v in merged.items() if v is not None}


def test_first_write_sets_labels_and_records_them() -> None:
    patch = label_patch(
        labels={"team": "a"}, annotations={}, desired={"edl.io/b": "1", "edl.io/a": "2"}
    )
    assert patch.body == {
        "metadata": {
            "labels": {"edl.io/a": "2", "edl.io/b": "1"},
            "annotations": {OWNED_LABELS: "edl.io/a,edl.io/b"},
        }
    }


def test_stale_owned_keys_go_and_foreign_keys_stay() -> None:
    current = {"edl.io/a": "1", "edl.io/old": "x", "nvidia.com/gpu.deploy.dcgm": "true"}
    annotations = {OWNED_LABELS: "edl.io/a,edl.io/old,edl.io/gone-already"}
    patch = label_patch(labels=current, annotations=annotations, desired={"edl.io/a": "1"})
    assert patch.body == {
        "metadata": {
            "labels": {"edl.io/old": None},
            "annotations": {OWNED_LABELS: "edl.io/a"},
        }
    }
    assert patch.removed == ("edl.io/old",)


def test_nothing_to_do_is_no_patch_and_empty_desired_drops_the_record() -> None:
    same = label_patch(
        labels={"edl.io/a": "1"}, annotations={OWNED_LABELS: "edl.io/a"}, desired={"edl.io/a": "1"}
    )
    assert same.body is None
    gone = label_patch(labels={"edl.io/a": "1"}, annotations={OWNED_LABELS: "edl.io/a"}, desired={})
    assert gone.body == {
        "metadata": {"labels": {"edl.io/a": None}, "annotations": {OWNED_LABELS: None}}
    }


def test_a_tampered_record_cannot_make_us_delete_foreign_labels() -> None:
    annotations = {OWNED_LABELS: "team,kubernetes.io/hostname,edl.io/old"}
    labels = {"team": "ml", "kubernetes.io/hostname": "n", "edl.io/old": "1"}
    patch = label_patch(labels=labels, annotations=annotations, desired={})
    assert patch.removed == ("edl.io/old",)


def test_a_label_we_now_produce_is_taken_over() -> None:
    patch = label_patch(
        labels={"nvidia.com/gpu.count": "4"}, annotations={}, desired={"nvidia.com/gpu.count": "8"}
    )
    assert patch.taken_over == ("nvidia.com/gpu.count",)


keys = st.sampled_from(["edl.io/a", "edl.io/b", "nvidia.com/gpu.count", "team", "zone"])


@given(
    st.dictionaries(keys, st.sampled_from(["1", "2"])),
    st.sets(keys),
    st.dictionaries(keys, st.sampled_from(["1", "2"])),
)
def test_patch_reaches_desired_and_spares_foreign_keys(
    current: dict[str, str], owned: set[str], desired: dict[str, str]
) -> None:
    annotations = {OWNED_LABELS: ",".join(sorted(owned))} if owned else {}
    result = apply(
        current, label_patch(labels=current, annotations=annotations, desired=desired).body
    )
    assert {k: result[k] for k in desired} == desired
    ours = {k for k in owned if k.startswith(OUR_PREFIXES)}
    for key, value in current.items():
        if key not in ours and key not in desired:
            assert result[key] == value
        if key in ours and key not in desired:
            assert key not in result


# --- cordon -----------------------------------------------------------------------------------


def test_cordon_annotation_names_devices_by_id_or_vendor_index() -> None:
    devices = [gpu(0), gpu(3), mig(0, 3, "1g.10gb"), npu(1)]
    assert parse_cordoned(" nvidia:3, ,GPU-0,nvidia:3 ") == ("nvidia:3", "GPU-0")
    cordon = cordoned_devices("nvidia:3, ascend-npu1, MIG-3-0, NVIDIA:0, nvidia:9, bogus", devices)
    assert cordon.device_ids == {"GPU-3", "ascend-npu1", "MIG-3-0", "GPU-0"}
    assert cordon.unknown == ("nvidia:9", "bogus")
    assert cordoned_devices(None, devices).device_ids == frozenset()


# --- feature file -----------------------------------------------------------------------------


def test_feature_file_is_replaced_whole_and_only_when_changed(tmp_path: Path) -> None:
    path = tmp_path / "features.d" / "edl-agent"
    assert write_features_file(path, {"nvidia.com/gpu.count": "8", "edl.io/a": "1"})
    assert path.read_text() == "edl.io/a=1\nnvidia.com/gpu.count=8\n"
    assert not write_features_file(path, {"edl.io/a": "1", "nvidia.com/gpu.count": "8"})
    assert sorted(p.name for p in path.parent.iterdir()) == ["edl-agent"]


# --- the condition ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("XID79", "XID79"),
        ("GPU_LOST", "GPULost"),
        ("NODE_VANISHED", "NodeVanished"),
        ("ECC_DBE", "ECCDBE"),
        ("NPU_HEALTH_Critical", "NPUHealthCritical"),
        ("NVML_INIT_FAILED", "NVMLInitFailed"),
        ("weird reason!", "WeirdReason"),
        ("0x80E01801", "Fault0x80E01801"),
        ("", "Fault"),
    ],
)
def test_condition_reasons_are_camel_case(raw: str, reason: str) -> None:
    assert condition_reason(raw) == reason


def test_healthy_condition() -> None:
    health = accelerator_health(inventory=inventory(nvidia(gpu(0), gpu(1))), unhealthy={})
    assert (health.status, health.reason) == ("True", "AcceleratorsHealthy")
    assert health.message == "all 2 accelerators healthy"


def test_unhealthy_condition_names_the_worst_fault_and_every_device() -> None:
    inv = inventory(nvidia(*(gpu(i) for i in range(4))), ascend(npu(0)))
    unhealthy = {
        "ascend-npu0": fault("NPU_HEALTH_Critical", Level.DEVICE_FATAL, since=0.5),
        "GPU-3": fault("XID79", Level.NODE_FATAL, since=2.0),
        "GPU-1": fault("GPU_LOST", Level.NODE_FATAL, since=1.0),
    }
    health = accelerator_health(inventory=inv, unhealthy=unhealthy)
    assert (health.status, health.reason) == ("False", "GPULost")
    assert health.message == (
        "3 of 5 accelerators unhealthy: nvidia 1 (GPU-1) GPU_LOST: off the bus; "
        "nvidia 3 (GPU-3) XID79: off the bus; "
        "ascend 0 (ascend-npu0) NPU_HEALTH_Critical: off the bus"
    )
    assert [f.device_id for f in health.faults] == ["GPU-1", "GPU-3", "ascend-npu0"]


def test_condition_message_is_cut_and_unknown_devices_named_by_id() -> None:
    unhealthy = {f"GPU-{i}-{'x' * 60}": fault() for i in range(40)}
    health = accelerator_health(inventory=inventory(nvidia(gpu(0))), unhealthy=unhealthy)
    assert len(health.message) == MAX_MESSAGE
    assert health.message.startswith("40 of 40 accelerators unhealthy: GPU-0-xxx")
    assert health.message.endswith("...")


NOTE = "; state directory refuses writes: "
LOST = " kept in memory only, lost if the agent restarts"


@pytest.mark.parametrize(
    ("unsaved", "said"),
    [
        (None, None),
        (Unsaved(), None),
        (Unsaved(faults=3), "faults for the restarter"),
        (Unsaved(quarantine=True), "the quarantine"),
        (Unsaved(faults=1, quarantine=True), "faults for the restarter and the quarantine"),
    ],
)
@pytest.mark.parametrize("sick", [False, True])
def test_a_disk_that_refuses_writes_is_said_in_the_message_only(
    unsaved: Unsaved | None, said: str | None, *, sick: bool
) -> None:
    inv = inventory(nvidia(gpu(0), gpu(1)))
    unhealthy = {"GPU-1": fault("XID79", Level.NODE_FATAL)} if sick else {}
    plain = accelerator_health(inventory=inv, unhealthy=unhealthy)
    health = accelerator_health(inventory=inv, unhealthy=unhealthy, unsaved=unsaved)
    assert (health.status, health.reason, health.faults) == (
        plain.status,
        plain.reason,
        plain.faults,
    )  # no accelerator fault
    expected = plain.message if said is None else plain.message + NOTE + said + LOST
    assert health.message == expected


def test_the_full_disk_note_is_never_cut_and_says_no_count() -> None:
    unhealthy = {f"GPU-{i}-{'x' * 60}": fault() for i in range(40)}
    unsaved = Unsaved(faults=7, quarantine=True)
    health = accelerator_health(
        inventory=inventory(nvidia(gpu(0))), unhealthy=unhealthy, unsaved=unsaved
    )
    assert len(health.message) == MAX_MESSAGE
    assert health.message.endswith(
        "..." + NOTE + "faults for the restarter and the quarantine" + LOST
    )
    assert "7" not in health.message.partition(NOTE)[2]  # the count changes; the condition not
    empty = accelerator_health(inventory=inventory(), unhealthy={}, unsaved=unsaved)
    assert (empty.reason, empty.message.count(NOTE)) == ("NoAcceleratorsFound", 1)


@pytest.mark.parametrize(
    ("unsaved", "counted", "plain"),
    [
        (Unsaved(), "", ""),
        (Unsaved(faults=2), "2 fault(s) for the restarter", "faults for the restarter"),
        (Unsaved(quarantine=True), "the quarantine", "the quarantine"),
        (
            Unsaved(faults=1, quarantine=True),
            "1 fault(s) for the restarter and the quarantine",
            "faults for the restarter and the quarantine",
        ),
    ],
)
def test_what_the_disk_refused_in_words(unsaved: Unsaved, counted: str, plain: str) -> None:
    assert (unsaved.describe(), unsaved.describe(counted=False)) == (counted, plain)
    assert bool(unsaved) == bool(counted)


def test_transition_time_moves_only_with_the_status() -> None:
    bad = AcceleratorHealth(False, "XID79", "1 of 8 accelerators unhealthy: ...")
    good = AcceleratorHealth(True, "AcceleratorsHealthy", "all 8 accelerators healthy")
    first = node_condition(good, previous=None, now=NOW)
    assert first["lastTransitionTime"] == first["lastHeartbeatTime"] == "2026-05-01T12:00:00Z"

    later = node_condition(good, previous=first, now=NOW + timedelta(minutes=5))
    assert later["lastHeartbeatTime"] == "2026-05-01T12:05:00Z"
    assert later["lastTransitionTime"] == "2026-05-01T12:00:00Z"

    flipped = node_condition(bad, previous=later, now=NOW + timedelta(minutes=6))
    assert flipped["status"] == "False"
    assert flipped["reason"] == "XID79"
    assert flipped["lastTransitionTime"] == "2026-05-01T12:06:00Z"


# --- events -----------------------------------------------------------------------------------


def test_events_for_new_changed_and_recovered_faults() -> None:
    inv = inventory(nvidia(*(gpu(i) for i in range(4))))
    before = accelerator_health(
        inventory=inv, unhealthy={"GPU-1": fault("XID48"), "GPU-2": fault()}
    )
    after = accelerator_health(inventory=inv, unhealthy={"GPU-1": fault("XID79"), "GPU-3": fault()})
    events = health_events(before.faults, after.faults)
    assert events == [
        EventSpec(
            WARNING, "AcceleratorUnhealthy", "nvidia 1 (GPU-1) unhealthy: XID79: off the bus"
        ),
        EventSpec(
            WARNING, "AcceleratorUnhealthy", "nvidia 3 (GPU-3) unhealthy: XID79: off the bus"
        ),
        EventSpec(NORMAL, "AcceleratorRecovered", "nvidia 2 (GPU-2) healthy again (was XID79)"),
    ]
    assert health_events(after.faults, after.faults) == []


def test_token_bucket_allows_a_burst_then_the_rate() -> None:
    bucket = TokenBucket(capacity=10, per_second=10 / 60)
    assert all(bucket.take(0.0) for _ in range(10))
    assert not bucket.take(0.0)
    assert not bucket.take(5.9)
    assert bucket.take(6.1)
    assert not bucket.take(6.2)


def test_gate_bumps_duplicates_within_the_window_and_drops_over_the_rate() -> None:
    gate = EventGate(window_seconds=600, capacity=3, per_minute=1)
    spec = EventSpec(WARNING, "AcceleratorUnhealthy", "nvidia 3 (GPU-3) unhealthy: XID79")
    assert gate.decide(spec, 0).action is Action.CREATE
    gate.sent(spec, name="node-a.1", count=1, now=0)
    decision = gate.decide(spec, 10)
    assert (decision.action, decision.name, decision.count) == (Action.BUMP, "node-a.1", 2)
    gate.sent(spec, name="node-a.1", count=2, now=10)
    assert gate.decide(spec, 20).action is Action.BUMP
    assert gate.decide(spec, 21).action is Action.DROP
    assert gate.dropped == 1
    assert gate.decide(spec, 10 + 601).action is Action.CREATE  # past the window: a new event
    gate.forget(spec)


# --- the updater without an API ------------------------------------------------------------------


def test_log_only_updater_logs_what_it_would_write_once() -> None:
    inv = inventory(nvidia(gpu(0), gpu(1)))
    updater = NodeUpdater(api=None, node_name="node-a", settings=NodeSettings())
    labels = labels_of(inv)
    healthy = accelerator_health(inventory=inv, unhealthy={})
    broken = accelerator_health(inventory=inv, unhealthy={"GPU-1": fault()})
    assert updater.log_only
    with capture_logs() as first:
        result = updater.sync(labels=labels, health=healthy, now=NOW)
    assert result.labels_written
    assert result.condition_written
    assert [e["event"] for e in first] == [
        "node labels (log only: no Kubernetes API)",
        "node condition (log only: no Kubernetes API)",
    ]
    assert first[0]["labels"] == labels
    with capture_logs() as again:
        updater.sync(labels=labels, health=healthy, now=NOW)
    assert again == []
    with capture_logs() as fault_logs:
        result = updater.sync(labels=labels, health=broken, now=NOW)
    assert [e["event"] for e in fault_logs] == [
        "node condition (log only: no Kubernetes API)",
        "node event (log only: no Kubernetes API)",
    ]
    assert fault_logs[0]["status"] == "False"
    assert fault_logs[1]["message"] == "nvidia 1 (GPU-1) unhealthy: XID79: off the bus"
    assert updater.cordoned(inv.devices).device_ids == frozenset()


def test_feature_file_mode_writes_without_an_api(tmp_path: Path) -> None:
    path = tmp_path / "edl-agent"
    settings = NodeSettings(labels="features_file", features_file=str(path))
    updater = NodeUpdater(api=None, node_name="node-a", settings=settings)
    inv = inventory(nvidia(gpu(0)))
    health = accelerator_health(inventory=inv, unhealthy={})
    assert updater.sync(labels=labels_of(inv), health=health, now=NOW).labels_written
    assert "nvidia.com/gpu.count=1\n" in path.read_text()
    assert not updater.sync(
        labels=labels_of(inv), health=health, now=NOW, force=True
    ).labels_written


# --- building a client --------------------------------------------------------------------------


def test_no_kubeconfig_and_not_in_a_cluster_means_no_client(tmp_path: Path) -> None:
    assert api_client("", environ={}) is None
    missing_token = str(tmp_path / "token")
    assert (
        api_client("", environ={"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, token_file=missing_token)
        is None
    )


def test_a_configured_kubeconfig_must_exist(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError, match="does not exist"):
        api_client(str(tmp_path / "nope"), environ={})
    broken = tmp_path / "kubeconfig"
    broken.write_text("apiVersion: v1\nkind: Config\n")
    with pytest.raises(KubeConfigError, match="cannot use"):
        api_client(str(broken), environ={})


def test_in_cluster_service_account(tmp_path: Path) -> None:
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("secret-token")
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    environ = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    api = api_client("", environ=environ, token_file=str(token), ca_file=str(ca))
    assert api is not None
    assert api.configuration.host == "https://10.0.0.1:443"
    api.close()
