"""What a vendor's fault report means for scheduling: pure, table-driven, overridable.

Every table maps a vendor's own vocabulary (an NVIDIA XID, an Ascend fault code, a health word)
to a `Level`. Operators override single entries through `HealthSettings.xid_levels` and
`HealthSettings.ascend_code_levels`; the overrides are plain mappings so that this module needs
nothing but the data.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from edl_agent.fault_codes import HEX_CODE, parse_ascend_code
from edl_agent.health.ascend_fault_codes import RULES as ASCEND_LEVEL_RULES
from edl_agent.health.ascend_fault_codes import AscendFaultType, ascend_fault_type
from edl_agent.health.ascend_fault_codes import table as ascend_code_table
from edl_agent.health.model import ClearsBy, HealthEvent, Level

Overrides = Mapping[str, str]

# --- NVIDIA XIDs ---------------------------------------------------------------------------------
#
# Source: NVIDIA's XID catalog for Ampere and newer GPUs
# (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html), column "Resolution Bucket
# (Immediate Action)"; cross-checked with the XIDs AWS's node monitoring agent treats as fatal and
# with NVIDIA/k8s-device-plugin#1974 (its default ignore list disagrees with the catalog).
# Each row: XID, catalog meaning, catalog immediate action -> our level.
#
# Level: RESTART_APP / IGNORE (the application or driver recovers on its own) -> IGNORE;
# RESET_GPU and memory-remapping events -> DEVICE_FATAL (drain the GPU until it is reset);
# RESTART_BM / RESTART_VM (the host must restart) -> NODE_FATAL.
# What clears it: IGNORE rows nothing (never quarantined); RESET_GPU and the ECC/remapping/NVLink
# workflows a reset of that GPU; RESTART_BM/VM a reboot of the node; CHECK_MECHANICALS and
# CONTACT_SUPPORT a person (an operator's release), since no reset or reboot repairs hardware.


@dataclass(frozen=True)
class Rule:
    """What a fault code means: its level and what ends the quarantine it causes."""

    level: Level
    clears_by: ClearsBy


_APP = Rule(Level.IGNORE, ClearsBy.NOTHING)
_RESET = Rule(Level.DEVICE_FATAL, ClearsBy.RESET)
_DEGRADE = Rule(Level.DEGRADED, ClearsBy.RESET)
_REBOOT = Rule(Level.NODE_FATAL, ClearsBy.REBOOT)
_PERSON = Rule(Level.DEVICE_FATAL, ClearsBy.RELEASE)

XID_CATALOG: Mapping[int, Rule] = {
    11: _APP,  # invalid or corrupted push buffer; RESTART_APP, then CHECK_APP/CUDA
    13: _APP,  # graphics engine exception; RESTART_APP (an application bug as a rule)
    25: _APP,  # invalid or illegal push buffer stream; RESTART_APP
    31: _APP,  # GPU memory page fault (illegal address in the application); RESTART_APP
    32: _APP,  # invalid or corrupted push buffer stream (PBDMA); RESTART_APP
    43: _APP,  # GPU stopped processing (the channel was reset); IGNORE
    45: _APP,  # preemptive cleanup after another error; follow that other XID
    68: _APP,  # NVDEC0 exception; RESTART_APP (also ignored by NVIDIA's device plugin)
    69: _APP,  # graphics engine class error; RESTART_APP, then CHECK_APP/CUDA
    80: _APP,  # corrupted data sent to the GPU; RESTART_APP, then CHECK_APP/CUDA
    46: _RESET,  # GPU stopped processing (timeout); RESET_GPU
    48: _RESET,  # double-bit ECC error; WORKFLOW_XID_48 (reset, then check remapping)
    54: _PERSON,  # auxiliary power not connected; CHECK_MECHANICALS
    62: _RESET,  # internal micro-controller halt; RESET_GPU
    # 63: row remapping recorded; the catalog says IGNORE, but the new mapping only takes effect
    # after a GPU reset ("reset gpu to activate"): degraded until then (AWS drains it as fatal).
    63: _DEGRADE,
    64: _RESET,  # row remapping failure; RESET_GPU
    74: _RESET,  # NVLink error; WORKFLOW_NVLINK_ERR (a reset clears the link state)
    79: _REBOOT,  # GPU has fallen off the bus; RESTART_BM (no reset reaches it)
    # 92: high single-bit ECC rate; the catalog says IGNORE. Degraded: a rising SBE rate precedes
    # uncorrectable errors, so the GPU takes no new work and its pod may leave gracefully.
    92: _DEGRADE,
    # 94: contained (poisoned) memory error; the catalog says RESTART_APP. The affected row is
    # remapped only at the next reset: degraded (no new work) until the GPU is reset.
    94: _DEGRADE,
    95: _RESET,  # uncontained memory error; RESET_GPU
    109: _RESET,  # context-switch timeout; RESET_GPU (NVIDIA's plugin ignores it)
    110: _RESET,  # security fault; RESET_GPU
    119: _RESET,  # GSP RPC timeout; RESET_GPU
    120: _RESET,  # GSP error; RESET_GPU
    136: _RESET,  # NVLink training failed; RESET_GPU
    140: _RESET,  # unrecovered ECC error; RESET_GPU
    143: _RESET,  # GPU initialization error; RESET_GPU
    151: Rule(Level.NODE_FATAL, ClearsBy.REBOOT),  # key rotation error (confidential); RESTART_VM
    155: _RESET,  # NVLink software-defined error; RESET_GPU
    156: _RESET,  # resource retirement event; RESET_GPU
    158: _RESET,  # GPU fatal timeout; RESET_GPU
}
XID_LEVELS: Mapping[int, Level] = {code: rule.level for code, rule in XID_CATALOG.items()}

# An XID missing from the table (new drivers add codes; NVLink 144-150 and 154 need their payload
# decoded) is logged and counted but leaves the GPU schedulable: draining on a code we cannot
# interpret would take healthy capacity away on every new driver, and ignoring it would hide it.
# Operators who know better set it in `health.xid_levels`; an unknown code they make severe is
# cleared by an operator's release unless `health.xid_clears_by` says otherwise.
UNKNOWN_XID_LEVEL = Level.WARN


def classify_xid(code: int, overrides: Overrides | None = None) -> Level:
    """The level of XID `code`; `overrides` is `HealthSettings.xid_levels` ({"31": "warn"})."""
    if overrides:
        override = overrides.get(str(code))
        if override is not None:
            return Level(override)
    return XID_LEVELS.get(code, UNKNOWN_XID_LEVEL)


def xid_clears_by(code: int, level: Level, overrides: Overrides | None = None) -> ClearsBy:
    """What ends the quarantine XID `code` at `level` causes (`health.xid_clears_by` first)."""
    override = (overrides or {}).get(str(code))
    if override is not None:
        return ClearsBy(override)
    rule = XID_CATALOG.get(code)
    return _clears_at(level, rule.clears_by if rule is not None else None)


def classify_ecc_dbe() -> Level:
    """A double-bit (uncorrectable) ECC error counted by the device: the data it held is lost and
    the page or row is retired or remapped only at the next reset (catalog: XID 48, RESET_GPU)."""
    return Level.DEVICE_FATAL


def classify_row_remap_failure() -> Level:
    """The device ran out of spare rows, or remapping failed: memory errors can no longer be
    repaired (catalog: XID 64, RESET_GPU; repeated failures need the board replaced)."""
    return Level.DEVICE_FATAL


# --- Ascend fault codes --------------------------------------------------------------------------

# The levels, their rules and the code table: `ascend_fault_codes` (MindCluster's own table, as
# data). SubHealthFault warns of a coming fault and PreSeparateNPU isolates the chip once its job
# has left it: both make it Degraded. ManuallySeparateNPU isolates it, as SeparateNPU does.
ASCEND_FAULT_TYPE_RULES: Mapping[AscendFaultType, Rule] = {
    kind: Rule(rule.level, rule.clears_by) for kind, rule in ASCEND_LEVEL_RULES.items()
}
ASCEND_FAULT_TYPE_LEVELS: Mapping[AscendFaultType, Level] = {
    kind: rule.level for kind, rule in ASCEND_FAULT_TYPE_RULES.items()
}
ASCEND_CODE_TYPES: Mapping[int, AscendFaultType] = ascend_code_table()

# Codes outside the table: MindCluster's default for unrecorded codes differs between releases
# (NotHandleFault in some, SeparateNPU in others, the driver's severity in the newest we read). We
# take the severity: the chip's health word decides, and a code never counts for less than a
# warning. An unknown code severe enough to drain the chip is cleared by an operator's release:
# nobody can say what repairs it.
UNKNOWN_ASCEND_CODE_LEVEL = Level.WARN


def ascend_code_level(code: int, overrides: Overrides | None = None) -> Level | None:
    """The level of fault code `code`, or None when neither the overrides nor the table know it.

    `overrides` is `HealthSettings.ascend_code_levels`, keyed by hex code in any spelling.
    """
    if overrides:
        for key, value in overrides.items():
            if HEX_CODE.match(key.strip()) and parse_ascend_code(key) == code:
                return Level(value)
    fault_type = ascend_fault_type(code)
    return ASCEND_FAULT_TYPE_LEVELS[fault_type] if fault_type is not None else None


def ascend_code_clears_by(code: int, level: Level, overrides: Overrides | None = None) -> ClearsBy:
    """What ends the quarantine fault code `code` at `level` causes
    (`health.ascend_code_clears_by` first, keyed by hex code in any spelling)."""
    for key, value in (overrides or {}).items():
        if HEX_CODE.match(key.strip()) and parse_ascend_code(key) == code:
            return ClearsBy(value)
    fault_type = ascend_fault_type(code)
    known = ASCEND_FAULT_TYPE_RULES[fault_type].clears_by if fault_type is not None else None
    return _clears_at(level, known)


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
    worst = max(range(len(codes)), key=lambda i: levels[i].rank)  # first of the highest
    return levels[worst], codes[worst]


# --- Kunlunxin XPU and Hygon DCU states ----------------------------------------------------------
#
# Neither xpu-smi nor hy-smi has a documented per-device health field (Kunlunxin's device plugin
# reads health through its xpuml library; hy-smi follows rocm-smi, which reports RAS counters but
# no health word). The simulated tools print a designed `XPU State` / `DCU State` field with these
# four words. On real nodes the field is absent: XPUs then speak through their ECC counters, and
# both vendors through their tool failing or no longer listing a device.
# What clears them follows the XID catalog's buckets: `Fault` is a device error the driver holds
# until the device is reset (so the tool reading Normal again is the evidence of a reset), an
# uncorrectable XPU ECC count is volatile and returns to 0 only at a reset, and `Lost` (off the
# bus) is XID 79's case: only a reboot brings the device back.
DEVICE_STATE_LEVELS: Mapping[str, Level | None] = {
    "normal": None,
    "warning": Level.DEGRADED,  # usable, but warning of a fault (e.g. throttling)
    "fault": Level.DEVICE_FATAL,  # the device reports a fault: drain until it reads normal
    "lost": Level.NODE_FATAL,  # gone from the bus: like XID 79, only a host restart helps
}
UNKNOWN_DEVICE_STATE_LEVEL = Level.WARN


DEVICE_STATE_CLEARS_BY: Mapping[str, ClearsBy] = {
    "warning": ClearsBy.CONDITION,
    "fault": ClearsBy.RESET,
    "lost": ClearsBy.REBOOT,
}


def classify_device_state(state: str) -> Level | None:
    """The level of a Kunlunxin/Hygon state word; None for Normal (case does not matter)."""
    return DEVICE_STATE_LEVELS.get(state.strip().lower(), UNKNOWN_DEVICE_STATE_LEVEL)


# --- what clears an event ------------------------------------------------------------------------

ECC_DBE_REASONS = frozenset({"ECC_DBE", "XPU_ECC_DBE"})
LOST_REASONS = frozenset({"GPU_LOST"})


def what_clears(  # noqa: PLR0911 -- one return per catalog reads plainer than a dispatch table
    event: HealthEvent,
    *,
    xid_overrides: Overrides | None = None,
    ascend_overrides: Overrides | None = None,
) -> ClearsBy:
    """What ends the condition `event` starts: its own `clears_by` when the source set one, else
    the catalog's column for its reason and code. Anything not severe clears by nothing; a severe
    event the catalogs do not name lasts while its source reports it (a missing /dev node, a
    device a tool no longer lists, a failing monitor)."""
    if event.clears_by is not None:
        return event.clears_by
    if not event.level.kept:
        return ClearsBy.NOTHING
    reason = event.reason
    if reason.startswith("XID") and event.code is not None:
        return xid_clears_by(event.code, event.level, xid_overrides)
    if reason.startswith("NPU_FAULT_") and event.code is not None:
        return ascend_code_clears_by(event.code, event.level, ascend_overrides)
    if reason in ECC_DBE_REASONS:
        return ClearsBy.RESET
    if reason in LOST_REASONS:
        return ClearsBy.REBOOT
    for prefix in ("XPU_STATE_", "DCU_STATE_"):
        if reason.startswith(prefix):
            state = reason.removeprefix(prefix).lower()
            return DEVICE_STATE_CLEARS_BY.get(state, ClearsBy.RELEASE)
    return ClearsBy.CONDITION


def _clears_at(level: Level, known: ClearsBy | None) -> ClearsBy:
    """The catalog's column for a code at `level` (the operator may have raised or lowered it):
    a level that is not severe clears by nothing; a severe level keeps the catalog's column when
    it has a severe one; an application-level code raised to severe clears by a reset (device)
    or a reboot (node); an unknown code raised to severe waits for an operator."""
    if not level.kept:
        return ClearsBy.NOTHING
    if known is not None and known is not ClearsBy.NOTHING:
        return known
    if known is None:
        return ClearsBy.RELEASE
    return ClearsBy.REBOOT if level is Level.NODE_FATAL else ClearsBy.RESET


# --- helpers -------------------------------------------------------------------------------------


def most_severe(levels: Iterable[Level]) -> Level:
    """The most severe of `levels` (at least one)."""
    return max(levels, key=lambda level: level.rank)
