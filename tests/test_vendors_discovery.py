"""Kunlunxin, Hygon and Ascend discovery on simulated nodes built from the shipped profiles."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from edl_agent.devices import ascend, hygon, kunlunxin
from edl_agent.devices.hostroot import HostRoot, ToolError
from edl_agent.devices.model import Health, Vendor, VendorReport
from edl_agent.sim import ascend_dcmi, ascend_tree, hygon_tree, kunlunxin_tree
from edl_agent.sim.files import VENDOR_SLOT
from edl_agent.sim.profile import load_profile, pci_bus_id
from edl_agent.sim.tree import build_tree


@dataclass(frozen=True)
class Case:
    profile: str
    vendor: Vendor
    discover: Callable[[HostRoot], VendorReport | None]
    product: str
    memory_mib: int
    driver_version: str
    tool: str  # host path of the stand-in
    data: str  # host path of the data file discovery's call prints
    per_device_node: str  # host path of device 3's own node


CASES = [
    Case(
        "kunlun-p800x8",
        Vendor.KUNLUNXIN,
        kunlunxin.discover,
        "P800",
        98304,
        "5.0.21.21",
        kunlunxin_tree.TOOL,
        kunlunxin_tree.QUERY_OUTPUT,
        "/dev/xpu3",
    ),
    Case(
        "hygon-k100x8",
        Vendor.HYGON,
        hygon.discover,
        "K100_AI",
        65536,
        "6.3.8",
        hygon_tree.TOOL,
        hygon_tree.JSON_OUTPUT,
        "/dev/dri/renderD131",
    ),
    Case(
        "ascend-910bx8",
        Vendor.ASCEND,
        ascend.discover,
        "Ascend910B3",
        65536,
        "24.1.rc2",
        ascend_tree.TOOL,
        ascend_tree.INFO_OUTPUT,
        "/dev/davinci3",
    ),
]
IDS = [case.profile for case in CASES]


@pytest.fixture
def logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """Captured log events, whatever level filter an earlier test configured."""
    saved = structlog.get_config()
    structlog.reset_defaults()
    try:
        with capture_logs() as captured:
            yield captured
    finally:
        structlog.configure(**saved)


def simulated(case: Case, tmp_path: Path) -> HostRoot:
    """The profile's node, its NPUs read through npu-smi (DCMI discovery: tests/test_dcmi.py)."""
    build_tree(load_profile(case.profile), tmp_path)
    ascend_dcmi.remove(tmp_path)
    return HostRoot.at(tmp_path)


def discovered(case: Case, root: HostRoot) -> VendorReport:
    report = case.discover(root)
    assert report is not None
    assert report.vendor is case.vendor
    return report


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_discovers_the_profile(case: Case, tmp_path: Path) -> None:
    root = simulated(case, tmp_path)
    report = discovered(case, root)
    assert report.error is None
    assert report.driver["driver_version"] == case.driver_version
    devices = report.devices
    assert [d.index for d in devices] == list(range(8))
    assert {d.product for d in devices} == {case.product}
    assert {d.memory_mib for d in devices} == {case.memory_mib}
    assert Counter(d.numa_node for d in devices) == {0: 4, 1: 4}
    slot = VENDOR_SLOT[case.vendor.value]
    assert [d.pci_bus_id for d in devices] == [pci_bus_id(slot, i) for i in range(8)]
    assert len({d.id for d in devices}) == 8
    assert {d.health for d in devices} == {Health.HEALTHY}
    for device in devices:
        assert device.device_nodes
        assert all(root.exists(node) for node in device.device_nodes)
        assert "problem" not in device.attributes


def test_kunlunxin_details(tmp_path: Path) -> None:
    report = discovered(CASES[0], simulated(CASES[0], tmp_path))
    xpu = report.devices[2]
    assert (xpu.id, xpu.kind) == ("kunlunxin-xpu2", "xpu")
    assert xpu.device_nodes == ("/dev/xpu2", "/dev/xpuctrl")
    assert xpu.attributes["uuid"].startswith("GPU-")
    assert len(xpu.attributes["serial_number"]) == 16
    assert report.driver["runtime_version"] == "10.2"


def test_hygon_details(tmp_path: Path) -> None:
    root = simulated(CASES[1], tmp_path)
    report = discovered(CASES[1], root)
    dcu = report.devices[0]
    # card0 is the BMC's VGA adapter, so DCU 0 is card1 with the first render node.
    assert dcu.device_nodes == ("/dev/dri/card1", "/dev/dri/renderD128", "/dev/kfd", "/dev/mkfd")
    assert dcu.attributes == {"drm_card": "card1", "compute_units": "120"}
    assert dcu.id == f"hygon-dcu-{dcu.pci_bus_id}"
    assert dcu.kind == "dcu"


def test_ascend_details(tmp_path: Path) -> None:
    report = discovered(CASES[2], simulated(CASES[2], tmp_path))
    npu = report.devices[5]
    assert (npu.id, npu.kind) == ("ascend-npu5", "npu")
    assert npu.device_nodes == (
        "/dev/davinci5",
        "/dev/davinci_manager",
        "/dev/devmm_svm",
        "/dev/hisi_hdc",
    )
    assert npu.attributes == {
        "chip_name": "910B3",
        "health_text": "OK",
        "npu_id": "5",
        "chip_id": "0",
    }


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_garbled_tool_output_is_an_error_not_an_exception(
    case: Case, tmp_path: Path, logs: list[MutableMapping[str, Any]]
) -> None:
    root = simulated(case, tmp_path)
    root.path(case.data).write_text("Segmentation fault\n\x00\x01 core dumped\n", encoding="utf-8")
    report = discovered(case, root)
    tool = Path(case.tool).name
    assert report.error is not None
    assert report.error.startswith(f"{tool} ")
    assert "unexpected output" in report.error
    assert "\n" not in report.error
    # Devices are still listed from the device nodes, with what is known without the tool (for
    # XPUs, the product `xpu-smi -L` still names).
    assert len(report.devices) == 8
    product = case.product if case.vendor is Vendor.KUNLUNXIN else "unknown"
    assert {d.product for d in report.devices} == {product}
    assert any(log["log_level"] == "warning" and log["vendor"] == case.vendor for log in logs)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_failing_tool_is_an_error(case: Case, tmp_path: Path) -> None:
    root = simulated(case, tmp_path)
    root.path(case.data).unlink()  # the stand-in's `cat` now fails
    report = discovered(case, root)
    assert report.error is not None
    assert report.error.startswith(f"{Path(case.tool).name} ")
    assert "exited 1" in report.error
    assert len(report.devices) == 8


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_missing_tool_lists_devices_from_nodes(case: Case, tmp_path: Path) -> None:
    root = simulated(case, tmp_path)
    root.path(case.tool).unlink()
    report = discovered(case, root)
    assert report.error is None
    assert [d.index for d in report.devices] == list(range(8))
    assert {d.health for d in report.devices} == {Health.HEALTHY}
    assert [d.id for d in report.devices] == [d.id for d in discovered(case, root).devices]


def test_missing_tool_keeps_what_sysfs_knows_for_hygon(tmp_path: Path) -> None:
    root = simulated(CASES[1], tmp_path)
    root.path(hygon_tree.TOOL).unlink()
    devices = discovered(CASES[1], root).devices
    assert {d.memory_mib for d in devices} == {65536}  # from the KFD memory bank
    assert Counter(d.numa_node for d in devices) == {0: 4, 1: 4}
    assert [d.pci_bus_id for d in devices] == [
        pci_bus_id(VENDOR_SLOT["hygon"], i) for i in range(8)
    ]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_ids_do_not_depend_on_the_tool(case: Case, tmp_path: Path) -> None:
    root = simulated(case, tmp_path)
    with_tool = [d.id for d in discovered(case, root).devices]
    root.path(case.data).write_text("garbage\n", encoding="utf-8")
    assert [d.id for d in discovered(case, root).devices] == with_tool


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_removed_device_node_makes_that_device_unhealthy(case: Case, tmp_path: Path) -> None:
    root = simulated(case, tmp_path)
    root.path(case.per_device_node).unlink()
    report = discovered(case, root)
    assert report.error is None
    unhealthy = [d for d in report.devices if d.health is Health.UNHEALTHY]
    assert [d.index for d in unhealthy] == [3]
    assert case.per_device_node in unhealthy[0].attributes["problem"]
    assert case.per_device_node not in unhealthy[0].device_nodes


@pytest.mark.parametrize(
    ("discover", "other_profile"),
    [
        (kunlunxin.discover, "hygon-k100x8"),
        (hygon.discover, "ascend-910bx8"),
        (ascend.discover, "kunlun-p800x8"),
    ],
)
def test_absent_vendor_is_none(
    discover: Callable[[HostRoot], VendorReport | None], other_profile: str, tmp_path: Path
) -> None:
    assert discover(HostRoot.at(tmp_path)) is None
    build_tree(load_profile(other_profile), tmp_path)
    assert discover(HostRoot.at(tmp_path)) is None


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_tool_without_devices_that_fails_is_quiet(case: Case, tmp_path: Path) -> None:
    """A vendor tool installed on a node without the hardware (it fails there) reports nothing."""
    root = simulated(case, tmp_path)
    root.path(case.data).unlink()
    for path in tmp_path.joinpath("dev").rglob("*"):
        if path.is_file():
            path.unlink()
    for card in tmp_path.joinpath("sys/class/drm").glob("card*"):
        card.joinpath("device").unlink()
    assert case.discover(root) is None


def test_ascend_health_from_npu_smi(tmp_path: Path) -> None:
    root = simulated(CASES[2], tmp_path)
    ascend_tree.set_health(tmp_path, 3, "Critical")
    ascend_tree.set_health(tmp_path, 4, "Warning")
    devices = discovered(CASES[2], root).devices
    assert [d.index for d in devices if d.health is Health.UNHEALTHY] == [3]
    assert devices[3].attributes["health_text"] == "Critical"
    assert devices[4].attributes["health_text"] == "Warning"


def test_ascend_driver_version_without_npu_smi(tmp_path: Path) -> None:
    root = simulated(CASES[2], tmp_path)
    root.path(ascend_tree.TOOL).unlink()
    assert discovered(CASES[2], root).driver == {"driver_version": "24.1.rc2"}


def test_ascend_part_of_mixed_node(tmp_path: Path) -> None:
    profile = load_profile("mixed-gpu-npu")
    assert profile.ascend is not None
    ascend_tree.write(profile.ascend, profile, tmp_path)
    devices = discovered(CASES[2], HostRoot.at(tmp_path)).devices
    assert len(devices) == 4
    assert Counter(d.numa_node for d in devices) == {0: 2, 1: 2}
    assert {d.product for d in devices} == {"Ascend910B3"}


@pytest.mark.parametrize(
    ("tool", "args", "data"),
    [
        (kunlunxin_tree.TOOL, ["-L"], kunlunxin_tree.LIST_OUTPUT),
        (hygon_tree.TOOL, [], hygon_tree.TABLE_OUTPUT),
        (ascend_tree.TOOL, ["info", "-m"], ascend_tree.MAP_OUTPUT),
    ],
)
def test_stand_ins_print_their_data_files(
    tool: str, args: list[str], data: str, tmp_path: Path
) -> None:
    for name in ("kunlun-p800x8", "hygon-k100x8", "ascend-910bx8"):
        build_tree(load_profile(name), tmp_path)
    root = HostRoot.at(tmp_path)
    assert root.run_tool(root.path(tool), args) == root.read_text(data)
    with pytest.raises(ToolError, match="unsupported arguments"):
        root.run_tool(root.path(tool), ["--bogus"])
