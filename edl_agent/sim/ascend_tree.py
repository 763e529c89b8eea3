"""Ascend NPUs of a simulated node: `/dev/davinci*`, PCI sysfs entries and an `npu-smi` stand-in.

The stand-in prints the recorded output kept next to it (`npu-smi.info.txt` for `info`,
`npu-smi.info-m.txt` for `info -m`). Each NPU's health is the Health cell of that table:
`set_health` rewrites it, which is how a fault (an NPU turning `Critical`) is simulated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from edl_agent.sim.profile import AscendSpec, Profile, numa_node_of, pci_bus_id
from edl_agent.sim.tree import VENDOR_SLOT, write_file

TOOL = "/usr/local/Ascend/driver/tools/npu-smi"
INFO_OUTPUT = TOOL + ".info.txt"
MAP_OUTPUT = TOOL + ".info-m.txt"
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
  *) echo "npu-smi (simulated): unsupported arguments: $*" >&2; exit 2 ;;
esac
"""

# Table frame of `npu-smi info` on 910B (npu-smi 24.1 / 25.3 recordings): cells 27, 15, 52 wide.
_BORDER = "+---------------------------+---------------+" + "-" * 52 + "+"
_DOUBLE = "+===========================+===============+" + "=" * 52 + "+"
_HEADER = (
    "| NPU   Name                | Health        | "
    "Power(W)    Temp(C)           Hugepages-Usage(page)|",
    "| Chip                      | Bus-Id        | "
    "AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |",
)
_PROCESS_HEADER = (
    "| NPU     Chip              | Process id    | "
    "Process name             | Process memory(MB)      |"
)


@dataclass(frozen=True)
class SimNpu:
    index: int
    chip_name: str
    memory_mib: int
    bus_id: str  # sysfs form
    numa_node: int
    health: str = "OK"


def npus_of(spec: AscendSpec, profile: Profile) -> list[SimNpu]:
    total = sum(group.count for group in spec.npus)
    flat = [group for group in spec.npus for _ in range(group.count)]
    return [
        SimNpu(
            index=index,
            chip_name=group.product,
            memory_mib=group.memory_mib,
            bus_id=pci_bus_id(VENDOR_SLOT["ascend"], index),
            numa_node=numa_node_of(index, total, profile.node.numa_nodes),
        )
        for index, group in enumerate(flat)
    ]


def write(spec: AscendSpec, profile: Profile, root: Path) -> None:
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
    write_file(root, INFO_OUTPUT, npu_smi_info(spec.driver_version, npus))
    write_file(root, MAP_OUTPUT, npu_smi_info_map(npus))
    write_file(root, TOOL, SCRIPT, mode=0o755)


def npu_smi_info(version: str, npus: list[SimNpu]) -> str:
    title = f" npu-smi {version:<25}Version: {version}"
    lines = ["+" + "-" * 96 + "+", f"|{title:<96}|", _BORDER, *_HEADER, _DOUBLE]
    for npu in npus:
        power = f"{90.0 + npu.index * 0.7:.1f}"
        temp = str(40 + npu.index % 5)
        hbm = f"{3400 + npu.index:<5}/ {npu.memory_mib}"
        lines += [
            _row(f"{npu.index:<6}{npu.chip_name}", npu.health, f"{power:<12}{temp:<18}0    / 0"),
            _row("0", npu.bus_id.upper(), f"{'0':<12}{'0    / 0':<18}{hbm}"),
            _DOUBLE,
        ]
    lines += [_BORDER, _PROCESS_HEADER, _DOUBLE]
    for npu in npus:
        lines += [f"|{f' No running processes found in NPU {npu.index}':<96}|", _DOUBLE]
    return "\n".join(lines) + "\n"


def _row(first: str, second: str, third: str) -> str:
    return f"| {first:<25} | {second:<13} | {third:<50} |"


def npu_smi_info_map(npus: list[SimNpu]) -> str:
    """`npu-smi info -m`: NPU id, chip id, chip logic id and chip name in 31-wide columns."""
    head = ("NPU ID", "Chip ID", "Chip Logic ID", "Chip Name")
    rows = [head] + [(str(n.index), "0", str(n.index), f"Ascend {n.chip_name}") for n in npus]
    return "".join("\t" + "".join(f"{cell:<31}" for cell in row) + "\n" for row in rows)


def set_health(root: Path, npu_id: int, health: str) -> None:
    """Rewrite NPU `npu_id`'s Health cell in the recorded `npu-smi info` output."""
    path = root / INFO_OUTPUT.lstrip("/")
    row = re.compile(rf"^(\| {npu_id:<6}\S+\s*\| )(.{{13}})( \|)", re.MULTILINE)
    text, count = row.subn(lambda m: f"{m.group(1)}{health:<13}{m.group(3)}", path.read_text())
    if count != 1:
        msg = f"NPU {npu_id} not found in {INFO_OUTPUT}"
        raise ValueError(msg)
    path.write_text(text, encoding="utf-8")
