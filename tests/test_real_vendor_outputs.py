"""Discovery, topology and the health pollers over every real tool output in tests/fixtures/real/.

Each sample is what the vendor tool prints on a host-root tree with the devices the sample shows
(tests/real_nodes.py); discovery runs as `edl-agent discover --host-root` does and the pollers as
the agent runs them. What each case expects was read from the sample by hand.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from edl_agent.cli import main
from edl_agent.config import HealthSettings
from edl_agent.devices import ascend, hygon, kunlunxin
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, Health, Vendor
from edl_agent.health.vendor_readings import poll_ascend, poll_hygon, poll_kunlunxin
from tests.real_nodes import REAL, ascend_node, hygon_node, kunlunxin_node, sample

SETTINGS = HealthSettings()


def discover(capsys: pytest.CaptureFixture[str], root: Path) -> dict[str, Any]:
    args = ["discover", "--host-root", str(root), "--format", "json", "--log-level", "error"]
    assert main(args) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


def devices_of(inventory: dict[str, Any], vendor: str) -> list[dict[str, Any]]:
    return [d for d in inventory["devices"] if d["vendor"] == vendor]


@contextlib.contextmanager
def captured_logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """Every log event, whatever level the CLI configured before."""
    saved = structlog.get_config()
    structlog.reset_defaults()
    try:
        with capture_logs() as captured:
            yield captured
    finally:
        structlog.configure(**saved)


def warnings_of(discover_vendor: Any, root: Path) -> list[MutableMapping[str, Any]]:
    with captured_logs() as logs:
        discover_vendor(HostRoot.at(root))
    return [event for event in logs if event["log_level"] == "warning"]


# ---- npu-smi info ------------------------------------------------------------------------------


def buses(*numbers: str) -> list[str | None]:
    return [f"0000:{n}:00.0" for n in numbers]


@dataclass(frozen=True)
class NpuCase:
    sample: str
    products: list[str]
    memory: list[int]
    buses: list[str | None]
    npu_ids: list[int]
    chip_ids: list[int]
    unhealthy: list[int]  # device indexes
    driver: str
    unreadable: int = 0  # cells warned about
    indexes: list[int] | None = None  # davinci<N>; default 0..n-1


NPU_CASES = [
    NpuCase(
        "ascend/910a-npu-smi-20.2.2-info.txt",
        ["Ascend910A"] * 8,
        [32768] * 8,
        buses("c1", "81", "41", "01", "c2", "82", "42", "02"),
        list(range(8)),
        [0] * 8,
        [],
        "20.2.2.spc001",
    ),
    NpuCase(
        "ascend/910prob-npu-smi-24.1.0-info.txt",
        ["Ascend910ProB"] * 8,
        [32768] * 8,  # HBM, not the 13553-15665 MB of the Memory-Usage column
        buses("c1", "81", "41", "01", "c2", "82", "42", "02"),
        list(range(8)),
        [0] * 8,
        [],
        "24.1.0",
    ),
    NpuCase(
        "ascend/910b4-npu-smi-24.1.rc3-info.txt",
        ["Ascend910B4"] * 8,
        [32768] * 8,
        buses("c1", "01", "c2", "02", "81", "41", "82", "42"),
        list(range(8)),
        [0] * 8,
        [],
        "24.1.rc3",
    ),
    NpuCase(
        "ascend/910b4-1-npu-smi-25.2.0-info-masked-bus.txt",
        ["Ascend910B4-1"] * 2,
        [65536] * 2,
        [None, None],  # 0000:xx:00.0: unreadable, so unknown
        [0, 1],
        [0, 0],
        [],
        "25.2.0",
        unreadable=2,
    ),
    NpuCase(
        "ascend/a3-910c-npu-smi-25.2.1-info.txt",
        ["Ascend910"] * 16,
        [65536] * 16,
        buses(
            "9d",
            "9f",
            "99",
            "9b",
            "95",
            "97",
            "91",
            "93",
            "8d",
            "8f",
            "89",
            "8b",
            "85",
            "87",
            "81",
            "83",
        ),
        [n // 2 for n in range(16)],
        [n % 2 for n in range(16)],
        [],
        "25.2.1",
    ),
    NpuCase(
        "ascend/300i-duo-310p3-npu-smi-25.0.rc1-info.txt",
        ["Ascend310P3"] * 8,
        [47304, 46717, 47304, 46717, 44280, 43693, 44280, 43693],
        buses("01", "01", "02", "02", "81", "81", "82", "82"),
        [1, 1, 2, 2, 4, 4, 5, 5],
        [0, 1] * 4,
        [4],  # NPU 4 chip 0 reads Critical
        "25.0.rc1.b033",
    ),
    NpuCase(
        "ascend/310b4-npu-smi-23.0.0-info.txt",
        ["Ascend310B4"],
        [15609],
        [None],  # NA: a 310B has no PCIe address; not a cell to warn about
        [0],
        [0],
        [0],  # Alarm
        "23.0.0",
    ),
]


@pytest.mark.parametrize("case", NPU_CASES, ids=[Path(c.sample).name for c in NPU_CASES])
def test_npu_smi_info(case: NpuCase, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    indexes = case.indexes or list(range(len(case.products)))
    root = ascend_node(tmp_path, indexes, sample(f"real/{case.sample}"))
    inventory = discover(capsys, root)
    npus = devices_of(inventory, "ascend")
    assert [d["id"] for d in npus] == [f"ascend-npu{n}" for n in indexes]
    assert [d["product"] for d in npus] == case.products
    assert [d["memory_mib"] for d in npus] == case.memory
    assert [d["pci_bus_id"] for d in npus] == case.buses
    assert [int(d["attributes"]["npu_id"]) for d in npus] == case.npu_ids
    assert [int(d["attributes"]["chip_id"]) for d in npus] == case.chip_ids
    unhealthy = [d["index"] for d in npus if d["health"] == Health.UNHEALTHY]
    assert unhealthy == case.unhealthy
    (report,) = (v for v in inventory["vendors"] if v["vendor"] == "ascend")
    assert (report["count"], report["error"]) == (len(indexes), None)
    assert report["driver"] == {"driver_version": case.driver, "health_source": "npu-smi"}

    warned = warnings_of(ascend.discover, root)
    assert [e.get("count") for e in warned] == ([case.unreadable] if case.unreadable else [])


def test_npu_smi_info_poll_reads_what_each_chip_shows(tmp_path: Path) -> None:
    """A3: the second die's Power is `-`; 300I Duo: Power NA and one chip Critical, whose fault
    codes cannot be queried here, so the Health word decides."""
    a3 = ascend_node(
        tmp_path / "a3", range(16), sample("real/ascend/a3-910c-npu-smi-25.2.1-info.txt")
    )
    result = poll_ascend(HostRoot.at(a3), _devices(a3, ascend.discover), SETTINGS)
    assert (result.ok, result.events) == (True, [])
    first, second = result.telemetry[:2]
    assert (first.power_w, first.temperature_c, first.memory_used_mib) == (161.8, 36.0, 3122)
    assert (second.power_w, second.temperature_c, second.memory_used_mib) == (None, 36.0, 2891)

    duo = ascend_node(
        tmp_path / "duo", range(8), sample("real/ascend/300i-duo-310p3-npu-smi-25.0.rc1-info.txt")
    )
    result = poll_ascend(HostRoot.at(duo), _devices(duo, ascend.discover), SETTINGS)
    (event,) = result.events
    assert (event.device_id, event.reason) == ("ascend-npu4", "NPU_HEALTH_Critical")
    assert "fault codes unknown" in event.detail
    assert {t.power_w for t in result.telemetry} == {None}
    assert [t.memory_total_mib for t in result.telemetry][:2] == [47304, 46717]


def test_npu_smi_health(tmp_path: Path) -> None:
    health = ascend.parse_npu_smi_health(sample("real/ascend/npu-smi-health-ok.txt"))
    assert health == ascend.NpuHealth(health="OK", codes=(), information="")
    # The 910A node's chip 0 reads OK in `-t health` as well: no event.
    root = ascend_node(
        tmp_path,
        range(8),
        sample("real/ascend/910a-npu-smi-20.2.2-info.txt"),
        health={(0, 0): sample("real/ascend/npu-smi-health-ok.txt")},
    )
    assert poll_ascend(HostRoot.at(root), _devices(root, ascend.discover), SETTINGS).events == []


# ---- npu-smi info -t topo ----------------------------------------------------------------------


def topology(capsys: pytest.CaptureFixture[str], root: Path) -> dict[str, Any]:
    args = ["discover", "--host-root", str(root), "--topology", "--format", "json"]
    assert main([*args, "--log-level", "error"]) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


def cells(topo: dict[str, Any]) -> dict[tuple[str, str], str]:
    labels = topo["matrix"]["labels"]
    return {
        (a, b): cell
        for a, row in zip(labels, topo["matrix"]["rows"], strict=True)
        for b, cell in zip(labels, row, strict=True)
    }


def test_910b_topology_hccs_between_every_pair(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = ascend_node(
        tmp_path,
        range(8),
        sample("real/ascend/910b4-npu-smi-24.1.rc3-info.txt"),
        topo=sample("real/ascend/910b-npu-smi-topo-hccs.txt"),
    )
    topo = topology(capsys, root)
    matrix = cells(topo)
    assert {matrix[(f"NPU{a}", f"NPU{b}")] for a in range(8) for b in range(8) if a != b} == {
        "HCCS"
    }
    affinity = [d["cpu_affinity"] for d in topo["devices"]]
    assert affinity == ["144-167", "0-23", "144-167", "0-23", "96-119", "48-71", "96-119", "48-71"]


def test_pcie_topology_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The four-NPU PCIe matrix (another node's) read over the 910ProB node's NPUs 0-3: its
    paths are npu-smi's, pairs it does not cover have none (no sysfs here)."""
    root = ascend_node(
        tmp_path,
        range(8),
        sample("real/ascend/910prob-npu-smi-24.1.0-info.txt"),
        topo=sample("real/ascend/npu-smi-topo-pxb-4npu.txt"),
    )
    matrix = cells(topology(capsys, root))
    assert [matrix[("NPU0", f"NPU{n}")] for n in range(1, 5)] == ["PXB", "SYS", "PXB", "N/A"]
    assert matrix[("NPU3", "NPU2")] == "PXB"


def test_a3_topology_sio_between_the_dies_of_one_npu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = ascend_node(
        tmp_path,
        range(16),
        sample("real/ascend/a3-910c-npu-smi-25.2.1-info.txt"),
        topo=sample("real/ascend/a3-npu-smi-topo-sio-2die.txt"),
    )
    topo = topology(capsys, root)
    (pair,) = [p for p in topo["pairs"] if p["devices"] == ["NPU12", "NPU13"]]
    assert pair["cell"] == "SIO"
    assert pair["link"] == {"kind": "sio", "count": None, "source": "npu-smi"}
    assert cells(topo)[("NPU12", "NPU14")] == "N/A"  # the container saw only its two dies
    assert topo["vendors"][0]["error"] is None


# ---- hy-smi ------------------------------------------------------------------------------------

BW_BUSES = ["0000:09:00.0", "0000:36:00.0"]


def test_bw_malformed_json_discovers_and_polls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    malformed = sample("real/hygon/bw-hy-smi-json-malformed.txt")
    root = hygon_node(tmp_path, BW_BUSES, query=malformed, status=malformed)
    inventory = discover(capsys, root)
    dcus = devices_of(inventory, "hygon")
    assert [(d["product"], d["memory_mib"], d["pci_bus_id"]) for d in dcus] == [
        ("BW", 65520, "0000:09:00.0"),
        ("BW", 65520, "0000:36:00.0"),
    ]
    assert {d["health"] for d in dcus} == {"Healthy"}
    (report,) = inventory["vendors"]
    # no `system` entry printed: no driver version; health is read through the tool
    assert (report["error"], report["driver"]) == (None, {"health_source": "hy-smi"})

    devices = _devices(root, hygon.discover)
    (warning,) = warnings_of(hygon.discover, root)
    assert warning["problems"] == [
        "JSON repaired: missing comma between keys",
        "JSON repaired: empty keys dropped",
    ]
    result = poll_hygon(HostRoot.at(root), devices, SETTINGS)
    assert (result.ok, result.events) == (True, [])
    figures = [
        (t.temperature_c, t.power_w, t.utilization_percent, t.memory_used_mib)
        for t in result.telemetry
    ]
    assert figures == [(57.0, 91.0, 0.0, 64169.0), (54.0, 84.0, 0.0, 64104.0)]


def test_bw_showbus_matches_dcus_by_pci_address(tmp_path: Path) -> None:
    """hy-smi's card0 is 0000:09:00.0; in this tree that is the second Hygon DRM card."""
    root = hygon_node(
        tmp_path,
        list(reversed(BW_BUSES)),
        query=sample("real/hygon/bw-hy-smi-json-malformed.txt"),
        status=sample("real/hygon/bw-hy-smi-showbus.json"),
    )
    devices = _devices(root, hygon.discover)
    statuses = hygon.parse_hy_smi_status(sample("real/hygon/bw-hy-smi-showbus.json"))
    assert [s.bus_id for s in statuses.values()] == BW_BUSES
    result = poll_hygon(HostRoot.at(root), devices, SETTINGS)
    assert result.checked == {d.id for d in devices}
    assert result.events == []


@pytest.mark.parametrize(
    ("name", "product", "memory"),
    [
        ("bw-hy-smi-showproductname.json", "BW", None),
        ("bw-hy-smi-showmeminfo-vram.json", None, 65520),
    ],
)
def test_bw_single_flag_outputs(name: str, product: str | None, memory: int | None) -> None:
    report = hygon.parse_hy_smi_json(sample(f"real/hygon/{name}"))
    assert [(d.index, d.product, d.memory_mib) for d in report.dcus] == [
        (0, product, memory),
        (1, product, memory),
    ]
    assert len(report.problems) == 2  # the field this flag does not print, per card


def test_bw_driver_version_text_is_no_json() -> None:
    with pytest.raises(hygon.HySmiParseError, match="no JSON object"):
        hygon.parse_hy_smi_json(sample("real/hygon/bw-hy-smi-showdriverversion.txt"))


# ---- xpu-smi -----------------------------------------------------------------------------------


def test_p800_q_by_id(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = sample("real/kunlunxin/p800-pcie-xpu-smi-5.0.21.26-q-id0.txt")
    root = kunlunxin_node(tmp_path, [0], text)
    inventory = discover(capsys, root)
    (xpu,) = devices_of(inventory, "kunlunxin")
    assert (xpu["product"], xpu["memory_mib"], xpu["pci_bus_id"]) == (
        "P800 PCIe",
        98304,
        "0000:21:00.0",
    )
    assert xpu["attributes"] == {
        "architecture": "KL3",
        "part_number": "B00100300110211",
        "serial_number": "02K0MA0258D0007R",
        "uuid": "GPU-8412bfa1-c3b9-50e6-86b5-065b83a1537c",
    }
    assert inventory["vendors"][0]["driver"] == {
        "driver_version": "5.0.21.26",
        "runtime_version": "10.2",
    }
    result = poll_kunlunxin(HostRoot.at(root), _devices(root, kunlunxin.discover), SETTINGS)
    (figures,) = result.telemetry
    assert (figures.temperature_c, figures.power_w, figures.utilization_percent) == (40, 75, 0)
    assert (figures.ecc_uncorrected_total, result.events) == (0, [])


def test_p800_q_attached_count_larger_than_the_blocks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = sample("real/kunlunxin/p800-pcie-xpu-smi-5.0.21.26-q-attached2.txt")
    root = kunlunxin_node(tmp_path, [0], text)
    (xpu,) = devices_of(discover(capsys, root), "kunlunxin")
    assert (xpu["product"], xpu["memory_mib"], xpu["pci_bus_id"], xpu["health"]) == (
        "P800 PCIe",
        98304,
        "0000:01:00.0",
        "Healthy",
    )
    result = poll_kunlunxin(HostRoot.at(root), _devices(root, kunlunxin.discover), SETTINGS)
    assert (result.telemetry[0].temperature_c, result.telemetry[0].power_w) == (46, 76)


def test_p800_list_names_the_product_when_q_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    listing = sample("real/kunlunxin/p800-oam-xpu-smi-5.0.21.47-L.txt")
    entries = kunlunxin.parse_xpu_smi_list(listing)
    assert [(e.smi_index, e.name) for e in entries] == [(n, "P800 OAM") for n in range(8)]
    assert entries[7].uuid == "GPU-4922595e-feb9-5762-9082-d8fd7f11abf5"
    root = kunlunxin_node(tmp_path, range(8), None, listing=listing)
    inventory = discover(capsys, root)
    xpus = devices_of(inventory, "kunlunxin")
    assert [(d["product"], d["memory_mib"]) for d in xpus] == [("P800 OAM", 0)] * 8
    assert "xpu-smi -q exited 1" in inventory["vendors"][0]["error"]


# ---- the corpus is read in full ----------------------------------------------------------------

READ_ELSEWHERE = {
    # `-t board` is kept for the record; no part of the agent runs it.
    "ascend/npu-smi-board-npu.txt",
    "ascend/npu-smi-board-chip.txt",
}


def test_every_sample_is_read_by_a_case() -> None:
    text = Path(__file__).read_text(encoding="utf-8")
    samples = {str(path.relative_to(REAL)) for path in REAL.rglob("*") if path.is_file()} - {
        "SOURCES.md"
    }
    unread = {name for name in samples - READ_ELSEWHERE if name.split("/", 1)[1] not in text}
    assert unread == set()
    sources = (REAL / "SOURCES.md").read_text(encoding="utf-8")
    assert {name for name in samples if f"`{name}`" not in sources} == set()


def _devices(root: Path, discover_vendor: Any) -> list[Device]:
    report = discover_vendor(HostRoot.at(root))
    assert report is not None
    assert report.vendor in (Vendor.ASCEND, Vendor.HYGON, Vendor.KUNLUNXIN)
    return list(report.devices)
