"""Kunlunxin XPUs of a simulated node: `/dev/xpu<N>`, PCI sysfs entries and an `xpu-smi` stand-in.

The stand-in is a shell script that prints the recorded output kept next to it
(`xpu-smi.q.txt` for `-q`, `xpu-smi.L.txt` for `-L`) in the layouts of the real samples in
tests/fixtures/real/kunlunxin/ (`-L`: `XPU i: <name>  <uuid>`); rewrite those files to simulate
faults. xpu-smi numbers XPUs in PCI order; /dev/xpu<N> is numbered by the driver's minor number,
which the profile may set apart from that order (`minor_numbers`). Each XPU block carries a
designed `XPU State` line (Normal, Warning, Fault, Lost) that real xpu-smi does not print;
`set_xpu_state` rewrites it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from edl_agent.sim.files import VENDOR_SLOT, write_file
from edl_agent.sim.profile import KunlunxinSpec, Profile, numa_node_of, pci_bus_id, stable_uuid

TOOL = "/usr/local/bin/xpu-smi"
QUERY_OUTPUT = TOOL + ".q.txt"
LIST_OUTPUT = TOOL + ".L.txt"
# PCI ids as the recorded P800 output shows them (`Device Id : 0x36862057`: device, vendor).
PCI_VENDOR = "0x2057"
PCI_DEVICE = "0x3686"
_STATE_WORD = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")

SCRIPT = """#!/bin/sh
# xpu-smi stand-in for a simulated node: prints the recorded output kept next to this script.
here=$(dirname "$0")
case "$*" in
  -q) exec cat "$here/xpu-smi.q.txt" ;;
  -L | "") exec cat "$here/xpu-smi.L.txt" ;;
  *) echo "xpu-smi (simulated): unsupported arguments: $*" >&2; exit 2 ;;
esac
"""


@dataclass(frozen=True)
class SimXpu:
    index: int  # xpu-smi's, in PCI order
    minor: int  # N of /dev/xpu<N>
    product: str
    memory_mib: int
    bus_id: str  # sysfs form
    numa_node: int
    serial_number: str
    uuid: str


def xpus_of(spec: KunlunxinSpec, profile: Profile) -> list[SimXpu]:
    total = sum(group.count for group in spec.xpus)
    flat = [group for group in spec.xpus for _ in range(group.count)]
    xpus = []
    for index, group in enumerate(flat):
        uuid = stable_uuid(profile.node.hostname, "kunlunxin", index)
        xpus.append(
            SimXpu(
                index=index,
                minor=spec.minor_numbers[index] if spec.minor_numbers else index,
                product=group.product,
                memory_mib=group.memory_mib,
                bus_id=pci_bus_id(VENDOR_SLOT["kunlunxin"], index),
                numa_node=numa_node_of(index, total, profile.node.numa_nodes),
                serial_number="02K0" + uuid.replace("-", "")[:12].upper(),
                uuid=f"GPU-{uuid}",
            )
        )
    return xpus


def write(spec: KunlunxinSpec, profile: Profile, root: Path) -> None:
    xpus = xpus_of(spec, profile)
    write_file(root, "/dev/xpuctrl", mode=0o666)
    for xpu in xpus:
        write_file(root, f"/dev/xpu{xpu.minor}", mode=0o666)
        sysfs = f"/sys/bus/pci/devices/{xpu.bus_id}"
        write_file(root, f"{sysfs}/vendor", PCI_VENDOR + "\n")
        write_file(root, f"{sysfs}/device", PCI_DEVICE + "\n")
        write_file(root, f"{sysfs}/numa_node", f"{xpu.numa_node}\n")
    write_file(root, QUERY_OUTPUT, xpu_smi_query(spec.driver_version, xpus))
    write_file(root, LIST_OUTPUT, xpu_smi_list(xpus))
    write_file(root, TOOL, SCRIPT, mode=0o755)


def _smi_bus_id(bus_id: str) -> str:
    """xpu-smi prints NVML-style addresses with an 8-digit domain."""
    domain, rest = bus_id.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


def xpu_smi_list(xpus: list[SimXpu]) -> str:
    """`xpu-smi -L` as driver 5.0.21.47 prints it: `XPU <i>: <product>  <uuid>`."""
    return "".join(f"XPU {xpu.index}: {xpu.product}  {xpu.uuid}\n" for xpu in xpus)


def xpu_smi_query(driver_version: str, xpus: list[SimXpu]) -> str:
    """`xpu-smi -q` laid out like the recorded P800 samples (driver 5.0.21.x): the sections and
    keys they show, values per XPU; `XPU State` is designed (see the module docstring)."""
    lines = [
        "==============XPUSMI LOG==============",
        "",
        _kv(0, "Timestamp", "Mon Jan  1 00:00:00 2024"),
        _kv(0, "Driver Version", driver_version),
        _kv(0, "XPU-RT Version", "10.2"),
        "",
        _kv(0, "Attached XPUs", str(len(xpus))),
    ]
    for xpu in xpus:
        domain, bus, rest = _smi_bus_id(xpu.bus_id).split(":")
        lines += [
            f"XPU {_smi_bus_id(xpu.bus_id)}",
            _kv(1, "Product Name", xpu.product),
            _kv(1, "Product Brand", "KUNLUNXIN"),
            _kv(1, "Product Architecture", "KL3"),
            _kv(1, "Serial Number", xpu.serial_number),
            _kv(1, "XPU UUID", xpu.uuid),
            _kv(1, "Minor Number", str(xpu.minor)),
            _kv(1, "PCIe Id", str(xpu.index)),
            _kv(1, "XPU State", "Normal"),  # designed: see the module docstring
            "    Firmware Version",
            _kv(2, "ALL Version", "1.0.2.14.1.54"),
            "    PCI",
            _kv(2, "Bus", f"0x{bus}"),
            _kv(2, "Device", f"0x{rest.split('.')[0]}"),
            _kv(2, "Function", f"0x{rest.split('.')[1]}"),
            _kv(2, "Domain", f"0x{domain[-4:]}"),
            _kv(2, "Device Id", f"{PCI_DEVICE}{PCI_VENDOR[2:]}"),
            _kv(2, "Bus Id", _smi_bus_id(xpu.bus_id)),
            "    Memory Usage",
            _kv(2, "Total", f"{xpu.memory_mib} MiB"),
            _kv(2, "Reserved", "0 MiB"),
            _kv(2, "Used", "0 MiB"),
            _kv(2, "Free", f"{xpu.memory_mib} MiB"),
            "    Utilization",
            _kv(2, "Xpu", "0 %"),
            "    ECC Errors",
            "        Volatile",
            _kv(3, "DRAM Correctable", "0"),
            _kv(3, "DRAM Uncorrectable", "0"),
            "        Aggregate",
            _kv(3, "DRAM Correctable", "0"),
            _kv(3, "DRAM Uncorrectable", "0"),
            "    Temperature",
            _kv(2, "XPU Current Temp", f"{40 + xpu.index % 5} C"),
            "    Power Readings",
            _kv(2, "Enforced Power Limit", "350.00 W"),
            _kv(2, "Power Draw", f"{85.0 + xpu.index * 0.5:.2f} W"),
            _kv(1, "Processes", "None"),
        ]
    return "\n".join(lines) + "\n"


def _kv(level: int, key: str, value: str) -> str:
    """A `Key : Value` line; xpu-smi aligns the colons at column 42 (the samples' top-level
    keys; their block keys sit at the heading's column in one sample, 4 deeper in the other)."""
    indent = "    " * level
    return f"{indent}{key:<{42 - len(indent)}}: {value}"


def set_xpu_state(root: Path, index: int, state: str) -> None:
    """Make XPU `index` (its Minor Number) report `state` (Normal, Warning, Fault, Lost, ...) in
    `xpu-smi -q`. ValueError (one line) for a bad argument or a tree without simulated XPUs."""
    if not _STATE_WORD.match(state):
        msg = f"state {state!r}: expected one word, e.g. Fault"
        raise ValueError(msg)
    _set_field(root, index, "XPU State", state)


def set_xpu_ecc(root: Path, index: int, *, uncorrectable: int) -> None:
    """Set XPU `index`'s volatile DRAM Uncorrectable ECC count in `xpu-smi -q`."""
    _set_field(root, index, "DRAM Uncorrectable", str(uncorrectable))


def _set_field(root: Path, index: int, key: str, value: str) -> None:
    """Rewrite the `key : value` line of XPU `index`'s block in the recorded `xpu-smi -q`."""
    path = root / QUERY_OUTPUT.lstrip("/")
    if not path.is_file():
        msg = f"{root}: no simulated Kunlunxin XPUs (no {QUERY_OUTPUT})"
        raise ValueError(msg)
    blocks = re.split(r"(?m)^(?=XPU )", path.read_text(encoding="utf-8"))
    minor = re.compile(rf"(?m)^\s+Minor Number\s*:\s*{index}\s*$")
    line = re.compile(rf"(?m)^(\s+{re.escape(key)}\s*:\s*)\S+\s*$")
    for position, block in enumerate(blocks):
        if index >= 0 and minor.search(block):
            blocks[position] = line.sub(lambda m: m.group(1) + value, block, count=1)
            path.write_text("".join(blocks), encoding="utf-8")
            return
    msg = f"{root}: no simulated XPU {index}"
    raise ValueError(msg)
