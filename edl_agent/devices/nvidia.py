"""NVIDIA discovery through NVML: GPUs, MIG devices, NVLink peers and NUMA placement, and
from sysfs each GPU's PCI class and whether it is a vGPU.

NVML is loaded from the host root (the driver's `libnvidia-ml.so.1`, or a simulated node's
fake one) by handing pynvml a ctypes handle before `nvmlInit`. pynvml keeps that handle and a
cache of function pointers in module globals, so every use of NVML goes through
`nvml_session`: sessions on the same library may run concurrently on any number of threads
(NVML reference-counts nvmlInit/nvmlShutdown), and pynvml is pointed at another library only
once no session is open.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pynvml
import structlog

from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Device, Link, LinkKind, Vendor, VendorReport

LIBRARY = "libnvidia-ml.so.1"
# Where drivers put the library: distribution packages, the GPU operator's driver container
# (/run/nvidia/driver), and the NVIDIA container toolkit's mounts.
LIBRARY_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/nvidia/lib64",
    "/usr/local/nvidia/lib",
    "/run/nvidia/driver/usr/lib/x86_64-linux-gnu",
    "/run/nvidia/driver/usr/lib64",
    "/usr/lib/aarch64-linux-gnu",
    "/run/nvidia/driver/usr/lib/aarch64-linux-gnu",
)
MIB = 1 << 20


class _Sessions:
    """Which library pynvml is bound to, and how many sessions use it."""

    changed = threading.Condition()
    library: str | None = None
    count = 0


ARCHITECTURES = {
    value: name.removeprefix("NVML_DEVICE_ARCH_").lower()
    for name, value in vars(pynvml).items()
    if name.startswith("NVML_DEVICE_ARCH_") and isinstance(value, int)
}


def discover(root: HostRoot) -> VendorReport | None:
    """NVIDIA devices under `root`; None when the node has neither the library nor GPUs."""
    log = structlog.get_logger().bind(vendor=Vendor.NVIDIA.value)
    device_nodes = root.glob("/dev", "nvidia[0-9]*")
    library = find_library(root)
    if library is None:
        if not device_nodes:
            return None
        return _failed(f"{device_nodes[0]} exists but {LIBRARY} was not found under {root.root}")
    try:
        with nvml_session(library):
            report = _read_node(root)
    except OSError as exc:
        if library == LIBRARY and not device_nodes:
            return None  # no driver on this host: the soname fallback found nothing either
        return _failed(f"cannot load {library}: {exc}")
    except pynvml.NVMLError as exc:
        return _failed(f"NVML initialisation failed ({library}): {exc}")
    log.debug(
        "nvml read",
        library=library,
        gpus=sum(d.kind == "gpu" for d in report.devices),
        mig_devices=sum(d.kind == "mig" for d in report.devices),
        error=report.error,
    )
    return report


def find_library(root: HostRoot) -> str | None:
    """The local path of the host's NVML library, or the bare soname on a root of `/`.

    On `/` the dynamic loader's own search (ldconfig cache, LD_LIBRARY_PATH) is the last resort,
    as pynvml itself would do.
    """
    for directory in LIBRARY_DIRS:
        candidate = root.path(f"{directory}/{LIBRARY}")
        if candidate.is_file():
            return str(candidate)
    return LIBRARY if root.root == Path("/") else None


@contextmanager
def nvml_session(library: str) -> Iterator[None]:
    """NVML initialised from `library` for the duration of the block.

    Raises OSError when the library cannot be loaded and pynvml.NVMLError when nvmlInit fails.
    Sessions on the same library run concurrently (a thread may also nest them); a session on
    another library waits until every open one has ended, so a thread must not open one
    inside a session on a different library.
    """
    _acquire(library)
    try:
        pynvml.nvmlInit()
    except BaseException:
        _release()
        raise
    try:
        yield
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            # What was read stays valid; a failed shutdown must not turn it into an error.
            log = structlog.get_logger().bind(vendor=Vendor.NVIDIA.value)
            log.warning("nvmlShutdown failed", error=str(exc))
        finally:
            _release()


def _acquire(library: str) -> None:
    with _Sessions.changed:
        _Sessions.changed.wait_for(lambda: _Sessions.count == 0 or _Sessions.library == library)
        if _Sessions.count == 0:
            _reset_pynvml(ctypes.CDLL(library))
            _Sessions.library = library
        _Sessions.count += 1


def _release() -> None:
    with _Sessions.changed:
        _Sessions.count -= 1
        if _Sessions.count == 0:
            _reset_pynvml(None)
            _Sessions.library = None
            _Sessions.changed.notify_all()


def _reset_pynvml(handle: ctypes.CDLL | None) -> None:
    # pynvml caches function pointers by name: without clearing the cache, a second library
    # would be called through the first one's functions.
    with pynvml.libLoadLock:
        pynvml.nvmlLib = handle
        pynvml._nvmlGetFunctionPointer_cache.clear()


@dataclasses.dataclass(frozen=True)
class _Gpu:
    device: Device  # links still empty
    nvlink_remotes: tuple[str, ...]  # sysfs-form PCI bus ids at the far end of active links
    mig_devices: tuple[Device, ...]


def _read_node(root: HostRoot) -> VendorReport:
    errors: list[str] = []
    driver = _driver_info(errors)
    gpus: list[_Gpu] = []
    try:
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        errors.append(f"device count: {exc}")
        count = 0
    for index in range(count):
        try:
            gpus.append(_read_gpu(root, index, errors))
        except pynvml.NVMLError as exc:
            errors.append(f"GPU {index}: {exc}")
    devices = [device for gpu in _with_links(gpus) for device in (gpu.device, *gpu.mig_devices)]
    return VendorReport(
        vendor=Vendor.NVIDIA,
        devices=tuple(devices),
        driver=driver,
        error="; ".join(errors) or None,
    )


def _driver_info(errors: list[str]) -> dict[str, str]:
    driver: dict[str, str] = {}
    try:
        driver["driver_version"] = _text(pynvml.nvmlSystemGetDriverVersion())
        driver["nvml_version"] = _text(pynvml.nvmlSystemGetNVMLVersion())
        cuda = int(pynvml.nvmlSystemGetCudaDriverVersion())
        driver["cuda_driver_version"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
    except pynvml.NVMLError as exc:
        errors.append(f"driver versions: {exc}")
    return driver


def _read_gpu(root: HostRoot, index: int, errors: list[str]) -> _Gpu:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
    minor = int(pynvml.nvmlDeviceGetMinorNumber(handle))
    pci_bus_id = sysfs_bus_id(_text(pynvml.nvmlDeviceGetPciInfo(handle).busId))
    major, minor_cc = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    mig_mode = _mig_mode(handle)
    architecture = _optional(pynvml.nvmlDeviceGetArchitecture, handle)
    attributes = {
        "compute_capability": f"{major}.{minor_cc}",
        "architecture": ARCHITECTURES.get(architecture, "unknown"),
        "minor": str(minor),
        "mig_mode": mig_mode,
    }
    serial = _optional(pynvml.nvmlDeviceGetSerial, handle)
    if serial:
        attributes["serial"] = _text(serial)
    attributes |= pci_facts(root, pci_bus_id)
    gpu = Device(
        vendor=Vendor.NVIDIA,
        kind="gpu",
        index=index,
        id=uuid,
        product=_text(pynvml.nvmlDeviceGetName(handle)),
        memory_mib=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // MIB,
        numa_node=root.pci_numa_node(pci_bus_id),
        pci_bus_id=pci_bus_id,
        device_nodes=(f"/dev/nvidia{minor}",),
        attributes=attributes,
    )
    migs = _read_migs(handle, gpu, errors) if mig_mode == "enabled" else ()
    return _Gpu(gpu, _nvlink_remotes(handle, index, errors), migs)


def _mig_mode(handle: Any) -> str:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        return "unsupported"
    return "enabled" if current == pynvml.NVML_DEVICE_MIG_ENABLE else "disabled"


def _read_migs(handle: Any, gpu: Device, errors: list[str]) -> tuple[Device, ...]:
    migs: list[Device] = []
    try:
        slots = int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))
    except pynvml.NVMLError as exc:
        errors.append(f"GPU {gpu.index} MIG devices: {exc}")
        return ()
    for index in range(slots):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except pynvml.NVMLError_NotFound:
            continue
        except pynvml.NVMLError as exc:
            errors.append(f"GPU {gpu.index} MIG device {index}: {exc}")
            continue
        try:
            migs.append(_read_mig(mig, index, gpu))
        except pynvml.NVMLError as exc:
            errors.append(f"GPU {gpu.index} MIG device {index}: {exc}")
    return tuple(migs)


def _read_mig(handle: Any, index: int, gpu: Device) -> Device:
    name = _text(pynvml.nvmlDeviceGetName(handle))
    attributes = {
        "gpu_instance_id": str(pynvml.nvmlDeviceGetGpuInstanceId(handle)),
        "compute_instance_id": str(pynvml.nvmlDeviceGetComputeInstanceId(handle)),
    }
    profile = mig_profile(name)
    if profile:
        attributes["mig_profile"] = profile
    return Device(
        vendor=Vendor.NVIDIA,
        kind="mig",
        index=index,
        id=_text(pynvml.nvmlDeviceGetUUID(handle)),
        product=name,
        memory_mib=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // MIB,
        numa_node=gpu.numa_node,
        pci_bus_id=gpu.pci_bus_id,
        device_nodes=gpu.device_nodes,
        parent=gpu.id,
        attributes=attributes,
    )


def mig_profile(name: str) -> str | None:
    """`3g.40gb` from a MIG device name such as `NVIDIA A100-SXM4-80GB MIG 3g.40gb`."""
    _, found, profile = name.rpartition("MIG ")
    if not found or not profile.strip():
        return None
    return profile.strip()


PCI_CONFIG_SIZE = 256  # the standard configuration space; PCIe's extended one follows it
_STATUS, _STATUS_CAPABILITIES = 0x06, 0x10
_CAPABILITIES_POINTER = 0x34
_VENDOR_CAPABILITY = 0x09
_VGPU_SIGNATURE = b"VF"


def pci_facts(root: HostRoot, bus_id: str) -> dict[str, str]:
    """What sysfs says of a GPU's PCI function: `pci_class` (the class code as sysfs writes it,
    `0x030200` for a 3D controller, `0x030000` for a VGA one) and `vgpu` (`true` when its
    configuration space carries NVIDIA's vGPU signature). Each is left out when it cannot be
    read: `vgpu` needs the whole configuration space, which sysfs gives only to readers with
    CAP_SYS_ADMIN (others get its first 64 bytes)."""
    device = f"/sys/bus/pci/devices/{bus_id}"
    facts: dict[str, str] = {}
    pci_class = root.read_optional(f"{device}/class")
    if pci_class:
        facts["pci_class"] = pci_class
    try:
        with root.path(f"{device}/config").open("rb") as file:
            config = file.read(PCI_CONFIG_SIZE)
    except OSError:
        return facts
    vgpu = vgpu_signature(config)
    if vgpu is not None:
        facts["vgpu"] = str(vgpu).lower()
    return facts


def vgpu_signature(config: bytes) -> bool | None:
    """Whether a PCI configuration space is a vGPU's: its first vendor-specific capability
    holds `VF` in the two bytes after its header (id, next, length). None when the space is
    shorter than its standard 256 bytes."""
    if len(config) < PCI_CONFIG_SIZE:
        return None
    if not config[_STATUS] & _STATUS_CAPABILITIES:
        return False
    seen: set[int] = set()
    position = config[_CAPABILITIES_POINTER] & 0xFC
    # Capabilities live after the 64-byte header; a pointer seen twice is a loop.
    while 0x40 <= position <= PCI_CONFIG_SIZE - 3 and position not in seen:
        seen.add(position)
        capability, following, length = config[position : position + 3]
        if capability == 0xFF:
            return False
        if capability == _VENDOR_CAPABILITY:
            body = config[position : position + length]
            return body[3:5] == _VGPU_SIGNATURE
        position = following & 0xFC
    return False


def _nvlink_remotes(handle: Any, index: int, errors: list[str]) -> tuple[str, ...]:
    remotes: list[str] = []
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
            remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            break  # no NVLink on this GPU, or past its last link
        except pynvml.NVMLError as exc:
            errors.append(f"GPU {index} NVLink {link}: {exc}")
            continue
        remotes.append(sysfs_bus_id(_text(remote.busId)))
    return tuple(remotes)


def _with_links(gpus: list[_Gpu]) -> list[_Gpu]:
    """Resolve NVLink far ends to peer GPUs; links to anything else (NVSwitches) are not peers."""
    by_bus_id = {gpu.device.pci_bus_id: gpu.device for gpu in gpus}
    resolved = []
    for gpu in gpus:
        counts = Counter(
            by_bus_id[remote].id for remote in gpu.nvlink_remotes if remote in by_bus_id
        )
        links = tuple(
            Link(peer=peer.id, kind=LinkKind.NVLINK, count=counts[peer.id])
            for peer in by_bus_id.values()
            if peer.id in counts and peer.id != gpu.device.id
        )
        resolved.append(
            dataclasses.replace(gpu, device=dataclasses.replace(gpu.device, links=links))
        )
    return resolved


def sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML's `00000000:18:00.0` in sysfs form, `0000:18:00.0`."""
    domain, _, rest = nvml_bus_id.strip().partition(":")
    return f"{int(domain, 16):04x}:{rest.lower()}"


def _optional(query: Any, handle: Any) -> Any:
    """The query's answer, or None where this GPU or an older driver does not offer it."""
    try:
        return query(handle)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        return None


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _failed(message: str) -> VendorReport:
    return VendorReport(vendor=Vendor.NVIDIA, error=" ".join(message.split()))
