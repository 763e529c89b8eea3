"""Allocate decisions: per-vendor device nodes and variables, shares, refusals."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edl_agent.config import PluginSettings, load_settings
from edl_agent.devices.container import (
    VENDOR_SPECS,
    AllocationError,
    DeviceNode,
    optional_control_nodes,
)
from edl_agent.devices.discovery import discover_node
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, Inventory, ResourceUnit, UnitKind, Vendor
from edl_agent.devices.resources import advertised_resources
from edl_agent.plugin.allocation import ALLOCATED_ANNOTATION, ContainerAllocation, allocate
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree

VNPU = {
    "ascend": {
        "vnpu_templates": [
            {"resource": "huawei.com/Ascend910-5c", "per_device": 4, "aicore": 5, "memory_mib": 1}
        ]
    }
}


@dataclass(frozen=True)
class Node:
    inventory: Inventory
    root: HostRoot
    units: Mapping[str, ResourceUnit]  # every resource's units

    @property
    def devices(self) -> dict[str, Device]:
        return {d.id: d for d in self.inventory.devices}

    def existing(self, *, without: Collection[str] = ()) -> frozenset[str]:
        candidates = {n for d in self.inventory.devices for n in d.device_nodes}
        candidates |= optional_control_nodes()
        return frozenset(p for p in candidates if self.root.exists(p) and p not in without)

    def ids(self, resource: str, *indexes: int) -> list[str]:
        """Whole-device ids of the devices with these host indexes, in the order given."""
        units = next(r for r in self.inventory.resources if r.name == resource).units
        by_index = {self.devices[u.device_id].index: u.id for u in units}
        return [by_index[i] for i in indexes]

    def allocate(self, ids: Sequence[str], **kwargs: Any) -> ContainerAllocation:
        plugin = kwargs.pop("plugin", {})
        return allocate(
            requested_ids=ids,
            units=kwargs.pop("units", self.units),
            devices=kwargs.pop("devices", self.devices),
            unhealthy=kwargs.pop("unhealthy", ()),
            existing_paths=kwargs.pop("existing_paths", self.existing()),
            settings=PluginSettings(**plugin),
        )


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Node]:
    cache: dict[str, Node] = {}

    def build(name: str, **extra: Any) -> Node:
        key = f"{name}{sorted(extra)}"
        if key not in cache:
            profile = load_profile(name)
            root = tmp_path_factory.mktemp(name)
            build_tree(profile, root)
            config = load_settings(
                defaults=profile.config, overrides={"host_root": str(root), **extra}
            )
            inventory = discover_node(config)
            resources = advertised_resources(inventory.devices, config)
            units = {u.id: u for r in resources for u in r.units}
            cache[key] = Node(inventory, HostRoot.at(str(root)), units)
        return cache[key]

    return build


def paths(granted: ContainerAllocation) -> list[str]:
    assert all(d.container_path == d.host_path and d.permissions == "rw" for d in granted.devices)
    return [d.host_path for d in granted.devices]


@pytest.mark.parametrize(
    ("profile", "resource", "envs", "nodes"),
    [
        (
            "kunlun-p800x8",
            "kunlunxin.com/xpu",
            {"XPU_VISIBLE_DEVICES": "3,5"},
            ["/dev/xpuctrl", "/dev/xpu3", "/dev/xpu5"],
        ),
        (
            "hygon-k100x8",
            "hygon.com/dcunum",
            {"HIP_VISIBLE_DEVICES": "0,1"},
            [
                "/dev/kfd",
                "/dev/mkfd",
                "/dev/dri/card4",
                "/dev/dri/renderD131",
                "/dev/dri/card6",
                "/dev/dri/renderD133",
            ],
        ),
        (
            "ascend-910bx8",
            "huawei.com/Ascend910",
            {"ASCEND_VISIBLE_DEVICES": "3,5"},
            [
                "/dev/davinci_manager",
                "/dev/devmm_svm",
                "/dev/hisi_hdc",
                "/dev/davinci3",
                "/dev/davinci5",
            ],
        ),
    ],
)
def test_vendor_conventions(
    simulated: Callable[..., Node],
    profile: str,
    resource: str,
    envs: dict[str, str],
    nodes: list[str],
) -> None:
    node = simulated(profile)
    ids = node.ids(resource, 5, 3)
    granted = node.allocate(ids)
    assert granted.envs == envs
    assert paths(granted) == nodes
    assert granted.annotations == {ALLOCATED_ANNOTATION: ",".join(reversed(ids))}
    assert granted.cdi_devices == ()
    assert granted.mounts == ()


@pytest.mark.parametrize(
    ("plugin", "env", "nodes", "cdi"),
    [
        ({}, "{gpu3},{gpu5}", [], []),
        ({"nvidia_device_id_strategy": "index"}, "3,5", [], []),
        (
            {"nvidia_device_specs": True},
            "{gpu3},{gpu5}",
            [
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools",
                "/dev/nvidia-modeset",
                "/dev/nvidia3",
                "/dev/nvidia5",
            ],
            [],
        ),
        (
            {"nvidia_cdi": True},
            "{gpu3},{gpu5}",
            [],
            ["nvidia.com/gpu={gpu3}", "nvidia.com/gpu={gpu5}"],
        ),
        (
            {"nvidia_cdi": True, "nvidia_device_id_strategy": "index"},
            "3,5",
            [],
            ["nvidia.com/gpu=3", "nvidia.com/gpu=5"],
        ),
        (
            {"cdi": True},
            "{gpu3},{gpu5}",
            [],
            ["nvidia.edl.io/gpu=gpu-3", "nvidia.edl.io/gpu=gpu-5"],
        ),
    ],
)
def test_nvidia_settings(
    simulated: Callable[..., Node],
    plugin: dict[str, Any],
    env: str,
    nodes: list[str],
    cdi: list[str],
) -> None:
    node = simulated("dgx-h100")
    ids = node.ids("nvidia.com/gpu", 5, 3)
    uuids = {"gpu3": ids[1], "gpu5": ids[0]}
    granted = node.allocate(ids, plugin=plugin)
    assert granted.envs == {"NVIDIA_VISIBLE_DEVICES": env.format_map(uuids)}
    assert paths(granted) == nodes
    assert list(granted.cdi_devices) == [name.format_map(uuids) for name in cdi]


def test_missing_optional_control_nodes_are_left_out(simulated: Callable[..., Node]) -> None:
    node = simulated("dgx-h100")
    existing = node.existing(without={"/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"})
    granted = node.allocate(
        node.ids("nvidia.com/gpu", 0), plugin={"nvidia_device_specs": True}, existing_paths=existing
    )
    assert paths(granted) == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia0"]


def test_mig_devices(simulated: Callable[..., Node]) -> None:
    node = simulated("dgx-a100-mig")
    gpu0 = next(d for d in node.inventory.devices if d.kind == "gpu" and d.index == 0)
    migs = [d for d in node.inventory.devices if d.parent == gpu0.id][:2]
    plugin = {"nvidia_device_id_strategy": "index", "nvidia_device_specs": True}
    granted = node.allocate([m.id for m in reversed(migs)], plugin=plugin)
    assert granted.envs == {"NVIDIA_VISIBLE_DEVICES": f"0:{migs[0].index},0:{migs[1].index}"}
    assert paths(granted)[-1] == "/dev/nvidia0"  # shared by both, passed once
    assert len(paths(granted)) == 5
    by_uuid = node.allocate([m.id for m in migs], plugin={"nvidia_cdi": True})
    assert by_uuid.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(m.id for m in migs)
    assert by_uuid.cdi_devices == tuple(f"nvidia.com/gpu={m.id}" for m in migs)
    ours = node.allocate([migs[0].id], plugin={"cdi": True})
    gi, ci = migs[0].attributes["gpu_instance_id"], migs[0].attributes["compute_instance_id"]
    assert ours.cdi_devices == (f"nvidia.edl.io/gpu=gpu-0-mig-{gi}-{ci}",)


@pytest.mark.parametrize(
    ("resource_suffix", "picks", "expected"),
    [
        ("_cgpu_memory", {0: 3, 1: 2}, {"EDL_SHARE_MEMORY_MIB": "5120"}),
        ("_cgpu_core", {2: 4}, {"EDL_SHARE_CORE_PERCENT": "20"}),
        ("_cgpu", {0: 2}, {"EDL_SHARE_REPLICAS": "2"}),
    ],
)
def test_cgpu_shares(
    simulated: Callable[..., Node],
    resource_suffix: str,
    picks: dict[int, int],
    expected: dict[str, str],
) -> None:
    node = simulated("cgpu-v100")
    resource = next(r for r in node.inventory.resources if r.name.endswith(resource_suffix))
    devices = node.devices
    ids = [
        u.id
        for index, count in picks.items()
        for u in [u for u in resource.units if devices[u.device_id].index == index][:count]
    ]
    granted = node.allocate(ids)
    physical = ",".join(dict.fromkeys(node.units[i].device_id for i in ids))
    assert granted.envs == {
        "NVIDIA_VISIBLE_DEVICES": physical,
        "EDL_SHARE_DEVICES": physical,
        **expected,
    }
    assert granted.annotations == {ALLOCATED_ANNOTATION: physical}


def test_vnpu_templates(simulated: Callable[..., Node]) -> None:
    node = simulated("ascend-910bx8", **VNPU)
    ids = [i for i in node.units if i.startswith("ascend-npu2::")][:2]
    granted = node.allocate(ids)
    assert granted.envs == {
        "ASCEND_VISIBLE_DEVICES": "2",
        "EDL_VNPU_TEMPLATE": "Ascend910-5c",
        "EDL_VNPU_AICORE": "10",
        "EDL_SHARE_DEVICES": "ascend-npu2",
    }
    assert "/dev/davinci2" in paths(granted)


def test_duplicate_ids_count_once(simulated: Callable[..., Node]) -> None:
    node = simulated("cgpu-v100")
    gpu = next(iter(node.devices))
    granted = node.allocate([f"{gpu}::0", f"{gpu}::0", f"{gpu}::1"])
    assert granted.envs["EDL_SHARE_REPLICAS"] == "2"


def mig_child(node: Node) -> Device:
    return next(d for d in node.inventory.devices if d.parent is not None)


@pytest.mark.parametrize(
    ("name", "make", "kind", "named"),
    [
        ("nothing", lambda n: {"ids": []}, "invalid_argument", "no device ids"),
        (
            "unknown",
            lambda n: {"ids": [n.ids("nvidia.com/gpu", 6)[0], "GPU-x"]},
            "invalid_argument",
            "GPU-x",
        ),
        (
            "unhealthy",
            lambda n: {
                "ids": n.ids("nvidia.com/gpu", 6, 7),
                "unhealthy": n.ids("nvidia.com/gpu", 7),
            },
            "failed_precondition",
            "{gpu7}",
        ),
        (
            "unhealthy parent",
            lambda n: {"ids": [mig_child(n).id], "unhealthy": [mig_child(n).parent]},
            "failed_precondition",
            "{mig}",
        ),
        (
            "device gone",
            lambda n: {"ids": n.ids("nvidia.com/gpu", 6), "devices": {}},
            "failed_precondition",
            "{gpu6}",
        ),
        (
            "parent gone",
            lambda n: {
                "ids": [mig_child(n).id],
                "devices": {k: v for k, v in n.devices.items() if k != mig_child(n).parent},
                "plugin": {"nvidia_device_id_strategy": "index"},
            },
            "failed_precondition",
            "{mig}",
        ),
        (
            "own node gone",
            lambda n: {
                "ids": n.ids("nvidia.com/gpu", 6),
                "existing_paths": n.existing(without={"/dev/nvidia6"}),
                "plugin": {"nvidia_device_specs": True},
            },
            "failed_precondition",
            "/dev/nvidia6",
        ),
    ],
)
def test_refusals(
    simulated: Callable[..., Node],
    name: str,
    make: Callable[[Node], dict[str, Any]],
    kind: str,
    named: str,
) -> None:
    node = simulated("dgx-a100-mig")
    kwargs = make(node)
    with pytest.raises(AllocationError) as caught:
        node.allocate(kwargs.pop("ids"), **kwargs)
    assert caught.value.kind == kind
    gpus = {f"gpu{i}": node.ids("nvidia.com/gpu", i)[0] for i in (6, 7)}
    assert named.format(mig=mig_child(node).id, **gpus) in str(caught.value)


def test_every_vendor_has_one_spec() -> None:
    assert set(VENDOR_SPECS) == set(Vendor)
    names = [spec.visible_env for spec in VENDOR_SPECS.values()]
    assert len(set(names)) == len(names)
    assert DeviceNode("/a", "/a").permissions == "rw"


@pytest.fixture(scope="module")
def cgpu(simulated: Callable[..., Node]) -> Node:
    return simulated("cgpu-v100")


@given(data=st.data())
def test_property_one_name_per_physical_device(cgpu: Node, data: st.DataObject) -> None:
    ids = data.draw(st.lists(st.sampled_from(sorted(cgpu.units)), min_size=1, max_size=40))
    granted = cgpu.allocate(ids)
    devices = cgpu.devices
    physical = sorted({cgpu.units[i].device_id for i in ids}, key=lambda d: devices[d].index)
    assert granted.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(physical)
    assert granted.annotations == {ALLOCATED_ANNOTATION: ",".join(physical)}
    assert granted.envs["EDL_SHARE_DEVICES"] == ",".join(physical)
    distinct = {cgpu.units[i] for i in ids}
    memory = sum(u.amount for u in distinct if u.kind is UnitKind.MEMORY)
    assert granted.envs.get("EDL_SHARE_MEMORY_MIB", "0") == str(memory)
    assert cgpu.allocate(list(reversed(ids))) == granted


@given(data=st.data())
def test_property_any_unknown_id_is_named(cgpu: Node, data: st.DataObject) -> None:
    ids = data.draw(st.lists(st.sampled_from(sorted(cgpu.units)), max_size=5))
    stranger = data.draw(st.text(min_size=1, max_size=12).filter(lambda s: s not in cgpu.units))
    position = data.draw(st.integers(0, len(ids)))
    with pytest.raises(AllocationError) as caught:
        cgpu.allocate([*ids[:position], stranger, *ids[position:]])
    assert caught.value.kind == "invalid_argument"
    assert stranger in str(caught.value)


def test_vnpu_template_name_comes_from_the_unit_id() -> None:
    # The template name comes from the unit id that devices.resources builds.
    settings = load_settings(overrides=VNPU)
    npu = Device(Vendor.ASCEND, "npu", 0, "npu-0", "Ascend910B3", 65536)
    units = [u for r in advertised_resources([npu], settings) for u in r.units]
    template = [u for u in units if u.kind is UnitKind.TEMPLATE]
    granted = allocate(
        requested_ids=[template[0].id],
        units={u.id: u for u in units},
        devices={npu.id: npu},
        unhealthy=(),
        existing_paths=(),
        settings=settings.plugin,
    )
    assert granted.envs["EDL_VNPU_TEMPLATE"] == "Ascend910-5c"
