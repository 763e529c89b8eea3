"""Ascend NPUs of a simulated node: `/dev/davinci*`, PCI sysfs entries and an `npu-smi` stand-in.

The stand-in prints the output kept next to it (`npu-smi.info.txt` for `info`,
`npu-smi.info-m.txt` for `info -m`, `npu-smi.topo.txt` for `info -t topo`,
`npu-smi.health.<npu>.txt` for `info -t health -i <npu>`, or `npu-smi.health.<npu>.<chip>.txt`
where an NPU has several chips), laid out as the real tool lays it out for the profile's kind of
node (`ascend_layout`: npu-smi 20.x, 910B, Atlas A3, 310P). Each chip's health is the Health cell
of its NPU row plus its health file: `set_npu_health` rewrites both, which is how a fault (a chip
turning `Critical` with fault code 0x80E01801) is simulated.

The node also has the driver's DCMI library (`ascend_dcmi`): `set_npu_health` changes what it
reports and raises its fault events, and the stand-in's reset clears it too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from edl_agent.sim import ascend_dcmi
from edl_agent.sim.ascend_layout import (
    Layout,
    SimNpu,
    health_width,
    npu_smi_info,
    npu_smi_map,
    npu_smi_topo,
)
from edl_agent.sim.files import VENDOR_SLOT, write_file
from edl_agent.sim.profile import AscendSpec, Profile, numa_cpulist, numa_node_of, pci_bus_id

TOOL = "/usr/local/Ascend/driver/tools/npu-smi"
INFO_OUTPUT = TOOL + ".info.txt"
MAP_OUTPUT = TOOL + ".info-m.txt"
TOPO_OUTPUT = TOOL + ".topo.txt"
HEALTH_OUTPUT = TOOL + ".health.{npu}.txt"
CHIP_HEALTH_OUTPUT = TOOL + ".health.{npu}.{chip}.txt"
VERSION_INFO = "/usr/local/Ascend/driver/version.info"
SHARED_NODES = ("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc")
PCI_VENDOR = "0x19e5"
PCI_DEVICE = "0xd802"  # Ascend 910B

SCRIPT = """#!/bin/sh
# npu-smi stand-in for a simulated node: prints the recorded output kept next to this script.
here=$(dirname "$0")
case "$*" in
  info) exec cat "$here/npu-smi.info.txt" ;;
  "info -m") exec cat "$here/npu-smi.info-m.txt" ;;
  "info -t topo") exec cat "$here/npu-smi.topo.txt" ;;
  "info -t health -i "*)
    npu=$5 chip=$7
    case "$npu" in "" | *[!0-9]*) echo "npu-smi (simulated): bad NPU id: $npu" >&2; exit 2 ;; esac
    [ -f "$here/npu-smi.health.$npu.$chip.txt" ] && exec cat "$here/npu-smi.health.$npu.$chip.txt"
    [ -f "$here/npu-smi.health.$npu.txt" ] && exec cat "$here/npu-smi.health.$npu.txt"
    echo "Error: the device $npu does not exist." >&2; exit 1 ;;
  "set -t reset -i "*" -c "*)
    npu=$5
    case "$npu" in "" | *[!0-9]*) echo "npu-smi (simulated): bad NPU id: $npu" >&2; exit 2 ;; esac
    found=
    for f in "$here/npu-smi.health.$npu.txt" "$here"/npu-smi.health."$npu".[0-9]*.txt; do
      [ -f "$f" ] && cp "$here/npu-smi.health-ok.txt" "$f" && found=1
    done
    [ -n "$found" ] || { echo "Error: the device $npu does not exist." >&2; exit 1; }
    sed -i -E "s/^(\\| $npu +[^ ]+ *\\| ).{@WIDTH@}( \\|)/\\1@OK@\\2/" "$here/npu-smi.info.txt"
@DCMI_RESET@    echo "Status : OK" ;;
  *) echo "npu-smi (simulated): unsupported arguments: $*" >&2; exit 2 ;;
esac
"""
HEALTH_OK_OUTPUT = TOOL + ".health-ok.txt"

_HEALTH_WORD = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,12}$")  # fits the 13-wide Health cell
_FAULT_CODE = re.compile(r"^(?:0[xX])?([0-9a-fA-F]{1,8})$")
_LEGACY_VERSION = re.compile(r"^(?:1\d|20)\.")  # driver 1x.x and 20.x print the old table


def layout_of(spec: AscendSpec) -> Layout:
    """The table layout the real npu-smi prints for this kind of node and driver."""
    products = [group.product for group in spec.npus]
    if _LEGACY_VERSION.match(spec.driver_version):
        return "legacy"
    if all(product.startswith("310") for product in products):
        return "inference"
    if any(group.chips > 1 for group in spec.npus):
        return "a3"
    return "standard"


def npus_of(spec: AscendSpec, profile: Profile) -> list[SimNpu]:
    """Every chip, in davinci order: NPU after NPU, each NPU's chips in order. The chips of an
    inference card share its PCI address; every A3 die has its own."""
    layout = layout_of(spec)
    cards = [(group, n) for group in spec.npus for n in range(group.count)]
    total = sum(group.count * group.chips for group in spec.npus)
    npus: list[SimNpu] = []
    for card, (group, n) in enumerate(cards):
        npu_id = group.npu_ids[n] if n < len(group.npu_ids) else card + group.first_npu_id
        for chip in range(group.chips):
            index = len(npus)
            bus_index = card if layout == "inference" else index
            npus.append(
                SimNpu(
                    index=index,
                    npu_id=npu_id,
                    chip_id=chip,
                    chip_name=group.product,
                    memory_mib=group.memory_mib,
                    bus_id=pci_bus_id(VENDOR_SLOT["ascend"], bus_index),
                    numa_node=numa_node_of(index, total, profile.node.numa_nodes),
                    ddr_mib=group.ddr_mib,
                )
            )
    return npus


def write(spec: AscendSpec, profile: Profile, root: Path) -> None:
    layout = layout_of(spec)
    npus = npus_of(spec, profile)
    for node in SHARED_NODES:
        write_file(root, node, mode=0o666)
    for npu in npus:
        write_file(root, f"/dev/davinci{npu.index}", mode=0o666)
        sysfs = f"/sys/bus/pci/devices/{npu.bus_id}"
        write_file(root, f"{sysfs}/vendor", PCI_VENDOR + "\n")
        write_file(root, f"{sysfs}/device", PCI_DEVICE + "\n")
        write_file(root, f"{sysfs}/numa_node", f"{npu.numa_node}\n")
    write_file(root, VERSION_INFO, f"Version={spec.driver_version}\n")
    write_file(root, INFO_OUTPUT, npu_smi_info(layout, spec.driver_version, npus))
    write_file(root, MAP_OUTPUT, npu_smi_map(layout, npus))
    cpus = {npu.numa_node: numa_cpulist(npu.numa_node) for npu in npus}
    write_file(root, TOPO_OUTPUT, npu_smi_topo(layout, npus, links=spec.hccs, cpus=cpus))
    multi_chip = any(group.chips > 1 for group in spec.npus)
    for npu in npus:
        write_file(
            root,
            _health_path(npu.npu_id, npu.chip_id, multi_chip=multi_chip),
            npu_smi_health(npu.health),
        )
    width = health_width(layout)
    script = SCRIPT.replace("@WIDTH@", str(width)).replace("@OK@", "OK".ljust(width))
    script = script.replace("@DCMI_RESET@", ascend_dcmi.reset_script_lines())
    write_file(root, TOOL, script, mode=0o755)
    write_file(root, HEALTH_OK_OUTPUT, npu_smi_health("OK"))
    ascend_dcmi.install(root, npus, hbm=layout != "inference")


def _health_path(npu: int, chip: int, *, multi_chip: bool) -> str:
    if multi_chip:
        return CHIP_HEALTH_OUTPUT.format(npu=npu, chip=chip)
    return HEALTH_OUTPUT.format(npu=npu)


def npu_smi_health(health: str, codes: Sequence[int] = (), information: str = "") -> str:
    """`npu-smi info -t health -i <N> -c <chip>` as Huawei's log-collection guide shows it; several
    codes are printed comma-separated (the real separator is undocumented)."""
    code_text = ", ".join(f"{code:08X}" for code in codes) or "NA"
    info = information or ("simulated fault" if codes else "NA")
    return "".join(
        f"        {key:<31}: {value}\n"
        for key, value in (
            ("Health Status", health),
            ("Error Code", code_text),
            ("Error Information", info),
        )
    )


def count_npus(root: Path) -> int:
    """How many chips the simulated `npu-smi info` lists (0 without simulated NPUs)."""
    path = root / INFO_OUTPUT.lstrip("/")
    return len(_chip_rows(path.read_text(encoding="utf-8"))) if path.is_file() else 0


def set_health(root: Path, index: int, health: str) -> tuple[int, int]:
    """Rewrite the Health cell of chip `index` (N of /dev/davinci<N>) in the simulated `npu-smi
    info`; its (npu id, chip id)."""
    path = root / INFO_OUTPUT.lstrip("/")
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    rows = _chip_rows("".join(lines))
    if not 0 <= index < len(rows):
        msg = f"NPU {index} not found in {INFO_OUTPUT}"
        raise ValueError(msg)
    npu_line, npu_id, chip_id = rows[index]
    cells = lines[npu_line].split("|")
    width = len(cells[2]) - 2
    if len(health) > width:
        msg = f"health {health!r}: at most {width} letters fit the Health cell"
        raise ValueError(msg)
    cells[2] = f" {health:<{width}} "
    lines[npu_line] = "|".join(cells)
    path.write_text("".join(lines), encoding="utf-8")
    return npu_id, chip_id


def _chip_rows(text: str) -> list[tuple[int, int, int]]:
    """(line of its NPU row, npu id, chip id) of every chip row of the device table, in order."""
    rows: list[tuple[int, int, int]] = []
    npu: tuple[int, int] | None = None  # (line, npu id)
    after_rule = False
    headers = 0
    for number, line in enumerate(text.splitlines()):
        if line.startswith("+"):
            after_rule = True
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if "Process id" in line:
            break
        if cells[1:2] in (["Health"], ["Bus-Id"]):
            headers += 1
            continue
        if headers < 2 or len(cells) != 3:
            continue
        if after_rule or npu is None:
            npu = (number, int(cells[0].split()[0]))
            after_rule = False
        else:
            rows.append((npu[0], npu[1], int(cells[0].split()[0])))
    return rows


def set_npu_health(
    root: Path, index: int, health_text: str, fault_codes: Sequence[int | str] = ()
) -> None:
    """Make chip `index` (N of /dev/davinci<N>) report `health_text` (OK, Warning, Alarm,
    Critical, ...) in `npu-smi info` and `fault_codes` (0x80E01801 or "80E01801") in `npu-smi
    info -t health`; OK with no codes clears a fault. ValueError (one line) for a bad argument
    or a tree without simulated NPUs."""
    if not (root / INFO_OUTPUT.lstrip("/")).is_file():
        msg = f"{root}: no simulated Ascend NPUs (no {INFO_OUTPUT})"
        raise ValueError(msg)
    if not _HEALTH_WORD.match(health_text):
        msg = f"health {health_text!r}: expected one word of at most 13 letters, e.g. Critical"
        raise ValueError(msg)
    codes = [_fault_code(code) for code in fault_codes]
    if not 0 <= index < count_npus(root):
        msg = f"{root}: no simulated NPU {index}"
        raise ValueError(msg)
    npu_id, chip_id = set_health(root, index, health_text)
    chip_file = root / CHIP_HEALTH_OUTPUT.format(npu=npu_id, chip=chip_id).lstrip("/")
    health_file = (
        chip_file if chip_file.is_file() else root / HEALTH_OUTPUT.format(npu=npu_id).lstrip("/")
    )
    health_file.write_text(npu_smi_health(health_text, codes), encoding="utf-8")
    ascend_dcmi.set_chip(root, index, health_text, codes)


def _fault_code(code: int | str) -> int:
    if isinstance(code, int):
        value = code
    else:
        match = _FAULT_CODE.match(code.strip())
        if match is None:
            msg = f"fault code {code!r}: expected hex like 0x80E01801"
            raise ValueError(msg)
        value = int(match.group(1), 16)
    if not 0 <= value <= 0xFFFFFFFF:
        msg = f"fault code {code!r}: expected a 32-bit code"
        raise ValueError(msg)
    return value
