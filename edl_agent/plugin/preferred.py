"""GetPreferredAllocation: which of the offered ids kubelet should take. Pure and total.

Whole devices: the set (with the must-include ids) of the highest sum of pair scores, where a
pair scores 20 on one NUMA node, 10 across (or unknown), plus 100 per direct link (NVLink, HCCS,
...). Exhaustive up to `EXHAUSTIVE_LIMIT` combinations, greedy beyond; ties go to the lowest
indexes. Shares (several ids per physical device): `pack` fills as few devices as possible,
`spread` deals ids round-robin over the devices with the most free ids.

Data it cannot use (an id it does not know, a device missing from the inventory, unreadable
links, must-include ids that are not offered, a size it cannot meet) gives a plain choice and the
reason, never an exception: kubelet asks on every pod, and one bad device must not stop
scheduling on the whole node.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from edl_agent.devices.container import host_order
from edl_agent.devices.model import Device, Link, ResourceUnit, UnitKind

EXHAUSTIVE_LIMIT = 5000
SAME_NUMA = 20
CROSS_NUMA = 10
PER_LINK = 100


@dataclass(frozen=True)
class Choice:
    ids: tuple[str, ...]
    fallback_reason: str | None = None


def preferred_allocation(
    *,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    units: Mapping[str, ResourceUnit],
    devices: Mapping[str, Device],
    unhealthy: Collection[str],
    placement: Literal["pack", "spread"],
) -> Choice:
    """Exactly min(size, len(available)) distinct ids from `available`, must-include ids first."""
    offered = tuple(dict.fromkeys(available))
    required = tuple(i for i in dict.fromkeys(must_include) if i in set(offered))
    want = max(0, min(size, len(offered)))
    down = frozenset(unhealthy)

    def sick(unit_id: str) -> bool:
        unit = units.get(unit_id)
        device_id = unit.device_id if unit is not None else unit_id
        device = devices.get(device_id)
        parent = device.parent if device is not None else None
        return unit_id in down or device_id in down or parent in down

    reason = _request_problem(offered, must_include, required, size) or _inventory_problem(
        offered, units, devices
    )
    healthy = [i for i in offered if i not in required and not sick(i)]
    if reason is None and len(required) + len(healthy) < want:
        reason = f"only {len(healthy)} healthy ids besides the must-include ones for size {size}"
    if reason is not None:
        rest = sorted((i for i in offered if i not in required), key=sick)
        return Choice((*required, *rest)[:want], reason)

    need = want - len(required)
    if all(units[i].kind is UnitKind.WHOLE for i in offered):
        picked = _whole_devices(required, healthy, need, units, devices)
    elif placement == "spread":
        picked = _spread(healthy, need, units, devices)
    else:
        picked = _pack(required, healthy, need, units, devices)
    return Choice((*required, *picked))


def pair_score(a: Device, b: Device) -> int:
    """Topology score of two devices: NUMA placement plus 100 per direct link between them."""
    near = a.numa_node is not None and a.numa_node == b.numa_node
    links = max(_link_count(a, b.id), _link_count(b, a.id))
    return (SAME_NUMA if near else CROSS_NUMA) + PER_LINK * links


def _link_count(device: Device, peer: str) -> int:
    return sum(link.count for link in device.links if link.peer == peer)


def _request_problem(
    offered: Sequence[str], must_include: Sequence[str], required: Sequence[str], size: int
) -> str | None:
    if size < 1:
        return f"allocation size {size} is less than 1"
    if stray := [i for i in must_include if i not in offered]:
        return f"must-include ids not among the available ones: {_few(stray)}"
    if len(required) > size:
        return f"{len(required)} must-include ids exceed allocation size {size}"
    if size > len(offered):
        return f"allocation size {size} exceeds the {len(offered)} available ids"
    return None


def _inventory_problem(
    offered: Sequence[str], units: Mapping[str, ResourceUnit], devices: Mapping[str, Device]
) -> str | None:
    if unknown := [i for i in offered if i not in units]:
        return f"unknown ids: {_few(unknown)}"
    for unit_id in offered:
        device = devices.get(units[unit_id].device_id)
        if device is None:
            return f"device {units[unit_id].device_id} (of id {unit_id}) is not in the inventory"
        if not _links_readable(device):
            return f"device {device.id} has unreadable links"
    return None


def _links_readable(device: Device) -> bool:
    links: object = device.links
    return isinstance(links, tuple) and all(
        isinstance(link, Link)
        and isinstance(link.peer, str)
        and isinstance(link.count, int)
        and link.count >= 0
        for link in links
    )


def _few(ids: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(ids[:limit])
    return shown if len(ids) <= limit else f"{shown} and {len(ids) - limit} more"


def _whole_devices(
    required: Sequence[str],
    candidates: Sequence[str],
    need: int,
    units: Mapping[str, ResourceUnit],
    devices: Mapping[str, Device],
) -> list[str]:
    if need == 0:
        return []

    def of(unit_id: str) -> Device:
        return devices[units[unit_id].device_id]

    ordered = sorted(candidates, key=lambda i: host_order(of(i), devices))
    n = len(ordered)
    matrix = [[pair_score(of(a), of(b)) if a != b else 0 for b in ordered] for a in ordered]
    # What each candidate adds by pairing with every must-include device.
    base = [sum(pair_score(of(c), of(r)) for r in required) for c in ordered]

    if math.comb(n, need) <= EXHAUSTIVE_LIMIT:
        best: tuple[int, ...] = ()
        best_score = -1
        for combo in itertools.combinations(range(n), need):  # lexicographic: lowest first
            score = sum(base[c] for c in combo)
            score += sum(matrix[a][b] for a, b in itertools.combinations(combo, 2))
            if score > best_score:
                best, best_score = combo, score
        return [ordered[c] for c in best]

    seeds: list[tuple[int, ...]] = [()] if required else [(c,) for c in range(n)]
    grown = [_grow(seed, base, matrix, need) for seed in seeds]
    return [ordered[c] for c in max(grown, key=lambda g: g[0])[1]]


def _grow(
    seed: tuple[int, ...], base: Sequence[int], matrix: Sequence[Sequence[int]], need: int
) -> tuple[int, tuple[int, ...]]:
    """Greedy: add the candidate that gains most with what is chosen; (total score, chosen)."""
    gain = list(base)
    chosen: list[int] = []
    total = 0
    while len(chosen) < need:
        if len(chosen) < len(seed):
            pick = seed[len(chosen)]
        else:
            rest = (c for c in range(len(gain)) if c not in chosen)
            pick = max(rest, key=lambda c: (gain[c], -c))
        total += gain[pick]
        chosen.append(pick)
        gain = [g + extra for g, extra in zip(gain, matrix[pick], strict=True)]
    return total, tuple(sorted(chosen))


def _free_units(
    candidates: Sequence[str], units: Mapping[str, ResourceUnit], devices: Mapping[str, Device]
) -> tuple[dict[str, list[str]], dict[str, tuple[int, int, int, str]]]:
    """Candidate ids by physical device, and each device's position."""
    free: dict[str, list[str]] = {}
    for unit_id in candidates:
        free.setdefault(units[unit_id].device_id, []).append(unit_id)
    return free, {d: host_order(devices[d], devices) for d in free}


def _spread(
    candidates: Sequence[str],
    need: int,
    units: Mapping[str, ResourceUnit],
    devices: Mapping[str, Device],
) -> list[str]:
    free, position = _free_units(candidates, units, devices)
    order = sorted(free, key=lambda d: (-len(free[d]), position[d]))
    dealt = itertools.chain.from_iterable(itertools.zip_longest(*(free[d] for d in order)))
    return [i for i in dealt if i is not None][:need]


def _pack(
    required: Sequence[str],
    candidates: Sequence[str],
    need: int,
    units: Mapping[str, ResourceUnit],
    devices: Mapping[str, Device],
) -> list[str]:
    free, position = _free_units(candidates, units, devices)
    holding = {units[i].device_id for i in required}
    picked: list[str] = []
    for pool in ([d for d in free if d in holding], [d for d in free if d not in holding]):
        while pool and len(picked) < need:
            left = need - len(picked)
            # Best fit: the smallest device that can take the rest; else the largest one.
            fits = [d for d in pool if len(free[d]) >= left]
            device = min(
                fits or pool,
                key=lambda d: (len(free[d]) if fits else -len(free[d]), position[d]),
            )
            pool.remove(device)
            picked += free[device][:left]
    return picked
