"""Which NVIDIA GPUs are Degraded, from the readings that warn before a GPU fails. Pure: readings
and `now` in, the warnings that hold out; no clocks, threads or NVML.

- `ECC_SBE_RATE`: `ecc_corrected_errors` corrected errors within `ecc_window_seconds`; ends
  when fewer than half as many fall within the window (a reset restarts the count);
- `ROWS_PENDING`: memory rows pending remapping; ends when none are (a reset applies them);
- `RECOVERY_DRAIN`: the driver asks for DRAIN_P2P or DRAIN_AND_RESET; ends when it asks for
  nothing;
- `CLOCKS_THROTTLED`: one of `throttle_reasons` in every reading for `throttle_seconds`; ends
  after as long with none of them;
- `PCIE_DOWNGRADED`: a link narrower than its maximum, or at a lower generation while the GPU is
  busy, in every reading for `pcie_seconds`; ends after as long at full width and generation.

A field the GPU does not report (None) neither starts nor ends a warning. Each warning lasts
while its readings say so: the health hub keeps it as a Degraded condition that ends on `GONE`
(or on any reset, reboot or release: the next reading opens it again if it still holds).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from edl_agent.health.model import DeviceTelemetry
from edl_agent.health_settings import CLOCK_EVENT_REASONS, DegradedSettings

ECC_SBE_RATE = "ECC_SBE_RATE"
ROWS_PENDING = "ROWS_PENDING"
RECOVERY_DRAIN = "RECOVERY_DRAIN"
CLOCKS_THROTTLED = "CLOCKS_THROTTLED"
PCIE_DOWNGRADED = "PCIE_DOWNGRADED"
WEAR_REASONS = frozenset(
    {ECC_SBE_RATE, ROWS_PENDING, RECOVERY_DRAIN, CLOCKS_THROTTLED, PCIE_DOWNGRADED}
)
DRAIN_ACTIONS = {3: "DRAIN_P2P", 4: "DRAIN_AND_RESET"}  # nvmlDeviceGpuRecoveryAction_t


@dataclass
class _Held:
    """A yes/no reading held for a time before it counts, either way."""

    on: bool = False
    since: float | None = None  # when the readings began to disagree with `on`

    def see(self, now: float, reading: bool, hold: float) -> None:
        if reading == self.on:
            self.since = None
        elif self.since is None:
            self.since = now
        if self.since is not None and now - self.since >= hold:
            self.on, self.since = reading, None


@dataclass
class _Gpu:
    corrected: deque[tuple[float, int]] = field(default_factory=deque)
    ecc_on: bool = False
    throttled: _Held = field(default_factory=_Held)
    throttle_detail: str = ""
    link: _Held = field(default_factory=_Held)
    link_detail: str = ""


class Wear:
    """The warnings of each GPU now, from its readings so far (`read` once per poll)."""

    def __init__(self, settings: DegradedSettings) -> None:
        self.settings = settings
        self._gpus: dict[str, _Gpu] = {}
        self._mask = sum(CLOCK_EVENT_REASONS[name] for name in settings.throttle_reasons)

    def read(self, readings: Iterable[DeviceTelemetry], now: float) -> dict[str, dict[str, str]]:
        """GPU uuid → reason → detail of every warning that holds after these readings (MIG
        devices and GPUs that reported nothing have none)."""
        found: dict[str, dict[str, str]] = {}
        seen = set()
        for reading in readings:
            told = (reading.clock_event_reasons, reading.pcie_width, reading.ecc_corrected_total)
            if all(value is None for value in told):
                continue  # a MIG device, or a GPU that answered nothing
            seen.add(reading.device_id)
            gpu = self._gpus.setdefault(reading.device_id, _Gpu())
            warnings = self._warnings(gpu, reading, now)
            if warnings:
                found[reading.device_id] = warnings
        for gone in set(self._gpus) - seen:
            del self._gpus[gone]
        return found

    def _warnings(self, gpu: _Gpu, reading: DeviceTelemetry, now: float) -> dict[str, str]:
        settings = self.settings
        warnings: dict[str, str] = {}
        ecc = self._ecc(gpu, reading.ecc_corrected_total, now)
        if ecc is not None:
            warnings[ECC_SBE_RATE] = ecc
        if settings.rows_pending and reading.rows_pending:
            warnings[ROWS_PENDING] = "memory rows pending remapping: a GPU reset applies them"
        action = DRAIN_ACTIONS.get(reading.recovery_action or 0)
        if settings.recovery_actions and action is not None:
            warnings[RECOVERY_DRAIN] = f"the driver's recovery action is {action}"
        reasons = reading.clock_event_reasons
        if reasons is not None:
            held = reasons & self._mask
            if held:
                gpu.throttle_detail = "clocks held down by " + ", ".join(
                    name for name, bit in CLOCK_EVENT_REASONS.items() if held & bit
                )
            gpu.throttled.see(now, bool(held), settings.throttle_seconds)
        if gpu.throttled.on:
            warnings[CLOCKS_THROTTLED] = gpu.throttle_detail
        below = self._link_below(reading)
        if below is not None:
            if below:
                gpu.link_detail = below
            gpu.link.see(now, bool(below), settings.pcie_seconds)
        if gpu.link.on:
            warnings[PCIE_DOWNGRADED] = gpu.link_detail
        return warnings

    def _ecc(self, gpu: _Gpu, total: int | None, now: float) -> str | None:
        limit = self.settings.ecc_corrected_errors
        if total is None or limit == 0:
            return None
        samples = gpu.corrected
        if samples and total < samples[-1][1]:
            samples.clear()  # the volatile counters restarted: the GPU was reset
            gpu.ecc_on = False
        samples.append((now, total))
        window = self.settings.ecc_window_seconds
        while len(samples) > 1 and samples[1][0] <= now - window:
            samples.popleft()
        rise = total - samples[0][1]
        gpu.ecc_on = rise >= limit if not gpu.ecc_on else 2 * rise >= limit
        if not gpu.ecc_on:
            return None
        return f"{rise} corrected ECC errors within {window:g} s ({total} since the last reset)"

    def _link_below(self, reading: DeviceTelemetry) -> str | None:
        """Why the link is below its maximum ("" when it is not); None when unknown."""
        width, width_max = reading.pcie_width, reading.pcie_width_max
        gen, gen_max = reading.pcie_generation, reading.pcie_generation_max
        if width is None or width_max is None or gen is None or gen_max is None:
            return None
        if width < width_max:
            return f"PCIe link x{width} of x{width_max} (generation {gen} of {gen_max})"
        busy = (reading.utilization_percent or 0) >= self.settings.pcie_busy_percent
        if gen < gen_max:
            return f"PCIe link generation {gen} of {gen_max} while busy" if busy else None
        return ""


def changes(
    now_found: Mapping[str, Mapping[str, str]], in_hub: Mapping[str, Iterable[str]]
) -> tuple[list[tuple[str, str, str]], list[tuple[str, str]]]:
    """What to tell the hub: warnings to open (device, reason, detail) that it does not hold, and
    warnings it holds (device → reasons among WEAR_REASONS) that no longer do."""
    opened = [
        (device_id, reason, detail)
        for device_id, warnings in sorted(now_found.items())
        for reason, detail in sorted(warnings.items())
        if reason not in set(in_hub.get(device_id, ()))
    ]
    ended = [
        (device_id, reason)
        for device_id, reasons in sorted(in_hub.items())
        for reason in sorted(set(reasons) & WEAR_REASONS)
        if reason not in now_found.get(device_id, {})
    ]
    return opened, ended
