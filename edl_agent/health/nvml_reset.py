"""Evidence that an NVIDIA GPU was reset, read through NVML.

A GPU reset (`nvidia-smi --gpu-reset`, a driver reload, a reboot) leaves marks NVML shows:

- the volatile ECC counters start again at 0 (aggregate counters keep the GPU's history);
- a row remapping (Ampere and later) that was pending is applied, so it is no longer pending;
- the GPU recovery action the driver reports (`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`, drivers
  R570 and later) goes from GPU_RESET / DRAIN_AND_RESET / BUS_RESET back to NONE.

A baseline of these is read when a GPU is quarantined; a later reading that went back on any of
them is a reset. A GPU whose baseline shows none of them (no ECC errors, nothing pending, a driver
that does not report recovery actions) gives no evidence: it waits for the agent's own reset
(`health.remediation`) or an operator's release, and its condition says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import pynvml

from edl_agent.devices.hostroot import HostRoot
from edl_agent.devices.nvidia import find_library, nvml_session

T = TypeVar("T")

Baseline = Mapping[str, int | None]

ECC_CORRECTED = "ecc_corrected"
ECC_UNCORRECTED = "ecc_uncorrected"
REMAP_PENDING = "remap_pending"
RECOVERY_ACTION = "recovery_action"
LOST = "lost"
RECOVERY_ACTION_FIELD = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
ACTION_NONE = 0
ACTIONS_A_RESET_CLEARS = frozenset({1, 4, 6})  # GPU_RESET, DRAIN_AND_RESET, BUS_RESET


def was_reset(before: Baseline, after: Baseline) -> bool:
    """Whether the GPU was reset between the two readings (pure)."""
    if after.get(LOST):
        return False
    for counter in (ECC_CORRECTED, ECC_UNCORRECTED):
        old, new = before.get(counter), after.get(counter)
        if old is not None and new is not None and new < old:
            return True
    if before.get(REMAP_PENDING) and after.get(REMAP_PENDING) == 0:
        return True
    action = before.get(RECOVERY_ACTION)
    return action in ACTIONS_A_RESET_CLEARS and after.get(RECOVERY_ACTION) == ACTION_NONE


def observable(baseline: Baseline) -> bool:
    """Whether a reset of a GPU with this baseline would show in a later reading."""
    return bool(
        baseline.get(ECC_CORRECTED)
        or baseline.get(ECC_UNCORRECTED)
        or baseline.get(REMAP_PENDING)
        or baseline.get(RECOVERY_ACTION) in ACTIONS_A_RESET_CLEARS
    )


def read_baselines(root: HostRoot, gpu_uuids: Iterable[str]) -> dict[str, Baseline]:
    """A reading per GPU uuid (physical GPUs); {} when NVML cannot be used at all. A GPU NVML no
    longer finds or that is lost reads as `{"lost": 1}`."""
    wanted = list(dict.fromkeys(gpu_uuids))
    library = find_library(root)
    if not wanted or library is None:
        return {}
    readings: dict[str, Baseline] = {}
    try:
        with nvml_session(library):
            for uuid in wanted:
                readings[uuid] = _reading(uuid)
    except (OSError, pynvml.NVMLError):
        return {}
    return readings


def _reading(uuid: str) -> Baseline:
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        pynvml.nvmlDeviceGetIndex(handle)  # a lost GPU fails here
    except pynvml.NVMLError_Uninitialized:
        raise
    except pynvml.NVMLError:
        return {LOST: 1}
    volatile = pynvml.NVML_VOLATILE_ECC
    corrected = _query(
        pynvml.nvmlDeviceGetTotalEccErrors,
        handle,
        pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
        volatile,
    )
    uncorrected = _query(
        pynvml.nvmlDeviceGetTotalEccErrors,
        handle,
        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        volatile,
    )
    rows = _query(pynvml.nvmlDeviceGetRemappedRows, handle)
    return {
        ECC_CORRECTED: int(corrected) if corrected is not None else None,
        ECC_UNCORRECTED: int(uncorrected) if uncorrected is not None else None,
        REMAP_PENDING: int(bool(rows[2])) if rows is not None else None,
        RECOVERY_ACTION: recovery_action(handle),
    }


def recovery_action(handle: Any) -> int | None:
    """The recovery action the driver says the GPU needs (R570 and later), or None."""
    values = _query(pynvml.nvmlDeviceGetFieldValues, handle, [RECOVERY_ACTION_FIELD])
    if values is None or values[0].nvmlReturn != pynvml.NVML_SUCCESS:
        return None
    return int(values[0].value.uiVal)


def _query(query: Callable[..., T], *args: Any) -> T | None:
    """The answer, or None where this GPU or driver cannot give one."""
    try:
        return query(*args)
    except pynvml.NVMLError_Uninitialized:
        raise
    except pynvml.NVMLError:
        return None
