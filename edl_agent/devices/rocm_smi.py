"""Hygon DCUs through DTK's rocm_smi library (`librocm_smi64.so`), loaded from the host root.

DTK ships rocm_smi's C API (rocm_smi.h) with Hygon's own additions; only the public calls every
version has are bound here: device count, PCI id, temperature, average power, busy percent,
VRAM and per-block ECC counts. One library object per path, initialised once for the process
(rsmi_init is reference-counted and its reads are thread-safe, but a lock keeps one reader at a
time so a read sees one consistent state). Nothing here starts a process.

Only DTK's directories are searched: an AMD ROCm install (`/opt/rocm`) has the same library for
AMD GPUs, which would list none of the Hygon cards.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from pathlib import Path

from edl_agent.devices import library_cache
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.library_cache import Opened
from edl_agent.devices.library_cache import usable as library_usable

LIBRARY = "librocm_smi64.so"
HEALTH_SOURCE = "librocm_smi64"  # what VendorReport.driver["health_source"] says
LIBRARY_DIRS = (
    "/opt/dtk/rocm_smi/lib",
    "/opt/dtk/lib",
    "/opt/hyhal/lib",
)

SUCCESS = 0
NOT_SUPPORTED = 2
FILE_ERROR = 3
NOT_FOUND = 10
UNEXPECTED_SIZE = 13
NO_DATA = 14
UNEXPECTED_DATA = 15
UNKNOWN_ERROR = 0xFFFFFFFF
# What reads of a device that has dropped off the bus return: rocm_smi turns the errno of its
# failing sysfs read into a status (EIO: UNEXPECTED_SIZE, ENXIO: UNEXPECTED_DATA, EBADF:
# FILE_ERROR, ESRCH: NOT_FOUND, ENODEV and anything unlisted: UNKNOWN_ERROR). A missing file
# (ENOENT) is NOT_SUPPORTED and a denied one PERMISSION: neither means the device is gone.
GONE = frozenset({FILE_ERROR, NOT_FOUND, UNEXPECTED_SIZE, UNEXPECTED_DATA, UNKNOWN_ERROR})
_NAMES = {
    NOT_SUPPORTED: "NOT_SUPPORTED",
    FILE_ERROR: "FILE_ERROR",
    4: "PERMISSION",
    8: "INIT_ERROR",
    NOT_FOUND: "NOT_FOUND",
    UNEXPECTED_SIZE: "UNEXPECTED_SIZE",
    NO_DATA: "NO_DATA",
    UNEXPECTED_DATA: "UNEXPECTED_DATA",
    UNKNOWN_ERROR: "UNKNOWN_ERROR",
}

TEMP_TYPE_EDGE = 0
TEMP_TYPE_JUNCTION = 1
TEMP_CURRENT = 0
TEMP_MAX = 1
MEM_TYPE_VRAM = 0
# rsmi_gpu_block_t bits whose ECC counts are read: memory controller, SDMA, GFX, MMHUB.
ECC_BLOCKS = (0x1, 0x2, 0x4, 0x8)

# rsmi_evt_notification_type_t (KFD's SMI event numbers); a mask bit is 1 << (event - 1).
EVT_VMFAULT = 1
EVT_THERMAL_THROTTLE = 2
EVT_GPU_PRE_RESET = 3
EVT_GPU_POST_RESET = 4
EVENT_MESSAGE_SIZE = 64

_MIB = 1024 * 1024


class RsmiError(Exception):
    """A rocm_smi call failed; `status` is its rsmi_status_t."""

    def __init__(self, call: str, status: int) -> None:
        super().__init__(f"{call} returned {status_name(status)}")
        self.call = call
        self.status = status


class _ErrorCount(ctypes.Structure):
    _fields_ = (("correctable", ctypes.c_uint64), ("uncorrectable", ctypes.c_uint64))


class _EventData(ctypes.Structure):
    _fields_ = (
        ("dv_ind", ctypes.c_uint32),
        ("event", ctypes.c_int32),
        ("message", ctypes.c_char * EVENT_MESSAGE_SIZE),
    )


@dataclass(frozen=True)
class DcuEvent:
    index: int
    kind: int  # EVT_*
    message: str


def event_mask(*kinds: int) -> int:
    mask = 0
    for kind in kinds:
        mask |= 1 << (kind - 1)
    return mask


@dataclass(frozen=True)
class DcuReading:
    """One device as the library reads it; None where a figure is not supported."""

    index: int
    bus_id: str | None
    gone: bool = False  # reads fail as for a device that left the bus
    gone_detail: str = ""
    temperature_c: float | None = None
    temperature_max_c: float | None = None
    power_w: float | None = None
    utilization_percent: float | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None


def status_name(status: int) -> str:
    return f"RSMI_STATUS_{_NAMES[status]}" if status in _NAMES else f"rsmi status {status}"


def find_library(root: HostRoot) -> str | None:
    """The local path of DTK's rocm_smi library under `root`, if it has one."""
    return library_cache.find(root, LIBRARY_DIRS, LIBRARY)


def bus_id_of(bdfid: int) -> str:
    """rocm_smi packs the address as domain << 32 | bus << 8 | device << 3 | function."""
    domain, bus = (bdfid >> 32) & 0xFFFFFFFF, (bdfid >> 8) & 0xFF
    return f"{domain:04x}:{bus:02x}:{(bdfid >> 3) & 0x1F:02x}.{bdfid & 0x7}"


class RocmSmi:
    """An initialised rocm_smi library. Raises OSError (cannot load) or RsmiError (rsmi_init)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lib = ctypes.CDLL(path)
        self._lock = threading.Lock()
        self._call("rsmi_init", ctypes.c_uint64(0))

    def read_all(self) -> list[DcuReading]:
        """Every device the library lists, in its index order. RsmiError when it cannot count
        them; a single figure that cannot be read is None."""
        with self._lock:
            count = ctypes.c_uint32()
            self._call("rsmi_num_monitor_devices", ctypes.byref(count))
            return [self._read(index) for index in range(count.value)]

    def bus_ids(self) -> dict[int, str]:
        """The PCI address of every device the library lists, by its index."""
        with self._lock:
            count = ctypes.c_uint32()
            self._call("rsmi_num_monitor_devices", ctypes.byref(count))
            found = {}
            for index in range(count.value):
                bdfid = ctypes.c_uint64()
                if self._status("rsmi_dev_pci_id_get", index, ctypes.byref(bdfid)) == SUCCESS:
                    found[index] = bus_id_of(bdfid.value)
            return found

    def events_start(self, index: int, mask: int) -> None:
        """Collect the events in `mask` for device `index` (RsmiError when it cannot)."""
        self._call("rsmi_event_notification_init", ctypes.c_uint32(index))
        self._call(
            "rsmi_event_notification_mask_set", ctypes.c_uint32(index), ctypes.c_uint64(mask)
        )

    def events_wait(self, timeout_ms: int, capacity: int = 16) -> list[DcuEvent]:
        """Events of the started devices, waiting up to `timeout_ms` for one (the wait runs
        without the GIL and without this object's lock); [] when none came."""
        buffer = (_EventData * capacity)()
        count = ctypes.c_uint32(capacity)
        function = self._lib.rsmi_event_notification_get
        function.restype = ctypes.c_uint32
        status = int(function(ctypes.c_int(timeout_ms), ctypes.byref(count), buffer))
        if status == NO_DATA:
            return []
        if status != SUCCESS:
            raise RsmiError("rsmi_event_notification_get", status)
        return [
            DcuEvent(
                index=int(item.dv_ind),
                kind=int(item.event),
                message=item.message.decode("utf-8", "replace").strip(),
            )
            for item in buffer[: min(count.value, capacity)]
        ]

    def events_stop(self, index: int) -> None:
        function = self._lib.rsmi_event_notification_stop
        function.restype = ctypes.c_uint32
        function(ctypes.c_uint32(index))

    def _read(self, index: int) -> DcuReading:
        bdfid = ctypes.c_uint64()
        status = self._status("rsmi_dev_pci_id_get", index, ctypes.byref(bdfid))
        bus_id = bus_id_of(bdfid.value) if status == SUCCESS else None
        busy = ctypes.c_uint32()
        status = self._status("rsmi_dev_busy_percent_get", index, ctypes.byref(busy))
        if status in GONE:
            detail = f"rsmi_dev_busy_percent_get returned {status_name(status)}"
            return DcuReading(index=index, bus_id=bus_id, gone=True, gone_detail=detail)
        corrected, uncorrected = self._ecc(index)
        return DcuReading(
            index=index,
            bus_id=bus_id,
            temperature_c=self._temperature(index, TEMP_CURRENT),
            temperature_max_c=self._temperature(index, TEMP_MAX),
            power_w=self._scaled("rsmi_dev_power_ave_get", index, 1e6, ctypes.c_uint32(0)),
            utilization_percent=float(busy.value) if status == SUCCESS else None,
            memory_used_mib=self._memory("rsmi_dev_memory_usage_get", index),
            memory_total_mib=self._memory("rsmi_dev_memory_total_get", index),
            ecc_corrected=corrected,
            ecc_uncorrected=uncorrected,
        )

    def _temperature(self, index: int, metric: int) -> float | None:
        """Junction (hotspot) temperature, else edge, in degrees C."""
        for sensor in (TEMP_TYPE_JUNCTION, TEMP_TYPE_EDGE):
            value = ctypes.c_int64()
            args = (ctypes.c_uint32(sensor), ctypes.c_uint32(metric), ctypes.byref(value))
            if self._status("rsmi_dev_temp_metric_get", index, *args) == SUCCESS:
                return value.value / 1000.0
        return None

    def _scaled(self, call: str, index: int, divisor: float, *args: object) -> float | None:
        value = ctypes.c_uint64()
        if self._status(call, index, *args, ctypes.byref(value)) != SUCCESS:
            return None
        return value.value / divisor

    def _memory(self, call: str, index: int) -> float | None:
        return self._scaled(call, index, _MIB, ctypes.c_uint32(MEM_TYPE_VRAM))

    def _ecc(self, index: int) -> tuple[int | None, int | None]:
        counts = [_ErrorCount() for _ in ECC_BLOCKS]
        read = [
            count
            for block, count in zip(ECC_BLOCKS, counts, strict=True)
            if self._status(
                "rsmi_dev_ecc_count_get", index, ctypes.c_uint64(block), ctypes.byref(count)
            )
            == SUCCESS
        ]
        if not read:
            return None, None
        return sum(c.correctable for c in read), sum(c.uncorrectable for c in read)

    def _status(self, call: str, index: int, *args: object) -> int:
        function = getattr(self._lib, call)
        function.restype = ctypes.c_uint32
        return int(function(ctypes.c_uint32(index), *args))

    def _call(self, call: str, *args: object) -> None:
        function = getattr(self._lib, call)
        function.restype = ctypes.c_uint32
        status = int(function(*args))
        if status != SUCCESS:
            raise RsmiError(call, status)


open_library: Opened[RocmSmi] = Opened(RocmSmi)


def usable(root: HostRoot) -> Path | None:
    """The library under `root` when it loads, initialises and lists its devices; else None."""
    return library_usable(
        find_library(root), lambda path: open_library(path).read_all(), (OSError, RsmiError)
    )
