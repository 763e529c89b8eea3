"""Fault injection into a simulated node (what `edl-agent simulate inject` runs).

NVIDIA faults are lines appended to the fake NVML library's fault file,
`/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1.faults` (format at the top of fake_nvml.c): an
agent waiting in nvmlEventSetWait wakes within milliseconds. Removing a device node works for
every vendor. Errors are ValueErrors with a one-line message naming the tree and the problem.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Vendor
from edl_agent.health import classify
from edl_agent.health.model import ClearsBy
from edl_agent.sim import ascend_tree, hygon_tree, kunlunxin_tree, nvidia_tree
from edl_agent.sim.files import BOOT_ID, write_file

# nvmlDeviceGpuRecoveryAction_t values the simulated driver reports after an XID.
_RECOVERY_ACTIONS = {ClearsBy.RESET: 1, ClearsBy.REBOOT: 2}

MAX_XID = 2**32 - 1
# The fake library's bounds (fake_nvml.c).
MAX_ECC_COUNT = 10**9
MAX_PCIE_GENERATION = 6
MAX_PCIE_WIDTH = 32
MAX_ROWS = 10**6

# Files that only a tree with that vendor's devices has.
_VENDOR_MARKERS = {
    Vendor.NVIDIA: (nvidia_tree.DATA, "/dev/nvidiactl"),
    Vendor.KUNLUNXIN: ("/dev/xpuctrl", kunlunxin_tree.TOOL),
    Vendor.HYGON: ("/dev/kfd", *hygon_tree.TOOLS),
    Vendor.ASCEND: ("/dev/davinci_manager", ascend_tree.TOOL),
}


def fault_file(root: Path) -> Path:
    return root / nvidia_tree.FAULTS.lstrip("/")


def inject_xid(root: Path, gpu_index: int, code: int, *, mig_index: int | None = None) -> None:
    """An XID critical error on a GPU, or attributed to one of its MIG devices. The simulated
    driver then reports the recovery action NVIDIA's catalog gives the code (GPU_RESET for a
    reset-class XID, NODE_REBOOT for XID 79 and other reboot-class ones)."""
    gpu = _gpu(root, gpu_index)
    if not 1 <= code <= MAX_XID:
        msg = f"XID code must be between 1 and {MAX_XID}, got {code}"
        raise ValueError(msg)
    fields = f"gpu={gpu_index} code={code}"
    if mig_index is not None:
        if not 0 <= mig_index < gpu.mig_devices:
            have = f"MIG devices 0-{gpu.mig_devices - 1}" if gpu.mig_devices else "no MIG devices"
            msg = f"{root}: NVIDIA GPU {gpu_index} has no MIG device {mig_index} ({have})"
            raise ValueError(msg)
        fields += f" mig={mig_index}"
    action = _RECOVERY_ACTIONS.get(classify.xid_clears_by(code, classify.classify_xid(code)))
    if action is not None:
        fields += f" action={action}"
    _append(root, f"xid {fields}")


def reset_device(root: Path, vendor: Vendor | str, index: int) -> str:
    """What the vendor's tools show after device `index` was reset (a one-line description).
    NVIDIA: the fake library's volatile ECC counters start again, a pending remap is applied and
    the recovery action is NONE (a lost GPU stays lost). NPU: Health OK with no fault codes.
    XPU/DCU: state Normal (XPU: volatile ECC counters 0)."""
    kind = _vendor(vendor)
    if kind is Vendor.NVIDIA:
        _gpu(root, index)
        _append(root, f"reset gpu={index}")
        return f"GPU {index} reset"
    if kind is Vendor.ASCEND:
        ascend_tree.set_npu_health(root, index, "OK")
    elif kind is Vendor.KUNLUNXIN:
        kunlunxin_tree.set_xpu_state(root, index, "Normal")
        kunlunxin_tree.set_xpu_ecc(root, index, uncorrectable=0)
    else:
        hygon_tree.set_dcu_state(root, index, "Normal")
    return f"{kind.value} device {index} reset"


def reboot(root: Path) -> str:
    """The node rebooted: a new boot id, and every fault the drivers held is gone (NVIDIA: lost
    GPUs back, recovery actions cleared; NPUs OK, XPUs/DCUs Normal). Removed /dev nodes stay
    removed: a device that vanished is not brought back by a reboot in this simulation."""
    host = _tree(root)
    write_file(root, BOOT_ID, f"{uuid.uuid4()}\n")
    done = ["new boot id"]
    if host.exists(nvidia_tree.DATA):
        _append(root, "reboot")
        done.append("NVIDIA driver state cleared")
    for kind, count in (
        (Vendor.ASCEND, ascend_tree.count_npus),
        (Vendor.KUNLUNXIN, _count_xpus),
        (Vendor.HYGON, hygon_tree.count_dcus),
    ):
        devices = count(root)
        for index in range(devices):
            reset_device(root, kind, index)
        if devices:
            done.append(f"{devices} {kind.value} devices reset")
    return ", ".join(done)


def inject_ecc_dbe(root: Path, gpu_index: int) -> None:
    """A double-bit (uncorrectable) ECC error: an event, and the uncorrected counters go up."""
    _gpu(root, gpu_index)
    _append(root, f"ecc_dbe gpu={gpu_index}")


def inject_ecc_sbe(root: Path, gpu_index: int, *, count: int = 1) -> None:
    """`count` single-bit (corrected) ECC errors: the corrected counters go up by `count`, with
    one event for them all."""
    _gpu(root, gpu_index)
    if not 1 <= count <= MAX_ECC_COUNT:
        msg = f"ECC error count must be between 1 and {MAX_ECC_COUNT}, got {count}"
        raise ValueError(msg)
    _append(root, f"ecc_sbe gpu={gpu_index}" + (f" count={count}" if count != 1 else ""))


def set_clock_event_reasons(root: Path, gpu_index: int, reasons: int) -> None:
    """What nvmlDeviceGetCurrentClocksEventReasons answers from now on: a mask of
    nvmlClocksEventReason* bits (0x8 HW slowdown, 0x40 HW thermal, ...; 0 for none). A reset
    leaves it; until set, a GPU reports 0x1 (idle)."""
    _gpu(root, gpu_index)
    if not 0 <= reasons < 2**64:
        msg = f"clocks-event reasons are a 64-bit mask, got {reasons}"
        raise ValueError(msg)
    _append(root, f"clocks gpu={gpu_index} reasons={reasons:#x}")


def set_pcie_link(
    root: Path, gpu_index: int, *, generation: int | None = None, width: int | None = None
) -> None:
    """The GPU's PCIe link trains at `generation` and/or `width` lanes (a downgrade: the fake
    library skips a line above the GPU's maximum); a reset or reboot trains it at its maximum."""
    _gpu(root, gpu_index)
    given = {"gen": generation, "width": width}
    fields = [f"{key}={value}" for key, value in given.items() if value is not None]
    if not fields:
        msg = "give a PCIe generation, a link width or both"
        raise ValueError(msg)
    if generation is not None and not 1 <= generation <= MAX_PCIE_GENERATION:
        msg = f"PCIe generation must be between 1 and {MAX_PCIE_GENERATION}, got {generation}"
        raise ValueError(msg)
    if width is not None and not 1 <= width <= MAX_PCIE_WIDTH:
        msg = f"PCIe link width must be between 1 and {MAX_PCIE_WIDTH} lanes, got {width}"
        raise ValueError(msg)
    _append(root, " ".join([f"pcie gpu={gpu_index}", *fields]))


def set_remapped_rows(
    root: Path, gpu_index: int, *, pending: int | None = None, failed: int | None = None
) -> None:
    """Rows of the GPU's memory waiting to be remapped (a reset applies them) and rows whose
    remapping failed (kept across resets and reboots); each given count replaces the last. NVML
    reports both as flags (nvmlDeviceGetRemappedRows' isPending, failureOccurred)."""
    _gpu(root, gpu_index)
    given = {"pending": pending, "failed": failed}
    fields = [f"{key}={value}" for key, value in given.items() if value is not None]
    if not fields:
        msg = "give rows pending, rows failed or both"
        raise ValueError(msg)
    if any(not 0 <= value <= MAX_ROWS for value in given.values() if value is not None):
        msg = f"row counts must be between 0 and {MAX_ROWS}"
        raise ValueError(msg)
    _append(root, " ".join([f"remap gpu={gpu_index}", *fields]))


def inject_lost(root: Path, gpu_index: int) -> None:
    """The GPU falls off the bus: an XID 79 event, then every NVML query on it fails."""
    _gpu(root, gpu_index)
    _append(root, f"lost gpu={gpu_index}")


def inject_recover(root: Path, gpu_index: int) -> None:
    """A lost GPU answers again (as after a reset)."""
    _gpu(root, gpu_index)
    _append(root, f"recover gpu={gpu_index}")


def set_nvml_init_failure(root: Path, on: bool) -> None:
    """While on, nvmlInit fails (driver not loaded) and pending event waits return an error."""
    _nvidia_gpus(root)
    _append(root, f"init_fail {'on' if on else 'off'}")


def set_gpu_telemetry(
    root: Path,
    gpu_index: int,
    *,
    temperature_c: int | None = None,
    power_w: int | None = None,
    utilization_percent: int | None = None,
    memory_used_mib: int | None = None,
) -> None:
    """What the GPU's telemetry queries answer from now on (fields left None keep theirs)."""
    _gpu(root, gpu_index)
    values = {
        "temperature_c": temperature_c,
        "power_w": power_w,
        "utilization": utilization_percent,
        "memory_used_mib": memory_used_mib,
    }
    given = {key: value for key, value in values.items() if value is not None}
    if not given:
        msg = "no telemetry value given"
        raise ValueError(msg)
    if any(value < 0 for value in given.values()):
        msg = "telemetry values cannot be negative"
        raise ValueError(msg)
    if given.get("utilization", 0) > 100:
        msg = f"utilization is a percentage, got {utilization_percent}"
        raise ValueError(msg)
    _append(root, " ".join([f"telemetry gpu={gpu_index}", *(f"{k}={v}" for k, v in given.items())]))


def remove_device_node(root: Path, vendor: Vendor | str, index: int) -> list[str]:
    """Delete device `index`'s own /dev node(s) (shared control nodes stay); the host paths
    removed. NVIDIA `/dev/nvidia<minor>`, Kunlunxin `/dev/xpu<N>`, Ascend `/dev/davinci<N>`,
    Hygon the DCU's `/dev/dri/card<N>` and `/dev/dri/renderD<M>`."""
    host = _tree(root)
    kind = _vendor(vendor)
    if not any(host.exists(marker) for marker in _VENDOR_MARKERS[kind]):
        msg = f"{root}: the simulated node has no {kind.value} devices"
        raise ValueError(msg)
    if index < 0:
        msg = f"device index must be 0 or more, got {index}"
        raise ValueError(msg)
    nodes = _own_nodes(root, host, kind, index)
    missing = [node for node in nodes if not host.exists(node)]
    if missing:
        msg = (
            f"{root}: {', '.join(missing)} does not exist: {kind.value} device {index} has no "
            "such node or it was already removed"
        )
        raise ValueError(msg)
    for node in nodes:
        host.path(node).unlink()
    return nodes


@dataclass(frozen=True)
class _SimGpu:
    index: int
    minor: int
    mig_devices: int
    uuid: str = ""


def _tree(root: Path) -> HostRoot:
    if not root.is_dir():
        msg = f"no simulated node at {root} (build one with `edl-agent simulate build`)"
        raise ValueError(msg)
    return HostRoot.at(root)


def _vendor(vendor: Vendor | str) -> Vendor:
    try:
        return Vendor(vendor)
    except ValueError:
        names = ", ".join(v.value for v in Vendor)
        msg = f"unknown vendor {vendor!r} (one of {names})"
        raise ValueError(msg) from None


def _nvidia_gpus(root: Path) -> dict[int, _SimGpu]:
    """The GPUs of the tree's fake NVML data file, by index."""
    data = _tree(root).path(nvidia_tree.DATA)
    try:
        text = data.read_text(encoding="utf-8")
    except FileNotFoundError:
        msg = f"{root}: the simulated node has no NVIDIA GPUs (no {nvidia_tree.DATA})"
        raise ValueError(msg) from None
    except OSError as exc:
        msg = f"{root}: cannot read {nvidia_tree.DATA}: {exc.strerror or exc}"
        raise ValueError(msg) from exc
    gpus: dict[int, _SimGpu] = {}
    for line in text.splitlines():
        kind, *pairs = line.split("\t")
        fields = dict(pair.partition("=")[::2] for pair in pairs)
        try:
            if kind == "gpu":
                index = int(fields["index"])
                gpus[index] = _SimGpu(
                    index, int(fields.get("minor", index)), 0, fields.get("uuid", "")
                )
            elif kind == "mig":
                parent = gpus[int(fields["gpu"])]
                gpus[parent.index] = replace(parent, mig_devices=parent.mig_devices + 1)
        except (KeyError, ValueError):
            msg = f"{root}: {nvidia_tree.DATA} is malformed: {line.strip()[:80]!r}"
            raise ValueError(msg) from None
    return gpus


def gpu_index(root: Path, uuid: str) -> int:
    """The index of the GPU with `uuid` (`GPU-...`, as kubelet and the pod's
    allocatedResourcesStatus name it)."""
    found = [gpu.index for gpu in _nvidia_gpus(root).values() if gpu.uuid == uuid]
    if not found:
        msg = f"{root}: no NVIDIA GPU has the uuid {uuid!r} (--device takes an index or a uuid)"
        raise ValueError(msg)
    return found[0]


def _gpu(root: Path, index: int) -> _SimGpu:
    gpus = _nvidia_gpus(root)
    if index not in gpus:
        have = f"GPUs 0-{max(gpus)}" if gpus else "no GPUs"
        msg = f"{root}: no NVIDIA GPU {index} (the node has {have})"
        raise ValueError(msg)
    return gpus[index]


def _append(root: Path, line: str) -> None:
    path = fault_file(root)
    # One write() of a whole line on an O_APPEND descriptor: a reader never sees half a fault.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _own_nodes(root: Path, host: HostRoot, vendor: Vendor, index: int) -> list[str]:
    if vendor is Vendor.NVIDIA:
        gpus = _nvidia_gpus(root) if host.exists(nvidia_tree.DATA) else {}
        minor = gpus[index].minor if index in gpus else index
        return [f"/dev/nvidia{minor}"]
    if vendor is Vendor.KUNLUNXIN:
        return [f"/dev/xpu{index}"]
    if vendor is Vendor.ASCEND:
        return [f"/dev/davinci{index}"]
    return _hygon_nodes(root, host, index)


def _hygon_nodes(root: Path, host: HostRoot, index: int) -> list[str]:
    """DCU `index` is the index-th Hygon DRM card in card-number order, as discovery counts."""
    cards = [
        card
        for card in host.glob("/sys/class/drm", "card*")
        if (host.read_optional(f"{card}/device/vendor") or "").lower() == hygon_tree.PCI_VENDOR
    ]
    if index >= len(cards):
        have = f"DCUs 0-{len(cards) - 1}" if cards else "no DCUs in sysfs"
        msg = f"{root}: no Hygon DCU {index} (the node has {have})"
        raise ValueError(msg)
    card = cards[index]
    renders = host.glob(f"{card}/device/drm", "renderD*")
    return [f"/dev/dri/{name.rsplit('/', 1)[-1]}" for name in [card, *renders]]


def _count_xpus(root: Path) -> int:
    path = root / kunlunxin_tree.QUERY_OUTPUT.lstrip("/")
    return path.read_text(encoding="utf-8").count("\nXPU ") if path.is_file() else 0
