"""`edl-agent discover --topology`: the pure model and renderer, the npu-smi parser, the sysfs and
KFD readers, and real discovery of the simulated profiles through the fake NVML library and the
vendor-tool stand-ins."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pynvml
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edl_agent.cli import main
from edl_agent.config import load_settings
from edl_agent.devices import ascend, nvidia
from edl_agent.devices.discovery import discover_node
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, Inventory, LinkKind, Vendor
from edl_agent.devices.nvidia_topology import mask_bits
from edl_agent.devices.topology import (
    PairFacts,
    PciePath,
    PciLocation,
    Placement,
    Source,
    Topology,
    VendorTopology,
    assemble,
    cell_text,
    format_cpulist,
    parse_cpulist,
    pci_location,
    pcie_path,
    render_matrix,
)
from edl_agent.devices.topology_read import placement, read_topology
from edl_agent.sim import ascend_tree, hygon_tree, nvidia_tree
from edl_agent.sim.files import write_file
from edl_agent.sim.profile import load_profile, numa_cpulist
from edl_agent.sim.tree import build_tree

# ---- the pure model and renderer ---------------------------------------------------------------


def device(vendor: Vendor, index: int, id_: str, numa: int | None = None) -> Device:
    return Device(vendor, "gpu" if vendor is Vendor.NVIDIA else "npu", index, id_, "x", 1, numa)


GPU_A = device(Vendor.NVIDIA, 0, "GPU-a", 0)
GPU_B = device(Vendor.NVIDIA, 1, "GPU-b", 0)
GPU_C = device(Vendor.NVIDIA, 2, "GPU-c", 1)
NPU_0 = device(Vendor.ASCEND, 0, "npu0", 0)


def model() -> Topology:
    near, far = parse_cpulist("0-23,48-71"), parse_cpulist("24-47,72-95")
    nvml = VendorTopology(
        vendor=Vendor.NVIDIA,
        known="NVML facts",
        source=Source.NVML,
        pairs={
            frozenset(("GPU-a", "GPU-b")): PairFacts(
                path=PciePath.PIX,
                path_source=Source.NVML,
                link=LinkKind.NVLINK,
                link_count=12,
                link_source=Source.NVML,
            ),
            frozenset(("GPU-a", "GPU-c")): PairFacts(path=PciePath.SYS, path_source=Source.NVML),
            frozenset(("GPU-b", "GPU-c")): PairFacts(path=PciePath.SYS, path_source=Source.NVML),
        },
        cpus={"GPU-a": near, "GPU-b": near, "GPU-c": far},
        numa={"GPU-a": (0,), "GPU-b": (0,), "GPU-c": (1,)},
    )
    placements = [
        Placement(GPU_A, numa_node=0),
        Placement(GPU_B, numa_node=0),
        Placement(GPU_C, numa_node=1),
        Placement(NPU_0, numa_node=0, cpus=parse_cpulist("0-23")),
    ]
    return assemble(node="n1", placements=placements, vendors=[nvml])


def test_matrix_from_a_model() -> None:
    text = render_matrix(model())

    assert text.splitlines()[:5] == [
        "      GPU0  GPU1  GPU2  NPU0  CPU Affinity  NUMA Affinity",
        "GPU0  X     NV12  SYS   NODE  0-23,48-71    0",
        "GPU1  NV12  X     SYS   NODE  0-23,48-71    0",
        "GPU2  SYS   SYS   X     SYS   24-47,72-95   1",
        "NPU0  NODE  NODE  SYS   X     0-23          0",
    ]
    legend = text.split("Legend:")[1]
    assert "  NV#  = a bond of # NVLinks" in legend
    assert "  PIX  = " in legend
    assert "HCCS" not in legend
    assert "N/A" not in legend
    assert "  nvidia: NVML facts" in text
    assert "NODE there may be nearer" in text  # GPU-NPU cells come from NUMA nodes alone


def test_model_keeps_the_path_under_a_link_and_names_sources() -> None:
    topology = model()

    ab = topology.facts("GPU-b", "GPU-a")
    assert (ab.link, ab.link_count, ab.path, ab.path_source) == (
        LinkKind.NVLINK,
        12,
        PciePath.PIX,
        Source.NVML,
    )
    a_npu = topology.facts("GPU-a", "npu0")
    assert (a_npu.link, a_npu.path, a_npu.path_source) == (None, PciePath.NODE, Source.SYSFS_NUMA)
    npu = topology.devices[3]
    assert (npu.cpus_source, npu.numa, npu.numa_source) == (Source.SYSFS, (0,), Source.SYSFS)
    assert topology.devices[2].cpus_source is Source.NVML


def test_json_from_a_model() -> None:
    data = json.loads(json.dumps(model().to_json()))

    assert data["node"] == "n1"
    assert data["matrix"]["labels"] == ["GPU0", "GPU1", "GPU2", "NPU0"]
    rows = data["matrix"]["rows"]
    assert rows[0] == ["X", "NV12", "SYS", "NODE"]
    assert all(rows[i][j] == rows[j][i] for i in range(4) for j in range(4))
    assert len(data["pairs"]) == 6
    first = data["pairs"][0]
    assert first == {
        "devices": ["GPU0", "GPU1"],
        "ids": ["GPU-a", "GPU-b"],
        "cell": "NV12",
        "pcie": "PIX",
        "pcie_source": "nvml",
        "link": {"kind": "nvlink", "count": 12, "source": "nvml"},
    }
    assert data["devices"][0]["cpu_affinity"] == "0-23,48-71"
    assert data["devices"][3]["numa_affinity"] == [0]
    assert data["vendors"] == [{"vendor": "nvidia", "known": "NVML facts", "error": None}]
    assert data["legend"]["NV#"] == "a bond of # NVLinks"


@pytest.mark.parametrize(
    ("facts", "cell"),
    [
        (PairFacts(link=LinkKind.NVLINK, link_count=18, path=PciePath.SYS), "NV18"),
        (PairFacts(link=LinkKind.HCCS, path=PciePath.PHB), "HCCS"),
        (PairFacts(link=LinkKind.XGMI), "XGMI"),
        (PairFacts(link=LinkKind.XPU_LINK, link_count=4), "XL4"),
        (PairFacts(path=PciePath.PXB), "PXB"),
        (PairFacts(), "N/A"),
    ],
)
def test_cell_shows_the_link_before_the_path(facts: PairFacts, cell: str) -> None:
    assert cell_text(facts) == cell


def test_legend_lists_uncounted_links_and_unknown_paths() -> None:
    hccs = VendorTopology(
        vendor=Vendor.ASCEND,
        known="npu-smi",
        pairs={frozenset(("npu0", "npu1")): PairFacts(link=LinkKind.HCCS)},
    )
    npu_1 = device(Vendor.ASCEND, 1, "npu1")
    unplaced = device(Vendor.ASCEND, 2, "npu2")
    topology = assemble(
        node="n",
        placements=[Placement(NPU_0), Placement(npu_1), Placement(unplaced)],
        vendors=[hccs],
    )
    text = render_matrix(topology)

    assert text.splitlines()[1].split() == ["NPU0", "X", "HCCS", "N/A", "N/A", "N/A"]
    assert "  HCCS = an HCCS link (npu-smi gives no link count)" in text
    assert "  N/A  = not known" in text
    assert "NV#" not in text
    bare = Topology(node="bare", devices=(), pairs={})
    assert render_matrix(bare) == "node bare: no accelerators"


SWITCH = ("0000:17:01.0", "0000:18:00.0")  # a root port, then a switch's upstream port


@pytest.mark.parametrize(
    ("a", "b", "numa", "expected"),
    [
        # Two downstream ports of one switch: PIX.
        (
            PciLocation("pci0000:17", (*SWITCH, "0000:19:00.0")),
            PciLocation("pci0000:17", (*SWITCH, "0000:19:01.0")),
            (0, 0),
            (PciePath.PIX, Source.SYSFS_PCI),
        ),
        # Below two different switches under one root port: PXB.
        (
            PciLocation("pci0000:17", (*SWITCH, "0000:19:00.0", "0000:1a:00.0", "0000:1b:00.0")),
            PciLocation("pci0000:17", (*SWITCH, "0000:19:01.0")),
            (0, 0),
            (PciePath.PXB, Source.SYSFS_PCI),
        ),
        # Behind one more bridge below the switch on one side: PXB.
        (
            PciLocation("pci0000:17", (*SWITCH, "0000:19:00.0", "0000:1a:00.0")),
            PciLocation("pci0000:17", (*SWITCH, "0000:19:01.0")),
            (0, 0),
            (PciePath.PXB, Source.SYSFS_PCI),
        ),
        # Different root ports of one host bridge: PHB.
        (
            PciLocation("pci0000:17", ("0000:17:01.0",)),
            PciLocation("pci0000:17", ("0000:17:02.0",)),
            (0, 0),
            (PciePath.PHB, Source.SYSFS_PCI),
        ),
        # Different host bridges: the NUMA nodes decide.
        (
            PciLocation("pci0000:17", ("0000:17:01.0",)),
            PciLocation("pci0000:3a", ("0000:3a:01.0",)),
            (0, 0),
            (PciePath.NODE, Source.SYSFS_PCI),
        ),
        (
            PciLocation("pci0000:17", ("0000:17:01.0",)),
            PciLocation("pci0000:97", ("0000:97:01.0",)),
            (0, 1),
            (PciePath.SYS, Source.SYSFS_PCI),
        ),
        (
            PciLocation("pci0000:17", ()),
            PciLocation("pci0000:97", ()),
            (0, None),
            (None, None),
        ),
        # No PCI tree: NUMA nodes alone.
        (None, None, (1, 1), (PciePath.NODE, Source.SYSFS_NUMA)),
        (None, PciLocation("pci0000:17", ()), (0, 1), (PciePath.SYS, Source.SYSFS_NUMA)),
        (None, None, (None, 1), (None, None)),
    ],
)
def test_pcie_path_from_sysfs(
    a: PciLocation | None,
    b: PciLocation | None,
    numa: tuple[int | None, int | None],
    expected: tuple[PciePath | None, Source | None],
) -> None:
    first = Placement(GPU_A, pci=a, numa_node=numa[0])
    second = Placement(GPU_B, pci=b, numa_node=numa[1])
    assert pcie_path(first, second) == expected
    assert pcie_path(second, first) == expected


@pytest.mark.parametrize(
    ("path", "location"),
    [
        (
            "/sys/devices/pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:00.0/0000:1a:00.0",
            PciLocation("pci0000:17", ("0000:17:01.0", "0000:18:00.0", "0000:19:00.0")),
        ),
        ("/sys/devices/pci0000:00/0000:00:02.0", PciLocation("pci0000:00", ())),
        # A VMD domain: the second host bridge is one more hop, not a bridge.
        (
            "/sys/devices/pci0000:00/0000:00:0e.5/pci10000:e0/10000:e0:1d.0/10000:e1:00.0",
            PciLocation("pci0000:00", ("0000:00:0e.5", "10000:e0:1d.0")),
        ),
        ("/sys/bus/pci/devices/0000:18:00.0", None),  # a plain directory: no tree
        ("/sys/devices/pci0000:17", None),
        ("", None),
    ],
)
def test_pci_location(path: str, location: PciLocation | None) -> None:
    assert pci_location(path) == location


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0-3,8", {0, 1, 2, 3, 8}), (" 5 \n", {5}), ("0-1,1-2", {0, 1, 2})],
)
def test_parse_cpulist(text: str, cpus: set[int]) -> None:
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["", "a-b", "3-1", "1,,2", "0-"])
def test_parse_cpulist_refuses_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="bad CPU"):
        parse_cpulist(text)


@given(st.sets(st.integers(min_value=0, max_value=600), min_size=1))
def test_cpulist_round_trip(cpus: set[int]) -> None:
    text = format_cpulist(cpus)
    assert parse_cpulist(text) == cpus
    assert text == format_cpulist(parse_cpulist(text))


def test_mask_bits() -> None:
    assert mask_bits([0b1011, 0, 1 << 63]) == {0, 1, 3, 191}
    assert mask_bits([0, 0]) == set()


# ---- npu-smi info -t topo ----------------------------------------------------------------------

NPU_SMI_TOPO = (
    "\t   NPU0       NPU1       NPU2       NPU3       CPU Affinity\n"
    "NPU0       X          HCCS       PIX        SYS        144-167\n"
    "NPU1       HCCS       X          NA         SYS        144-167\n"
    "NPU2       PIX        NA         X          HCCS_SW    96-119\n"
    "NPU3       SYS        SYS        HCCS_SW    X          0-23,48-71\n"
    "\n"
    "Legend:\n"
    "\n"
    "  X    = the NPU itself\n"
    "  NPU9 = a legend line that looks like a row\n"
)


def test_parse_npu_smi_topo() -> None:
    topo = ascend.parse_npu_smi_topo(NPU_SMI_TOPO)

    assert topo.npus == (0, 1, 2, 3)
    assert topo.cells[(0, 1)] == "HCCS"
    assert topo.cells[(1, 2)] == "NA"
    assert topo.cells[(3, 2)] == "HCCS_SW"
    assert topo.cells[(2, 2)] == "X"
    assert len(topo.cells) == 16
    assert topo.cpu_affinity == {0: "144-167", 1: "144-167", 2: "96-119", 3: "0-23,48-71"}


def test_parse_npu_smi_topo_of_one_npu_and_extra_columns() -> None:
    one = ascend.parse_npu_smi_topo("\tNPU0       CPU Affinity\nNPU0       X          0-7\n")
    assert (one.npus, one.cpu_affinity) == ((0,), {0: "0-7"})
    extra = ascend.parse_npu_smi_topo(
        "  NPU0    NPU1    NUMA Affinity    CPU Affinity\n"
        "NPU0    X       HCCS    0                0-7\n"
        "NPU1    HCCS    X       0                8-15\n"
    )
    assert extra.cpu_affinity == {0: "0-7", 1: "8-15"}


def test_parse_npu_smi_topo_refuses_output_without_a_matrix() -> None:
    with pytest.raises(ascend.NpuSmiParseError, match="no `NPU0 NPU1"):
        ascend.parse_npu_smi_topo("Error: the command is not supported\n")


def test_parse_npu_smi_topo_unsupported_device_is_an_empty_matrix() -> None:
    topo = ascend.parse_npu_smi_topo("This device does not support querying topo.\n")
    assert (topo.npus, topo.cells, topo.problems) == ((), {}, ())
    assert topo.unsupported == "This device does not support querying topo."


@pytest.mark.parametrize(
    ("text", "cells", "problem"),
    [
        (
            "  NPU0   NPU1   CPU Affinity\nNPU0   X      HCCS   0-7\n",
            {(0, 0): "X", (0, 1): "HCCS"},
            "no row for NPU1",
        ),
        ("  NPU0   NPU1   CPU Affinity\nNPU0   X\n", {(0, 0): "X"}, "line 2: 1 of 2 cells"),
    ],
)
def test_parse_npu_smi_topo_keeps_what_a_short_matrix_has(
    text: str, cells: dict[tuple[int, int], str], problem: str
) -> None:
    topo = ascend.parse_npu_smi_topo(text)
    assert topo.cells == cells
    assert any(line.startswith(problem) for line in topo.problems)


# ---- real discovery of simulated nodes ---------------------------------------------------------


def topology_text(capsys: pytest.CaptureFixture[str], profile: str) -> str:
    assert main(["discover", "--simulate", profile, "--topology", "--log-level", "error"]) == 0
    return capsys.readouterr().out


def topology_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    argv = ["discover", *args, "--topology", "--format", "json", "--log-level", "error"]
    assert main(argv) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


def matrix(text: str) -> tuple[dict[tuple[str, str], str], dict[str, tuple[str, str]]]:
    """Cells by (row, column) label, and each row's CPU and NUMA affinity, from the text."""
    lines = text.split("\n\nLegend:", maxsplit=1)[0].splitlines()
    labels = lines[0].split()[:-4]  # then CPU Affinity, NUMA Affinity
    cells, affinity = {}, {}
    for line in lines[1:]:
        row, *rest = line.split()
        assert len(rest) == len(labels) + 2, line
        cells.update({(row, col): cell for col, cell in zip(labels, rest, strict=False)})
        affinity[row] = (rest[-2], rest[-1])
    return cells, affinity


def label_numa(profile: str, vendor: str) -> dict[str, int]:
    """Label -> NUMA node of one vendor's devices, as the profile places them."""
    node = load_profile(profile).node
    spec: Any = getattr(load_profile(profile), vendor)
    groups = spec.gpus if vendor == "nvidia" else spec.npus
    count = sum(g.count for g in groups)
    prefix = "GPU" if vendor == "nvidia" else "NPU"
    return {f"{prefix}{i}": i * node.numa_nodes // count for i in range(count)}


def test_dgx_h100_text(capsys: pytest.CaptureFixture[str]) -> None:
    spec = load_profile("dgx-h100").nvidia
    assert spec is not None
    assert (spec.nvlink, spec.nvlink_links) == ("all", 2)  # what the matrix below shows
    cells, affinity = matrix(topology_text(capsys, "dgx-h100"))

    labels = [f"GPU{i}" for i in range(8)]
    for a in labels:
        for b in labels:
            assert cells[(a, b)] == ("X" if a == b else "NV2"), (a, b)
    numa = label_numa("dgx-h100", "nvidia")
    assert affinity == {label: (numa_cpulist(numa[label]), str(numa[label])) for label in labels}
    assert affinity["GPU0"] == ("0-31", "0")
    assert affinity["GPU7"] == ("32-63", "1")


def test_dgx_h100_json(capsys: pytest.CaptureFixture[str]) -> None:
    data = topology_json(capsys, "--simulate", "dgx-h100")

    assert data["node"] == "sim-dgx-h100"
    assert [d["label"] for d in data["devices"]] == [f"GPU{i}" for i in range(8)]
    assert {(d["cpu_affinity_source"], d["numa_affinity_source"]) for d in data["devices"]} == {
        ("nvml", "nvml")
    }
    assert len(data["pairs"]) == 28
    assert {json.dumps(p["link"]) for p in data["pairs"]} == {
        json.dumps({"kind": "nvlink", "count": 2, "source": "nvml"})
    }
    # Under the NVLinks, the fake's common ancestors: NODE within a NUMA node, SYS across.
    paths = {tuple(p["devices"]): (p["pcie"], p["pcie_source"]) for p in data["pairs"]}
    assert paths[("GPU0", "GPU3")] == ("NODE", "nvml")
    assert paths[("GPU3", "GPU4")] == ("SYS", "nvml")
    assert data["vendors"][0]["vendor"] == "nvidia"
    assert data["vendors"][0]["error"] is None


def test_dgx_a100_mig_is_per_physical_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    data = topology_json(capsys, "--simulate", "dgx-a100-mig")

    assert [d["label"] for d in data["devices"]] == [f"GPU{i}" for i in range(8)]
    assert all(d["id"].startswith("GPU-") for d in data["devices"])
    rows = data["matrix"]["rows"]
    assert {rows[i][j] for i in range(8) for j in range(8) if i != j} == {"NV2"}
    assert [d["numa_affinity"] for d in data["devices"]] == [[0]] * 4 + [[1]] * 4


def test_mixed_gpu_npu_text(capsys: pytest.CaptureFixture[str]) -> None:
    text = topology_text(capsys, "mixed-gpu-npu")
    cells, affinity = matrix(text)

    # nvlink: pairs, 3 links -> GPU0-GPU1 and GPU2-GPU3; GPUs 0-1 and NPUs 0-1 on NUMA node 0.
    assert cells[("GPU0", "GPU1")] == cells[("GPU3", "GPU2")] == "NV3"
    assert cells[("GPU0", "GPU2")] == cells[("GPU1", "GPU3")] == "SYS"  # PCIe A100s across nodes
    assert cells[("NPU0", "NPU1")] == "PHB"  # npu-smi, no HCCS in this profile
    assert cells[("NPU1", "NPU2")] == "SYS"
    assert cells[("GPU0", "NPU0")] == cells[("NPU1", "GPU1")] == "NODE"  # sysfs, NUMA alone
    assert cells[("GPU0", "NPU2")] == cells[("NPU3", "GPU1")] == "SYS"
    assert affinity["NPU0"] == ("0-31", "0")
    assert affinity["NPU3"] == ("32-63", "1")
    assert affinity["GPU2"] == ("32-63", "1")
    assert "  nvidia: NVML" in text
    assert "  ascend: npu-smi info -t topo" in text
    assert "NODE there may be nearer" in text


def test_mixed_gpu_npu_json_sources(capsys: pytest.CaptureFixture[str]) -> None:
    data = topology_json(capsys, "--simulate", "mixed-gpu-npu")

    pairs = {tuple(p["devices"]): p for p in data["pairs"]}
    assert pairs[("GPU0", "GPU2")]["pcie_source"] == "nvml"
    assert pairs[("NPU0", "NPU1")]["pcie_source"] == "npu-smi"
    assert pairs[("GPU0", "NPU0")]["pcie_source"] == "sysfs-numa"
    assert pairs[("GPU0", "NPU0")]["link"] is None
    npus = [d for d in data["devices"] if d["vendor"] == "ascend"]
    assert {(d["cpu_affinity_source"], d["numa_affinity_source"]) for d in npus} == {
        ("npu-smi", "sysfs")
    }
    assert {v["vendor"]: v["error"] for v in data["vendors"]} == {"nvidia": None, "ascend": None}


def test_ascend_910b_hccs(capsys: pytest.CaptureFixture[str]) -> None:
    spec = load_profile("ascend-910bx8").ascend
    assert spec is not None
    assert spec.hccs == "all"
    data = topology_json(capsys, "--simulate", "ascend-910bx8")

    assert [d["label"] for d in data["devices"]] == [f"NPU{i}" for i in range(8)]
    assert len(data["pairs"]) == 28
    for pair in data["pairs"]:
        assert pair["cell"] == "HCCS"
        assert pair["link"] == {"kind": "hccs", "count": None, "source": "npu-smi"}
        a, b = (int(label[3:]) for label in pair["devices"])
        assert pair["pcie"] == ("NODE" if a // 4 == b // 4 else "SYS")  # sysfs NUMA under HCCS
    assert [d["cpu_affinity"] for d in data["devices"]] == ["0-31"] * 4 + ["32-63"] * 4


def test_kunlunxin_from_sysfs_only(capsys: pytest.CaptureFixture[str]) -> None:
    data = topology_json(capsys, "--simulate", "kunlun-p800x8")

    assert [d["label"] for d in data["devices"]] == [f"XPU{i}" for i in range(8)]
    rows = data["matrix"]["rows"]
    assert rows[0] == ["X", "NODE", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"]
    assert {p["pcie_source"] for p in data["pairs"]} == {"sysfs-numa"}
    assert {p["link"] is None for p in data["pairs"]} == {True}
    assert [d["cpu_affinity"] for d in data["devices"]] == ["0-31"] * 4 + ["32-63"] * 4
    assert "no XPU Link information" in data["vendors"][0]["known"]


# ---- readers against trees changed by hand ----------------------------------------------------


def discovered(root: Path, profile: str) -> Inventory:
    build_tree(load_profile(profile), root)
    settings = load_settings(
        file=None, environ={}, overrides={"host_root": str(root), "node_name": "n"}
    )
    return discover_node(settings)


def test_sysfs_pci_tree(tmp_path: Path) -> None:
    """Real sysfs links /sys/bus/pci/devices/<address> into the /sys/devices tree; there the
    XPUs' shared switch and root ports give PIX, PXB and PHB."""
    inventory = discovered(tmp_path, "kunlun-p800x8")
    xpus = inventory.devices
    switch = "devices/pci0001:17/0001:17:01.0/0001:18:00.0"
    parents = {
        0: f"{switch}/0001:19:00.0",
        1: f"{switch}/0001:19:01.0",
        2: f"{switch}/0001:19:02.0/0001:1a:00.0/0001:1b:00.0",
        3: "devices/pci0001:17/0001:17:02.0",
    }
    for index, parent in parents.items():
        bus_id = xpus[index].pci_bus_id
        assert bus_id is not None
        moved = tmp_path / "sys" / parent / bus_id
        moved.parent.mkdir(parents=True, exist_ok=True)
        link = tmp_path / "sys/bus/pci/devices" / bus_id
        shutil.move(link, moved)
        link.symlink_to(Path("../../..") / parent / bus_id)
    write_file(tmp_path, f"/sys/bus/pci/devices/{xpus[0].pci_bus_id}/local_cpulist", "0-7\n")

    topology = read_topology(HostRoot.at(tmp_path), inventory)
    ids = [x.id for x in xpus]

    assert topology.cell(ids[0], ids[1]) == "PIX"
    assert topology.cell(ids[0], ids[2]) == "PXB"
    assert topology.cell(ids[1], ids[3]) == "PHB"
    assert topology.cell(ids[0], ids[4]) == "SYS"  # XPU4 has no tree: NUMA nodes decide
    assert topology.facts(ids[0], ids[1]).path_source is Source.SYSFS_PCI
    assert topology.facts(ids[0], ids[4]).path_source is Source.SYSFS_NUMA
    assert topology.devices[0].cpus == frozenset(range(8))  # its own local_cpulist
    assert topology.devices[1].cpus == parse_cpulist("0-31")  # its NUMA node's CPUs


def test_single_numa_node_host(tmp_path: Path) -> None:
    inventory = discovered(tmp_path, "kunlun-p800x8")
    xpu = inventory.devices[0]
    unplaced = Device(xpu.vendor, xpu.kind, 9, "x9", "x", 1, None, xpu.pci_bus_id)
    root = HostRoot.at(tmp_path)

    assert placement(root, unplaced, [0]).numa_node == 0  # the only node on the host
    assert placement(root, unplaced, [0, 1]).numa_node == 0  # sysfs numa_node of its address
    no_pci = Device(xpu.vendor, xpu.kind, 9, "x9", "x", 1)
    assert placement(root, no_pci, [0, 1]) == Placement(no_pci)
    assert placement(root, no_pci, [1]).cpus == parse_cpulist("32-63")


def test_hygon_xgmi_from_kfd_io_links(tmp_path: Path) -> None:
    inventory = discovered(tmp_path, "hygon-k100x8")
    profile = load_profile("hygon-k100x8")
    assert profile.hygon is not None
    # KFD numbers the CPU nodes first, then one node per DCU (as hygon_tree writes them).
    gpu_node = {dcu.index: 2 + dcu.index for dcu in hygon_tree.dcus_of(profile.hygon, profile)}
    assert profile.node.numa_nodes == 2
    kfd = hygon_tree.KFD_NODES

    def io_link(node: int, number: int, kind: int, to: int) -> None:
        write_file(
            tmp_path,
            f"{kfd}/{node}/io_links/{number}/properties",
            f"type {kind}\nversion_major 0\nnode_from {node}\nnode_to {to}\nweight 15\n",
        )

    for a, b in ((0, 1), (1, 0), (2, 3)):  # xGMI between DCU 0 and 1 (both ways), 2 -> 3
        io_link(gpu_node[a], 1, 11, gpu_node[b])
    io_link(gpu_node[4], 0, 2, 0)  # PCIe to its CPU node
    io_link(gpu_node[5], 0, 2, gpu_node[6])  # PCIe peer link: not a direct link

    topology = read_topology(HostRoot.at(tmp_path), inventory)
    ids = [d.id for d in inventory.devices]

    assert topology.cell(ids[0], ids[1]) == "XGMI"
    assert topology.cell(ids[3], ids[2]) == "XGMI"
    assert topology.facts(ids[0], ids[1]).link_source is Source.KFD
    assert topology.facts(ids[0], ids[1]).link_count is None
    assert topology.cell(ids[5], ids[6]) == "NODE"
    assert topology.cell(ids[0], ids[2]) == "NODE"
    assert topology.cell(ids[0], ids[7]) == "SYS"


def test_nvml_gone_keeps_discovered_nvlinks(tmp_path: Path) -> None:
    inventory = discovered(tmp_path, "cgpu-v100")
    (tmp_path / nvidia_tree.LIBRARY.lstrip("/")).unlink()

    topology = read_topology(HostRoot.at(tmp_path), inventory)
    ids = [d.id for d in inventory.devices]

    assert topology.vendors[0].error is not None
    assert "not found" in topology.vendors[0].error
    assert topology.cell(ids[0], ids[1]) == "NV2"  # nvlink: pairs, 2 links
    assert topology.cell(ids[0], ids[2]) == "NODE"  # sysfs, NUMA nodes alone
    assert topology.facts(ids[0], ids[2]).path_source is Source.SYSFS_NUMA
    assert topology.devices[0].cpus_source is Source.SYSFS
    assert "error nvidia:" in render_matrix(topology)


def test_npu_smi_failing_leaves_sysfs(tmp_path: Path) -> None:
    inventory = discovered(tmp_path, "ascend-910bx8")
    (tmp_path / ascend_tree.TOPO_OUTPUT.lstrip("/")).write_text("garbage\n")

    topology = read_topology(HostRoot.at(tmp_path), inventory)
    ids = [d.id for d in inventory.devices]

    assert topology.vendors[0].error is not None
    assert "unexpected output" in topology.vendors[0].error
    assert topology.cell(ids[0], ids[1]) == "NODE"
    assert topology.cell(ids[0], ids[7]) == "SYS"


# ---- the fake NVML library's affinity calls ------------------------------------------------


def test_fake_nvml_affinity(tmp_path: Path) -> None:
    build_tree(load_profile("dgx-a100-mig"), tmp_path)
    library = str(HostRoot.at(tmp_path).path(nvidia_tree.LIBRARY))
    with nvidia.nvml_session(library):
        gpu = pynvml.nvmlDeviceGetHandleByIndex(6)
        assert mask_bits(pynvml.nvmlDeviceGetCpuAffinity(gpu, 1)) == set(range(32, 64))
        node = pynvml.NVML_AFFINITY_SCOPE_NODE
        socket = pynvml.NVML_AFFINITY_SCOPE_SOCKET
        assert mask_bits(pynvml.nvmlDeviceGetMemoryAffinity(gpu, 2, node)) == {1}
        assert mask_bits(pynvml.nvmlDeviceGetCpuAffinityWithinScope(gpu, 2, socket)) == set(
            range(32, 64)
        )
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetMemoryAffinity(gpu, 2, 7)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetCpuAffinity(gpu, 0)
        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(pynvml.nvmlDeviceGetHandleByIndex(0), 0)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetCpuAffinity(mig, 1)
