"""What the benchmark scripts share (each imports it from its own directory)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

Figures = Mapping[str, tuple[float, str]]  # figure name → (value, unit)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q`th percentile of `values` (q in 0..100)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def print_side_by_side(prefix: str, ours: Figures, theirs: Figures) -> None:
    """`<prefix>_<figure>_ours`, `_theirs` and `_ratio` (ours / theirs) lines for each figure."""
    for key, (value, unit) in ours.items():
        other = theirs[key][0]
        print(f"{prefix}_{key}_ours {value:.6g} {unit}")
        print(f"{prefix}_{key}_theirs {other:.6g} {unit}")
        ratio = value / other if other > 0 else float("nan")
        print(f"{prefix}_{key}_ratio {ratio:.3f} ratio")


def run_test_for_figures(repo: Path, test: str, env: Mapping[str, str], tag: str) -> None:
    """Run pytest on `test` (it writes its figures where `env` says); exit 1 with the end of its
    output when it fails."""
    print(f"[{tag}] pytest {test}", file=sys.stderr, flush=True)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        cwd=repo,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        print(done.stdout[-4000:], file=sys.stderr)
        raise SystemExit(1)
