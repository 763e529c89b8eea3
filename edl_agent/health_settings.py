"""Settings of the agent's health beyond its fault tables: resets of idle quarantined devices
(`health.remediation`) and the warnings that make an NVIDIA GPU Degraded (`health.degraded`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from edl_agent.settings_loader import section, setting

# NVML's clocks-event (throttle) reason bits (nvmlClocksEventReason*), by the names settings and
# metrics use.
CLOCK_EVENT_REASONS: Mapping[str, int] = {
    "idle": 0x1,
    "applications_clocks": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "hw_power_brake": 0x80,
    "display_clock": 0x100,
}


def _default_reset_commands() -> dict[str, list[str]]:
    return {
        "nvidia": ["nvidia-smi", "--gpu-reset", "-i", "{index}"],
        "ascend": ["npu-smi", "set", "-t", "reset", "-i", "{npu_id}", "-c", "{chip_id}"],
    }


@dataclass(frozen=True)
class RemediationSettings:
    enabled: bool = setting(
        False,
        "Reset quarantined devices the agent finds idle (held by no pod). Off by default: a "
        "reset is an action on the node, and an operator opts in to it.",
    )
    commands: dict[str, list[str]] = section(
        _default_reset_commands,
        "The reset command per vendor, its first word a tool found under the host root; `{index}` "
        "is the device's index and `{NAME}` any of its attributes (`discover` lists them, e.g. "
        "Ascend's `{npu_id}` and `{chip_id}`). A device lacking one is not reset. Vendors "
        "without a command are never reset by the agent.",
    )
    max_per_hour: int = setting(4, "Resets per node in any hour; one device at a time.")
    max_attempts: int = setting(
        3, "Failed resets of one device before it waits for an operator's release instead."
    )
    timeout_seconds: float = setting(300.0, "How long one reset command may run.")
    interval_seconds: float = setting(30.0, "How often idle quarantined devices are looked for.")

    def check(self) -> None:
        for vendor, command in self.commands.items():
            if vendor not in {"nvidia", "kunlunxin", "hygon", "ascend"}:
                raise ValueError(f"commands: {vendor!r} is not a vendor")
            if not command or not command[0].strip() or "/" in command[0]:
                raise ValueError(f"commands.{vendor}: the first word must be a tool name")
        if not 1 <= self.max_per_hour <= 3600:
            raise ValueError("max_per_hour: must be between 1 and 3600")
        if not 1 <= self.max_attempts <= 100:
            raise ValueError("max_attempts: must be between 1 and 100")
        if not 1 <= self.timeout_seconds <= 3600:
            raise ValueError("timeout_seconds: must be between 1 and 3600")
        if not 0.1 <= self.interval_seconds <= 3600:
            raise ValueError("interval_seconds: must be between 0.1 and 3600")


def _default_throttle_reasons() -> list[str]:
    # Heat and the board's power brake: a GPU held at the software power cap is only busy.
    return ["hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"]


@dataclass(frozen=True)
class DegradedSettings:
    enabled: bool = setting(
        True,
        "Read every NVIDIA GPU for warnings each `poll_seconds`: corrected ECC errors climbing, "
        "memory rows pending remapping, a recovery action asking for a drain, clocks throttled "
        "by heat or power, a PCIe link trained below its maximum.",
    )
    poll_seconds: float = setting(10.0, "How often the GPUs are read for warnings.")
    ecc_corrected_errors: int = setting(
        10,
        "Corrected (single-bit) ECC errors within `ecc_window_seconds` that make a GPU "
        "Degraded; it is not Degraded for them again until fewer than half as many fall within "
        "the window. 0: not read.",
    )
    ecc_window_seconds: float = setting(3600.0, "The window corrected ECC errors are counted in.")
    rows_pending: bool = setting(
        True, "A GPU with memory rows pending remapping (applied at its next reset) is Degraded."
    )
    recovery_actions: bool = setting(
        True,
        "A GPU whose driver asks for a drain (recovery action DRAIN_P2P or DRAIN_AND_RESET) is "
        "Degraded until the driver asks for nothing.",
    )
    throttle_reasons: list[str] = section(
        _default_throttle_reasons,
        "Clocks-event reasons that make a GPU Degraded when one holds `throttle_seconds` (names: "
        + ", ".join(CLOCK_EVENT_REASONS)
        + "); [] reads none.",
    )
    throttle_seconds: float = setting(
        60.0,
        "How long a throttle reason must hold (each poll seeing it) to degrade a GPU, and how "
        "long without any of them ends it.",
    )
    pcie_seconds: float = setting(
        60.0,
        "How long a PCIe link must run below its maximum (narrower; or a lower generation "
        "while the GPU is busy) to degrade a GPU, and how long at full speed ends it.",
    )
    pcie_busy_percent: float = setting(
        50.0,
        "A lower link generation counts only while the GPU is at least this busy: an idle GPU "
        "lowers its link's generation to save power.",
    )

    def check(self) -> None:
        unknown = sorted(set(self.throttle_reasons) - set(CLOCK_EVENT_REASONS))
        if unknown:
            raise ValueError(f"throttle_reasons: unknown {', '.join(unknown)}")
        bounds = {
            "poll_seconds": 3600,
            "ecc_window_seconds": 30 * 86400,
            "throttle_seconds": 86400,
            "pcie_seconds": 86400,
        }
        for key, most in bounds.items():
            if not 0 < getattr(self, key) <= most:
                raise ValueError(f"{key}: must be positive and at most {most}")
        if self.ecc_corrected_errors < 0:
            raise ValueError("ecc_corrected_errors: must not be negative")
        if not 0 <= self.pcie_busy_percent <= 100:
            raise ValueError("pcie_busy_percent: must be between 0 and 100")
