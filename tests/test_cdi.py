"""CDI specs from real discovery of simulated nodes, checked against the CDI project's own JSON
schema, and the writer that puts them where the container runtime reads them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft7Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from edl_agent.cdi import (
    CDI_VERSION,
    CdiWriter,
    Grant,
    claim_cdi_id,
    claim_spec,
    vendor_spec,
)
from edl_agent.cdi.spec import CLAIM_UID_ENV
from edl_agent.config import PluginSettings, load_settings
from edl_agent.devices import names
from edl_agent.devices.container import VENDOR_SPECS, optional_control_nodes
from edl_agent.devices.discovery import discover_node
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, Inventory, ResourceUnit, UnitKind, Vendor
from edl_agent.plugin.allocation import allocate
from edl_agent.sim.profile import load_profile, profile_names
from edl_agent.sim.tree import build_tree

# The last release of the CDI Go module that ships `schema/` inside the module itself; later
# releases moved it out of the module.
CDI_MODULE = "tags.cncf.io/container-device-interface"
CDI_MODULE_VERSION = "v0.8.1"
CLAIM_UID = "6f1c2a9e-55b0-4c1e-9d0a-3b8f2e7d4c10"

# Naming rules from the CDI specification (SPEC.md, "Kind" and "CDI Devices"), which its JSON
# schema does not encode.
_SEGMENT = r"[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?"
KIND = re.compile(rf"^{_SEGMENT}(\.{_SEGMENT})*/{_SEGMENT}$")
DEVICE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
ENV_ENTRY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


# --- the CDI project's schema ----------------------------------------------------------------


@dataclass(frozen=True)
class CdiSchema:
    """The CDI project's schema.json, and the containerEdits definition from its defs.json:
    schema.json leaves a spec's own (spec-level) containerEdits unchecked."""

    spec: Draft7Validator
    edits: Draft7Validator

    def errors(self, spec: Mapping[str, Any]) -> list[str]:
        found = [error.message for error in self.spec.iter_errors(spec)]
        if "containerEdits" in spec:
            edits = self.edits.iter_errors(spec["containerEdits"])
            found += [f"containerEdits: {error.message}" for error in edits]
        return found


@pytest.fixture(scope="session")
def cdi_schema(tmp_path_factory: pytest.TempPathFactory) -> CdiSchema:
    """The CDI JSON schema, from the Go module cache (downloaded once through the Go proxy)."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("go is not on PATH: the CDI schema is read from the CDI Go module")
    result = subprocess.run(
        [go, "mod", "download", "-json", f"{CDI_MODULE}@{CDI_MODULE_VERSION}"],
        cwd=tmp_path_factory.mktemp("go"),  # outside any Go module
        env={**os.environ, "GOFLAGS": "-mod=mod"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"go mod download failed: {result.stdout}{result.stderr}"
    return load_schema(Path(json.loads(result.stdout)["Dir"]) / "schema")


def load_schema(schema_dir: Path) -> CdiSchema:
    """Validators whose `$ref`s to sibling files (defs.json) resolve to the files in
    `schema_dir`."""
    documents = {path: json.loads(path.read_text()) for path in schema_dir.glob("*.json")}
    registry: Registry[Any] = Registry().with_resources(
        (path.as_uri(), Resource.from_contents(doc, default_specification=DRAFT7))
        for path, doc in documents.items()
    )
    Draft7Validator.check_schema(documents[schema_dir / "schema.json"])

    def validator(uri: str) -> Draft7Validator:
        return Draft7Validator({"$ref": uri}, registry=registry)

    return CdiSchema(
        spec=validator((schema_dir / "schema.json").as_uri()),
        edits=validator(f"{(schema_dir / 'defs.json').as_uri()}#/definitions/containerEdits"),
    )


def assert_valid_cdi(spec: Mapping[str, Any], schema: CdiSchema) -> None:
    assert schema.errors(spec) == []
    assert spec["cdiVersion"] == CDI_VERSION
    assert KIND.match(spec["kind"]), spec["kind"]
    assert len(spec["kind"].partition("/")[2]) <= 63
    device_names = [device["name"] for device in spec["devices"]]
    assert device_names, "a CDI spec needs at least one device"
    assert len(set(device_names)) == len(device_names)
    assert all(DEVICE_NAME.match(name) for name in device_names), device_names
    edits = [spec.get("containerEdits", {}), *(d["containerEdits"] for d in spec["devices"])]
    # schema.json's env items are not constrained, so their form is checked here
    assert all(ENV_ENTRY.match(entry) for edit in edits for entry in edit.get("env", []))
    assert all(node["path"].startswith("/dev/") for e in edits for node in e.get("deviceNodes", []))
    json.dumps(spec)  # serialisable as it is


def broken(spec: Mapping[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    copy: dict[str, Any] = json.loads(json.dumps(spec))
    change(copy)
    return copy


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda s: s["devices"][0].pop("name"), id="device without a name"),
        pytest.param(lambda s: s["devices"][0].pop("containerEdits"), id="device without edits"),
        pytest.param(
            lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].pop("path"),
            id="device node without a path",
        ),
        pytest.param(lambda s: s.pop("kind"), id="no kind"),
        pytest.param(lambda s: s.pop("cdiVersion"), id="no version"),
        pytest.param(lambda s: s.update(devices={}), id="devices not a list"),
        pytest.param(
            lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(major="195"),
            id="device node major not a number",
        ),
        pytest.param(
            lambda s: s["containerEdits"]["deviceNodes"][0].pop("path"),
            id="spec-level node without a path",
        ),
        pytest.param(
            lambda s: s["containerEdits"].update(deviceNodes="/dev/xpuctrl"),
            id="spec-level nodes not a list",
        ),
    ],
)
def test_schema_rejects_broken_specs(
    simulated: Callable[[str], Node],
    cdi_schema: CdiSchema,
    change: Callable[[dict[str, Any]], None],
) -> None:
    node = simulated("kunlun-p800x8")
    spec = vendor_spec(Vendor.KUNLUNXIN, node.inventory.devices, node.present)
    assert spec is not None
    assert cdi_schema.errors(spec) == []
    assert cdi_schema.errors(broken(spec, change)) != []


# --- simulated nodes -------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    inventory: Inventory
    root: HostRoot
    units: Mapping[str, ResourceUnit]
    settings: PluginSettings

    @property
    def devices(self) -> dict[str, Device]:
        return {d.id: d for d in self.inventory.devices}

    @property
    def present(self) -> frozenset[str]:
        """The host paths that exist: every device node and control node on the simulated host."""
        candidates = {n for d in self.inventory.devices for n in d.device_nodes}
        return frozenset(p for p in candidates | optional_control_nodes() if self.root.exists(p))

    def of(self, vendor: Vendor) -> list[Device]:
        return [d for d in self.inventory.devices if d.vendor is vendor]

    def whole(self, vendor: Vendor, *indexes: int) -> list[Device]:
        """The vendor's whole devices (no MIG instances) with these host indexes, in this order."""
        by_index = {d.index: d for d in self.of(vendor) if d.parent is None}
        return [by_index[i] for i in indexes]

    def allocate_envs(self, units: Sequence[ResourceUnit]) -> Mapping[str, str]:
        granted = allocate(
            requested_ids=[u.id for u in units],
            units={u.id: u for u in units},
            devices=self.devices,
            unhealthy=(),
            existing_paths=self.present,
            settings=self.settings,
        )
        return granted.envs


def build_node(profile_name: str, root: Path, **overrides: Any) -> Node:
    profile = load_profile(profile_name)
    build_tree(profile, root)
    config = load_settings(defaults=profile.config, overrides={"host_root": str(root), **overrides})
    inventory = discover_node(config)
    units = {u.id: u for r in inventory.resources for u in r.units}
    return Node(inventory, HostRoot.at(str(root)), units, config.plugin)


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Node]:
    cache: dict[str, Node] = {}

    def build(name: str, **overrides: Any) -> Node:
        key = f"{name}{sorted(overrides.items())}"
        if key not in cache:
            cache[key] = build_node(name, tmp_path_factory.mktemp(name), **overrides)
        return cache[key]

    return build


def spec_devices(spec: Mapping[str, Any]) -> dict[str, list[str]]:
    """CDI device name → the paths of its device nodes."""
    return {
        d["name"]: [n["path"] for n in d["containerEdits"]["deviceNodes"]] for d in spec["devices"]
    }


def spec_control_nodes(spec: Mapping[str, Any]) -> list[str]:
    return [n["path"] for n in spec.get("containerEdits", {}).get("deviceNodes", [])]


# --- vendor specs ----------------------------------------------------------------------------


@pytest.mark.parametrize("profile", profile_names())
def test_vendor_specs_name_every_discovered_device(
    simulated: Callable[[str], Node], cdi_schema: CdiSchema, profile: str
) -> None:
    node = simulated(profile)
    assert node.inventory.errors == {}
    for vendor in Vendor:
        members = node.of(vendor)
        spec = vendor_spec(vendor, node.inventory.devices, node.present)
        if not members:
            assert spec is None
            continue
        assert spec is not None
        assert_valid_cdi(spec, cdi_schema)
        assert spec["kind"] == names.cdi_kind(vendor)
        expected = names.device_names(members)
        assert len(spec["devices"]) == len(members) == len(expected)
        assert set(spec_devices(spec)) == set(expected.values())
        by_name = {name: node.devices[i] for i, name in expected.items()}
        for name, paths in spec_devices(spec).items():
            device = by_name[name]
            shared = VENDOR_SPECS[vendor].control_nodes
            assert paths == [p for p in device.device_nodes if p not in shared]
            assert paths, f"{name} has no device node of its own"
        assert spec_control_nodes(spec) == [
            p for p in VENDOR_SPECS[vendor].control_nodes if node.root.exists(p)
        ]


def test_vendor_spec_lists_devices_in_host_order(simulated: Callable[[str], Node]) -> None:
    node = simulated("dgx-h100")
    spec = vendor_spec(Vendor.NVIDIA, reversed(node.inventory.devices), node.present)
    assert spec is not None
    assert list(spec_devices(spec)) == [f"gpu-{i}" for i in range(8)]


def test_mig_devices_carry_their_gpu_node(simulated: Callable[[str], Node]) -> None:
    node = simulated("dgx-a100-mig")
    spec = vendor_spec(Vendor.NVIDIA, node.inventory.devices, node.present)
    assert spec is not None
    listed = spec_devices(spec)
    migs = [d for d in node.inventory.devices if d.parent is not None]
    assert migs
    for mig in migs:
        gpu = node.devices[mig.parent or ""]
        name = names.device_name(mig, gpu)
        assert name.startswith(f"gpu-{gpu.index}-mig-")
        assert listed[name] == [f"/dev/nvidia{gpu.index}"] == listed[f"gpu-{gpu.index}"]
    gpu0_migs = [name for name in listed if name.startswith("gpu-0-mig-")]
    assert list(listed).index("gpu-0") < min(list(listed).index(n) for n in gpu0_migs)


def test_mig_device_without_its_gpu_is_left_out(simulated: Callable[[str], Node]) -> None:
    node = simulated("dgx-a100-mig")
    gpu0 = node.whole(Vendor.NVIDIA, 0)[0]
    without = [d for d in node.inventory.devices if d.id != gpu0.id]
    spec = vendor_spec(Vendor.NVIDIA, without, node.present)
    assert spec is not None
    assert not [name for name in spec_devices(spec) if name.startswith("gpu-0")]
    assert len(spec["devices"]) == len([d for d in without if d.parent != gpu0.id])


@pytest.mark.parametrize(
    ("profile", "vendor", "removed"),
    [
        ("dgx-h100", Vendor.NVIDIA, ["/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"]),
        ("hygon-k100x8", Vendor.HYGON, ["/dev/mkfd"]),
        ("kunlun-p800x8", Vendor.KUNLUNXIN, ["/dev/xpuctrl"]),
        ("ascend-910bx8", Vendor.ASCEND, ["/dev/hisi_hdc"]),
    ],
)
def test_control_nodes_only_when_present_on_the_host(
    tmp_path: Path,
    cdi_schema: CdiSchema,
    profile: str,
    vendor: Vendor,
    removed: list[str],
) -> None:
    node = build_node(profile, tmp_path)
    for path in removed:
        (tmp_path / path.lstrip("/")).unlink()
    spec = vendor_spec(vendor, node.inventory.devices, node.present)
    assert spec is not None
    assert_valid_cdi(spec, cdi_schema)
    kept = [p for p in VENDOR_SPECS[vendor].control_nodes if p not in removed]
    assert spec_control_nodes(spec) == kept
    every_device_node = {p for paths in spec_devices(spec).values() for p in paths}
    assert not every_device_node & set(VENDOR_SPECS[vendor].control_nodes)


def test_no_control_node_present_means_no_spec_level_edits(
    simulated: Callable[[str], Node],
) -> None:
    node = simulated("ascend-910bx8")
    spec = vendor_spec(Vendor.ASCEND, node.inventory.devices, present_paths=())
    assert spec is not None
    assert "containerEdits" not in spec
    assert len(spec["devices"]) == 8


def test_device_nodes_are_host_paths_not_under_the_host_root(
    simulated: Callable[[str], Node],
) -> None:
    node = simulated("hygon-k100x8")
    spec = vendor_spec(Vendor.HYGON, node.inventory.devices, node.present)
    assert spec is not None
    text = json.dumps(spec)
    assert str(node.root.root) not in text
    assert spec_devices(spec)["dcu-3"] == ["/dev/dri/card4", "/dev/dri/renderD131"]


# --- claim specs -----------------------------------------------------------------------------


def claim_env(spec: Mapping[str, Any]) -> dict[str, str]:
    [device] = spec["devices"]
    assert device["name"] == names.claim_cdi_name(CLAIM_UID)
    return dict(entry.split("=", 1) for entry in device["containerEdits"]["env"])


def whole_units(node: Node, devices: Sequence[Device]) -> list[ResourceUnit]:
    by_device = {u.device_id: u for u in node.units.values() if u.kind is UnitKind.WHOLE}
    return [by_device[d.id] for d in devices]


@pytest.mark.parametrize(
    ("profile", "picks", "overrides"),
    [
        ("dgx-h100", {Vendor.NVIDIA: (5, 3)}, {}),
        ("dgx-h100", {Vendor.NVIDIA: (5, 3)}, {"plugin": {"nvidia_device_id_strategy": "index"}}),
        ("kunlun-p800x8", {Vendor.KUNLUNXIN: (7, 0, 2)}, {}),
        ("hygon-k100x8", {Vendor.HYGON: (6, 1)}, {}),
        ("ascend-910bx8", {Vendor.ASCEND: (4,)}, {}),
        ("mixed-gpu-npu", {Vendor.ASCEND: (2, 1), Vendor.NVIDIA: (3,)}, {}),
    ],
)
def test_claim_env_matches_allocate(
    simulated: Callable[..., Node],
    cdi_schema: CdiSchema,
    profile: str,
    picks: Mapping[Vendor, Sequence[int]],
    overrides: Mapping[str, Any],
) -> None:
    node = simulated(profile, **overrides)
    devices = [d for vendor, indexes in picks.items() for d in node.whole(vendor, *indexes)]
    spec = claim_spec(CLAIM_UID, [Grant(d) for d in devices], settings=node.settings)
    assert_valid_cdi(spec, cdi_schema)
    assert spec["kind"] == names.CLAIM_CDI_KIND
    env = claim_env(spec)
    assert env.pop(CLAIM_UID_ENV) == CLAIM_UID
    assert env == node.allocate_envs(whole_units(node, devices))
    assert set(env) == {VENDOR_SPECS[vendor].visible_env for vendor in picks}


def test_claim_env_names_hygon_cards_from_zero_in_host_order(
    simulated: Callable[[str], Node],
) -> None:
    node = simulated("hygon-k100x8")
    spec = claim_spec(CLAIM_UID, [Grant(d) for d in node.whole(Vendor.HYGON, 6, 1)])
    assert claim_env(spec)["HIP_VISIBLE_DEVICES"] == "0,1"


def test_claim_env_for_mig_devices(simulated: Callable[..., Node]) -> None:
    by_index = {"plugin": {"nvidia_device_id_strategy": "index"}}
    node = simulated("dgx-a100-mig", **by_index)
    gpu = node.whole(Vendor.NVIDIA, 2)[0]
    migs = [d for d in node.inventory.devices if d.parent == gpu.id][1:3]
    grants = [Grant(m) for m in reversed(migs)]
    spec = claim_spec(
        CLAIM_UID, grants, node_devices=node.inventory.devices, settings=node.settings
    )
    env = claim_env(spec)
    assert env["NVIDIA_VISIBLE_DEVICES"] == f"2:{migs[0].index},2:{migs[1].index}"
    mig_units = [u for u in node.units.values() if u.device_id in {m.id for m in migs}]
    assert env == {**node.allocate_envs(mig_units), CLAIM_UID_ENV: CLAIM_UID}
    by_uuid = claim_env(claim_spec(CLAIM_UID, grants))
    assert by_uuid["NVIDIA_VISIBLE_DEVICES"] == ",".join(m.id for m in migs)


def test_claim_share_env_matches_allocate_of_the_same_shares(
    simulated: Callable[[str], Node], cdi_schema: CdiSchema
) -> None:
    node = simulated("cgpu-v100")
    gpu0, gpu1, gpu2 = node.whole(Vendor.NVIDIA, 0, 1, 2)

    def units(device: Device, kind: UnitKind, count: int) -> list[ResourceUnit]:
        return [u for u in node.units.values() if u.device_id == device.id and u.kind is kind][
            :count
        ]

    memory_unit = units(gpu0, UnitKind.MEMORY, 1)[0].amount
    core_unit = units(gpu2, UnitKind.CORE, 1)[0].amount
    grants = [
        Grant(gpu1, memory_mib=2 * memory_unit),
        Grant(gpu0, memory_mib=3 * memory_unit),
        Grant(gpu2, core_percent=4 * core_unit),
    ]
    spec = claim_spec(CLAIM_UID, grants)
    assert_valid_cdi(spec, cdi_schema)
    env = claim_env(spec)
    same_shares = [
        *units(gpu0, UnitKind.MEMORY, 3),
        *units(gpu1, UnitKind.MEMORY, 2),
        *units(gpu2, UnitKind.CORE, 4),
    ]
    assert env == {**node.allocate_envs(same_shares), CLAIM_UID_ENV: CLAIM_UID}
    assert env["EDL_SHARE_MEMORY_MIB"] == str(5 * memory_unit)
    assert env["EDL_SHARE_CORE_PERCENT"] == str(4 * core_unit)
    assert (
        env["EDL_SHARE_DEVICES"]
        == env["NVIDIA_VISIBLE_DEVICES"]
        == f"{gpu0.id},{gpu1.id},{gpu2.id}"
    )


def test_whole_devices_have_no_share_env(simulated: Callable[[str], Node]) -> None:
    node = simulated("cgpu-v100")
    env = claim_env(claim_spec(CLAIM_UID, [Grant(node.whole(Vendor.NVIDIA, 4)[0])]))
    assert not [key for key in env if key.startswith("EDL_SHARE_")]


@pytest.mark.parametrize(
    ("memory_mib", "core_percent"), [(0, None), (-1, None), (None, 0), (None, 101)]
)
def test_grant_refuses_impossible_shares(
    simulated: Callable[[str], Node], memory_mib: int | None, core_percent: int | None
) -> None:
    gpu = simulated("cgpu-v100").whole(Vendor.NVIDIA, 0)[0]
    with pytest.raises(ValueError, match=gpu.id):
        Grant(gpu, memory_mib=memory_mib, core_percent=core_percent)


@pytest.mark.parametrize("uid", ["", "../etc", "a/b", "-x", "x-", "a b", "claim.json", "x" * 200])
def test_unsafe_claim_uids_are_refused(tmp_path: Path, uid: str) -> None:
    with pytest.raises(ValueError, match="claim uid"):
        claim_spec(uid, [])
    with pytest.raises(ValueError, match="claim uid"):
        CdiWriter(tmp_path).write_claim(uid, {})
    assert list(tmp_path.iterdir()) == []


def test_static_cdi_ids_name_devices_of_the_vendor_specs(simulated: Callable[[str], Node]) -> None:
    """What Allocate (`plugin.cdi`) and prepare answer for a device is a device of its vendor's
    static spec."""
    node = simulated("mixed-gpu-npu")
    devices = [*node.whole(Vendor.ASCEND, 3), *node.whole(Vendor.NVIDIA, 1, 0)]
    ids = [names.device_cdi_id(d, node.devices) for d in devices]
    assert ids == ["ascend.edl.io/npu=npu-3", "nvidia.edl.io/gpu=gpu-1", "nvidia.edl.io/gpu=gpu-0"]
    specs = {
        spec["kind"]: spec_devices(spec)
        for vendor in Vendor
        if (spec := vendor_spec(vendor, node.inventory.devices, node.present)) is not None
    }
    for cdi_id in ids:
        kind, _, name = cdi_id.partition("=")
        assert name in specs[kind]
    assert claim_cdi_id(CLAIM_UID) == f"claim.edl.io/env=claim-{CLAIM_UID}"


def test_the_cdi_id_of_a_mig_device_needs_its_gpu(simulated: Callable[[str], Node]) -> None:
    node = simulated("dgx-a100-mig")
    mig = next(d for d in node.inventory.devices if d.parent is not None)
    gpu = node.devices[mig.parent or ""]
    cdi_id = names.device_cdi_id(mig, node.devices)
    assert cdi_id == names.cdi_id(Vendor.NVIDIA, names.device_name(mig, gpu))
    assert cdi_id.partition("=")[2] in spec_devices(
        vendor_spec(Vendor.NVIDIA, node.inventory.devices, node.present) or {}
    )
    with pytest.raises(ValueError, match=mig.id):
        names.device_cdi_id(mig, {})


# --- writer ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def specs(simulated: Callable[[str], Node]) -> dict[Vendor, dict[str, Any] | None]:
    node = simulated("mixed-gpu-npu")
    return {v: vendor_spec(v, node.inventory.devices, node.present) for v in Vendor}


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_writer_writes_readable_specs_and_creates_the_directory(
    tmp_path: Path, specs: Mapping[Vendor, dict[str, Any] | None]
) -> None:
    directory = tmp_path / "var" / "run" / "cdi"
    writer = CdiWriter(directory)
    old_umask = os.umask(0o077)
    try:
        written = writer.sync_vendor_specs(specs)
    finally:
        os.umask(old_umask)
    assert listing(directory) == ["edl.io-ascend.json", "edl.io-nvidia.json"]
    assert sorted(written) == sorted(directory.iterdir())
    for vendor in (Vendor.NVIDIA, Vendor.ASCEND):
        path = writer.vendor_path(vendor)
        assert json.loads(path.read_text()) == specs[vendor]
        assert path.stat().st_mode & 0o777 == 0o644


def test_unchanged_specs_are_not_rewritten(
    tmp_path: Path, specs: Mapping[Vendor, dict[str, Any] | None]
) -> None:
    writer = CdiWriter(tmp_path)
    writer.sync_vendor_specs(specs)
    before = {p.name: p.stat().st_ino for p in tmp_path.iterdir()}
    assert writer.sync_vendor_specs(specs) == []
    assert {p.name: p.stat().st_ino for p in tmp_path.iterdir()} == before

    changed = dict(specs)
    changed[Vendor.NVIDIA] = broken(specs[Vendor.NVIDIA] or {}, lambda s: s["devices"].pop())
    assert writer.sync_vendor_specs(changed) == [writer.vendor_path(Vendor.NVIDIA)]
    nvidia = writer.vendor_path(Vendor.NVIDIA)
    # replaced by a rename, not rewritten in place: a reader never sees a partial file
    assert nvidia.stat().st_ino != before[nvidia.name]
    assert json.loads(nvidia.read_text()) == changed[Vendor.NVIDIA]
    assert writer.vendor_path(Vendor.ASCEND).stat().st_ino == before["edl.io-ascend.json"]


def test_a_file_with_another_mode_is_rewritten(
    tmp_path: Path, specs: Mapping[Vendor, dict[str, Any] | None]
) -> None:
    writer = CdiWriter(tmp_path)
    writer.sync_vendor_specs(specs)
    writer.vendor_path(Vendor.ASCEND).chmod(0o600)
    assert writer.sync_vendor_specs(specs) == [writer.vendor_path(Vendor.ASCEND)]
    assert writer.vendor_path(Vendor.ASCEND).stat().st_mode & 0o777 == 0o644


FOREIGN = [
    "nvidia.com-gpu.json",
    "edl.io.json",
    "other-edl.io-nvidia.json",
    "edl.io-nvidia.yaml",
    "vendor.json.tmp",
]


def test_sync_removes_stale_vendor_files_and_nothing_else(
    tmp_path: Path, specs: Mapping[Vendor, dict[str, Any] | None]
) -> None:
    for name in FOREIGN:
        (tmp_path / name).write_text("foreign\n")
    writer = CdiWriter(tmp_path)
    writer.sync_vendor_specs(
        {**specs, Vendor.KUNLUNXIN: specs[Vendor.NVIDIA], Vendor.HYGON: specs[Vendor.ASCEND]}
    )
    writer.write_claim(CLAIM_UID, claim_spec(CLAIM_UID, []))
    (tmp_path / "edl.io-nvidia.json.x1y2.tmp").write_text("{")  # left by an interrupted write

    removed = writer.sync_vendor_specs({Vendor.NVIDIA: specs[Vendor.NVIDIA], Vendor.HYGON: None})
    assert sorted(removed) == [
        writer.vendor_path(Vendor.ASCEND),
        writer.vendor_path(Vendor.HYGON),
        writer.vendor_path(Vendor.KUNLUNXIN),
    ]
    assert listing(tmp_path) == sorted(
        [*FOREIGN, "edl.io-nvidia.json", f"edl.io-claim-{CLAIM_UID}.json"]
    )
    assert all((tmp_path / name).read_text() == "foreign\n" for name in FOREIGN)
    assert writer.sync_vendor_specs({}) == [writer.vendor_path(Vendor.NVIDIA)]
    assert writer.claim_uids() == [CLAIM_UID]


def test_claim_specs_are_written_listed_and_removed_idempotently(tmp_path: Path) -> None:
    writer = CdiWriter(tmp_path / "cdi")
    assert writer.claim_uids() == []
    assert writer.remove_claim(CLAIM_UID) is False
    other = "0a8d2c44-1f6e-4b7a-a0c5-9e3d1b2f4a68"
    for uid in (CLAIM_UID, other):
        path = writer.write_claim(uid, claim_spec(uid, []))
        assert path == tmp_path / "cdi" / f"edl.io-claim-{uid}.json"
        assert claim_env_of(path) == {CLAIM_UID_ENV: uid}
    writer.write_claim(CLAIM_UID, claim_spec(CLAIM_UID, []))
    (tmp_path / "cdi" / "edl.io-claim-..json").write_text("{}")  # not a uid: not listed
    assert writer.claim_uids() == sorted([CLAIM_UID, other])
    assert writer.remove_claim(CLAIM_UID) is True
    assert writer.remove_claim(CLAIM_UID) is False
    assert writer.claim_uids() == [other]


def claim_env_of(path: Path) -> dict[str, str]:
    [device] = json.loads(path.read_text())["devices"]
    return dict(entry.split("=", 1) for entry in device["containerEdits"]["env"])


def test_a_failed_write_keeps_the_old_spec_and_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = CdiWriter(tmp_path)
    old = claim_spec(CLAIM_UID, [])
    path = writer.write_claim(CLAIM_UID, old)

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left on device") as caught:
        writer.write_claim(CLAIM_UID, broken(old, lambda s: s.update(kind="claim.edl.io/other")))
    assert caught.value.filename == str(path)
    assert caught.value.errno == 28
    assert isinstance(caught.value.__cause__, OSError)
    assert json.loads(path.read_text()) == old
    assert listing(tmp_path) == [path.name]


def test_errors_name_the_file(
    tmp_path: Path, specs: Mapping[Vendor, dict[str, Any] | None]
) -> None:
    not_a_directory = tmp_path / "cdi"
    not_a_directory.write_text("")
    writer = CdiWriter(not_a_directory)
    for call in (writer.claim_uids, lambda: writer.sync_vendor_specs(specs)):
        with pytest.raises(NotADirectoryError, match="cannot list CDI specs") as listing_failed:
            call()
        assert listing_failed.value.filename == str(not_a_directory)
    with pytest.raises(NotADirectoryError, match="cannot read CDI spec") as reading_failed:
        writer.write_claim(CLAIM_UID, claim_spec(CLAIM_UID, []))
    assert reading_failed.value.filename == str(writer.claim_path(CLAIM_UID))


def test_written_files_are_what_the_specs_say(
    tmp_path: Path, cdi_schema: CdiSchema, specs: Mapping[Vendor, dict[str, Any] | None]
) -> None:
    writer = CdiWriter(tmp_path)
    writer.sync_vendor_specs(specs)
    writer.write_claim(CLAIM_UID, claim_spec(CLAIM_UID, []))
    for path in tmp_path.iterdir():
        assert_valid_cdi(json.loads(path.read_text()), cdi_schema)
