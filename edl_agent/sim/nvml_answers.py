"""Every NVML answer edl-agent's NVIDIA code reads, as JSON-shaped data, and the fake library's
data file made from it.

`read_all()` runs inside an NVML session. Each query is asked on its own: one that fails is
kept as `{"error": "<NVML's message>"}` in place of its answer, so a recording shows which calls
a driver or GPU refuses instead of losing the GPU.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import pynvml

from edl_agent.devices.nvidia import sysfs_bus_id
from edl_agent.devices.nvidia_topology import CPU_SET_WORDS, NODE_SET_WORDS, mask_bits
from edl_agent.devices.topology import format_cpulist
from edl_agent.health.nvml_reset import RECOVERY_ACTION_FIELD
from edl_agent.health.nvml_watch import WANTED_EVENTS
from edl_agent.sim.inject import MAX_PCIE_GENERATION, MAX_PCIE_WIDTH
from edl_agent.sim.nvidia_tree import data_record as _record

MIB = 1 << 20
EVENT_WAIT_MS = 200
ECC_COUNTERS = {
    "volatile_corrected": ("NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_VOLATILE_ECC"),
    "volatile_uncorrected": ("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC"),
    "aggregate_corrected": ("NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_AGGREGATE_ECC"),
    "aggregate_uncorrected": ("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_AGGREGATE_ECC"),
}


class Scrub(Protocol):
    def gpu_uuid(self, real: str, index: int) -> str: ...
    def mig_uuid(self, real: str, gpu: int, index: int) -> str: ...
    def serial(self, real: str, index: int) -> str: ...


def ask(query: Callable[..., Any], *args: Any) -> Any:
    """The answer as JSON-shaped data, or {"error": ...}."""
    try:
        return _plain(query(*args))
    except pynvml.NVMLError as exc:
        return {"error": str(exc)}


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, ctypes.Structure):
        return {name: _plain(getattr(value, name)) for name, *_ in value._fields_}
    if isinstance(value, ctypes.Array):
        return [_plain(item) for item in value]
    return value


def failed(answer: Any) -> bool:
    return isinstance(answer, dict) and set(answer) == {"error"}


def read_all() -> dict[str, Any]:
    system = {
        "driver_version": ask(pynvml.nvmlSystemGetDriverVersion),
        "nvml_version": ask(pynvml.nvmlSystemGetNVMLVersion),
        "cuda_driver_version": ask(pynvml.nvmlSystemGetCudaDriverVersion),
    }
    count = ask(pynvml.nvmlDeviceGetCount)
    gpus = [_gpu(index) for index in range(count)] if isinstance(count, int) else []
    return {"system": system, "device_count": count, "gpus": gpus, "events": _events(count)}


def _gpu(index: int) -> dict[str, Any]:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    gpu: dict[str, Any] = {
        "index": index,
        "uuid": ask(pynvml.nvmlDeviceGetUUID, handle),
        "name": ask(pynvml.nvmlDeviceGetName, handle),
        "serial": ask(pynvml.nvmlDeviceGetSerial, handle),
        "minor": ask(pynvml.nvmlDeviceGetMinorNumber, handle),
        "brand": ask(pynvml.nvmlDeviceGetBrand, handle),
        "architecture": ask(pynvml.nvmlDeviceGetArchitecture, handle),
        "compute_capability": ask(pynvml.nvmlDeviceGetCudaComputeCapability, handle),
        "memory": ask(pynvml.nvmlDeviceGetMemoryInfo, handle),
        "pci": ask(pynvml.nvmlDeviceGetPciInfo, handle),
        "mig_mode": ask(pynvml.nvmlDeviceGetMigMode, handle),
        "max_mig_devices": ask(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle),
        "enforced_power_limit_mw": ask(pynvml.nvmlDeviceGetEnforcedPowerLimit, handle),
        "temperature_c": ask(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU),
        "power_usage_mw": ask(pynvml.nvmlDeviceGetPowerUsage, handle),
        "utilization": ask(pynvml.nvmlDeviceGetUtilizationRates, handle),
        "ecc_mode": ask(pynvml.nvmlDeviceGetEccMode, handle),
        "ecc_errors": {
            name: ask(
                pynvml.nvmlDeviceGetTotalEccErrors,
                handle,
                getattr(pynvml, kind),
                getattr(pynvml, counter),
            )
            for name, (kind, counter) in ECC_COUNTERS.items()
        },
        "remapped_rows": ask(pynvml.nvmlDeviceGetRemappedRows, handle),
        "clock_event_reasons": _clock_event_reasons(handle),
        "pcie_link": {
            "generation": ask(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
            "generation_max": ask(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
            "gpu_generation_max": ask(pynvml.nvmlDeviceGetGpuMaxPcieLinkGeneration, handle),
            "width": ask(pynvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
            "width_max": ask(pynvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
        },
        "recovery_action": _recovery_action(handle),
        "supported_event_types": ask(pynvml.nvmlDeviceGetSupportedEventTypes, handle),
        "cpu_affinity": _bits(ask(pynvml.nvmlDeviceGetCpuAffinity, handle, CPU_SET_WORDS)),
        "memory_affinity": _bits(
            ask(
                pynvml.nvmlDeviceGetMemoryAffinity,
                handle,
                NODE_SET_WORDS,
                pynvml.NVML_AFFINITY_SCOPE_NODE,
            )
        ),
        "nvlinks": _nvlinks(handle),
    }
    pci = gpu["pci"]
    if isinstance(pci, dict) and isinstance(pci.get("busId"), str):
        gpu["bus_id"] = pci["busId"]
    mode = gpu["mig_mode"]
    if isinstance(mode, list) and mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE:
        gpu["migs"] = list(_migs(handle, gpu["max_mig_devices"]))
    return gpu


def _bits(answer: Any) -> Any:
    return answer if failed(answer) else sorted(mask_bits(answer))


def _clock_event_reasons(handle: Any) -> Any:
    reasons = ask(pynvml.nvmlDeviceGetCurrentClocksEventReasons, handle)
    if failed(reasons):  # a driver before R535 knows the older name only
        reasons = ask(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
    return reasons


def _recovery_action(handle: Any) -> Any:
    try:
        value = pynvml.nvmlDeviceGetFieldValues(handle, [RECOVERY_ACTION_FIELD])[0]
    except pynvml.NVMLError as exc:
        return {"error": str(exc)}
    if value.nvmlReturn != pynvml.NVML_SUCCESS:
        return {"error": str(pynvml.NVMLError(value.nvmlReturn))}
    return int(value.value.uiVal)


def _nvlinks(handle: Any) -> dict[str, Any]:
    """Link states in order until NVML says the GPU has no more; remote ends of active links."""
    states: list[Any] = []
    remotes: dict[str, str] = {}
    stopped_by = None
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        state = ask(pynvml.nvmlDeviceGetNvLinkState, handle, link)
        if failed(state):
            stopped_by = state["error"]
            break
        states.append(state)
        if state == pynvml.NVML_FEATURE_ENABLED:
            remote = ask(pynvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
            if not failed(remote):
                remotes[str(link)] = remote["busId"]
    return {"states": states, "remotes": remotes, "stopped_by": stopped_by}


def _migs(handle: Any, slots: Any) -> Iterator[dict[str, Any]]:
    for index in range(slots if isinstance(slots, int) else 0):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except pynvml.NVMLError:
            continue
        yield {
            "index": index,
            "uuid": ask(pynvml.nvmlDeviceGetUUID, mig),
            "name": ask(pynvml.nvmlDeviceGetName, mig),
            "memory": ask(pynvml.nvmlDeviceGetMemoryInfo, mig),
            "gpu_instance": ask(pynvml.nvmlDeviceGetGpuInstanceId, mig),
            "compute_instance": ask(pynvml.nvmlDeviceGetComputeInstanceId, mig),
        }


def _events(count: Any) -> dict[str, Any]:
    """What the health watcher's calls answer: an event set, registration, one short wait."""
    try:
        events = pynvml.nvmlEventSetCreate()
    except pynvml.NVMLError as exc:
        return {"create": {"error": str(exc)}}
    try:
        registered = {}
        for index in range(count if isinstance(count, int) else 0):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            supported = ask(pynvml.nvmlDeviceGetSupportedEventTypes, handle)
            wanted = WANTED_EVENTS & supported if isinstance(supported, int) else 0
            registered[str(index)] = ask(pynvml.nvmlDeviceRegisterEvents, handle, wanted, events)
        try:
            event = pynvml.nvmlEventSetWait(events, EVENT_WAIT_MS)
            wait: Any = {"event_type": event.eventType, "event_data": event.eventData}
        except pynvml.NVMLError_Timeout:
            wait = {"quiet_ms": EVENT_WAIT_MS}  # what a healthy node answers
        except pynvml.NVMLError as exc:
            wait = {"error": str(exc)}
        return {"create": None, "registered": registered, "wait": wait}
    finally:
        pynvml.nvmlEventSetFree(events)


def failures(answers: Any, path: str = "") -> Iterator[str]:
    """The paths of the queries that failed (`gpus.0.serial`)."""
    if failed(answers):
        yield path
    elif isinstance(answers, dict):
        for key, value in answers.items():
            yield from failures(value, f"{path}.{key}" if path else str(key))
    elif isinstance(answers, list):
        for index, value in enumerate(answers):
            yield from failures(value, f"{path}.{index}" if path else str(index))


def fake_data(answers: dict[str, Any], scrub: Scrub, *, numa_of: Callable[[str], Any]) -> str:
    """The fake libnvidia-ml.so.1's data file (format in fake_nvml.c) that answers as recorded."""
    system = answers["system"]
    lines = [
        "# fake NVML data, recorded from a real node by `edl-agent simulate record`",
        _record("format", version=1),
        _record(
            "system",
            driver=system["driver_version"],
            nvml=system["nvml_version"],
            cuda=system["cuda_driver_version"],
        ),
    ]
    for gpu in answers["gpus"]:
        lines.extend(_gpu_records(gpu, scrub, numa_of))
    return "\n".join(lines) + "\n"


def _gpu_records(gpu: dict[str, Any], scrub: Scrub, numa_of: Callable[[str], Any]) -> list[str]:
    index = gpu["index"]
    fields: dict[str, Any] = {
        "index": index,
        "uuid": scrub.gpu_uuid(gpu["uuid"], index),
        "name": gpu["name"],
        "memory_mib": gpu["memory"]["total"] // MIB,
        "bus_id": gpu["bus_id"],
    }
    optional = {
        "minor": gpu["minor"],
        "compute_capability": _capability(gpu["compute_capability"]),
        "architecture": gpu["architecture"],
        "brand": gpu["brand"],
        "power_limit_w": _watts(gpu["enforced_power_limit_mw"]),
    }
    fields.update({key: value for key, value in optional.items() if not failed(value)})
    numa = numa_of(sysfs_bus_id(gpu["bus_id"]))
    if numa is not None:
        fields["numa_node"] = numa
    if not failed(gpu["serial"]):
        fields["serial"] = scrub.serial(gpu["serial"], index)
    fields["mig"] = _mig_mode(gpu["mig_mode"])
    links = gpu["nvlinks"]
    if links["states"]:
        fields["nvlinks"] = len(links["states"])
    if not failed(gpu["cpu_affinity"]) and gpu["cpu_affinity"]:
        fields["cpus"] = format_cpulist(gpu["cpu_affinity"])
    fields.update(_pcie_maxima(gpu.get("pcie_link", {})))  # recordings before it lack it
    records = [_record("gpu", **fields)]
    for mig in gpu.get("migs", []):
        records.append(
            _record(
                "mig",
                gpu=index,
                index=mig["index"],
                uuid=scrub.mig_uuid(mig["uuid"], index, mig["index"]),
                name=mig["name"],
                memory_mib=mig["memory"]["total"] // MIB,
                gpu_instance=mig["gpu_instance"],
                compute_instance=mig["compute_instance"],
            )
        )
    for link, remote in sorted(links["remotes"].items(), key=lambda item: int(item[0])):
        records.append(_record("nvlink", gpu=index, link=link, remote=remote))
    return records


def _pcie_maxima(link: dict[str, Any]) -> dict[str, int]:
    """The data file's pcie_gen_max / pcie_width_max: the most the recorded GPU's link could
    reach in its slot (the replayed link trains at it until a pcie fault line)."""
    generation = link.get("generation_max")
    if not isinstance(generation, int):
        generation = link.get("gpu_generation_max")
    found = {}
    for key, value, highest in (
        ("pcie_gen_max", generation, MAX_PCIE_GENERATION),
        ("pcie_width_max", link.get("width_max"), MAX_PCIE_WIDTH),
    ):
        if isinstance(value, int) and 1 <= value <= highest:
            found[key] = value
    return found


def _capability(answer: Any) -> Any:
    return answer if failed(answer) else f"{answer[0]}.{answer[1]}"


def _watts(answer: Any) -> Any:
    return answer if failed(answer) else int(answer) // 1000


def _mig_mode(answer: Any) -> str:
    if failed(answer):
        return "unsupported"
    return "enabled" if answer[0] == pynvml.NVML_DEVICE_MIG_ENABLE else "disabled"
