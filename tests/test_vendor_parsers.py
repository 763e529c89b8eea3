"""Vendor-tool output parsers (xpu-smi, hy-smi, npu-smi, KFD topology): text in, records out."""

from __future__ import annotations

import json

import pytest

from edl_agent.devices.ascend import NpuSmiParseError, parse_npu_smi_info, parse_version_info
from edl_agent.devices.hygon import (
    HySmiParseError,
    parse_hy_smi_json,
    parse_hy_smi_status,
    parse_kfd_properties,
)
from edl_agent.devices.kunlunxin import (
    XpuSmiParseError,
    XpuSmiReport,
    parse_xpu_smi_list,
    parse_xpu_smi_query,
    sysfs_bus_id,
)
from edl_agent.devices.lenient_json import LenientJson, read_lenient_json

# --- Kunlunxin: xpu-smi -q --------------------------------------------------------------------

XPU_SMI_Q = """\
==============XPUSMI LOG==============

Timestamp                                 : Tue Feb  3 18:20:01 2026
Driver Version                            : 5.0.21.26
XPU-RT Version                            : 10.2

Attached XPUs                             : 2
XPU 00000000:01:00.0
    Product Name                          : P800 PCIe
    Product Brand                         : KUNLUNXIN
    Product Architecture                  : KL3
    Serial Number                         : 02K0TEST0000001A
    XPU UUID                              : GPU-00000000-0000-4000-8000-000000000001
    Minor Number                          : 0
    XPU Part Number                       : B00100300110112
    Firmware Version
        PBL Version                       : 1.0
    PCI
        Bus                               : 0x01
        Domain                            : 0x0000
        Bus Id                            : 00000000:01:00.0
        XPU Link Info
            PCIe Generation
                Max                       : 4
    Memory Usage
        Total                             : 98304 MiB
        Used                              : 0 MiB
    L3 Usage
        Total                             : 96 MiB
    Processes                             : None
XPU 00000000:9C:00.0
    Product Name                          : P800 OAM
    Minor Number                          : 5
    PCI
        Bus Id                            : 00000000:9C:00.0
    Memory Usage
        Total                             : 98304 MiB
"""


def test_xpu_smi_query_reads_header_and_blocks() -> None:
    report = parse_xpu_smi_query(XPU_SMI_Q)
    assert report.driver_version == "5.0.21.26"
    assert report.runtime_version == "10.2"
    first, second = report.xpus
    assert first.product == "P800 PCIe"
    assert first.bus_id == "0000:01:00.0"
    assert first.memory_mib == 98304  # Memory Usage > Total, not L3 Usage > Total
    assert first.minor == 0
    assert first.serial_number == "02K0TEST0000001A"
    assert first.uuid == "GPU-00000000-0000-4000-8000-000000000001"
    assert first.part_number == "B00100300110112"
    assert first.architecture == "KL3"
    assert (second.bus_id, second.minor, second.serial_number) == ("0000:9c:00.0", 5, None)


def test_xpu_smi_query_without_devices() -> None:
    text = "Driver Version : 5.0.21.26\nAttached XPUs : 0\n"
    assert parse_xpu_smi_query(text) == XpuSmiReport("5.0.21.26", None, ())


def test_xpu_smi_query_bus_id_from_heading_when_pci_section_missing() -> None:
    text = "Attached XPUs : 1\nXPU 00000000:21:00.0\n    Product Name : P800\n"
    text += "    Memory Usage\n        Total : 1024 MiB\n"
    (xpu,) = parse_xpu_smi_query(text).xpus
    assert (xpu.bus_id, xpu.minor) == ("0000:21:00.0", None)


@pytest.mark.parametrize(
    "text",
    ["", "garbage", "\x00\x7f\x01 binary noise", "error: driver not loaded : code 3\n"],
)
def test_xpu_smi_query_refuses_output_without_xpus(text: str) -> None:
    with pytest.raises(XpuSmiParseError, match="no XPU blocks"):
        parse_xpu_smi_query(text)


@pytest.mark.parametrize(
    ("old", "new", "field", "problem"),
    [
        ("P800 OAM", "", "product", "XPU 00000000:9C:00.0: no Product Name"),
        ("98304 MiB", "96 GiB", "memory_mib", "Memory Usage > Total"),
        ("00000000:9C:00.0\n    Memory", "9C:00.0\n    Memory", "bus_id", "no readable PCI"),
        (
            "Minor Number                          : 5",
            "Minor Number : five",
            "minor",
            "Minor Number 'five'",
        ),
    ],
)
def test_xpu_smi_query_unreadable_field_is_unknown(
    old: str, new: str, field: str, problem: str
) -> None:
    text = new.join(XPU_SMI_Q.rsplit(old, 1))  # in the second block
    report = parse_xpu_smi_query(text)
    first, second = report.xpus
    assert getattr(second, field) is None
    assert (first.product, first.memory_mib, first.bus_id) == ("P800 PCIe", 98304, "0000:01:00.0")
    assert any(problem in line for line in report.problems)


def test_xpu_smi_query_attached_count_that_does_not_match_is_noted() -> None:
    text = XPU_SMI_Q.replace("Attached XPUs                             : 2", "Attached XPUs : 3")
    report = parse_xpu_smi_query(text)
    assert len(report.xpus) == 2
    assert report.problems == ("`Attached XPUs : 3` but 2 XPU blocks printed",)


def test_xpu_smi_query_trailing_noise_stays_out_of_the_facts() -> None:
    report = parse_xpu_smi_query(XPU_SMI_Q + "Segmentation fault\n")
    assert [x.product for x in report.xpus] == ["P800 PCIe", "P800 OAM"]


def test_xpu_smi_list_names_uuids_and_old_bus_ids() -> None:
    text = (
        "XPU 0: P800 OAM  GPU-ed733bb8-c4a8-5bb5-9431-14512597fc12\n"
        "XPU 1: 00000000:21:00.0\n"
        "something else\n"
    )
    first, second = parse_xpu_smi_list(text)
    assert (first.smi_index, first.name, first.uuid) == (
        0,
        "P800 OAM",
        "GPU-ed733bb8-c4a8-5bb5-9431-14512597fc12",
    )
    assert (second.name, second.bus_id) == (None, "0000:21:00.0")
    with pytest.raises(XpuSmiParseError, match="no `XPU"):
        parse_xpu_smi_list("No devices were found\n")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("00000000:01:00.0", "0000:01:00.0"),
        ("00000001:9C:00.0", "0001:9c:00.0"),
        ("0000:C1:00.1", "0000:c1:00.1"),
        ("9C:00.0", None),
    ],
)
def test_sysfs_bus_id(text: str, expected: str | None) -> None:
    assert sysfs_bus_id(text) == expected


# --- Hygon: hy-smi --json, KFD topology ---------------------------------------------------------


def hy_json(**cards: dict[str, str]) -> str:
    return json.dumps({**cards, "system": {"Driver version": "6.3.8"}})


def test_hy_smi_json_reads_cards_in_index_order() -> None:
    text = hy_json(
        card1={"Card Series": "K100_AI", "vram Total Memory (MiB)": "65520"},
        card0={
            "Card Series": "K100_AI",
            "vram Total Memory (MiB)": "65520",
            "PCI Bus": "0000:1A:00.0",
        },
    )
    report = parse_hy_smi_json(text)
    assert report.driver_version == "6.3.8"
    assert [(d.index, d.product, d.memory_mib, d.bus_id) for d in report.dcus] == [
        (0, "K100_AI", 65520, "0000:1a:00.0"),
        (1, "K100_AI", 65520, None),
    ]


def test_hy_smi_json_accepts_rocm_smi_spellings() -> None:
    text = json.dumps({"card0": {"Card series": "Z100L", "VRAM Total Memory (B)": "34342961152"}})
    (dcu,) = parse_hy_smi_json(text).dcus
    assert (dcu.product, dcu.memory_mib) == ("Z100L", 32752)
    assert parse_hy_smi_json(text).driver_version is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no JSON object"),
        ("HCU[0]\t\t: Card Series: K100_AI\n", "no JSON object"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"system": {"Driver version": "6.3.8"}}', "no card<N> entries"),
        ('{"card0": "K100_AI"}', "no card<N> entries"),
    ],
)
def test_hy_smi_json_refuses_output_without_cards(text: str, message: str) -> None:
    with pytest.raises(HySmiParseError, match=message):
        parse_hy_smi_json(text)


@pytest.mark.parametrize(
    ("card", "field", "problem"),
    [
        ({"vram Total Memory (MiB)": "1"}, "product", "card0: no Card Series"),
        ({"Card Series": "K100", "vram Total Memory (MiB)": "N/A"}, "memory_mib", "numeric vram"),
        (
            {"Card Series": "K100", "VRAM Total Memory (B)": "1", "PCI Bus": "x"},
            "bus_id",
            "card0: PCI Bus 'x' holds no address",
        ),
    ],
)
def test_hy_smi_json_unreadable_field_is_unknown(
    card: dict[str, str], field: str, problem: str
) -> None:
    good = {"Card Series": "K100", "vram Total Memory (MiB)": "65520", "PCI Bus": "0000:1a:00.0"}
    report = parse_hy_smi_json(json.dumps({"card0": card, "card1": good}))
    first, second = report.dcus
    assert getattr(first, field) is None
    assert (second.product, second.memory_mib, second.bus_id) == ("K100", 65520, "0000:1a:00.0")
    assert any(problem in line for line in report.problems)


def test_hy_smi_bus_value_with_serial_and_oam_id() -> None:
    text = '{"card0": {"PCI Bus": "0000:09:00.0 --> SN: 01-000206-07SCC2 --> OAM ID: 1"}}'
    assert parse_hy_smi_status(text)[0].bus_id == "0000:09:00.0"


def test_lenient_json_reads_around_missing_commas_empty_keys_and_text() -> None:
    text = (
        "WARNING: the driver is old\n"
        '{"card0": {"a": "1""b": 2, "": "", "": "", "c": 41.0C} "card1": {"a": "3"}}\n'
        "done\n"
    )
    read = read_lenient_json(text)
    assert read.data == {"card0": {"a": "1", "b": "2", "c": "41.0C"}, "card1": {"a": "3"}}
    assert set(read.repairs) == {
        "text outside the JSON object ignored",
        "missing comma between keys",
        "empty keys dropped",
        "bare values read as text",
    }


def test_lenient_json_keeps_strict_json_as_it_is() -> None:
    assert read_lenient_json('{"a": [1, {"b": null}]}') == LenientJson({"a": [1, {"b": None}]})


@pytest.mark.parametrize(
    ("text", "data", "repair"),
    [
        ('{"a": "1", "b": ', {"a": "1", "b": None}, "object not closed"),
        ('{"a": "1" "b"}', {"a": "1"}, "key without a value skipped"),
        ('{"a": [1, 2}', {"a": ["1", "2"]}, "array not closed"),
        ('{"a": "1" "a": "2"}', {"a": "2"}, "repeated key 'a': the last value kept"),
        ('{oops "a": "1"}', {"a": "1"}, "unreadable text inside an object skipped"),
    ],
)
def test_lenient_json_repairs(text: str, data: dict[str, object], repair: str) -> None:
    read = read_lenient_json(text)
    assert read.data == data
    assert repair in read.repairs


def test_kfd_properties_keeps_integer_pairs() -> None:
    text = "cpu_cores_count 0\nsimd_count 480\nmarketing_name K100\nlocation_id 6144\n\ndomain 2\n"
    assert parse_kfd_properties(text) == {
        "cpu_cores_count": 0,
        "simd_count": 480,
        "location_id": 6144,
        "domain": 2,
    }


# --- Ascend: npu-smi info ---------------------------------------------------------------------

BORDER = "+---------------------------+---------------+" + "-" * 52 + "+"
DOUBLE = "+===========================+===============+" + "=" * 52 + "+"
NPU_SMI_910B = f"""\
+{"-" * 96}+
| npu-smi 25.3.rc1                 Version: 25.3.rc1                                             |
{BORDER}
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
{DOUBLE}
| 0     910B3               | OK            | 96.2        39                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          58626/ 65536         |
{DOUBLE}
| 1     910B3               | Warning       | 91.1        50                0    / 0             |
| 0                         | 0000:C2:00.0  | 0           0    / 0          3436 / 65536         |
{DOUBLE}
{BORDER}
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
{DOUBLE}
| 0       0                 | 2698909       |                          | 600                     |
{DOUBLE}
| No running processes found in NPU 1                                                            |
{DOUBLE}
"""

# Multi-chip card layout (two chips per NPU, `Chip Device` header): designed, not recorded.
NPU_SMI_310P = f"""\
| npu-smi 23.0.0                   Version: 23.0.0                                               |
{BORDER}
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip  Device              | Bus-Id        | AICore(%)   Memory-Usage(MB)                        |
{DOUBLE}
| 4     310P3               | Alarm         | 60.0        45                0    / 0             |
| 0     2                   | 0000:81:00.0  | 0           1520 / 44280                           |
| 1     3                   | 0000:81:00.0  | 0           1318 / 43693                           |
{DOUBLE}
"""


def test_npu_smi_info_reads_npu_and_chip_rows() -> None:
    info = parse_npu_smi_info(NPU_SMI_910B)
    assert info.version == "25.3.rc1"
    assert [(n.npu_id, n.chip_id, n.index) for n in info.npus] == [(0, 0, 0), (1, 0, 1)]
    assert [(n.name, n.health, n.bus_id, n.memory_mib) for n in info.npus] == [
        ("910B3", "OK", "0000:c1:00.0", 65536),
        ("910B3", "Warning", "0000:c2:00.0", 65536),
    ]


def test_npu_smi_info_multi_chip_card_takes_device_column_as_index() -> None:
    info = parse_npu_smi_info(NPU_SMI_310P)
    assert [(n.npu_id, n.chip_id, n.index, n.health) for n in info.npus] == [
        (4, 0, 2, "Alarm"),
        (4, 1, 3, "Alarm"),
    ]
    assert [n.memory_mib for n in info.npus] == [44280, 43693]  # no HBM column: Memory-Usage


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no `NPU Name | Health`"),
        ("dcmi module initialize failed. ret is -8005\n", "table header"),
        (NPU_SMI_910B.split(DOUBLE, maxsplit=1)[0] + DOUBLE + "\n", "no NPU rows"),
        ("\x00\x01\x02", "table header"),
    ],
)
def test_npu_smi_info_rejects_garbled_output(text: str, message: str) -> None:
    with pytest.raises(NpuSmiParseError, match=message.replace("|", r"\|")):
        parse_npu_smi_info(text)


@pytest.mark.parametrize(
    ("old", "new", "field", "problem"),
    [
        ("| 0     910B3 ", "| zero  910B3 ", "npu_id", "line 7: NPU cell 'zero  910B3'"),
        ("0000:C1:00.0", "C1:00.0     ", "bus_id", "line 8: Bus-Id 'C1:00.0'"),
        ("58626/ 65536", "58626 65536 ", "memory_mib", "line 8: memory cell"),
    ],
)
def test_npu_smi_info_unreadable_cell_loses_only_its_field(
    old: str, new: str, field: str, problem: str
) -> None:
    info = parse_npu_smi_info(NPU_SMI_910B.replace(old, new))
    first, second = info.npus
    assert getattr(first, field) is None
    assert (second.npu_id, second.bus_id, second.memory_mib) == (1, "0000:c2:00.0", 65536)
    assert first.name == "910B3"
    (line,) = info.problems
    assert line.startswith(problem)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Version=24.1.rc2\nascendhal_version=7.35.19\n", "24.1.rc2"),
        ("package_version=x\n", None),
        ("", None),
    ],
)
def test_driver_version_info(text: str, expected: str | None) -> None:
    assert parse_version_info(text) == expected
