"""Ascend NPUs through the driver's DCMI library (`libdcmi.so`), loaded from the host root.

The calls and struct layouts are those of DCMI's published C API (`dcmi_interface_api.h`, as
Ascend's own device plugin and exporter use it): card list, chips per card, logic and physical
ids, chip info, PCIe address, health, error codes, HBM or DDR memory, temperature, power, AI Core
utilisation, and the fault-event subscription. One library object per path, initialised once for
the process; a lock keeps one reader at a time. Nothing here starts a process.

Ids: a chip is addressed by (card id, device id in card) — npu-smi's NPU and Chip columns; its
logic id names it in events; its physical id is N of /dev/davinci<N>, the agent's device index.
"""

from __future__ import annotations

import ctypes
import ipaddress
import queue
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from edl_agent.devices import library_cache
from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.library_cache import Opened
from edl_agent.devices.library_cache import usable as library_usable

LIBRARY = "libdcmi.so"
HEALTH_SOURCE = "libdcmi"  # what VendorReport.driver["health_source"] says
# Where the driver and the DCMI package install it; the directories Ascend's device plugin puts
# on its library path.
LIBRARY_DIRS = (
    "/usr/local/Ascend/driver/lib64/driver",
    "/usr/local/Ascend/driver/lib64",
    "/usr/local/dcmi",
)

SUCCESS = 0
NOT_SUPPORTED = -8255
_ERRORS = {
    -8001: "invalid parameter",
    -8002: "permission denied",
    -8005: "internal error",
    -8006: "timed out",
    -8007: "invalid device id",
    -8008: "device does not exist",
    -8012: "not ready",
    -8013: "not supported in a container",
    NOT_SUPPORTED: "not supported",
}
# dcmi_get_device_health: the words npu-smi prints in its Health column for the same values.
HEALTH_WORDS = {0: "OK", 1: "Warning", 2: "Alarm", 3: "Critical"}
ASSERT_RECOVERED = 0
ASSERT_RAISED = 1
ASSERT_ONCE = 2
SUBSCRIBE_ALL = -1
UTILIZATION_AICORE = 2
ROCE_PORT = 1
IP_V4, IP_V6 = 0, 1
MAX_CARDS = 64
MAX_ERROR_CODES = 128
_NAME_LENGTH = 32


class DcmiError(Exception):
    """A DCMI call failed; `status` is its return code."""

    def __init__(self, call: str, status: int) -> None:
        super().__init__(f"{call} returned {status} ({_ERRORS.get(status, 'error')})")
        self.call = call
        self.status = status


class _ChipInfo(ctypes.Structure):
    _fields_ = (
        ("chip_type", ctypes.c_ubyte * _NAME_LENGTH),
        ("chip_name", ctypes.c_ubyte * _NAME_LENGTH),
        ("chip_ver", ctypes.c_ubyte * _NAME_LENGTH),
        ("aicore_cnt", ctypes.c_uint),
    )


class _PcieInfo(ctypes.Structure):
    _fields_ = (
        ("venderid", ctypes.c_uint),
        ("subvenderid", ctypes.c_uint),
        ("deviceid", ctypes.c_uint),
        ("subdeviceid", ctypes.c_uint),
        ("domain", ctypes.c_int),
        ("bdf_busid", ctypes.c_uint),
        ("bdf_deviceid", ctypes.c_uint),
        ("bdf_funcid", ctypes.c_uint),
        ("reserve", ctypes.c_ubyte * 32),
    )


class _HbmInfo(ctypes.Structure):
    _fields_ = (
        ("memory_size", ctypes.c_ulonglong),  # MB
        ("freq", ctypes.c_uint),
        ("memory_usage", ctypes.c_ulonglong),  # MB
        ("temp", ctypes.c_int),
        ("bandwith_util_rate", ctypes.c_uint),
    )


class _MemoryInfo(ctypes.Structure):
    _fields_ = (
        ("memory_size", ctypes.c_ulonglong),  # MB
        ("memory_available", ctypes.c_ulonglong),  # MB
        ("freq", ctypes.c_uint),
        ("hugepagesize", ctypes.c_ulong),
        ("hugepages_total", ctypes.c_ulong),
        ("hugepages_free", ctypes.c_ulong),
        ("utiliza", ctypes.c_uint),
        ("reserve", ctypes.c_ubyte * 60),
    )


class _FaultEvent(ctypes.Structure):
    _fields_ = (
        ("event_id", ctypes.c_uint),
        ("deviceid", ctypes.c_ushort),  # the chip's logic id
        ("node_type", ctypes.c_ubyte),
        ("node_id", ctypes.c_ubyte),
        ("sub_node_type", ctypes.c_ubyte),
        ("sub_node_id", ctypes.c_ubyte),
        ("severity", ctypes.c_ubyte),
        ("assertion", ctypes.c_ubyte),
        ("event_serial_num", ctypes.c_int),
        ("notify_serial_num", ctypes.c_int),
        ("alarm_raised_time", ctypes.c_ulonglong),
        ("event_name", ctypes.c_char * 256),
        ("additional_info", ctypes.c_char * 32),
        ("resv", ctypes.c_ubyte * 32),
    )


class _Event(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("dms_event", _FaultEvent))


class _EventFilter(ctypes.Structure):
    _fields_ = (
        ("filter_flag", ctypes.c_ulonglong),
        ("event_id", ctypes.c_uint),
        ("severity", ctypes.c_ubyte),
        ("node_type", ctypes.c_ubyte),
        ("resv", ctypes.c_ubyte * 32),
    )


class _IpAddress(ctypes.Structure):
    _fields_ = (("u_addr", ctypes.c_ubyte * 16), ("ip_type", ctypes.c_int))


_HANDLER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Event))


@dataclass(frozen=True)
class NpuChip:
    """One chip as DCMI reads it; None where a figure cannot be read."""

    card: int
    device: int
    logic_id: int
    phy_id: int
    chip_name: str | None  # 910B3, 310P3, ...
    bus_id: str | None
    health: int | None  # 0..3, HEALTH_WORDS
    error_codes: tuple[int, ...] = ()
    codes_read: bool = True
    memory_mib: int | None = None
    memory_used_mib: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    aicore_percent: float | None = None
    ip: str | None = None  # the RoCE port's address, read only where asked for

    @property
    def health_word(self) -> str:
        if self.health is None:
            return "Unknown"
        return HEALTH_WORDS.get(self.health, f"Unknown{self.health}")


@dataclass(frozen=True)
class FaultEvent:
    """One fault event as the subscription delivers it."""

    event_id: int  # the fault code, e.g. 0x80E01801
    logic_id: int
    severity: int
    assertion: int  # ASSERT_*
    name: str


def find_library(root: HostRoot) -> str | None:
    """The local path of the DCMI library under `root`, if it has one."""
    return library_cache.find(root, LIBRARY_DIRS, LIBRARY)


class Dcmi:
    """An initialised DCMI library. Raises OSError (cannot load) or DcmiError (dcmi_init)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lib = ctypes.CDLL(path)
        self._lock = threading.Lock()
        self._events: queue.SimpleQueue[FaultEvent] | None = None
        self._handler: object = None  # the C callback, kept alive as long as the library
        self._call("dcmi_init")

    def chips(self, *, addresses: bool = False) -> list[NpuChip]:
        """Every chip of every card, in card then device order, with each chip's RoCE address
        where `addresses` (discovery wants it; polls do not). DcmiError when the cards or their
        chips cannot be listed; a single figure that cannot be read is None."""
        with self._lock:
            chips = [self._chip(card, device) for card, device in self._addresses()]
            if addresses:
                chips = [replace(c, ip=self._device_ip(c.card, c.device)) for c in chips]
            return chips

    def phy_ids(self) -> dict[int, int]:
        """Each chip's physical id by its logic id."""
        with self._lock:
            found = {}
            for card, device in self._addresses():
                logic = ctypes.c_int()
                self._call("dcmi_get_device_logic_id", ctypes.byref(logic), card, device)
                phy = ctypes.c_uint()
                args = (ctypes.c_uint(logic.value), ctypes.byref(phy))
                self._call("dcmi_get_device_phyid_from_logicid", *args)
                found[logic.value] = phy.value
            return found

    def subscribe(self) -> queue.SimpleQueue[FaultEvent]:
        """Fault events of every chip, from now on, into the returned queue. The library calls
        back from a thread of its own for the rest of the process; a second call returns the
        same queue. DcmiError when the subscription is refused."""
        with self._lock:
            if self._events is not None:
                return self._events
            events: queue.SimpleQueue[FaultEvent] = queue.SimpleQueue()

            def on_event(pointer: ctypes._Pointer[_Event]) -> None:
                # Runs on the library's thread: copy the event and hand it over, nothing else.
                raw = pointer.contents.dms_event
                events.put(
                    FaultEvent(
                        event_id=int(raw.event_id),
                        logic_id=int(raw.deviceid),
                        severity=int(raw.severity),
                        assertion=int(raw.assertion),
                        name=raw.event_name.decode("utf-8", "replace").strip(),
                    )
                )

            handler = _HANDLER(on_event)
            function = self._lib.dcmi_subscribe_fault_event
            function.restype = ctypes.c_int
            function.argtypes = (ctypes.c_int, ctypes.c_int, _EventFilter, _HANDLER)
            status = int(function(SUBSCRIBE_ALL, SUBSCRIBE_ALL, _EventFilter(), handler))
            if status != SUCCESS:
                raise DcmiError("dcmi_subscribe_fault_event", status)
            self._handler = handler
            self._events = events
            return events

    def _addresses(self) -> list[tuple[int, int]]:
        count = ctypes.c_int()
        cards = (ctypes.c_int * MAX_CARDS)()
        self._call("dcmi_get_card_list", ctypes.byref(count), cards, MAX_CARDS)
        found: list[tuple[int, int]] = []
        for card in cards[: max(0, min(count.value, MAX_CARDS))]:
            chips = ctypes.c_int()
            self._call("dcmi_get_device_num_in_card", card, ctypes.byref(chips))
            found.extend((card, device) for device in range(chips.value))
        return found

    def _chip(self, card: int, device: int) -> NpuChip:
        logic = ctypes.c_int()
        self._call("dcmi_get_device_logic_id", ctypes.byref(logic), card, device)
        phy = ctypes.c_uint()
        self._call(
            "dcmi_get_device_phyid_from_logicid", ctypes.c_uint(logic.value), ctypes.byref(phy)
        )
        info = _ChipInfo()
        name = None
        if self._status("dcmi_get_device_chip_info", card, device, ctypes.byref(info)) == SUCCESS:
            name = bytes(info.chip_name).split(b"\0", 1)[0].decode("ascii", "replace") or None
        health = ctypes.c_uint()
        read = self._status("dcmi_get_device_health", card, device, ctypes.byref(health))
        codes, codes_read = self._error_codes(card, device)
        total, used = self._memory(card, device)
        return NpuChip(
            card=card,
            device=device,
            logic_id=logic.value,
            phy_id=phy.value,
            chip_name=name,
            bus_id=self._bus_id(card, device),
            health=health.value if read == SUCCESS else None,
            error_codes=codes,
            codes_read=codes_read,
            memory_mib=total,
            memory_used_mib=used,
            temperature_c=self._int("dcmi_get_device_temperature", card, device, 1.0),
            power_w=self._int("dcmi_get_device_power_info", card, device, 0.1),
            aicore_percent=self._utilization(card, device),
        )

    def _device_ip(self, card: int, device: int) -> str | None:
        """The RoCE port's IPv4 address, else its IPv6 one that is not link-local (as Ascend's
        device plugin reads it for the rank table); None where the chip has neither."""
        for kind in (IP_V4, IP_V6):
            address, mask = _IpAddress(ip_type=kind), _IpAddress()
            args = (ROCE_PORT, 0, ctypes.byref(address), ctypes.byref(mask))
            if self._status("dcmi_get_device_ip", card, device, *args) != SUCCESS:
                continue
            raw = bytes(address.u_addr)
            found = ipaddress.ip_address(raw[:4] if kind == IP_V4 else raw)
            if not found.is_link_local and not found.is_unspecified:
                return str(found)
        return None

    def _bus_id(self, card: int, device: int) -> str | None:
        pcie = _PcieInfo()
        if self._status("dcmi_get_device_pcie_info_v2", card, device, ctypes.byref(pcie)):
            return None
        return (
            f"{pcie.domain & 0xFFFF:04x}:{pcie.bdf_busid & 0xFF:02x}:"
            f"{pcie.bdf_deviceid & 0x1F:02x}.{pcie.bdf_funcid & 0x7}"
        )

    def _error_codes(self, card: int, device: int) -> tuple[tuple[int, ...], bool]:
        count = ctypes.c_int()
        codes = (ctypes.c_uint * MAX_ERROR_CODES)()
        args = (ctypes.byref(count), codes, ctypes.c_uint(MAX_ERROR_CODES))
        if self._status("dcmi_get_device_errorcode_v2", card, device, *args) != SUCCESS:
            return (), False
        return tuple(int(code) for code in codes[: max(0, min(count.value, MAX_ERROR_CODES))]), True

    def _memory(self, card: int, device: int) -> tuple[int | None, int | None]:
        """HBM where the chip has it (910), else its DDR (310): total and used MiB."""
        hbm = _HbmInfo()
        if self._status("dcmi_get_device_hbm_info", card, device, ctypes.byref(hbm)) == SUCCESS:
            return int(hbm.memory_size), int(hbm.memory_usage)
        ddr = _MemoryInfo()
        if self._status("dcmi_get_device_memory_info_v3", card, device, ctypes.byref(ddr)):
            return None, None
        return int(ddr.memory_size), int(ddr.memory_size - ddr.memory_available)

    def _int(self, call: str, card: int, device: int, scale: float) -> float | None:
        value = ctypes.c_int()
        if self._status(call, card, device, ctypes.byref(value)) != SUCCESS or value.value < 0:
            return None
        return round(value.value * scale, 3)

    def _utilization(self, card: int, device: int) -> float | None:
        rate = ctypes.c_uint()
        args = (ctypes.c_int(UTILIZATION_AICORE), ctypes.byref(rate))
        if self._status("dcmi_get_device_utilization_rate", card, device, *args) != SUCCESS:
            return None
        return float(rate.value)

    def _status(self, call: str, *args: object) -> int:
        function = getattr(self._lib, call)
        function.restype = ctypes.c_int
        return int(function(*args))

    def _call(self, call: str, *args: object) -> None:
        status = self._status(call, *args)
        if status != SUCCESS:
            raise DcmiError(call, status)


open_library: Opened[Dcmi] = Opened(Dcmi)


def usable(root: HostRoot) -> Path | None:
    """The library under `root` when it loads, initialises and lists its devices; else None."""
    return library_usable(
        find_library(root), lambda path: open_library(path).chips(), (OSError, DcmiError)
    )
