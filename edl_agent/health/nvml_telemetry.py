"""NVIDIA telemetry for scrapes: temperature, power, utilization, memory and ECC counts per GPU,
and memory per MIG device. Per GPU also the readings that warn before it fails: clocks-event
(throttle) reasons, the PCIe link against its maximum, row remapping pending or failed, and the
recovery action the driver asks for.

`NvmlTelemetry` keeps one NVML session open between reads, because nvmlInit on a real node can
take far longer than a scrape should (it shares the library with the watcher and discovery; see
`nvml_session`). A query a GPU cannot answer leaves its field None; a GPU that is lost keeps its
uuid (when it was seen before) with every field None.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import pynvml
import structlog

from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Vendor
from edl_agent.devices.nvidia import find_library, nvml_session
from edl_agent.health.model import DeviceTelemetry
from edl_agent.health.nvml_reset import recovery_action

MIB = 1 << 20
T = TypeVar("T")


class NvmlTelemetry:
    """`DeviceTelemetry` of the GPUs under `root`; thread-safe; `close()` ends the session."""

    def __init__(self, root: HostRoot) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._session: contextlib.ExitStack | None = None
        self._uuids: dict[int, str] = {}  # by GPU index, to name a GPU that got lost
        self._log = structlog.get_logger().bind(vendor=Vendor.NVIDIA.value, part="nvml-telemetry")

    def read(self) -> list[DeviceTelemetry]:
        """GPUs in index order, each followed by its MIG devices; [] when NVML is unavailable."""
        with self._lock:
            if self._session is None and not self._open():
                return []
            try:
                return self._read()
            except pynvml.NVMLError as exc:
                # The library as a whole stopped answering: start afresh on the next read.
                self._log.warning("nvml telemetry failed", error=str(exc))
                self._close()
                return []

    def close(self) -> None:
        with self._lock:
            self._close()

    def __enter__(self) -> NvmlTelemetry:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _open(self) -> bool:
        library = find_library(self.root)
        if library is None:
            return False
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(nvml_session(library))
        except (OSError, pynvml.NVMLError) as exc:
            self._log.debug("nvml telemetry unavailable", library=library, error=str(exc))
            return False
        self._session = stack
        return True

    def _close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def _read(self) -> list[DeviceTelemetry]:
        figures: list[DeviceTelemetry] = []
        for index in range(int(pynvml.nvmlDeviceGetCount())):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            except pynvml.NVMLError:
                if index in self._uuids:
                    figures.append(DeviceTelemetry(device_id=self._uuids[index]))
                continue
            self._uuids[index] = uuid
            figures.append(_gpu(uuid, handle))
            figures.extend(_migs(handle))
        return figures


def read_nvidia_telemetry(root: HostRoot) -> list[DeviceTelemetry]:
    """One read in a session of its own (see NvmlTelemetry to keep the session between reads)."""
    with NvmlTelemetry(root) as telemetry:
        return telemetry.read()


def _gpu(uuid: str, handle: Any) -> DeviceTelemetry:
    temperature = _query(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU)
    power_mw = _query(pynvml.nvmlDeviceGetPowerUsage, handle)
    utilization = _query(pynvml.nvmlDeviceGetUtilizationRates, handle)
    memory = _query(pynvml.nvmlDeviceGetMemoryInfo, handle)
    rows = _query(pynvml.nvmlDeviceGetRemappedRows, handle)  # Ampere and later
    return DeviceTelemetry(
        device_id=uuid,
        temperature_c=float(temperature) if temperature is not None else None,
        power_w=power_mw / 1000 if power_mw is not None else None,
        utilization_percent=float(utilization.gpu) if utilization is not None else None,
        memory_used_mib=memory.used / MIB if memory is not None else None,
        memory_total_mib=memory.total / MIB if memory is not None else None,
        ecc_corrected_total=_ecc(handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
        ecc_uncorrected_total=_ecc(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
        clock_event_reasons=_clock_event_reasons(handle),
        pcie_generation=_number(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
        pcie_generation_max=_pcie_generation_max(handle),
        pcie_width=_number(pynvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
        pcie_width_max=_number(pynvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
        rows_pending=int(bool(rows[2])) if rows is not None else None,
        rows_failed=int(bool(rows[3])) if rows is not None else None,
        recovery_action=recovery_action(handle),
    )


def _ecc(handle: Any, error_type: int) -> int | None:
    # Volatile counters move as errors happen; aggregate ones may only be updated at unload.
    count = _query(pynvml.nvmlDeviceGetTotalEccErrors, handle, error_type, pynvml.NVML_VOLATILE_ECC)
    return int(count) if count is not None else None


def _clock_event_reasons(handle: Any) -> int | None:
    try:
        return int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
    except pynvml.NVMLError_FunctionNotFound:
        pass  # a driver before R535 knows the query by its older name only
    except pynvml.NVMLError_Uninitialized:
        raise
    except pynvml.NVMLError:
        return None
    return _number(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)


def _pcie_generation_max(handle: Any) -> int | None:
    """The most the link can train at with this GPU in this slot: a GPU in a slower slot is not
    a downgraded one. The GPU's own maximum when the driver does not say."""
    found = _number(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, handle)
    if found is None:
        found = _number(pynvml.nvmlDeviceGetGpuMaxPcieLinkGeneration, handle)
    return found


def _number(query: Callable[[Any], object], handle: Any) -> int | None:
    value = _query(query, handle)
    return int(value) if isinstance(value, int) else None


def _migs(handle: Any) -> list[DeviceTelemetry]:
    mode = _query(pynvml.nvmlDeviceGetMigMode, handle)
    if mode is None or mode[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
        return []
    slots = _query(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle) or 0
    figures = []
    for slot in range(int(slots)):
        mig = _query(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)
        uuid = _query(pynvml.nvmlDeviceGetUUID, mig) if mig is not None else None
        if uuid is None:
            continue
        memory = _query(pynvml.nvmlDeviceGetMemoryInfo, mig)
        figures.append(
            DeviceTelemetry(
                device_id=_text(uuid),
                memory_used_mib=memory.used / MIB if memory is not None else None,
                memory_total_mib=memory.total / MIB if memory is not None else None,
            )
        )
    return figures


def _query(query: Callable[..., T], *args: Any) -> T | None:
    """The answer, or None where this device, driver or moment cannot give one."""
    try:
        return query(*args)
    except pynvml.NVMLError_Uninitialized:
        raise  # the session is gone: not a per-device gap
    except pynvml.NVMLError:
        return None


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
