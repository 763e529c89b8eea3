"""ResourceSlices from discovered devices (dra.slices), their publication against an in-memory
API (dra.publisher) and the DRA calls over a generic request (dra.api): pure tests. The same
slices against the real API server are in tests/cluster/test_dra_slices.py."""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from edl_agent.config import Settings, load_settings
from edl_agent.devices import names
from edl_agent.devices.discovery import discover_node
from edl_agent.devices.model import Device, Health, Inventory, Vendor, VendorReport
from edl_agent.dra.api import SLICES, KubeDraApi
from edl_agent.dra.publisher import SlicePublisher, SlicePublishError
from edl_agent.dra.slices import (
    CONSUMABLE_CAPACITY,
    DEVICE_TAINTS,
    MAX_DEVICES_PER_SLICE,
    PARTITIONABLE_DEVICES,
    PCI_BUS_ID,
    UNHEALTHY_TAINT_KEY,
    carry_taint_times,
    desired_slices,
    dropped_features,
    same_content,
    slice_name,
    without_features,
)
from edl_agent.dra.values import mib_quantity, semver
from edl_agent.health.state import DeviceState
from edl_agent.kube import ApiError
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree

NOW = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
NODE = "gpu-node-1"
NVIDIA = names.driver_name(Vendor.NVIDIA)
ASCEND = names.driver_name(Vendor.ASCEND)
ALL_DRA = {v.value: {"serve": "dra"} for v in Vendor}
# The API's rules for attribute and capacity names, values and slice names (resource.k8s.io/v1).
C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,31}$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(-(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(\.(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*)?"
    r"(\+[0-9a-zA-Z-]+(\.[0-9a-zA-Z-]+)*)?$"
)
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


@dataclasses.dataclass(frozen=True)
class Simulated:
    inventory: Inventory
    settings: Settings

    def slices(self, unhealthy: Any = (), **kw: Any) -> dict[str, list[dict[str, Any]]]:
        return desired_slices((self.inventory, unhealthy), self.settings, NODE, NOW, **kw)

    def device(self, index: int, kind: str = "gpu") -> Device:
        return next(d for d in self.inventory.devices if d.index == index and d.kind == kind)


def simulate(name: str, root: Path, overrides: Mapping[str, Any] | None = None) -> Simulated:
    profile = load_profile(name)
    build_tree(profile, root)
    settings = load_settings(
        defaults=profile.config,
        overrides={"host_root": str(root), **ALL_DRA, **(overrides or {})},
    )
    return Simulated(discover_node(settings), settings)


@pytest.fixture(scope="module")
def h100(tmp_path_factory: pytest.TempPathFactory) -> Simulated:
    return simulate("dgx-h100", tmp_path_factory.mktemp("dgx-h100"))


@pytest.fixture(scope="module")
def a100_mig(tmp_path_factory: pytest.TempPathFactory) -> Simulated:
    return simulate("dgx-a100-mig", tmp_path_factory.mktemp("dgx-a100-mig"))


@pytest.fixture(scope="module")
def v100_shared(tmp_path_factory: pytest.TempPathFactory) -> Simulated:
    return simulate("cgpu-v100", tmp_path_factory.mktemp("cgpu-v100"))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Simulated:
    return simulate("mixed-gpu-npu", tmp_path_factory.mktemp("mixed-gpu-npu"))


def devices_of(specs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for spec in specs for d in spec.get("devices", [])}


def counter_sets(specs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for spec in specs for c in spec.get("sharedCounters", [])}


def value(device: dict[str, Any], attribute: str) -> Any:
    (only,) = device["attributes"][attribute].values()
    return only


def mib(quantity: str) -> int:
    number, suffix = re.fullmatch(r"(\d+)(Mi|Gi|Ti)?", quantity).groups()  # type: ignore[union-attr]
    return int(number) * {None: 1, "Mi": 1, "Gi": 1024, "Ti": 1024 * 1024}[suffix]


# --- what a pool holds ------------------------------------------------------------------------


def test_a_dgx_h100_is_one_slice_of_eight_gpus_with_their_facts(h100: Simulated) -> None:
    slices = h100.slices()

    assert list(slices) == [NVIDIA]
    (spec,) = slices[NVIDIA]
    assert spec["driver"] == NVIDIA
    assert spec["nodeName"] == NODE
    assert spec["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    devices = devices_of(slices[NVIDIA])
    assert list(devices) == [f"gpu-{i}" for i in range(8)]
    gpu3, found = devices["gpu-3"], h100.device(3)
    assert {name: value(gpu3, name) for name in gpu3["attributes"]} == {
        "vendor": "nvidia",
        "kind": "gpu",
        "product": "NVIDIA H100 80GB HBM3",
        "model": "h100",
        "id": found.id,
        "uuid": found.id,
        "index": 3,
        "serial": found.attributes["serial"],
        "numaNode": found.numa_node,
        "resource.kubernetes.io/numaNode": found.numa_node,
        PCI_BUS_ID: found.pci_bus_id,
        "driverVersion": "550.90.7",
        "cudaDriverVersion": "12.4.0",
        "computeCapability": "9.0.0",
        "architecture": "hopper",
    }
    assert gpu3["attributes"]["driverVersion"] == {"version": "550.90.7"}
    assert gpu3["attributes"]["numaNode"] == {"int": found.numa_node}
    assert gpu3["attributes"]["resource.kubernetes.io/numaNode"] == {"int": found.numa_node}
    assert gpu3["capacity"] == {"memory": {"value": "81559Mi"}}
    assert not {"taints", "allowMultipleAllocations", "consumesCounters"} & gpu3.keys()


@pytest.mark.parametrize(
    "profile", ["dgx-h100", "dgx-a100-mig", "cgpu-v100", "mixed-gpu-npu", "hygon-k100x8",
                "kunlun-p800x8", "ascend-910bx8"],
)  # fmt: skip
def test_each_driver_offers_every_discovered_device_once(profile: str, tmp_path: Path) -> None:
    sim = simulate(profile, tmp_path)
    devices = sim.inventory.devices
    split = {d.parent for d in devices if d.parent is not None}
    expected: dict[str, set[str]] = {}
    all_names = names.device_names(devices)
    for device in devices:
        if device.id not in split:  # a GPU split into MIG devices is offered through them
            expected.setdefault(names.driver_name(device.vendor), set()).add(all_names[device.id])

    slices = sim.slices()

    assert {driver: set(devices_of(specs)) for driver, specs in slices.items()} == expected
    for driver, specs in slices.items():
        offered = [d["name"] for spec in specs for d in spec.get("devices", [])]
        assert len(offered) == len(set(offered)), driver
        by_name = {v: k for k, v in all_names.items()}
        for name, device in devices_of(specs).items():
            assert value(device, "id") == by_name[name]
            assert value(device, "vendor") == names.vendor_of_driver(driver).value  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "profile", ["dgx-h100", "dgx-a100-mig", "cgpu-v100", "mixed-gpu-npu", "hygon-k100x8",
                "kunlun-p800x8", "ascend-910bx8"],
)  # fmt: skip
def test_names_values_and_sizes_are_within_the_apis_limits(profile: str, tmp_path: Path) -> None:
    sim = simulate(profile, tmp_path)
    unhealthy = {d.id: "XID 79: GPU has fallen off the bus!" for d in sim.inventory.devices[:2]}

    for driver, specs in sim.slices(unhealthy).items():
        assert DNS_SUBDOMAIN.match(driver)
        assert len(driver) <= 63
        for spec in specs:
            assert ("devices" in spec) != ("sharedCounters" in spec)
            assert len(spec.get("devices", [])) <= 64
            assert len(spec.get("sharedCounters", [])) <= 8
        for device in devices_of(specs).values():
            assert DNS_LABEL.match(device["name"])
            keys = [*device["attributes"], *device.get("capacity", {})]
            assert len(keys) <= 32
            for key in keys:
                domain, _, identifier = key.rpartition("/")
                assert C_IDENTIFIER.match(identifier), key
                assert not domain or DNS_SUBDOMAIN.match(domain), key
            for attribute in device["attributes"].values():
                ((kind, item),) = attribute.items()
                assert kind in {"string", "int", "bool", "version"}
                if kind in {"string", "version"}:
                    assert len(item) <= 64
                if kind == "version":
                    assert SEMVER.match(item), item
            for taint in device.get("taints", []):
                assert LABEL_VALUE.match(taint["value"])
                assert len(taint["value"]) <= 63
        for counter_set in counter_sets(specs).values():
            assert DNS_LABEL.match(counter_set["name"])
            assert all(DNS_LABEL.match(counter) for counter in counter_set["counters"])


def test_only_vendors_served_through_dra_get_a_pool(mixed: Simulated) -> None:
    both = mixed.slices()
    assert set(both) == {NVIDIA, ASCEND}
    npu = devices_of(both[ASCEND])["npu-2"]
    assert value(npu, "kind") == "npu"
    assert value(npu, "driverVersion") == "24.1.0-rc2"
    assert "cudaDriverVersion" not in npu["attributes"]
    assert npu["capacity"] == {"memory": {"value": "64Gi"}}

    for serve, expected in (("both", {NVIDIA, ASCEND}), ("device-plugin", {NVIDIA})):
        settings = dataclasses.replace(
            mixed.settings, ascend=dataclasses.replace(mixed.settings.ascend, serve=serve)
        )
        slices = desired_slices((mixed.inventory, ()), settings, NODE, NOW)
        assert set(slices) == expected, serve


# --- MIG: partitionable devices ---------------------------------------------------------------


def test_mig_devices_consume_their_gpus_counters(a100_mig: Simulated) -> None:
    (devices_spec, counters_spec) = a100_mig.slices()[NVIDIA]
    devices, sets = devices_of([devices_spec]), counter_sets([counters_spec])
    all_names = names.device_names(a100_mig.inventory.devices)
    migs = [d for d in a100_mig.inventory.devices if d.kind == "mig"]
    parents = {d.parent for d in migs}

    assert (
        devices_spec["pool"]["resourceSliceCount"]
        == counters_spec["pool"]["resourceSliceCount"]
        == 2
    )
    assert set(sets) == {all_names[p] for p in parents if p}
    assert {"gpu-6", "gpu-7"} <= devices.keys()  # MIG-capable but not split: whole
    assert not {all_names[p] for p in parents if p} & devices.keys()
    for mig in migs:
        entry = devices[all_names[mig.id]]
        parent = a100_mig.inventory.device(mig.parent or "")
        assert parent is not None
        assert value(entry, "kind") == "mig"
        assert value(entry, "migProfile") == mig.attributes["mig_profile"]
        assert value(entry, "parentUUID") == parent.id
        assert value(entry, "parentIndex") == parent.index
        assert value(entry, "gpuInstance") == int(mig.attributes["gpu_instance_id"])
        assert value(entry, "computeCapability") == "8.0.0"  # the GPU's
        assert entry["consumesCounters"] == [
            {
                "counterSet": all_names[parent.id],
                "counters": {"memory": {"value": mib_quantity(mig.memory_mib)}},
            }
        ]
    for name, counter_set in sets.items():
        consumed = sum(
            mib(c["counters"]["memory"]["value"])
            for d in devices.values()
            for c in d.get("consumesCounters", [])
            if c["counterSet"] == name
        )
        assert counter_set["counters"] == {"memory": {"value": "80Gi"}}
        assert 0 < consumed <= 80 * 1024


def test_without_mig_strategy_whole_gpus_only(a100_mig: Simulated) -> None:
    settings = dataclasses.replace(
        a100_mig.settings, nvidia=dataclasses.replace(a100_mig.settings.nvidia, mig_strategy="none")
    )

    (spec,) = desired_slices((a100_mig.inventory, ()), settings, NODE, NOW)[NVIDIA]

    assert list(devices_of([spec])) == [f"gpu-{i}" for i in range(8)]


def test_a_counter_set_holds_all_its_mig_devices_even_when_the_gpu_reports_less() -> None:
    gpu = Device(Vendor.NVIDIA, "gpu", 0, "GPU-0", "NVIDIA A100", 40000)
    migs = [
        Device(Vendor.NVIDIA, "mig", i, f"MIG-{i}", "NVIDIA A100 MIG 3g.20gb", 20352,
               parent="GPU-0", attributes={"gpu_instance_id": str(i + 1), "mig_profile": "3g.20gb"})
        for i in range(2)
    ]  # fmt: skip
    settings = load_settings(
        overrides={**ALL_DRA, "nvidia": {"serve": "dra", "mig_strategy": "mixed"}}
    )

    specs = desired_slices((inventory_of(gpu, *migs), ()), settings, NODE, NOW)[NVIDIA]

    assert counter_sets(specs)["gpu-0"]["counters"]["memory"]["value"] == mib_quantity(2 * 20352)


# --- sharing: consumable capacity -------------------------------------------------------------


def test_a_shared_gpu_allows_many_claims_taking_units_of_it(v100_shared: Simulated) -> None:
    (spec,) = v100_shared.slices()[NVIDIA]
    gpu0 = devices_of([spec])["gpu-0"]

    assert gpu0["allowMultipleAllocations"] is True
    assert gpu0["capacity"] == {
        "memory": {
            "value": "32Gi",
            "requestPolicy": {"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}},
        },
        "cores": {
            "value": "100",
            "requestPolicy": {"default": "5", "validRange": {"min": "5", "step": "5"}},
        },
        "replicas": {
            "value": "4",
            "requestPolicy": {"default": "1", "validRange": {"min": "1", "step": "1"}},
        },
    }
    assert all(d.get("allowMultipleAllocations") for d in devices_of([spec]).values())


def test_a_device_too_small_for_two_units_gets_no_step_and_one_below_a_unit_no_policy() -> None:
    rule = {"resource": "kunlunxin.com/xpu", "memory_unit_mib": 1024, "core_unit_percent": 100}
    settings = load_settings(overrides={**ALL_DRA, "sharing": [rule]})
    xpus = [
        Device(Vendor.KUNLUNXIN, "xpu", i, f"xpu{i}", "P800", memory)
        for i, memory in enumerate((1536, 512))
    ]

    devices = devices_of(desired_slices((inventory_of(*xpus), ()), settings, NODE, NOW)[
        names.driver_name(Vendor.KUNLUNXIN)
    ])  # fmt: skip

    assert devices["xpu-0"]["capacity"]["memory"]["requestPolicy"] == {
        "default": "1Gi",
        "validRange": {"min": "1Gi"},
    }
    assert "requestPolicy" not in devices["xpu-1"]["capacity"]["memory"]
    assert devices["xpu-0"]["capacity"]["cores"]["requestPolicy"]["validRange"] == {"min": "100"}
    assert "replicas" not in devices["xpu-0"]["capacity"]


# --- health: taints ---------------------------------------------------------------------------


def test_unhealthy_devices_carry_a_taint_with_the_reason(a100_mig: Simulated) -> None:
    settings = dataclasses.replace(
        a100_mig.settings,
        dra=dataclasses.replace(a100_mig.settings.dra, unhealthy_taint="NoExecute"),
    )
    gpu0, gpu7 = a100_mig.device(0), a100_mig.device(7)
    reasons = {gpu0.id: "XID79", gpu7.id: "XID 48: double bit ECC error"}

    specs = desired_slices((a100_mig.inventory, reasons), settings, NODE, NOW)[NVIDIA]

    devices = devices_of(specs)
    tainted = {name: d["taints"] for name, d in devices.items() if "taints" in d}
    children = [n for n in devices if n.startswith("gpu-0-mig-")]
    assert set(tainted) == {*children, "gpu-7"}
    assert tainted["gpu-7"] == [
        {
            "key": UNHEALTHY_TAINT_KEY,
            "value": "XID-48-double-bit-ECC-error",
            "effect": "NoExecute",
            "timeAdded": "2026-05-01T12:00:00Z",
        }
    ]
    assert {t[0]["value"] for n, t in tainted.items() if n in children} == {"XID79"}


def test_a_snapshot_taints_what_it_finds_unhealthy(h100: Simulated) -> None:
    state = DeviceState(h100.inventory)
    state.set_unhealthy({h100.device(5).id})
    gone = dataclasses.replace(h100.device(6), health=Health.UNHEALTHY)
    reports = (dataclasses.replace(
        h100.inventory.reports[0],
        devices=tuple(gone if d.index == 6 else d for d in h100.inventory.reports[0].devices),
    ),)  # fmt: skip

    from_snapshot = desired_slices(state.snapshot(), h100.settings, NODE, NOW)
    from_ids = desired_slices(
        (dataclasses.replace(h100.inventory, reports=reports), [h100.device(5).id]),
        h100.settings, NODE, NOW,
    )  # fmt: skip

    assert {n for n, d in devices_of(from_snapshot[NVIDIA]).items() if "taints" in d} == {"gpu-5"}
    tainted = {n: d["taints"][0]["value"] for n, d in devices_of(from_ids[NVIDIA]).items()
               if "taints" in d}  # fmt: skip
    assert tainted == {"gpu-5": "true", "gpu-6": "true"}


# --- splitting and names ----------------------------------------------------------------------


def test_large_pools_split_into_slices_of_64_devices_and_8_counter_sets() -> None:
    gpus = [Device(Vendor.NVIDIA, "gpu", i, f"GPU-{i}", "NVIDIA A100", 81920) for i in range(150)]
    migs = [
        Device(Vendor.NVIDIA, "mig", 0, f"MIG-{i}", "NVIDIA A100 MIG 7g.80gb", 81920,
               parent=f"GPU-{i}", attributes={"gpu_instance_id": "0", "mig_profile": "7g.80gb"})
        for i in range(10)
    ]  # fmt: skip
    settings = load_settings(
        overrides={**ALL_DRA, "nvidia": {"serve": "dra", "mig_strategy": "mixed"}}
    )

    specs = desired_slices((inventory_of(*gpus, *migs), ()), settings, NODE, NOW)[NVIDIA]

    assert [len(s.get("devices", s.get("sharedCounters"))) for s in specs] == [64, 64, 22, 8, 2]
    assert MAX_DEVICES_PER_SLICE == 64
    assert {s["pool"]["resourceSliceCount"] for s in specs} == {5}
    assert len(devices_of(specs)) == 150  # 140 whole GPUs and 10 MIG devices
    assert len(counter_sets(specs)) == 10


def test_slice_names_are_per_node_driver_and_index_and_fit_the_api() -> None:
    assert slice_name(NODE, NVIDIA, 0) == "gpu-node-1-gpu-nvidia-0"
    assert slice_name(NODE, names.driver_name(Vendor.HYGON), 12) == "gpu-node-1-dcu-hygon-12"
    long_node = ".".join(["a" * 63] * 4)[:253]
    long_other = long_node[:-1] + "b"
    name = slice_name(long_node, NVIDIA, 3)
    assert len(name) <= 253
    assert DNS_SUBDOMAIN.match(name)
    assert name.endswith("-gpu-nvidia-3")
    assert name != slice_name(long_other, NVIDIA, 3)
    assert name == slice_name(long_node, NVIDIA, 3)


@pytest.mark.parametrize(
    ("mebibytes", "quantity"),
    [(81920, "80Gi"), (81559, "81559Mi"), (1024 * 1024, "1Ti"), (1536, "1536Mi"), (0, "0")],
)
def test_memory_is_written_as_the_api_server_writes_it_back(mebibytes: int, quantity: str) -> None:
    assert mib_quantity(mebibytes) == quantity


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("535.183.01", "535.183.1"),
        ("550.90.07", "550.90.7"),
        ("24.1.rc2", "24.1.0-rc2"),
        ("5.0.21.21", "5.0.21+21"),
        ("12.4", "12.4.0"),
        ("8.0", "8.0.0"),
        ("6.3.8", "6.3.8"),
        ("v1.2.3-beta.01", "1.2.3-beta.1"),
        ("unknown", None),
        ("", None),
    ],
)
def test_versions_become_semantic_versions(version: str, expected: str | None) -> None:
    assert semver(version) == expected
    assert expected is None or SEMVER.match(expected)


# --- comparing with what is stored, and clusters without a feature ----------------------------


def test_the_generation_and_a_kept_taints_time_are_not_changes(h100: Simulated) -> None:
    reasons = {h100.device(2).id: "XID79"}
    (stored,) = h100.slices(reasons)[NVIDIA]
    stored["pool"]["generation"] = 7
    later = desired_slices((h100.inventory, reasons), h100.settings, NODE, NOW + timedelta(hours=1))

    assert same_content(later[NVIDIA][0], stored)
    assert carry_taint_times(later[NVIDIA][0], stored)["devices"][2]["taints"][0]["timeAdded"] == (
        "2026-05-01T12:00:00Z"
    )
    other_reason = h100.slices({h100.device(2).id: "XID48"})[NVIDIA][0]
    assert not same_content(other_reason, stored)
    assert not same_content(h100.slices()[NVIDIA][0], stored)


def test_fields_a_server_drops_are_noticed(a100_mig: Simulated, v100_shared: Simulated) -> None:
    mig_sent = a100_mig.slices({a100_mig.device(0).id: "XID79"})[NVIDIA]
    shared_sent = v100_shared.slices()[NVIDIA][0]

    assert dropped_features(mig_sent[0], copy.deepcopy(mig_sent[0])) == frozenset()
    stripped = copy.deepcopy(mig_sent[0])
    for device in stripped["devices"]:
        device.pop("taints", None)
        device.pop("consumesCounters", None)
    assert dropped_features(mig_sent[0], stripped) == {DEVICE_TAINTS, PARTITIONABLE_DEVICES}
    assert dropped_features(mig_sent[1], {**mig_sent[1], "sharedCounters": None}) == {
        PARTITIONABLE_DEVICES
    }
    plain = without_features([shared_sent], {CONSUMABLE_CAPACITY})[0]
    assert dropped_features(shared_sent, plain) == {CONSUMABLE_CAPACITY}


def test_without_a_feature_its_fields_go_and_unhealthy_devices_are_left_out(
    a100_mig: Simulated, v100_shared: Simulated
) -> None:
    reasons = {a100_mig.device(7).id: "XID79"}
    mig_specs = a100_mig.slices(reasons)[NVIDIA]

    plain = without_features(mig_specs, {PARTITIONABLE_DEVICES, DEVICE_TAINTS})

    (spec,) = plain
    assert spec["pool"]["resourceSliceCount"] == 1
    assert "gpu-7" not in devices_of(plain)
    assert len(devices_of(plain)) == len(devices_of(mig_specs)) - 1
    assert not any("consumesCounters" in d for d in devices_of(plain).values())
    assert len(devices_of(mig_specs)) == len(devices_of(a100_mig.slices(reasons)[NVIDIA]))

    (whole,) = without_features(v100_shared.slices()[NVIDIA], {CONSUMABLE_CAPACITY})
    for device in devices_of([whole]).values():
        assert "allowMultipleAllocations" not in device
        assert not any("requestPolicy" in c for c in device["capacity"].values())
    assert without_features(mig_specs, ()) == mig_specs


# --- the publisher, against an API held in memory ---------------------------------------------


class MemoryApi:
    """The DRA calls over a dict, as the API server answers them: resourceVersions, 409 on a
    stale one, 404s, and (with `drops`) the fields of features that are off dropped silently."""

    def __init__(self, *, drops: frozenset[str] = frozenset()) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.nodes = {NODE: {"metadata": {"name": NODE, "uid": "node-uid-1"}}}
        self.version = 0
        self.calls: list[str] = []
        self.drops = drops
        self.race: str | None = None  # a slice someone else rewrites before our next write

    def read_node(self, name: str) -> dict[str, Any]:
        if name not in self.nodes:
            raise ApiError(404, f'nodes "{name}" not found')
        return copy.deepcopy(self.nodes[name])

    def list_resource_slices(self, *, node: str, driver: str | None = None) -> list[dict[str, Any]]:
        self.calls.append("list")
        return [
            copy.deepcopy(s)
            for s in self.slices.values()
            if s["spec"]["nodeName"] == node and driver in (None, s["spec"]["driver"])
        ]

    def create_resource_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        self.calls.append("create")
        self._race()
        name = body["metadata"]["name"]
        if name in self.slices:
            raise ApiError(409, f'resourceslices "{name}" already exists')
        return self._store(body)

    def replace_resource_slice(self, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self.calls.append("replace")
        self._race()
        if name not in self.slices:
            raise ApiError(404, "not found")
        if body["metadata"]["resourceVersion"] != self.slices[name]["metadata"]["resourceVersion"]:
            raise ApiError(409, "the object has been modified")
        return self._store(body)

    def delete_resource_slice(self, name: str, *, resource_version: str | None = None) -> bool:
        self.calls.append("delete")
        if name not in self.slices:
            return False
        if resource_version not in (None, self.slices[name]["metadata"]["resourceVersion"]):
            raise ApiError(409, "precondition failed")
        del self.slices[name]
        return True

    def read_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        raise ApiError(404, "not found")

    def writes(self) -> list[str]:
        return [c for c in self.calls if c != "list"]

    def _store(self, body: Mapping[str, Any]) -> dict[str, Any]:
        self.version += 1
        stored = copy.deepcopy(dict(body))
        stored["metadata"]["resourceVersion"] = str(self.version)
        self._drop_fields(stored["spec"])
        self.slices[stored["metadata"]["name"]] = stored
        return copy.deepcopy(stored)

    def _drop_fields(self, spec: dict[str, Any]) -> None:
        if PARTITIONABLE_DEVICES in self.drops:
            spec.pop("sharedCounters", None)
        for device in spec.get("devices", []):
            if DEVICE_TAINTS in self.drops:
                device.pop("taints", None)
            if PARTITIONABLE_DEVICES in self.drops:
                device.pop("consumesCounters", None)
            if CONSUMABLE_CAPACITY in self.drops:
                device.pop("allowMultipleAllocations", None)
                for capacity in device.get("capacity", {}).values():
                    capacity.pop("requestPolicy", None)

    def _race(self) -> None:
        if self.race is not None and self.race in self.slices:
            self.version += 1
            self.slices[self.race]["metadata"]["resourceVersion"] = str(self.version)
            self.race = None


def inventory_of(*devices: Device, node: str = NODE) -> Inventory:
    reports = {}
    for device in devices:
        reports.setdefault(device.vendor, []).append(device)
    return Inventory(
        node, tuple(VendorReport(v, tuple(ds)) for v, ds in reports.items()), resources=()
    )


def test_a_sync_creates_the_pools_then_changes_nothing(mixed: Simulated) -> None:
    api = MemoryApi()
    publisher = SlicePublisher(api, NODE)

    with capture_logs() as logs:
        first = publisher.sync(mixed.slices())
    again = publisher.sync(mixed.slices())

    assert (first.created, first.updated, first.deleted) == (2, 0, 0)
    assert first.generations == {NVIDIA: 1, ASCEND: 1}
    assert set(api.slices) == {f"{NODE}-gpu-nvidia-0", f"{NODE}-npu-ascend-0"}
    stored = api.slices[f"{NODE}-gpu-nvidia-0"]
    assert stored["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "node-uid-1", "controller": True}
    ]
    assert stored["apiVersion"] == "resource.k8s.io/v1"
    assert (again.writes, again.generations) == (0, {NVIDIA: 1, ASCEND: 1})
    assert api.writes() == ["create", "create"]
    written = [e for e in logs if e["event"] == "resource slices written"]
    assert {(e["driver"], e["generation"], e["created"]) for e in written} == {
        (NVIDIA, 1, 1), (ASCEND, 1, 1)
    }  # fmt: skip


def test_a_health_change_rewrites_the_pool_at_the_next_generation(h100: Simulated) -> None:
    api = MemoryApi()
    SlicePublisher(api, NODE).sync(h100.slices())
    sick = {h100.device(4).id: "XID79"}
    restarted = SlicePublisher(api, NODE)  # a new agent process: generation from the API

    result = restarted.sync(h100.slices(sick))
    later = desired_slices((h100.inventory, sick), h100.settings, NODE, NOW + timedelta(hours=1))
    unchanged = restarted.sync(later)
    healed = restarted.sync(h100.slices())

    assert (result.created, result.updated, result.deleted) == (0, 1, 0)
    assert result.generations == {NVIDIA: 2}
    assert unchanged.writes == 0
    assert healed.generations == {NVIDIA: 3}
    (stored,) = api.slices.values()
    assert not any("taints" in d for d in stored["spec"]["devices"])


def test_a_vanished_driver_and_extra_slices_are_deleted(mixed: Simulated) -> None:
    api = MemoryApi()
    publisher = SlicePublisher(api, NODE)
    publisher.sync(mixed.slices())
    foreign = {
        "metadata": {"name": "someone-elses", "resourceVersion": "1"},
        "spec": {"driver": "gpu.example.com", "nodeName": NODE, "pool": {"name": NODE}},
    }
    api.slices["someone-elses"] = foreign
    nvidia_only = {NVIDIA: mixed.slices()[NVIDIA]}

    result = publisher.sync(nvidia_only)

    assert (result.created, result.updated, result.deleted) == (0, 0, 1)
    assert set(api.slices) == {f"{NODE}-gpu-nvidia-0", "someone-elses"}
    assert publisher.remove_all().deleted == 1
    assert set(api.slices) == {"someone-elses"}


def test_a_conflict_lists_again_and_retries(h100: Simulated) -> None:
    api = MemoryApi()
    publisher = SlicePublisher(api, NODE)
    publisher.sync(h100.slices())
    api.race = f"{NODE}-gpu-nvidia-0"

    result = publisher.sync(h100.slices({h100.device(1).id: "XID79"}))

    assert publisher.conflicts == 1
    assert result.updated == 1
    assert api.calls[-4:] == ["list", "replace", "list", "replace"]


def test_conflicts_without_end_raise_a_publish_error(h100: Simulated) -> None:
    api = MemoryApi()
    publisher = SlicePublisher(api, NODE, attempts=2)
    api.slices[f"{NODE}-gpu-nvidia-0"] = {  # a name of ours taken, on another node
        "metadata": {"name": f"{NODE}-gpu-nvidia-0", "resourceVersion": "1"},
        "spec": {"driver": NVIDIA, "nodeName": "other", "pool": {"name": "other"}},
    }

    with pytest.raises(SlicePublishError) as raised:
        publisher.sync(h100.slices())

    assert raised.value.status == 409
    assert "already exists" in str(raised.value)


def test_a_missing_node_is_a_publish_error(h100: Simulated) -> None:
    api = MemoryApi()
    del api.nodes[NODE]

    with pytest.raises(SlicePublishError, match="not found"):
        SlicePublisher(api, NODE).sync(h100.slices())
    assert api.writes() == []


def test_a_server_without_consumable_capacity_gets_whole_devices_and_one_warning(
    v100_shared: Simulated,
) -> None:
    api = MemoryApi(drops=frozenset({CONSUMABLE_CAPACITY}))
    publisher = SlicePublisher(api, NODE)

    with capture_logs() as logs:
        first = publisher.sync(v100_shared.slices())
        second = publisher.sync(v100_shared.slices())

    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [(e["feature"], e["fallback"]) for e in warnings] == [
        (CONSUMABLE_CAPACITY, "shared devices are published whole: one claim holds each")
    ]
    assert publisher.unsupported == {CONSUMABLE_CAPACITY}
    assert first.created == 1
    assert second.writes == 0
    (stored,) = api.slices.values()
    assert not any("allowMultipleAllocations" in d for d in stored["spec"]["devices"])


def test_a_server_without_device_taints_gets_no_unhealthy_devices(h100: Simulated) -> None:
    api = MemoryApi(drops=frozenset({DEVICE_TAINTS}))
    publisher = SlicePublisher(api, NODE)
    sick = h100.slices({h100.device(3).id: "XID79"})

    result = publisher.sync(sick)
    again = publisher.sync(sick)

    assert publisher.unsupported == {DEVICE_TAINTS}
    assert (result.created, result.updated) == (1, 1)  # as sent, then without gpu-3
    assert again.writes == 0
    (stored,) = api.slices.values()
    assert "gpu-3" not in {d["name"] for d in stored["spec"]["devices"]}
    assert len(stored["spec"]["devices"]) == 7


# --- the calls, over a generic request --------------------------------------------------------


class RecordingClient:
    def __init__(self, answers: list[dict[str, Any] | ApiError]) -> None:
        self.answers = answers
        self.requests: list[tuple[str, str, Any, Any]] = []

    def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        query: Mapping[str, str] | None = None,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        self.requests.append((method, path, body, dict(query or {})))
        answer = self.answers.pop(0)
        if isinstance(answer, ApiError):
            raise answer
        return answer


def test_listing_selects_the_node_and_driver_and_follows_continue_tokens() -> None:
    client = RecordingClient([
        {"items": [{"metadata": {"name": "a"}}], "metadata": {"continue": "next"}},
        {"items": [{"metadata": {"name": "b"}}], "metadata": {}},
    ])  # fmt: skip

    items = KubeDraApi(client).list_resource_slices(node=NODE, driver=NVIDIA)

    assert [i["metadata"]["name"] for i in items] == ["a", "b"]
    (_, path, _, first), (_, _, _, second) = client.requests
    assert path == SLICES == "/apis/resource.k8s.io/v1/resourceslices"
    assert first["fieldSelector"] == f"spec.nodeName={NODE},spec.driver={NVIDIA}"
    assert second["continue"] == "next"


def test_deletes_carry_the_precondition_and_a_gone_slice_is_no_error() -> None:
    client = RecordingClient([{}, ApiError(404, "not found")])
    api = KubeDraApi(client)

    assert api.delete_resource_slice("x", resource_version="42") is True
    assert api.delete_resource_slice("y") is False
    (method, path, body, _), (_, _, plain, _) = client.requests
    assert (method, path) == ("DELETE", f"{SLICES}/x")
    assert body["preconditions"] == {"resourceVersion": "42"}
    assert "preconditions" not in plain

    failing = KubeDraApi(RecordingClient([ApiError(403, "forbidden")]))
    with pytest.raises(ApiError):
        failing.delete_resource_slice("z")


def test_claims_and_slices_are_addressed_by_escaped_names() -> None:
    client = RecordingClient([{}, {}, {}])
    api = KubeDraApi(client)

    api.read_resource_claim("ml team", "claim-1")
    api.replace_resource_slice("a/b", {"metadata": {}})
    api.create_resource_slice({"metadata": {}})

    paths = [(m, p) for m, p, _, _ in client.requests]
    assert paths == [
        ("GET", "/apis/resource.k8s.io/v1/namespaces/ml%20team/resourceclaims/claim-1"),
        ("PUT", f"{SLICES}/a%2Fb"),
        ("POST", SLICES),
    ]
