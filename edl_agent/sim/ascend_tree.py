"""Ascend NPUs of a simulated node: `/dev/davinci*`, PCI sysfs entries and an `npu-smi` stand-in.

The stand-in prints the recorded output kept next to it (`npu-smi.info.txt` for `info`,
`npu-smi.info-m.txt` for `info -m`, `npu-smi.topo.txt` for `info -t topo`,
`npu-smi.health.<N>.txt` for `info -t health -i <N>`).
Each NPU's health is the Health cell of that table plus its health file: `set_npu_health`
rewrites both, which is how a fault (an NPU turning `Critical` with fault code 0x80E01801) is
simulated. NPU ids equal device indexes here (one chip per NPU), so `-c <chip>` is not checked.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from edl_agent.sim.files import VENDOR_SLOT, write_file
from edl_agent.sim.profile import AscendSpec, Profile, numa_cpulist, numa_node_of, pci_bus_id

TOOL = "/usr/local/Ascend/driver/tools/npu-smi"
INFO_OUTPUT = TOOL + ".info.txt"
MAP_OUTPUT = TOOL + ".info-m.txt"
TOPO_OUTPUT = TOOL + ".topo.txt"
HEALTH_OUTPUT = TOOL + ".health.{npu}.txt"
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
    npu=$5
    case "$npu" in "" | *[!0-9]*) echo "npu-smi (simulated): bad NPU id: $npu" >&2; exit 2 ;; esac
    [ -f "$here/npu-smi.health.$npu.txt" ] && exec cat "$here/npu-smi.health.$npu.txt"
    echo "Error: the device $npu does not exist." >&2; exit 1 ;;
  "set -t reset -i "*" -c "*)
    npu=$5
    case "$npu" in "" | *[!0-9]*) echo "npu-smi (simulated): bad NPU id: $npu" >&2; exit 2 ;; esac
    if [ ! -f "$here/npu-smi.health.$npu.txt" ]; then
      echo "Error: the device $npu does not exist." >&2; exit 1
    fi
    sed -i -E "s/^(\\| $npu +[^ ]+ *\\| ).{13}( \\|)/\\1OK           \\2/" "$here/npu-smi.info.txt"
    cp "$here/npu-smi.health-ok.txt" "$here/npu-smi.health.$npu.txt"
    echo "Status : OK" ;;
  *) echo "npu-smi (simulated): unsupported arguments: $*" >&2; exit 2 ;;
esac
"""
HEALTH_OK_OUTPUT = TOOL + ".health-ok.txt"

# Table frame of `npu-smi info` on 910B (npu-smi 24.1 / 25.3 recordings): cells 27, 15, 52 wide.
_BORDER = "+---------------------------+---------------+" + "-" * 52 + "+"
_DOUBLE = "+===========================+===============+" + "=" * 52 + "+"
_HEADER = (
    "| NPU   Name                | Health        | "
    "Power(W)    Temp(C)           Hugepages-Usage(page)|",
    "| Chip                      | Bus-Id        | "
    "AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |",
)
_HEALTH_WORD = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,12}$")  # fits the 13-wide Health cell
_FAULT_CODE = re.compile(r"^(?:0[xX])?([0-9a-fA-F]{1,8})$")
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
    write_file(root, TOPO_OUTPUT, npu_smi_topo(npus, hccs=spec.hccs == "all"))
    for npu in npus:
        write_file(root, HEALTH_OUTPUT.format(npu=npu.index), npu_smi_health(npu.health))
    write_file(root, TOOL, SCRIPT, mode=0o755)
    write_file(root, HEALTH_OK_OUTPUT, npu_smi_health("OK"))


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


def npu_smi_topo(npus: list[SimNpu], *, hccs: bool) -> str:
    """`npu-smi info -t topo`: NPU-by-NPU matrix in 11-wide columns, then each NPU's CPU affinity
    (layout of npu-smi 24.1 on 910B3). Without HCCS, NPUs on one NUMA node meet at the CPU's host
    bridge (PHB) and others across the sockets (SYS); the legend is worded here."""

    def cell(a: SimNpu, b: SimNpu) -> str:
        if a.index == b.index:
            return "X"
        if hccs:
            return "HCCS"
        return "PHB" if a.numa_node == b.numa_node else "SYS"

    head = "\t   " + "".join(f"{f'NPU{n.index}':<11}" for n in npus) + "CPU Affinity"
    rows = [
        f"{f'NPU{a.index}':<11}"
        + "".join(f"{cell(a, b):<11}" for b in npus)
        + numa_cpulist(a.numa_node)
        for a in npus
    ]
    legend = [
        "  X    = the NPU itself",
        "  SYS  = PCIe and the link between NUMA nodes",
        "  PHB  = PCIe through the CPU's host bridge",
        "  PIX  = PCIe through one switch",
        "  PXB  = PCIe through several switches",
        "  HCCS = HCCS",
        "  NA   = not known",
    ]
    return "\n".join([head, *rows, "", "Legend:", "", *legend]) + "\n"


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


def set_health(root: Path, npu_id: int, health: str) -> None:
    """Rewrite NPU `npu_id`'s Health cell in the recorded `npu-smi info` output."""
    path = root / INFO_OUTPUT.lstrip("/")
    row = re.compile(rf"^(\| {npu_id:<6}\S+\s*\| )(.{{13}})( \|)", re.MULTILINE)
    text, count = row.subn(lambda m: f"{m.group(1)}{health:<13}{m.group(3)}", path.read_text())
    if count != 1:
        msg = f"NPU {npu_id} not found in {INFO_OUTPUT}"
        raise ValueError(msg)
    path.write_text(text, encoding="utf-8")


def set_npu_health(
    root: Path, index: int, health_text: str, fault_codes: Sequence[int | str] = ()
) -> None:
    """Make NPU `index` report `health_text` (OK, Warning, Alarm, Critical, ...) in `npu-smi info`
    and `fault_codes` (0x80E01801 or "80E01801") in `npu-smi info -t health`; OK with no codes
    clears a fault. ValueError (one line) for a bad argument or a tree without simulated NPUs."""
    if not (root / INFO_OUTPUT.lstrip("/")).is_file():
        msg = f"{root}: no simulated Ascend NPUs (no {INFO_OUTPUT})"
        raise ValueError(msg)
    if not _HEALTH_WORD.match(health_text):
        msg = f"health {health_text!r}: expected one word of at most 13 letters, e.g. Critical"
        raise ValueError(msg)
    codes = [_fault_code(code) for code in fault_codes]
    health_file = root / HEALTH_OUTPUT.format(npu=index).lstrip("/")
    if index < 0 or not health_file.is_file():
        msg = f"{root}: no simulated NPU {index}"
        raise ValueError(msg)
    set_health(root, index, health_text)
    health_file.write_text(npu_smi_health(health_text, codes), encoding="utf-8")


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
