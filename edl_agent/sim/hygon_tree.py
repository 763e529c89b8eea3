"""Hygon DCUs of a simulated node: DRM cards, KFD topology, device nodes and a `hy-smi` stand-in.

Like a real server, the node also has a BMC VGA adapter as DRM `card0` (PCI vendor 0x1a03, no
render node), so DCU `i` is `card<i+1>`: discovery must not equate DCU index and card number.
The stand-in prints `<tool>.json` (any `--json` call) or `<tool>.txt` (no arguments), kept next
to it; rewrite them to simulate faults. The tool is hy-smi, or DTK's rocm-smi on an older node
without hy-smi (profile `tool`). Its JSON is strict as rocm-smi prints it, or (profile
`json_style: bw`) as hy-smi prints it on BW nodes: commas missing between some keys, `"": ""`
twice per card, `PCI Bus` values carrying serial number and OAM id
(tests/fixtures/real/hygon/). Each card carries a designed `DCU State` field (Normal, Warning,
Fault, Lost) that real hy-smi does not print; `set_dcu_state` rewrites it in place.

The node also has DTK's rocm_smi library (`librocm_smi64.so`, built from fake_rocm_smi.c) and
its data file. rocm_smi has no state word; `set_dcu_state` writes what the library shows for
each: Warning, the junction temperature at its max threshold; Fault, an uncorrectable ECC
error; Lost, reads that fail as for a device off the bus (a word the library cannot show reads
as Warning). `inject_dcu_event` adds an event for the library's event API.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from edl_agent.sim import fake_lib_build
from edl_agent.sim.fake_lib_build import FakeLibrary
from edl_agent.sim.files import VENDOR_SLOT, write_file
from edl_agent.sim.profile import HygonSpec, Profile, numa_node_of, pci_bus_id, stable_uuid

TOOL = "/opt/hyhal/bin/hy-smi"
JSON_OUTPUT = "/opt/hyhal/bin/hy-smi.json"
TABLE_OUTPUT = "/opt/hyhal/bin/hy-smi.txt"
ROCM_TOOL = "/opt/dtk/bin/rocm-smi"  # DTK's, on nodes without hy-smi
ROCM_SMI = FakeLibrary("librocm_smi64.so", "fake_rocm_smi.c", "fake-rocm-smi")
LIBRARY = "/opt/dtk/rocm_smi/lib/librocm_smi64.so"
LIBRARY_DATA = LIBRARY + ".data"
LIBRARY_EVENTS = LIBRARY + ".events"  # append-only; the library delivers what is added
# rsmi_evt_notification_type_t by the names `inject_dcu_event` takes.
EVENT_KINDS = {"vmfault": 1, "thermal_throttle": 2, "pre_reset": 3, "post_reset": 4}
TEMP_MAX_C = 100.0
TOOLS = (TOOL, ROCM_TOOL)
PCI_VENDOR = "0x1d94"
BMC_VGA_BUS = "0000:03:00.0"
KFD_NODES = "/sys/class/kfd/kfd/topology/nodes"
SIMD_PER_CU = 4
_STATE_WORD = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")

SCRIPT = """#!/bin/sh
# hy-smi stand-in for a simulated node: prints the recorded output kept next to this script.
here=$(dirname "$0") name=$(basename "$0")
case " $* " in
  *" --json "*) exec cat "$here/$name.json" ;;
  "  ") exec cat "$here/$name.txt" ;;
  *) echo "$name (simulated): unsupported arguments: $*" >&2; exit 2 ;;
esac
"""


@dataclass(frozen=True)
class SimDcu:
    index: int
    product: str
    memory_mib: int
    compute_units: int
    bus_id: str
    numa_node: int
    card: int  # N of card<N>
    render_minor: int  # M of renderD<M>


def dcus_of(spec: HygonSpec, profile: Profile) -> list[SimDcu]:
    total = sum(group.count for group in spec.dcus)
    flat = [group for group in spec.dcus for _ in range(group.count)]
    return [
        SimDcu(
            index=index,
            product=group.product,
            memory_mib=group.memory_mib,
            compute_units=group.compute_units,
            bus_id=pci_bus_id(VENDOR_SLOT["hygon"], index),
            numa_node=numa_node_of(index, total, profile.node.numa_nodes),
            card=index + 1,  # card0 is the BMC's VGA adapter
            render_minor=128 + index,  # the VGA adapter has no render node
        )
        for index, group in enumerate(flat)
    ]


def write(spec: HygonSpec, profile: Profile, root: Path) -> None:
    dcus = dcus_of(spec, profile)
    for node in ("/dev/kfd", "/dev/mkfd"):
        write_file(root, node, mode=0o666)
    _write_pci_card(root, card=0, bus_id=BMC_VGA_BUS, vendor="0x1a03", numa_node=0)
    write_file(root, "/dev/dri/card0", mode=0o666)
    for numa in range(profile.node.numa_nodes):
        write_file(root, f"{KFD_NODES}/{numa}/properties", _kfd_cpu_properties())
    for dcu in dcus:
        _write_pci_card(
            root,
            card=dcu.card,
            bus_id=dcu.bus_id,
            vendor=PCI_VENDOR,
            numa_node=dcu.numa_node,
            render_minor=dcu.render_minor,
        )
        write_file(root, f"/dev/dri/card{dcu.card}", mode=0o666)
        write_file(root, f"/dev/dri/renderD{dcu.render_minor}", mode=0o666)
        kfd_node = f"{KFD_NODES}/{profile.node.numa_nodes + dcu.index}"
        write_file(root, f"{kfd_node}/properties", _kfd_gpu_properties(dcu, profile))
        write_file(root, f"{kfd_node}/mem_banks/0/properties", _kfd_memory(dcu))
    tool = ROCM_TOOL if spec.tool == "rocm-smi" else TOOL
    if spec.tool == "rocm-smi":
        json_text = rocm_smi_json(spec.driver_version, dcus)
    elif spec.json_style == "bw":
        json_text = hy_smi_bw_json(spec.driver_version, dcus)
    else:
        json_text = hy_smi_json(spec.driver_version, dcus)
    write_file(root, tool + ".json", json_text)
    write_file(root, tool + ".txt", hy_smi_table(dcus))
    write_file(root, tool, SCRIPT, mode=0o755)
    install_library(root)
    write_file(root, LIBRARY_DATA, library_data(dcus, bw=spec.json_style == "bw"))


def install_library(root: Path) -> None:
    """Copy the cached fake library into the tree as a new file (renamed into place: a process
    that has the old file loaded must not see its code change)."""
    local = root / LIBRARY.lstrip("/")
    local.parent.mkdir(parents=True, exist_ok=True)
    staging = local.with_name(f".{local.name}.tmp")
    shutil.copyfile(fake_lib_build.library_path(ROCM_SMI), staging)
    staging.chmod(0o755)
    staging.replace(local)


def library_data(dcus: list[SimDcu], *, bw: bool) -> str:
    """The fake library's data: the figures the tool's JSON shows, every DCU healthy."""
    lines = ["# fake rocm_smi data, written by edl_agent/sim/hygon_tree.py"]
    for dcu in dcus:
        temperature = (53.0 if bw else 38.0) + dcu.index % 4
        power = 84.0 + dcu.index if bw else 60.0
        fields = {
            "bdfid": _bdfid(dcu.bus_id),
            "temp_mc": int(temperature * 1000),
            "temp_max_mc": int(TEMP_MAX_C * 1000),
            "power_uw": int(power * 1e6),
            "busy": 0,
            "vram_total": dcu.memory_mib * 1024 * 1024,
            "vram_used": 3 * 1024 * 1024,
            "ecc_ce": 0,
            "ecc_ue": 0,
            "gone": 0,
        }
        lines.append("\t".join(["dcu", *(f"{key}={value}" for key, value in fields.items())]))
    return "\n".join(lines) + "\n"


def _bdfid(bus_id: str) -> int:
    domain, bus, rest = bus_id.split(":")
    slot, function = rest.split(".")
    return int(domain, 16) << 32 | int(bus, 16) << 8 | int(slot, 16) << 3 | int(function)


def _write_pci_card(
    root: Path,
    *,
    card: int,
    bus_id: str,
    vendor: str,
    numa_node: int,
    render_minor: int | None = None,
) -> None:
    """A PCI device directory and `/sys/class/drm/card<N>/device` linking to it, as sysfs has."""
    pci = f"/sys/bus/pci/devices/{bus_id}"
    write_file(root, f"{pci}/vendor", vendor + "\n")
    write_file(root, f"{pci}/numa_node", f"{numa_node}\n")
    write_file(root, f"{pci}/uevent", f"PCI_SLOT_NAME={bus_id}\n")
    (root / pci.lstrip("/") / "drm" / f"card{card}").mkdir(parents=True, exist_ok=True)
    if render_minor is not None:
        (root / pci.lstrip("/") / "drm" / f"renderD{render_minor}").mkdir(exist_ok=True)
    card_dir = root / "sys/class/drm" / f"card{card}"
    card_dir.mkdir(parents=True, exist_ok=True)
    link = card_dir / "device"
    if not link.is_symlink():
        link.symlink_to(f"../../../bus/pci/devices/{bus_id}")  # relative: stays inside the root


def _kfd_cpu_properties() -> str:
    return "cpu_cores_count 32\nsimd_count 0\nlocation_id 0\ndomain 0\ndrm_render_minor 0\n"


def _kfd_gpu_properties(dcu: SimDcu, profile: Profile) -> str:
    domain, bus, rest = dcu.bus_id.split(":")
    slot, function = rest.split(".")
    unique = int(stable_uuid(profile.node.hostname, "hygon", dcu.index).replace("-", "")[:15], 16)
    properties = {
        "cpu_cores_count": 0,
        "simd_count": dcu.compute_units * SIMD_PER_CU,
        "simd_per_cu": SIMD_PER_CU,
        "vendor_id": int(PCI_VENDOR, 16),
        "location_id": int(bus, 16) << 8 | int(slot, 16) << 3 | int(function),
        "domain": int(domain, 16),
        "drm_render_minor": dcu.render_minor,
        "unique_id": unique,
    }
    return "".join(f"{name} {value}\n" for name, value in properties.items())


def _kfd_memory(dcu: SimDcu) -> str:
    return f"heap_type 1\nsize_in_bytes {dcu.memory_mib * 1024 * 1024}\nflags 0\nwidth 4096\n"


def hy_smi_json(driver_version: str, dcus: list[SimDcu]) -> str:
    """hy-smi's rocm-smi-style JSON: `card<i>` objects of strings plus a `system` object."""
    data: dict[str, dict[str, str]] = {
        f"card{dcu.index}": {
            "Card Series": dcu.product,
            "vram Total Memory (MiB)": str(dcu.memory_mib),
            "vram Total Used Memory (MiB)": "3",
            "Temperature (Sensor junction) (C)": f"{38.0 + dcu.index % 4:.1f}",
            "Average Graphics Package Power (W)": "60.0",
            "HCU use (%)": "0",
            "DCU State": "Normal",  # designed: see the module docstring
        }
        for dcu in dcus
    }
    data["system"] = {"Driver version": driver_version}
    return json.dumps(data, indent=2) + "\n"


def hy_smi_table(dcus: list[SimDcu]) -> str:
    """The default `hy-smi` summary (columns as Hygon's docs list them; layout designed)."""
    rule = "=" * 86
    head = f"{'DCU':<8}{'Temp':<10}{'AvgPwr':<11}{'Perf':<9}{'PwrCap':<11}"
    head += f"{'VRAM%':<8}{'DCU%':<8}Mode"
    rows = [
        f"{dcu.index:<8}{f'{35 + dcu.index % 4}.0C':<10}{'60.0W':<11}{'auto':<9}"
        f"{'400.0W':<11}{'0%':<8}{'0%':<8}Normal"
        for dcu in dcus
    ]
    title = " System Management Interface ".center(86, "=")
    end = " End of SMI Log ".center(86, "=")
    return "\n".join([title, rule, head, *rows, rule, end]) + "\n"


def hy_smi_bw_json(driver_version: str, dcus: list[SimDcu]) -> str:
    """hy-smi's JSON as BW nodes print it (tests/fixtures/real/hygon/bw-hy-smi-json-malformed.txt):
    one line, no comma after two of the power keys, `"": ""` twice, `PCI Bus` with serial number
    and OAM id (bw-hy-smi-showbus.json)."""

    def pair(key: str, value: str) -> str:
        return f"{json.dumps(key)}: {json.dumps(value)}"

    cards = []
    for dcu in dcus:
        serial = "01-000206-" + stable_uuid("hygon-bw-serial", dcu.index // 8)[:6].upper()
        power = pair("Average Graphics Package Power (W)", f"{84.0 + dcu.index:.1f}")
        power += pair("Average GFX Core Power (W)", "16.0")  # the missing commas, as printed
        power += pair("Average Memory Power (W)", "34.0")
        fields = [
            pair("Card Series", dcu.product),
            pair("Card Vendor", "C-3000 IC Design Co., Ltd."),
            power,
            pair("Temperature (Sensor edge) (C)", f"{50.0 + dcu.index % 4:.1f}"),
            pair("Temperature (Sensor junction) (C)", f"{53.0 + dcu.index % 4:.1f}"),
            pair("HCU use (%)", "0.0"),
            pair("HCU memory use (%)", "0"),
            pair("", ""),
            pair("", ""),
            pair("vram Total Memory (MiB)", str(dcu.memory_mib)),
            pair("vram Total Used Memory (MiB)", "3"),
            pair("PCI Bus", f"{dcu.bus_id} --> SN: {serial} --> OAM ID: {dcu.index % 8 + 1}"),
            pair("DCU State", "Normal"),  # designed: see the module docstring
        ]
        cards.append(f'"card{dcu.index}": {{{", ".join(fields)}}}')
    system = f'"system": {{{pair("Driver version", driver_version)}}}'
    return "{" + ", ".join([*cards, system]) + "}\n"


def rocm_smi_json(driver_version: str, dcus: list[SimDcu]) -> str:
    """DTK's rocm-smi JSON as AMD's rocm-smi prints it: memory in bytes, `GPU use (%)`, the bus
    id under `PCI Bus`. Reconstructed from rocm-smi's key names (no public DTK sample was found):
    tests/fixtures/reconstructed/hygon/."""
    data: dict[str, dict[str, str]] = {
        f"card{dcu.index}": {
            "Card series": dcu.product,
            "Card vendor": "Chengdu Haiguang IC Design Co., Ltd.",
            "PCI Bus": dcu.bus_id.upper(),
            "Temperature (Sensor junction) (C)": f"{38.0 + dcu.index % 4:.1f}",
            "Average Graphics Package Power (W)": "60.0",
            "GPU use (%)": "0",
            "VRAM Total Memory (B)": str(dcu.memory_mib * 1024 * 1024),
            "VRAM Total Used Memory (B)": str(3 * 1024 * 1024),
            "DCU State": "Normal",  # designed: see the module docstring
        }
        for dcu in dcus
    }
    data["system"] = {"Driver version": driver_version}
    return json.dumps(data, indent=4) + "\n"


def set_dcu_state(root: Path, index: int, state: str) -> None:
    """Make DCU `index` (the tool's `card<index>`) report `state` (Normal, Warning, Fault, Lost,
    ...) in its JSON, edited in place so that a BW node's malformed JSON stays as malformed.
    ValueError (one line) for a bad argument or a tree without DCUs."""
    path = json_output(root)
    if path is None:
        msg = f"{root}: no simulated Hygon DCUs (no {JSON_OUTPUT})"
        raise ValueError(msg)
    if not _STATE_WORD.match(state):
        msg = f"state {state!r}: expected one word, e.g. Fault"
        raise ValueError(msg)
    field = re.compile(rf'("card{max(index, 0)}"\s*:\s*{{[^{{}}]*?"DCU State"\s*:\s*")[^"]*"')
    text = path.read_text(encoding="utf-8")
    edited, found = field.subn(lambda m: f'{m.group(1)}{state}"', text, count=1)
    if index < 0 or not found:
        msg = f"{root}: no simulated DCU {index}"
        raise ValueError(msg)
    path.write_text(edited, encoding="utf-8")
    _set_library_state(root, index, state)


def _set_library_state(root: Path, index: int, state: str) -> None:
    """What the fake library shows for `state` (module docstring), when the tree has it."""
    path = root / LIBRARY_DATA.lstrip("/")
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    rows = [number for number, line in enumerate(lines) if line.startswith("dcu\t")]
    if index >= len(rows):
        return
    word = state.strip().lower()
    fields = dict(field.split("=", 1) for field in lines[rows[index]].split("\t")[1:])
    normal_temp = fields.get("normal_temp_mc", fields["temp_mc"])
    fields["normal_temp_mc"] = normal_temp
    at_max = word not in {"normal", "fault", "lost"}
    fields["temp_mc"] = fields["temp_max_mc"] if at_max else normal_temp
    fields["ecc_ue"] = "1" if word == "fault" else "0"
    fields["gone"] = "1" if word == "lost" else "0"
    lines[rows[index]] = "\t".join(["dcu", *(f"{k}={v}" for k, v in fields.items())])
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text("\n".join(lines) + "\n", encoding="utf-8")
    staging.replace(path)  # the library re-reads the file: it must never see half of it


def json_output(root: Path) -> Path | None:
    """The JSON the simulated hy-smi (or rocm-smi) prints, if the tree has one."""
    for tool in TOOLS:
        path = root / (tool + ".json").lstrip("/")
        if path.is_file():
            return path
    return None


def count_dcus(root: Path) -> int:
    """How many `card<N>` entries the simulated tool's JSON has (0 without simulated DCUs)."""
    path = json_output(root)
    text = path.read_text(encoding="utf-8") if path is not None else ""
    return len(set(re.findall(r'"card(\d+)"\s*:', text)))


def inject_dcu_event(root: Path, index: int, kind: str, message: str = "") -> None:
    """An rocm_smi event on DCU `index` (`kind` one of EVENT_KINDS), delivered to a process
    collecting that kind. ValueError (one line) for a bad argument or a tree without DCUs."""
    path = root / LIBRARY_EVENTS.lstrip("/")
    if not (root / LIBRARY_DATA.lstrip("/")).is_file():
        msg = f"{root}: no simulated Hygon DCUs with the rocm_smi library"
        raise ValueError(msg)
    if kind not in EVENT_KINDS:
        msg = f"event {kind!r}: expected one of {', '.join(EVENT_KINDS)}"
        raise ValueError(msg)
    if not 0 <= index < count_dcus(root):
        msg = f"{root}: no simulated DCU {index}"
        raise ValueError(msg)
    text = " ".join(message.split())[:63]
    with path.open("a", encoding="utf-8") as file:
        file.write(f"event\tdcu={index}\tkind={EVENT_KINDS[kind]}\tmessage={text}\n")
