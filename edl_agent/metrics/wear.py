"""Metrics of the readings that warn before a GPU fails: clocks-event (throttle) reasons, the PCIe
link against its maximum, and memory row remapping pending or failed. Part of `EdlCollector`'s
scrape; labelled like the other telemetry (`TELEMETRY_LABELS`), each only where the device
reported it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from edl_agent.health.model import DeviceTelemetry
from edl_agent.health_settings import CLOCK_EVENT_REASONS

# The identity every telemetry family carries, here and in collectors.py.
TELEMETRY_LABELS = ("vendor", "index", "device_id")

_NAMED_BITS = sum(CLOCK_EVENT_REASONS.values())


@dataclass
class WearFamilies:
    """The families, fresh (without samples) for each scrape."""

    clock_event_reasons: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "edl_device_clock_event_reasons",
            "1 while the reason holds the GPU's clocks down (NVML clocks-event reasons: idle, "
            "sw_power_cap, hw_slowdown, sw_thermal, hw_thermal, hw_power_brake, ...), else 0; "
            "other: any bit not named here.",
            labels=(*TELEMETRY_LABELS, "reason"),
        )
    )
    pcie_generation: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "edl_device_pcie_link_generation",
            "PCIe generation the GPU's link runs at (of=current) and the highest it can reach in "
            "its slot (of=max).",
            labels=(*TELEMETRY_LABELS, "of"),
        )
    )
    pcie_width: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "edl_device_pcie_link_width",
            "PCIe lanes the GPU's link runs with (of=current) and the most it can have in its "
            "slot (of=max).",
            labels=(*TELEMETRY_LABELS, "of"),
        )
    )
    remapped_rows: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "edl_device_remapped_rows",
            "GPU memory row remapping as NVML flags it: state=pending is 1 while a remapping "
            "waits for a GPU reset; state=failed is 1 once a remapping failed.",
            labels=(*TELEMETRY_LABELS, "state"),
        )
    )

    degraded: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "edl_device_degraded",
            "1 while the device is Degraded (a fault is coming: it serves the pods on it and "
            "takes no new one; a MIG device when its GPU is), else 0.",
            labels=TELEMETRY_LABELS,
        )
    )

    def add(self, labels: Sequence[str], reading: DeviceTelemetry) -> None:
        """`reading`'s samples; `labels` are its TELEMETRY_LABELS values."""
        reasons = reading.clock_event_reasons
        if reasons is not None:
            for name, bit in CLOCK_EVENT_REASONS.items():
                self.clock_event_reasons.add_metric([*labels, name], _flag(reasons & bit))
            self.clock_event_reasons.add_metric([*labels, "other"], _flag(reasons & ~_NAMED_BITS))
        for family, current, most in (
            (self.pcie_generation, reading.pcie_generation, reading.pcie_generation_max),
            (self.pcie_width, reading.pcie_width, reading.pcie_width_max),
        ):
            for of, value in (("current", current), ("max", most)):
                if value is not None:
                    family.add_metric([*labels, of], value)
        for state, flag in (("pending", reading.rows_pending), ("failed", reading.rows_failed)):
            if flag is not None:
                self.remapped_rows.add_metric([*labels, state], _flag(flag))

    def all(self) -> list[Metric]:
        return [getattr(self, f.name) for f in fields(self)]


def _flag(value: int) -> float:
    return 1.0 if value else 0.0
