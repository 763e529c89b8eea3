"""What a vendor's fault report means for scheduling: pure, table-driven, overridable.

Every table maps a vendor's own vocabulary (an NVIDIA XID, an Ascend fault code, a health word)
to a `Level`. Operators override single entries through `HealthSettings.xid_levels` and
`HealthSettings.ascend_code_levels`; the overrides are plain mappings so that this module needs
nothing but the data.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping

from edl_agent.health.model import Level

Overrides = Mapping[str, str]

_HEX_CODE = re.compile(r"^(?:0[xX])?([0-9a-fA-F]{1,8})$")

# --- NVIDIA XIDs ---------------------------------------------------------------------------------
#
# Source: NVIDIA's XID catalog for Ampere and newer GPUs
# (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html), column "Resolution Bucket
# (Immediate Action)"; cross-checked with the XIDs AWS's node monitoring agent treats as fatal and
# with NVIDIA/k8s-device-plugin#1974 (its default ignore list disagrees with the catalog).
# Each row: XID, catalog meaning, catalog immediate action -> our level.
#
# RESTART_APP / IGNORE (the application or driver recovers on its own) -> IGNORE;
# RESET_GPU and memory-remapping events -> DEVICE_FATAL (drain the GPU until it is reset);
# RESTART_BM / RESTART_VM (the host must restart) -> NODE_FATAL.
XID_LEVELS: Mapping[int, Level] = {
    11: Level.IGNORE,  # invalid or corrupted push buffer; RESTART_APP, then CHECK_APP/CUDA
    13: Level.IGNORE,  # graphics engine exception; RESTART_APP (an application bug as a rule)
    25: Level.IGNORE,  # invalid or illegal push buffer stream; RESTART_APP
    31: Level.IGNORE,  # GPU memory page fault (illegal address in the application); RESTART_APP
    32: Level.IGNORE,  # invalid or corrupted push buffer stream (PBDMA); RESTART_APP
    43: Level.IGNORE,  # GPU stopped processing (the channel was reset); IGNORE
    45: Level.IGNORE,  # preemptive cleanup after another error; follow that other XID
    68: Level.IGNORE,  # NVDEC0 exception; RESTART_APP (also ignored by NVIDIA's device plugin)
    69: Level.IGNORE,  # graphics engine class error; RESTART_APP, then CHECK_APP/CUDA
    80: Level.IGNORE,  # corrupted data sent to the GPU; RESTART_APP, then CHECK_APP/CUDA
    46: Level.DEVICE_FATAL,  # GPU stopped processing (timeout); RESET_GPU
    48: Level.DEVICE_FATAL,  # double-bit ECC error; WORKFLOW_XID_48 (reset, then check remapping)
    54: Level.DEVICE_FATAL,  # auxiliary power not connected; CHECK_MECHANICALS
    62: Level.DEVICE_FATAL,  # internal micro-controller halt; RESET_GPU
    # 63: row remapping recorded; the catalog says IGNORE, but the new mapping only takes effect
    # after a GPU reset ("reset gpu to activate"), so the GPU is drained until then (AWS: fatal).
    63: Level.DEVICE_FATAL,
    64: Level.DEVICE_FATAL,  # row remapping failure; RESET_GPU
    74: Level.DEVICE_FATAL,  # NVLink error; WORKFLOW_NVLINK_ERR (a reset clears the link state)
    79: Level.NODE_FATAL,  # GPU has fallen off the bus; RESTART_BM (no reset reaches it)
    # 92: high single-bit ECC rate; the catalog says IGNORE. We drain: a rising SBE rate precedes
    # uncorrectable errors, and a long job would lose more than the drain costs.
    92: Level.DEVICE_FATAL,
    # 94: contained (poisoned) memory error; the catalog says RESTART_APP. The affected row is
    # remapped only at the next reset, so new work is kept off the GPU until it is reset.
    94: Level.DEVICE_FATAL,
    95: Level.DEVICE_FATAL,  # uncontained memory error; RESET_GPU
    109: Level.DEVICE_FATAL,  # context-switch timeout; RESET_GPU (NVIDIA's plugin ignores it)
    110: Level.DEVICE_FATAL,  # security fault; RESET_GPU
    119: Level.DEVICE_FATAL,  # GSP RPC timeout; RESET_GPU
    120: Level.DEVICE_FATAL,  # GSP error; RESET_GPU
    136: Level.DEVICE_FATAL,  # NVLink training failed; RESET_GPU
    140: Level.DEVICE_FATAL,  # unrecovered ECC error; RESET_GPU
    143: Level.DEVICE_FATAL,  # GPU initialization error; RESET_GPU
    151: Level.NODE_FATAL,  # key rotation error (confidential computing); RESTART_VM
    155: Level.DEVICE_FATAL,  # NVLink software-defined error; RESET_GPU
    156: Level.DEVICE_FATAL,  # resource retirement event; RESET_GPU
    158: Level.DEVICE_FATAL,  # GPU fatal timeout; RESET_GPU
}

# An XID missing from the table (new drivers add codes; NVLink 144-150 and 154 need their payload
# decoded) is logged and counted but leaves the GPU schedulable: draining on a code we cannot
# interpret would take healthy capacity away on every new driver, and ignoring it would hide it.
# Operators who know better set it in `health.xid_levels`.
UNKNOWN_XID_LEVEL = Level.WARN


def classify_xid(code: int, overrides: Overrides | None = None) -> Level:
    """The level of XID `code`; `overrides` is `HealthSettings.xid_levels` ({"31": "warn"})."""
    if overrides:
        override = overrides.get(str(code))
        if override is not None:
            return Level(override)
    return XID_LEVELS.get(code, UNKNOWN_XID_LEVEL)


def classify_ecc_dbe() -> Level:
    """A double-bit (uncorrectable) ECC error counted by the device: the data it held is lost and
    the page or row is retired or remapped only at the next reset (catalog: XID 48, RESET_GPU)."""
    return Level.DEVICE_FATAL


def classify_row_remap_failure() -> Level:
    """The device ran out of spare rows, or remapping failed: memory errors can no longer be
    repaired (catalog: XID 64, RESET_GPU; repeated failures need the board replaced)."""
    return Level.DEVICE_FATAL


def check_xid_overrides(overrides: Overrides) -> None:
    """Raise ValueError naming the first key that is not an XID number or value not a level."""
    for key, value in overrides.items():
        if not key.strip().isdigit():
            msg = f"health.xid_levels: {key!r} is not an XID number"
            raise ValueError(msg)
        _check_level("health.xid_levels", key, value)


# --- Ascend fault codes --------------------------------------------------------------------------


class AscendFaultType(enum.StrEnum):
    """The fault levels of Huawei's Ascend device plugin (MindCluster), mildest first."""

    NOT_HANDLE = "NotHandleFault"  # does not affect the job; nothing to do
    RESTART_REQUEST = "RestartRequest"  # re-run the inference request or training step
    RESTART_BUSINESS = "RestartBusiness"  # re-run the job; the chip stays in service
    FREE_RESTART_NPU = "FreeRestartNPU"  # reset the chip once it is idle
    RESTART_NPU = "RestartNPU"  # reset the chip now, then re-run the job
    PRE_SEPARATE_NPU = "PreSeparateNPU"  # isolate the chip once its jobs have left it
    SEPARATE_NPU = "SeparateNPU"  # a reset does not help: isolate the chip
    MANUALLY_SEPARATE_NPU = "ManuallySeparateNPU"  # isolated after repeated faults; a person clears


# Job-level types leave the chip schedulable: the job (not the device) has to retry, which is the
# job controller's business, so they are warnings here. Reset types drain the chip until it is
# reset. Isolation types say a reset does not help: the chip is out until someone repairs it,
# which is what NODE_FATAL means for us (stays until sound).
ASCEND_FAULT_TYPE_LEVELS: Mapping[AscendFaultType, Level] = {
    AscendFaultType.NOT_HANDLE: Level.IGNORE,
    AscendFaultType.RESTART_REQUEST: Level.WARN,
    AscendFaultType.RESTART_BUSINESS: Level.WARN,
    AscendFaultType.FREE_RESTART_NPU: Level.DEVICE_FATAL,
    AscendFaultType.RESTART_NPU: Level.DEVICE_FATAL,
    AscendFaultType.PRE_SEPARATE_NPU: Level.NODE_FATAL,
    AscendFaultType.SEPARATE_NPU: Level.NODE_FATAL,
    AscendFaultType.MANUALLY_SEPARATE_NPU: Level.NODE_FATAL,
}

# A sample of the default fault-code table that MindCluster ships (faultCode.json of the Ascend
# device plugin / Container Manager, hex form); meanings from Huawei's chip fault-code reference
# where one is published. ManuallySeparateNPU and PreSeparateNPU are not assigned to chip codes
# by default: the plugin reaches them through fault frequency and node-level rules.
ASCEND_CODE_TYPES: Mapping[int, AscendFaultType] = {
    0x80E21007: AscendFaultType.NOT_HANDLE,  # dmp_daemon node status detection abnormal
    0x81078603: AscendFaultType.NOT_HANDLE,  # parameter-plane network link down
    0x80E38003: AscendFaultType.NOT_HANDLE,
    0x80CB8009: AscendFaultType.RESTART_REQUEST,  # AIV bus access error
    0x80CB800A: AscendFaultType.RESTART_REQUEST,  # AIV operator timeout (warm reset)
    0x80C98009: AscendFaultType.RESTART_REQUEST,  # AIC bus access error
    # HBM multi-bit (uncorrectable) ECC: the bad region is isolated and the job re-run.
    0x80E01801: AscendFaultType.RESTART_BUSINESS,
    0x8C204E00: AscendFaultType.RESTART_BUSINESS,
    0x8C0E4E00: AscendFaultType.FREE_RESTART_NPU,
    0x8C104E00: AscendFaultType.FREE_RESTART_NPU,
    0x8C03A000: AscendFaultType.RESTART_NPU,
    0x8C1FA006: AscendFaultType.RESTART_NPU,
    0x80E24E00: AscendFaultType.RESTART_NPU,
    0x80E18402: AscendFaultType.SEPARATE_NPU,  # HBM multi-bit ECC, isolated rows reached 64
    0x80E3A201: AscendFaultType.SEPARATE_NPU,
    0x80E0020B: AscendFaultType.SEPARATE_NPU,
}

# Codes outside the table: MindCluster's default for unrecorded codes differs between releases
# (NotHandleFault in some, SeparateNPU in others, the driver's severity in the newest we read). We
# take the severity: the chip's health word decides, and a code never counts for less than a
# warning.
UNKNOWN_ASCEND_CODE_LEVEL = Level.WARN


def parse_ascend_code(text: str) -> int:
    """`0x80E01801`, `80E01801` or `80e01801` to its number; ValueError for anything else."""
    match = _HEX_CODE.match(text.strip())
    if match is None:
        msg = f"{text!r} is not an Ascend fault code (8 hex digits, e.g. 0x80E01801)"
        raise ValueError(msg)
    return int(match.group(1), 16)


def format_ascend_code(code: int) -> str:
    """The spelling used in reasons and settings: `0x80E01801`."""
    return f"0x{code:08X}"


def ascend_code_level(code: int, overrides: Overrides | None = None) -> Level | None:
    """The level of fault code `code`, or None when neither the overrides nor the table know it.

    `overrides` is `HealthSettings.ascend_code_levels`, keyed by hex code in any spelling.
    """
    if overrides:
        for key, value in overrides.items():
            if _HEX_CODE.match(key.strip()) and parse_ascend_code(key) == code:
                return Level(value)
    fault_type = ASCEND_CODE_TYPES.get(code)
    return ASCEND_FAULT_TYPE_LEVELS[fault_type] if fault_type is not None else None


def check_ascend_overrides(overrides: Overrides) -> None:
    """Raise ValueError naming the first key that is not a hex fault code or value not a level."""
    for key, value in overrides.items():
        try:
            parse_ascend_code(key)
        except ValueError as exc:
            msg = f"health.ascend_code_levels: {exc}"
            raise ValueError(msg) from None
        _check_level("health.ascend_code_levels", key, value)


# npu-smi's Health column: OK, then three alarm grades. Warning is a minor alarm with the chip
# still usable (discovery keeps it Healthy); Alarm (major) and Critical (urgent) take it out until
# the word reads OK again. The word grades the alarm, not its remedy, so neither is NODE_FATAL:
# a fault code, when npu-smi prints one, says whether isolation is needed.
NPU_HEALTH_LEVELS: Mapping[str, Level | None] = {
    "ok": None,
    "warning": Level.WARN,
    "alarm": Level.DEVICE_FATAL,
    "critical": Level.DEVICE_FATAL,
}
UNKNOWN_NPU_HEALTH_LEVEL = Level.WARN  # e.g. `UNKNOWN` while the driver restarts


def classify_npu_health(word: str) -> Level | None:
    """The level of an npu-smi Health word; None for OK (case does not matter)."""
    return NPU_HEALTH_LEVELS.get(word.strip().lower(), UNKNOWN_NPU_HEALTH_LEVEL)


def classify_npu_fault(
    health: str, codes: tuple[int, ...], overrides: Overrides | None = None
) -> tuple[Level | None, int | None]:
    """The level of one NPU chip from its health word and fault codes, and the deciding code.

    Without codes the word decides. With codes the codes decide (the table, with the operator's
    overrides, is more specific than the word), each unknown code counting as the word's level
    but at least a warning. The deciding code is the first one of the highest level.
    """
    word_level = classify_npu_health(health)
    if not codes:
        return word_level, None
    floor = most_severe([word_level or UNKNOWN_ASCEND_CODE_LEVEL, UNKNOWN_ASCEND_CODE_LEVEL])
    levels = [ascend_code_level(code, overrides) or floor for code in codes]
    worst = max(range(len(codes)), key=lambda i: _rank(levels[i]))  # first of the highest
    return levels[worst], codes[worst]


# --- Kunlunxin XPU and Hygon DCU states ----------------------------------------------------------
#
# Neither xpu-smi nor hy-smi has a documented per-device health field (Kunlunxin's device plugin
# reads health through its xpuml library; hy-smi follows rocm-smi, which reports RAS counters but
# no health word). The simulated tools print a designed `XPU State` / `DCU State` field with these
# four words. On real nodes the field is absent: XPUs then speak through their ECC counters, and
# both vendors through their tool failing or no longer listing a device.
DEVICE_STATE_LEVELS: Mapping[str, Level | None] = {
    "normal": None,
    "warning": Level.WARN,  # degraded but usable (e.g. throttling)
    "fault": Level.DEVICE_FATAL,  # the device reports a fault: drain until it reads normal
    "lost": Level.NODE_FATAL,  # gone from the bus: like XID 79, only a host restart helps
}
UNKNOWN_DEVICE_STATE_LEVEL = Level.WARN


def classify_device_state(state: str) -> Level | None:
    """The level of a Kunlunxin/Hygon state word; None for Normal (case does not matter)."""
    return DEVICE_STATE_LEVELS.get(state.strip().lower(), UNKNOWN_DEVICE_STATE_LEVEL)


# --- helpers -------------------------------------------------------------------------------------

_ORDER = (Level.IGNORE, Level.WARN, Level.DEVICE_FATAL, Level.NODE_FATAL)


def _rank(level: Level) -> int:
    return _ORDER.index(level)


def most_severe(levels: Iterable[Level]) -> Level:
    """The most severe of `levels` (at least one)."""
    return max(levels, key=_rank)


def _check_level(setting: str, key: str, value: str) -> None:
    if value not in {level.value for level in Level}:
        choices = ", ".join(level.value for level in _ORDER)
        msg = f"{setting}[{key!r}]: {value!r} is not one of {choices}"
        raise ValueError(msg)
