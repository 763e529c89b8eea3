"""NVIDIA health from NVML events: XID critical errors, ECC errors and GPUs falling off the bus.

`NvmlWatcher` is a supervised part: it holds an NVML session on the host root's library,
registers every GPU for XID critical and single/double-bit ECC events, and waits in
nvmlEventSetWait (which releases the GIL) with a short timeout so that the stop is noticed. Each
event becomes one `HealthEvent` handed to `on_event` on the part's thread:

- XID `n` on a GPU: reason `XID<n>`, level `classify_xid(n)`, `code` n. On a MIG-enabled GPU,
  NVML names the GPU and compute instance the error is attributed to; the event then carries
  that MIG device's uuid, and the GPU's uuid when NVML gives no instance (0xFFFFFFFF).
- double-bit ECC: reason `ECC_DBE`, level `classify_xid(48)` (the driver reports a DBE as XID
  48 as well, so both come from one table). Single-bit errors are only counted
  (`single_bit_errors`, by device id).
- a GPU that answers NVML_ERROR_GPU_IS_LOST (probed after every XID, and for every GPU when a
  wait itself reports a lost GPU): reason `GPU_LOST`, level NODE_FATAL; `cleared` once it
  answers again. A GPU already lost when the watcher starts has no readable uuid: unless this
  watcher saw it earlier, that event has `device_id` None and names the GPU index in `detail`.
- the monitor itself failing: reason `NVML_INIT_FAILED` (library missing, nvmlInit failing) or
  `NVML_EVENT_LOOP_FAILED` (event set, registration or wait failing), `device_id` None, level
  NODE_FATAL, once per reason while it lasts; the failure ends the part, which the supervisor
  counts and runs again after its backoff; each reason is reported `cleared` once a wait
  succeeds again.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pynvml
import structlog

from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.model import Vendor
from edl_agent.devices.nvidia import LIBRARY, find_library, nvml_session
from edl_agent.health.model import HealthEvent, Level

NVML_INIT_FAILED = "NVML_INIT_FAILED"
NVML_EVENT_LOOP_FAILED = "NVML_EVENT_LOOP_FAILED"
GPU_LOST = "GPU_LOST"
ECC_DBE = "ECC_DBE"
XID_DOUBLE_BIT_ECC = 48
NO_INSTANCE = 0xFFFFFFFF
WANTED_EVENTS = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypeSingleBitEccError
)
LOST_PROBE_SECONDS = 1.0


class MonitorFailure(Exception):
    """NVML cannot be used: `reason` is the health event's."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = " ".join(detail.split())


@dataclass
class _Gpu:
    index: int
    uuid: str
    handle: Any
    migs: dict[tuple[int, int], str] = field(default_factory=dict)  # (GI, CI) -> MIG uuid


class NvmlWatcher:
    """Turns NVML events of the GPUs under `root` into HealthEvents: a supervised part, ready
    while its event loop runs."""

    name = "nvml-watch"

    def __init__(
        self,
        root: HostRoot,
        on_event: Callable[[HealthEvent], None],
        classify_xid: Callable[[int], Level],
        *,
        wait_ms: int = 5000,
    ) -> None:
        self.root = root
        self.on_event = on_event
        self.classify_xid = classify_xid
        self.wait_ms = wait_ms
        self.single_bit_errors: Counter[str] = Counter()
        self._ready = False
        self._failing: set[str] = set()
        self._uuids: dict[int, str] = {}  # by GPU index; outlives sessions to name lost GPUs
        self._lost: set[int] = set()
        self._log = structlog.get_logger().bind(vendor=Vendor.NVIDIA.value, part=self.name)

    @property
    def ready(self) -> bool:
        """True while the event loop runs (a wait has succeeded since the last (re)start)."""
        return self._ready

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        """One NVML session, until `stop` (seen between waits: NVML's cannot be cut short). A
        failure is reported as a health event (once per reason while it lasts) and raised: the
        supervisor runs the watcher again after its backoff."""
        try:
            self._session(stop, ready)
        except MonitorFailure as failure:
            self._failed(failure.reason, failure.detail)
            raise
        except Exception as exc:
            self._failed(NVML_EVENT_LOOP_FAILED, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._ready = False

    def _session(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        library = find_library(self.root)
        if library is None:
            raise MonitorFailure(NVML_INIT_FAILED, f"{LIBRARY} not found under {self.root.root}")
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(nvml_session(library))
            except OSError as exc:
                raise MonitorFailure(NVML_INIT_FAILED, f"cannot load {library}: {exc}") from exc
            except pynvml.NVMLError as exc:
                raise MonitorFailure(NVML_INIT_FAILED, f"nvmlInit ({library}): {exc}") from exc
            try:
                event_set = pynvml.nvmlEventSetCreate()
            except pynvml.NVMLError as exc:
                raise MonitorFailure(NVML_EVENT_LOOP_FAILED, f"nvmlEventSetCreate: {exc}") from exc
            stack.callback(_free, event_set, self._log)
            self._loop(event_set, self._register(event_set), stop, ready)

    def _register(self, event_set: Any) -> dict[int, _Gpu]:
        """Watched GPUs by handle address."""
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as exc:
            raise MonitorFailure(NVML_EVENT_LOOP_FAILED, f"nvmlDeviceGetCount: {exc}") from exc
        self._lost &= set(range(count))
        gpus: dict[int, _Gpu] = {}
        for index in range(count):
            self._watch(index, event_set, gpus)
        return gpus

    def _watch(self, index: int, event_set: Any, gpus: dict[int, _Gpu]) -> None:
        """Register GPU `index` for events and add it to `gpus`; a lost GPU is only marked."""
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpu = _Gpu(index, _text(pynvml.nvmlDeviceGetUUID(handle)), handle)
        except pynvml.NVMLError_GpuIsLost as exc:
            self._mark_lost(index, str(exc))
            return
        except pynvml.NVMLError as exc:
            self._log.warning("GPU not watched", index=index, error=str(exc))
            return
        self._uuids[index] = gpu.uuid
        try:
            wanted = int(pynvml.nvmlDeviceGetSupportedEventTypes(handle)) & WANTED_EVENTS
            if wanted:
                pynvml.nvmlDeviceRegisterEvents(handle, wanted, event_set)
            else:
                self._log.warning("GPU reports no health events", gpu=gpu.uuid)
        except pynvml.NVMLError_GpuIsLost as exc:
            self._mark_lost(index, str(exc))
            return
        except pynvml.NVMLError as exc:
            self._log.warning("GPU events not registered", gpu=gpu.uuid, error=str(exc))
            return
        gpu.migs = _mig_instances(handle)
        gpus[_address(handle)] = gpu
        self._mark_found(index)

    def _loop(
        self,
        event_set: Any,
        gpus: dict[int, _Gpu],
        stop: threading.Event,
        ready: Callable[[], None],
    ) -> None:
        next_probe = time.monotonic() + LOST_PROBE_SECONDS
        while not stop.is_set():
            try:
                # The first wait returns at once: it shows whether the loop works.
                data = pynvml.nvmlEventSetWait(event_set, self.wait_ms if self._ready else 0)
            except pynvml.NVMLError_Timeout:
                data = None
            except pynvml.NVMLError_GpuIsLost:
                # NVML names no GPU here: find which, and do not spin while it stays lost.
                self._confirm_running(ready)
                self._probe(gpus.values())
                stop.wait(self.wait_ms / 1000)
                continue
            except pynvml.NVMLError as exc:
                raise MonitorFailure(NVML_EVENT_LOOP_FAILED, f"nvmlEventSetWait: {exc}") from exc
            self._confirm_running(ready)
            if data is not None:
                self._handle(data, gpus)
            if self._lost and time.monotonic() >= next_probe:
                next_probe = time.monotonic() + LOST_PROBE_SECONDS
                self._probe([gpu for gpu in gpus.values() if gpu.index in self._lost])
                watched = {gpu.index for gpu in gpus.values()}
                for index in sorted(self._lost - watched):  # lost before it could be registered
                    self._watch(index, event_set, gpus)

    def _handle(self, data: Any, gpus: dict[int, _Gpu]) -> None:
        at = time.monotonic()
        gpu = gpus.get(_address(data.device))
        if gpu is None:
            self._log.warning("event for an unwatched device", event_type=int(data.eventType))
            return
        event_type = int(data.eventType)
        if event_type == pynvml.nvmlEventTypeXidCriticalError:
            code = int(data.eventData)
            device_id = self._xid_device(gpu, int(data.gpuInstanceId), int(data.computeInstanceId))
            self._emit(
                HealthEvent(
                    vendor=Vendor.NVIDIA,
                    device_id=device_id,
                    reason=f"XID{code}",
                    level=self.classify_xid(code),
                    at=at,
                    detail=f"XID {code} on GPU {gpu.index}",
                    code=code,
                )
            )
            self._probe([gpu])
        elif event_type == pynvml.nvmlEventTypeDoubleBitEccError:
            self._emit(
                HealthEvent(
                    vendor=Vendor.NVIDIA,
                    device_id=gpu.uuid,
                    reason=ECC_DBE,
                    level=self.classify_xid(XID_DOUBLE_BIT_ECC),
                    at=at,
                    detail=f"double-bit ECC error on GPU {gpu.index}",
                )
            )
        elif event_type == pynvml.nvmlEventTypeSingleBitEccError:
            self.single_bit_errors[gpu.uuid] += 1

    def _xid_device(self, gpu: _Gpu, gpu_instance: int, compute_instance: int) -> str:
        if NO_INSTANCE in (gpu_instance, compute_instance):
            return gpu.uuid
        key = (gpu_instance, compute_instance)
        if key not in gpu.migs:  # MIG layout changed since registration
            gpu.migs = _mig_instances(gpu.handle)
        return gpu.migs.get(key, gpu.uuid)

    def _probe(self, gpus: Iterable[_Gpu]) -> None:
        """Mark GPUs lost or found by whether they answer a query that reaches the device."""
        for gpu in gpus:
            try:
                pynvml.nvmlDeviceGetTemperature(gpu.handle, pynvml.NVML_TEMPERATURE_GPU)
            except pynvml.NVMLError_GpuIsLost as exc:
                self._mark_lost(gpu.index, str(exc))
                continue
            except pynvml.NVMLError:
                pass  # no sensor, or busy: the GPU still answers
            self._mark_found(gpu.index)

    def _mark_lost(self, index: int, error: str) -> None:
        if index in self._lost:
            return
        self._lost.add(index)
        uuid = self._uuids.get(index)
        detail = f"GPU {index}: {error}" + ("" if uuid else " (uuid unknown)")
        self._log.error("GPU lost", gpu=uuid, index=index, error=error)
        self._emit(
            HealthEvent(
                vendor=Vendor.NVIDIA,
                device_id=uuid,
                reason=GPU_LOST,
                level=Level.NODE_FATAL,
                at=time.monotonic(),
                detail=detail,
            )
        )

    def _mark_found(self, index: int) -> None:
        if index not in self._lost:
            return
        self._lost.discard(index)
        uuid = self._uuids.get(index)
        self._log.info("lost GPU answers again", gpu=uuid, index=index)
        self._emit(
            HealthEvent(
                vendor=Vendor.NVIDIA,
                device_id=uuid,
                reason=GPU_LOST,
                level=Level.NODE_FATAL,
                at=time.monotonic(),
                detail=f"GPU {index} answers again",
                cleared=True,
            )
        )

    def _confirm_running(self, ready: Callable[[], None]) -> None:
        if self._ready:
            return
        self._ready = True
        ready()
        self._log.info("nvml event loop running")
        for reason in sorted(self._failing):
            self._emit(
                HealthEvent(
                    vendor=Vendor.NVIDIA,
                    device_id=None,
                    reason=reason,
                    level=Level.NODE_FATAL,
                    at=time.monotonic(),
                    detail="NVML event loop running again",
                    cleared=True,
                )
            )
        self._failing.clear()

    def _failed(self, reason: str, detail: str) -> None:
        if reason in self._failing:
            return
        self._failing.add(reason)
        self._emit(
            HealthEvent(
                vendor=Vendor.NVIDIA,
                device_id=None,
                reason=reason,
                level=Level.NODE_FATAL,
                at=time.monotonic(),
                detail=detail,
            )
        )

    def _emit(self, event: HealthEvent) -> None:
        try:
            self.on_event(event)
        except Exception:
            self._log.exception("health event handler failed", reason=event.reason)


def _free(event_set: Any, log: Any) -> None:
    try:
        pynvml.nvmlEventSetFree(event_set)
    except pynvml.NVMLError as exc:
        log.warning("nvmlEventSetFree failed", error=str(exc))


def _mig_instances(handle: Any) -> dict[tuple[int, int], str]:
    """(GPU instance id, compute instance id) -> MIG uuid; empty without MIG."""
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
        if current != pynvml.NVML_DEVICE_MIG_ENABLE:
            return {}
        slots = int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))
    except pynvml.NVMLError:
        return {}
    instances: dict[tuple[int, int], str] = {}
    for slot in range(slots):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            key = (
                int(pynvml.nvmlDeviceGetGpuInstanceId(mig)),
                int(pynvml.nvmlDeviceGetComputeInstanceId(mig)),
            )
            instances[key] = _text(pynvml.nvmlDeviceGetUUID(mig))
        except pynvml.NVMLError:
            continue
    return instances


def _address(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
