"""What the benchmark scripts share (each imports it from its own directory)."""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q`th percentile of `values` (q in 0..100)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]
