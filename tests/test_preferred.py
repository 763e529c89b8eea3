"""GetPreferredAllocation choices: topology for whole devices, pack/spread for shares, fallbacks."""

from __future__ import annotations

import itertools
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edl_agent.config import load_settings
from edl_agent.devices.discovery import discover_node
from edl_agent.devices.model import (
    Device,
    Inventory,
    Link,
    LinkKind,
    ResourceUnit,
    UnitKind,
    Vendor,
)
from edl_agent.plugin import preferred
from edl_agent.plugin.preferred import Choice, pair_score, preferred_allocation
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree

Placement = Literal["pack", "spread"]
PLACEMENTS: tuple[Placement, ...] = ("pack", "spread")


def gpu(i: int, numa: int | None = 0, links: Mapping[int, int] | None = None) -> Device:
    return Device(
        Vendor.NVIDIA,
        "gpu",
        i,
        f"GPU-{i}",
        "Test GPU",
        1024,
        numa_node=numa,
        links=tuple(Link(f"GPU-{p}", LinkKind.NVLINK, c) for p, c in (links or {}).items()),
    )


def node(
    numa: Sequence[int | None], pairs: Mapping[tuple[int, int], int] | None = None
) -> list[Device]:
    """GPUs with the given NUMA nodes; each (a, b): count pair is listed on both ends."""
    links: dict[int, dict[int, int]] = {i: {} for i in range(len(numa))}
    for (a, b), count in (pairs or {}).items():
        links[a][b] = links[b][a] = count
    return [gpu(i, n, links[i]) for i, n in enumerate(numa)]


def whole(devices: Sequence[Device]) -> dict[str, ResourceUnit]:
    return {d.id: ResourceUnit(d.id, d.id) for d in devices}


def shares(devices: Sequence[Device], per_device: int) -> dict[str, ResourceUnit]:
    return {
        f"{d.id}::{i}": ResourceUnit(f"{d.id}::{i}", d.id, UnitKind.REPLICA)
        for d in devices
        for i in range(per_device)
    }


def choose(
    devices: Sequence[Device],
    size: int,
    *,
    units: Mapping[str, ResourceUnit] | None = None,
    available: Sequence[str] | None = None,
    must: Sequence[str] = (),
    unhealthy: Collection[str] = (),
    placement: Placement = "pack",
    inventory: Mapping[str, Device] | None = None,
) -> Choice:
    units = whole(devices) if units is None else units
    return preferred_allocation(
        available=list(units) if available is None else available,
        must_include=must,
        size=size,
        units=units,
        devices={d.id: d for d in devices} if inventory is None else inventory,
        unhealthy=unhealthy,
        placement=placement,
    )


def indexes(choice: Choice, units: Mapping[str, ResourceUnit] | None = None) -> list[int]:
    """Host indexes of the physical devices behind the chosen ids, in choice order."""
    return [int((units[i].device_id if units else i).split("-")[1]) for i in choice.ids]


PAIRS = {(0, 1): 2, (2, 3): 2, (4, 5): 2, (6, 7): 2}


@dataclass(frozen=True)
class Case:
    name: str
    devices: list[Device]
    size: int
    expected: set[int]
    must: tuple[int, ...] = ()
    unhealthy: tuple[int, ...] = ()


WHOLE_CASES = [
    Case("nvlink pair wins", node([0] * 8, PAIRS), 2, {0, 1}),
    Case("must-include keeps its pair", node([0] * 8, PAIRS), 2, {2, 3}, must=(2,)),
    Case("same NUMA without links", node([0, 0, 1, 1]), 2, {2, 3}, must=(3,)),
    Case("ties go to the lowest indexes", node([0] * 4), 2, {0, 1}),
    Case("more links win", node([0] * 4, {(0, 1): 1, (2, 3): 2}), 2, {2, 3}),
    Case("unhealthy is skipped", node([0] * 8, PAIRS), 2, {2, 3}, unhealthy=(0,)),
    Case("link beats NUMA", node([0, 1, 0, 1], {(0, 1): 1}), 2, {0, 1}),
    Case("three on one NUMA node", node([0, 0, 1, 1, 0, 1]), 3, {0, 1, 4}),
    Case("tie beside two must-includes", node([0, 0, 1, 1]), 3, {0, 1, 3}, must=(0, 3)),
    Case("all of them", node([0] * 4, {(0, 1): 1}), 4, {0, 1, 2, 3}),
]


@pytest.mark.parametrize("case", WHOLE_CASES, ids=lambda c: c.name)
def test_whole_devices(case: Case) -> None:
    choice = choose(
        case.devices,
        case.size,
        must=[f"GPU-{i}" for i in case.must],
        unhealthy=[f"GPU-{i}" for i in case.unhealthy],
    )
    assert choice.fallback_reason is None
    assert set(indexes(choice)) == case.expected
    assert indexes(choice)[: len(case.must)] == list(case.must)


def test_one_sided_links_still_count() -> None:
    devices = [gpu(0), gpu(1), gpu(2), gpu(3, links={2: 1})]
    assert set(indexes(choose(devices, 2))) == {2, 3}


def test_greedy_beyond_the_exhaustive_limit() -> None:
    # Two NVLink cliques of 8, one per NUMA node: C(16, 8) = 12870 sets is over the limit.
    clique = dict.fromkeys(itertools.combinations(range(8), 2), 1)
    clique |= {(a + 8, b + 8): 1 for a, b in itertools.combinations(range(8), 2)}
    devices = node([0] * 8 + [1] * 8, clique)
    assert set(indexes(choose(devices, 8))) == set(range(8))
    assert set(indexes(choose(devices, 8, must=["GPU-9"]))) == set(range(8, 16))
    assert set(indexes(choose(devices, 3, must=["GPU-12"], unhealthy=["GPU-8"]))) == {9, 10, 12}


@dataclass(frozen=True)
class ShareCase:
    name: str
    free: dict[int, int]  # device index -> free ids offered
    size: int
    placement: Placement
    expected: list[int]  # device indexes of the chosen ids, sorted
    must: tuple[tuple[int, int], ...] = ()  # (device, unit) ids that must be included


SHARE_CASES = [
    ShareCase("pack onto one device", {0: 4, 1: 4, 2: 4}, 3, "pack", [0, 0, 0]),
    ShareCase("pack best fit", {0: 4, 1: 2, 2: 3}, 2, "pack", [1, 1]),
    ShareCase("pack largest then best fit", {0: 4, 1: 3, 2: 2}, 6, "pack", [0, 0, 0, 0, 2, 2]),
    ShareCase("pack next to must-include", {0: 4, 1: 4}, 3, "pack", [1, 1, 1], must=((1, 0),)),
    ShareCase("spread one per device", {0: 4, 1: 4, 2: 4}, 3, "spread", [0, 1, 2]),
    ShareCase("spread most free first", {0: 1, 1: 3, 2: 2}, 2, "spread", [1, 2]),
    ShareCase("spread wraps around", {0: 2, 1: 2}, 3, "spread", [0, 0, 1]),
]


@pytest.mark.parametrize("case", SHARE_CASES, ids=lambda c: c.name)
def test_shares(case: ShareCase) -> None:
    devices = node([0] * len(case.free))
    units = shares(devices, 4)
    must = [f"GPU-{d}::{u}" for d, u in case.must]
    available = must + [f"GPU-{d}::{u}" for d, n in case.free.items() for u in range(4 - n, 4)]
    choice = choose(
        devices, case.size, units=units, available=available, must=must, placement=case.placement
    )
    assert choice.fallback_reason is None
    assert sorted(indexes(choice, units)) == case.expected
    assert list(choice.ids[: len(must)]) == must


def test_shares_skip_unhealthy_devices() -> None:
    devices = node([0, 0])
    units = shares(devices, 4)
    choice = choose(devices, 2, units=units, unhealthy=["GPU-0"], placement="spread")
    assert indexes(choice, units) == [1, 1]


def test_mig_device_under_an_unhealthy_gpu_is_not_preferred() -> None:
    parent = gpu(0)
    migs = [
        Device(Vendor.NVIDIA, "mig", i, f"MIG-{i}", "mig", 10, numa_node=0, parent="GPU-0")
        for i in range(2)
    ]
    other = Device(Vendor.NVIDIA, "mig", 0, "MIG-9", "mig", 10, numa_node=0, parent="GPU-1")
    units = whole([*migs, other])
    choice = choose([parent, gpu(1), *migs, other], 1, units=units, unhealthy=["GPU-0"])
    assert choice == Choice(("MIG-9",))


def test_pair_score_follows_the_table() -> None:
    a, b = gpu(0, 0, {1: 2}), gpu(1, 0, {0: 2})
    assert pair_score(a, b) == 220
    assert pair_score(gpu(0, 0), gpu(1, 1)) == 10
    assert pair_score(gpu(0, None), gpu(1, None)) == 10
    assert pair_score(gpu(0, 1), gpu(1, 1)) == 20


BROKEN = Device(
    Vendor.NVIDIA, "gpu", 3, "GPU-3", "x", 1, links=(Link("GPU-0", LinkKind.NVLINK, -1),)
)
NOT_A_LINK: Any = ("GPU-0",)


@pytest.mark.parametrize(
    ("name", "kwargs", "expected", "reason"),
    [
        ("size zero", {"size": 0}, [], "less than 1"),
        ("too large", {"size": 9}, [0, 1, 2, 3], "exceeds the 4 available"),
        ("stray must", {"size": 2, "must": ["GPU-7", "GPU-2"]}, [2, 0], "GPU-7"),
        ("too many musts", {"size": 1, "must": ["GPU-2", "GPU-1"]}, [2], "exceed allocation"),
        ("unknown id", {"size": 2, "available": ["GPU-x", "GPU-1"]}, None, "unknown ids: GPU-x"),
        ("missing device", {"size": 2, "drop": "GPU-2"}, [0, 1], "GPU-2"),
        ("negative link count", {"size": 2, "replace": BROKEN}, [0, 1], "unreadable links"),
        (
            "links of another type",
            {
                "size": 2,
                "replace": Device(Vendor.NVIDIA, "gpu", 3, "GPU-3", "x", 1, links=NOT_A_LINK),
            },
            [0, 1],
            "unreadable links",
        ),
        ("few healthy", {"size": 3, "unhealthy": ["GPU-0", "GPU-1"]}, [2, 3, 0], "healthy"),
    ],
)
def test_fallbacks(
    name: str, kwargs: dict[str, Any], expected: list[int] | None, reason: str
) -> None:
    kwargs = dict(kwargs)  # the parameter table is shared: leave it whole
    devices = node([0, 0, 1, 1], {(2, 3): 2})
    units = whole(devices)
    inventory = {d.id: d for d in devices}
    if "drop" in kwargs:
        del inventory[kwargs.pop("drop")]
    if "replace" in kwargs:
        replacement = kwargs.pop("replace")
        inventory[replacement.id] = replacement
    available = kwargs.pop("available", list(units))
    choice = choose(devices, units=units, inventory=inventory, available=available, **kwargs)
    assert choice.fallback_reason is not None
    assert reason in choice.fallback_reason
    if expected is not None:
        assert indexes(choice) == expected
    else:
        assert choice.ids == ("GPU-x", "GPU-1")


# Simulated nodes: discovery's own data, as the plugin will see it.


def simulated(name: str, root: Path) -> Inventory:
    profile = load_profile(name)
    build_tree(profile, root)
    return discover_node(load_settings(defaults=profile.config, overrides={"host_root": str(root)}))


def test_cgpu_v100_prefers_an_nvlink_pair(tmp_path: Path) -> None:
    devices = simulated("cgpu-v100", tmp_path).devices
    choice = choose(devices, 2)
    assert set(indexes_of(choice, devices)) == {0, 1}
    pair = choose(devices, 2, must=[devices[5].id])
    assert set(indexes_of(pair, devices)) == {4, 5}


def test_cgpu_v100_memory_units_pack_and_spread(tmp_path: Path) -> None:
    inventory = simulated("cgpu-v100", tmp_path)
    devices = {d.id: d for d in inventory.devices}
    resource = next(r for r in inventory.resources if r.name.endswith("_cgpu_memory"))
    units = {u.id: u for u in resource.units}
    packed = choose(inventory.devices, 8, units=units, placement="pack")
    spread = choose(inventory.devices, 8, units=units, placement="spread")
    assert {devices[units[i].device_id].index for i in packed.ids} == {0}
    assert {devices[units[i].device_id].index for i in spread.ids} == set(range(8))


@pytest.mark.parametrize("vendor", [Vendor.NVIDIA, Vendor.ASCEND])
def test_mixed_node_prefers_close_pairs(tmp_path: Path, vendor: Vendor) -> None:
    devices = [d for d in simulated("mixed-gpu-npu", tmp_path).devices if d.vendor is vendor]
    assert set(indexes_of(choose(devices, 2), devices)) == {0, 1}
    assert set(indexes_of(choose(devices, 2, must=[devices[3].id]), devices)) == {2, 3}
    linked = vendor is Vendor.NVIDIA  # GPUs come in NVLink pairs; NPUs only share NUMA nodes
    assert (pair_score(devices[0], devices[1]) > 100) == linked


def test_dgx_h100_four_gpus_share_a_numa_node(tmp_path: Path) -> None:
    devices = simulated("dgx-h100", tmp_path).devices
    for must in ([], [devices[6].id]):
        choice = choose(devices, 4, must=must)
        chosen = [d for d in devices if d.id in choice.ids]
        assert len({d.numa_node for d in chosen}) == 1
        assert choice.fallback_reason is None


def test_dgx_h100_with_a_device_missing_falls_back(tmp_path: Path) -> None:
    devices = simulated("dgx-h100", tmp_path).devices
    inventory = {d.id: d for d in devices[1:]}
    choice = choose(devices, 4, inventory=inventory)
    assert choice.fallback_reason is not None
    assert devices[0].id in choice.fallback_reason
    assert len(set(choice.ids)) == 4


def indexes_of(choice: Choice, devices: Sequence[Device]) -> list[int]:
    by_id = {d.id: d.index for d in devices}
    return [by_id[i] for i in choice.ids]


# Properties over random nodes and requests.


@dataclass
class Scenario:
    devices: list[Device]
    units: dict[str, ResourceUnit]
    available: list[str]
    must: list[str]
    size: int
    unhealthy: list[str]
    placement: Placement
    inventory: dict[str, Device] = field(default_factory=dict)


@st.composite
def scenarios(
    draw: st.DrawFn, *, per_device: int | None = None, consistent: bool = False
) -> Scenario:
    n = draw(st.integers(1, 7))
    numa = draw(st.lists(st.sampled_from([0, 1, None]), min_size=n, max_size=n))
    pairs = draw(
        st.dictionaries(
            st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)).filter(lambda p: p[0] < p[1]),
            st.integers(1, 4),
            max_size=6,
        )
    )
    devices = node(numa, pairs)
    k = draw(st.integers(1, 4)) if per_device is None else per_device
    units = whole(devices) if k == 1 else shares(devices, k)
    ids = list(units)
    available = draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))
    must = draw(st.lists(st.sampled_from(available), unique=True, max_size=3))
    if not consistent and draw(st.booleans()):
        must += draw(st.lists(st.sampled_from(ids), max_size=2))
    low = len(must) if consistent else 0
    size = draw(
        st.integers(max(low, 1 if consistent else 0), len(available) + (0 if consistent else 2))
    )
    unhealthy = draw(st.lists(st.sampled_from([d.id for d in devices]), unique=True))
    inventory = {d.id: d for d in devices}
    if not consistent:
        for device_id in draw(st.lists(st.sampled_from(list(inventory)), unique=True, max_size=2)):
            del inventory[device_id]
    placement = draw(st.sampled_from(PLACEMENTS))
    return Scenario(devices, units, available, must, size, unhealthy, placement, inventory)


def run(
    s: Scenario, available: Sequence[str] | None = None, placement: Placement | None = None
) -> Choice:
    return preferred_allocation(
        available=s.available if available is None else available,
        must_include=s.must,
        size=s.size,
        units=s.units,
        devices=s.inventory,
        unhealthy=s.unhealthy,
        placement=s.placement if placement is None else placement,
    )


@given(scenarios())
def test_property_always_a_valid_choice(s: Scenario) -> None:
    choice = run(s)
    assert len(choice.ids) == len(set(choice.ids)) == max(0, min(s.size, len(s.available)))
    assert set(choice.ids) <= set(s.available)
    required = [i for i in dict.fromkeys(s.must) if i in s.available]
    if len(required) <= s.size:
        assert set(required) <= set(choice.ids)
        assert list(choice.ids[: len(required)]) == required


def sick(s: Scenario, unit_id: str) -> bool:
    return s.units[unit_id].device_id in s.unhealthy


@given(scenarios(consistent=True))
def test_property_consistent_requests_do_not_fall_back(s: Scenario) -> None:
    choice = run(s)
    healthy = [i for i in s.available if not sick(s, i) and i not in s.must]
    enough = len(s.must) + len(healthy) >= s.size
    assert (choice.fallback_reason is None) == enough, choice.fallback_reason
    if enough:
        assert not any(sick(s, i) for i in choice.ids if i not in s.must)


@given(scenarios(per_device=1, consistent=True))
def test_property_whole_devices_maximise_the_score(s: Scenario) -> None:
    choice = run(s)
    if choice.fallback_reason is not None:
        return
    by_id = {d.id: d for d in s.devices}

    def score(ids: Collection[str]) -> int:
        total = 0
        for a, b in itertools.combinations(ids, 2):
            da, db = by_id[a], by_id[b]
            near = da.numa_node is not None and da.numa_node == db.numa_node
            links = sum(lk.count for lk in da.links if lk.peer == b)
            total += (20 if near else 10) + 100 * links
        return total

    healthy = [i for i in s.available if not sick(s, i) and i not in s.must]
    best = max(
        score([*s.must, *rest]) for rest in itertools.combinations(healthy, s.size - len(s.must))
    )
    assert score(choice.ids) == best


@given(scenarios(consistent=True), st.randoms(use_true_random=False))
def test_property_order_of_available_does_not_matter(s: Scenario, rnd: random.Random) -> None:
    shuffled = list(s.available)
    rnd.shuffle(shuffled)
    first, second = run(s), run(s, available=shuffled)
    assert first.fallback_reason == second.fallback_reason
    if first.fallback_reason is None:
        assert physical(s, first) == physical(s, second)


@given(scenarios(consistent=True))
def test_property_pack_uses_no_more_devices_than_spread(s: Scenario) -> None:
    packed, spread = run(s, placement="pack"), run(s, placement="spread")
    assert len(set(physical(s, packed))) <= len(set(physical(s, spread)))


def physical(s: Scenario, choice: Choice) -> list[str]:
    return sorted(s.units[i].device_id for i in choice.ids)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(9, 24), st.data())
def test_property_large_nodes_answer_validly(n: int, data: st.DataObject) -> None:
    size = data.draw(st.integers(2, n))
    numa = [i * 2 // n for i in range(n)]
    devices = node(numa, {(i, i + 1): 1 for i in range(0, n - 1, 2)})
    must = data.draw(st.lists(st.sampled_from([d.id for d in devices]), unique=True, max_size=2))
    choice = choose(devices, size, must=must)
    assert choice.fallback_reason is None
    assert len(set(choice.ids)) == size
    assert set(must) <= set(choice.ids)


def test_exhaustive_limit_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    devices = node([0, 0, 1, 1, 0, 1], {(1, 4): 1, (2, 5): 3})
    exhaustive = choose(devices, 3)
    monkeypatch.setattr(preferred, "EXHAUSTIVE_LIMIT", 0)
    assert set(choose(devices, 3).ids) == set(exhaustive.ids)
