"""Record what a real NVIDIA node shows, so that a simulated node can show it again.

`record(root, out)` opens NVML from the node's host root and writes a recording directory:

    recording.json   what was recorded, when, with which driver, and every query that failed
    tree/            the host-root files discovery reads (sysfs, /proc/driver/nvidia, /dev names,
                     DMI)
    fake-nvml.sim    the fake NVML library's data file (format in fake_nvml.c) answering as the
                     GPUs did
    nvml.json        every NVML answer our discovery, health watcher, telemetry and reset
                     evidence read, raw (telemetry, ECC counters and events are not replayed)
    tools/           `nvidia-smi -q`, `-L` and `topo -m` as the node printed them
    discover.json    what `edl-agent discover --format json` read on the recorded node

Identifying values (GPU and MIG UUIDs, serial numbers, the host name, nvidia-smi's PDI and serial
lines) are replaced everywhere by stable stand-ins, the same one for each occurrence, so that
links, MIG parents and tool outputs still agree. `sim/replay.py` turns a recording back into a
host-root tree.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml

from edl_agent.devices import nvidia
from edl_agent.devices.hostroot import HostRoot, ToolError
from edl_agent.sim import nvml_answers
from edl_agent.sim.profile import stable_uuid
from edl_agent.sim.smi_check import cross_check

FORMAT = 1
FAKE_NVML_DATA = "fake-nvml.sim"
RECORDED_HOST = "recorded-node"
SMI_TOOLS = {"q": ("-q",), "L": ("-L",), "topo-m": ("topo", "-m")}
# Lines of `nvidia-smi -q` whose values identify one board or chassis.
SMI_PRIVATE_KEYS = re.compile(
    r"^(\s*(?:Serial Number|GPU PDI|Chassis Serial Number|Board Id|GPU UUID)\s*:\s*)(\S.*)$",
    re.MULTILINE,
)
HOST_FILES = (
    "/sys/class/dmi/id/product_name",
    "/proc/driver/nvidia/version",
)
PCI_FILES = ("numa_node", "vendor", "class", "local_cpulist")


class RecordError(Exception):
    """The node cannot be recorded (no NVML, or NVML fails to start); one line saying why."""


@dataclass
class Scrubber:
    """Stable stand-ins for identifying values; the same value always gets the same stand-in."""

    replacements: dict[str, str] = field(default_factory=dict)
    hosts: dict[str, str] = field(default_factory=dict)

    def gpu_uuid(self, real: str, index: int) -> str:
        return self._remember(real, "GPU-" + stable_uuid("recorded", "gpu", index))

    def mig_uuid(self, real: str, gpu: int, index: int) -> str:
        return self._remember(real, "MIG-" + stable_uuid("recorded", "mig", gpu, index))

    def serial(self, real: str, index: int) -> str:
        return self._remember(real, f"REC{index:010d}")

    def host(self, real: str) -> str:
        # A host name can be a common word ("vm"): it is replaced only where it stands alone.
        if real:
            self.hosts[real] = RECORDED_HOST
        return RECORDED_HOST

    def _remember(self, real: str, stand_in: str) -> str:
        if real and real not in {"N/A", "[N/A]"}:
            self.replacements.setdefault(real, stand_in)
        return stand_in

    def text(self, text: str) -> str:
        # Longest first, so that a value containing another is replaced whole.
        for real in sorted(self.replacements, key=len, reverse=True):
            text = text.replace(real, self.replacements[real])
        for real, stand_in in self.hosts.items():
            text = re.sub(rf"(?<![\w.-]){re.escape(real)}(?![\w-])", stand_in, text)
        return SMI_PRIVATE_KEYS.sub(_masked, text)

    def value(self, value: Any) -> Any:
        """`value` (JSON-shaped) with every identifying string replaced."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.value(item) for item in value]
        if isinstance(value, dict):
            return {self.text(str(k)): self.value(v) for k, v in value.items()}
        return value


def _masked(match: re.Match[str]) -> str:
    value = match.group(2)
    if value.startswith(("GPU-", "MIG-", "REC")) or value in {"N/A", "[N/A]"}:
        return match.group(0)  # already a stand-in, or nothing to hide
    return match.group(1) + "REDACTED"


@dataclass(frozen=True)
class RecordSummary:
    out: Path
    gpus: int
    mig_devices: int
    failed_queries: int


def record(
    root: HostRoot,
    out: Path,
    *,
    discover_json: Callable[[], dict[str, Any]],
    now: datetime.datetime | None = None,
) -> RecordSummary:
    """Record the NVIDIA node under `root` into the empty or missing directory `out`.

    `discover_json` runs discovery on the node (the caller owns the settings) and is called
    after NVML was read, so its answer is scrubbed with the same stand-ins.
    """
    library = nvidia.find_library(root)
    if library is None:
        msg = f"{nvidia.LIBRARY} not found under {root.root}: nothing to record"
        raise RecordError(msg)
    try:
        with nvidia.nvml_session(library):
            answers = nvml_answers.read_all()
    except OSError as exc:
        msg = f"cannot load {library}: {exc}"
        raise RecordError(msg) from None
    except pynvml.NVMLError as exc:
        msg = f"NVML initialisation failed ({library}): {exc}"
        raise RecordError(msg) from None
    scrub = Scrubber()
    hostname = (root.read_optional("/etc/hostname") or "").strip()
    scrub.host(hostname)
    data = nvml_answers.fake_data(answers, scrub, numa_of=root.pci_numa_node)
    tree = out / "tree"
    _write(out / FAKE_NVML_DATA, scrub.text(data))
    _write(tree / "etc/hostname", RECORDED_HOST + "\n")
    for host_path in _host_files(root, answers):
        text = root.read_optional(host_path)
        if text is not None:
            _write(tree / host_path.lstrip("/"), scrub.text(text) + "\n")
    for name in root.glob("/dev", "nvidia*"):
        if root.path(name).is_dir():
            (tree / name.lstrip("/")).mkdir(parents=True, exist_ok=True)
        else:
            _write(tree / name.lstrip("/"), "")
    tools = {name: scrub.text(text) for name, text in _smi_outputs(root).items()}
    for name, text in tools.items():
        _write(out / "tools" / f"nvidia-smi-{name}.txt", text)
    discovered = scrub.value(discover_json())
    _write(out / "discover.json", _json(discovered))
    _write(out / "nvml.json", _json(scrub.value(answers)))
    failed = sum(1 for _ in nvml_answers.failures(answers))
    when = now or datetime.datetime.now(datetime.UTC)
    system = answers.get("system", {})
    meta = {
        "format": FORMAT,
        "recorded_at": when.isoformat(timespec="seconds"),
        "driver_version": system.get("driver_version"),
        "nvml_version": system.get("nvml_version"),
        "cuda_driver_version": system.get("cuda_driver_version"),
        "gpus": [gpu.get("name") for gpu in answers.get("gpus", [])],
        "tools": sorted(tools),
        "failed_queries": sorted(set(nvml_answers.failures(answers))),
    }
    if "q" in tools:
        meta["nvidia_smi_check"] = cross_check(tools["q"], discovered.get("devices", []))
    _write(out / "recording.json", _json(scrub.value(meta)))
    gpus = answers.get("gpus", [])
    return RecordSummary(
        out=out,
        gpus=len(gpus),
        mig_devices=sum(len(gpu.get("migs", [])) for gpu in gpus),
        failed_queries=failed,
    )


def _host_files(root: HostRoot, answers: dict[str, Any]) -> Iterator[str]:
    yield from HOST_FILES
    for node in root.glob("/sys/devices/system/node", "node[0-9]*"):
        yield f"{node}/cpulist"
    for gpu in answers.get("gpus", []):
        bus_id = gpu.get("bus_id")
        if isinstance(bus_id, str):
            for name in PCI_FILES:
                yield f"/sys/bus/pci/devices/{nvidia.sysfs_bus_id(bus_id)}/{name}"


def _smi_outputs(root: HostRoot) -> dict[str, str]:
    """What nvidia-smi prints on the node; a tool that is missing or fails is left out."""
    smi = root.which("nvidia-smi")
    if smi is None:
        return {}
    outputs = {}
    for name, args in SMI_TOOLS.items():
        try:
            outputs[name] = root.run_tool(smi, args, timeout=60.0)
        except ToolError:
            continue
    return outputs


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True) + "\n"
