"""A broken vendor tool takes nothing away: for Kunlunxin, Hygon and Ascend, a tool that prints
non-UTF-8 (a localised GBK build), exits 1, prints garbage, hangs, or prints 200 MB gives a
one-line discovery error, a failed poll that does not raise, and a carried inventory that
advertises exactly what it did before. Real tools (shell scripts) under real simulated trees."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import psutil
import pytest

from edl_agent.config import HealthSettings, load_settings
from edl_agent.devices import ascend, hygon, kunlunxin
from edl_agent.devices.carry import carry_forward
from edl_agent.devices.discovery import discover_node
from edl_agent.devices.hostroot import MAX_TOOL_OUTPUT, HostRoot, ToolError
from edl_agent.devices.model import Health, Inventory, Vendor
from edl_agent.health import vendor_readings
from edl_agent.sim import ascend_dcmi, ascend_tree, hygon_tree, kunlunxin_tree
from edl_agent.sim.profile import load_profile
from edl_agent.sim.tree import build_tree

VENDORS = {
    Vendor.KUNLUNXIN: ("kunlun-p800x8", kunlunxin_tree.TOOL, kunlunxin.discover),
    Vendor.HYGON: ("hygon-k100x8", hygon_tree.TOOL, hygon.discover),
    Vendor.ASCEND: ("ascend-910bx8", ascend_tree.TOOL, ascend.discover),
}
BROKEN = {
    "gbk": "printf '\\311\\350\\261\\270 \\327\\264\\314\\254: \\325\\375\\263\\243\\n'",
    "exit-1": "echo 'error: the driver is not loaded' >&2; exit 1",
    "garbage": "echo '{[ lorem ipsum'",
    "hang": "sleep 30",
    "200MB": "head -c 209715200 /dev/zero | tr '\\0' x",
}


def node(tmp_path: Path, vendor: Vendor) -> tuple[Path, Inventory]:
    profile, _, _ = VENDORS[vendor]
    tree = tmp_path / "node"
    build_tree(load_profile(profile), tree)
    # Through the tools alone, which these tests break: without DCMI, and without rocm_smi (with
    # it, Hygon's rediscovery reuses hy-smi's last report while the cards stay the same).
    ascend_dcmi.remove(tree)
    (tree / hygon_tree.LIBRARY.lstrip("/")).unlink(missing_ok=True)
    return tree, discover_node(settings(tree))


def settings(tree: Path) -> object:
    return load_settings(overrides={"host_root": str(tree)})


def break_tool(tree: Path, vendor: Vendor, case: str) -> None:
    tool = tree / VENDORS[vendor][1].lstrip("/")
    script(tool.parent, tool.name, BROKEN[case])


def units(inventory: Inventory) -> dict[str, tuple[str, ...]]:
    return {r.name: tuple(u.id for u in r.units) for r in inventory.resources}


@pytest.mark.parametrize("case", sorted(BROKEN))
@pytest.mark.parametrize("vendor", sorted(VENDORS, key=lambda v: v.value))
def test_a_broken_tool_keeps_the_last_inventory(tmp_path: Path, vendor: Vendor, case: str) -> None:
    tree, before = node(tmp_path, vendor)
    assert before.devices, "the healthy tool lists devices"
    break_tool(tree, vendor, case)
    rss = psutil.Process().memory_info().rss
    started = time.monotonic()

    report = VENDORS[vendor][2](HostRoot(tree.resolve(), tool_timeout=0.5))
    assert report is not None
    assert report.error, "a broken tool is an error, never an empty success"
    assert "\n" not in report.error
    # Ascend and Hygon fall back to /dev or sysfs: less than the tool knew (no products).
    assert all(d.product == "unknown" for d in report.devices)

    health = HealthSettings(tool_timeout_seconds=0.5)
    result = vendor_readings.poll(vendor, HostRoot.at(tree), before.devices, health)
    assert not result.ok
    assert [(e.device_id, e.level.value) for e in result.events] == [(None, "warn")]

    assert time.monotonic() - started < 10
    assert psutil.Process().memory_info().rss - rss < 64 << 20  # 200 MB were never held

    fresh = discover_node(settings(tree))
    carried = carry_forward(before, fresh, carried=frozenset(), settings=settings(tree))
    assert units(carried.inventory) == units(before)
    assert carried.failed.keys() == {vendor}
    assert carried.gone == ()
    assert {d.health for d in carried.inventory.devices} == {Health.HEALTHY}


def script(tmp_path: Path, name: str, body: str) -> Path:
    tool = tmp_path / name
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(0o755)
    return tool


def test_a_huge_output_is_cut_and_the_tool_killed(tmp_path: Path) -> None:
    tool = script(tmp_path, "chatty", "yes 'a long line of output from a tool gone wrong'")
    before = _children()
    with pytest.raises(ToolError, match=f"printed more than {MAX_TOOL_OUTPUT >> 20} MiB"):
        HostRoot.at(tmp_path).run_tool(tool, [], timeout=30)
    assert _children() == before


def test_a_hung_tool_and_what_it_started_are_killed(tmp_path: Path) -> None:
    tool = script(tmp_path, "hangs", "sleep 60 &\nsleep 60")
    before = _children()
    with pytest.raises(ToolError, match=r"timed out after 0\.3s"):
        HostRoot.at(tmp_path).run_tool(tool, [], timeout=0.3)
    assert _children() == before


def test_a_device_a_working_tool_stops_listing_stays_unhealthy(tmp_path: Path) -> None:
    tree, before = node(tmp_path, Vendor.KUNLUNXIN)
    listing = tree / kunlunxin_tree.QUERY_OUTPUT.lstrip("/")
    blocks = listing.read_text().split("\nXPU ")
    text = "\nXPU ".join(blocks[:-1]) + "\n"  # the last XPU is no longer listed
    listing.write_text(re.sub(r"(Attached XPUs\s*: )8", r"\g<1>7", text))
    (tree / "dev/xpu7").unlink()  # gone from the bus: no /dev node either
    fresh = discover_node(settings(tree))
    assert len(fresh.devices) == len(before.devices) - 1
    carried = carry_forward(before, fresh, carried=frozenset(), settings=settings(tree))
    assert units(carried.inventory) == units(before)
    [gone] = carried.gone
    assert gone.health is Health.UNHEALTHY
    assert carried.failed == {}
    again = carry_forward(
        carried.inventory, before, carried=frozenset({gone.id}), settings=settings(tree)
    )
    assert again.returned == {gone.id}
    assert again.gone == ()


def _children() -> set[int]:
    """Ids of the processes under this test process that still run (the session's control
    plane among them; zombies count as gone)."""
    alive = set()
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return alive
