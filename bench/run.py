"""Run every benchmark and collect the figures.

    .venv/bin/python bench/run.py [--quick] [--only NAME ...] [--output bench/results.json]

Each benchmark runs as its own process, one after the other (they would disturb each other's
timings side by side), with `--quick` passed on in quick mode. Their `name value unit` lines
are printed as they come; everything else they say goes to stderr as progress. A benchmark that
is missing, crashes or overruns its time limit is reported as failed and the others still run;
the exit status is then 1. Figures never fail the run, whatever their values.

The NVIDIA side by sides (bench/nvidia_peer.py, bench/node_peer.py) need NVIDIA's plugin (and,
for node_peer, its GPU Feature Discovery) built: full mode builds them
(bench/build_nvidia_plugin.py, about 2 minutes cold for the plugin, a little more for GFD); quick
mode runs each only when what it needs is already built and otherwise says how to build it.

Writes bench/results.json: every figure with its unit and benchmark, each benchmark's status
and duration, and the machine (CPU, memory, Python, date, git commit, quick or full).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

import build_nvidia_plugin  # noqa: E402

# name, script; in this order (cheap and independent first, the peers last).
BENCHMARKS = [
    ("discovery", "discovery_bench.py"),
    ("plugin", "plugin_bench.py"),
    ("health", "health_bench.py"),
    ("polled", "polled_bench.py"),
    ("vendor_events", "vendor_events.py"),
    ("metrics", "metrics_bench.py"),
    ("restarter", "restarter_bench.py"),
    ("intake_storm", "intake_storm.py"),
    ("fleet_scale", "fleet_scale.py"),
    ("idle_minute", "idle_minute.py"),
    ("dra", "dra_bench.py"),
    ("nvidia_peer", "nvidia_peer.py"),
    ("node_peer", "node_peer.py"),
    ("kubelet_peer", "kubelet_peer.py"),
    ("training_faults", "training_faults.py"),
    ("goodput", "goodput.py"),
]
# What each peer benchmark needs of bench/build_nvidia_plugin.py's commands.
PEERS = {
    "nvidia_peer": (build_nvidia_plugin.BINARY,),
    "node_peer": (build_nvidia_plugin.BINARY, build_nvidia_plugin.GFD),
    "kubelet_peer": (build_nvidia_plugin.BINARY,),
}
TIME_LIMIT_S = {"quick": 100.0, "full": 1800.0}
# Benchmarks that take longer in full mode: the fleet's loads alone are 20 minutes.
FULL_TIME_LIMIT_S = {"fleet_scale": 5400.0, "goodput": 3600.0, "training_faults": 3600.0}
# Not in quick mode, which stays under 2 minutes: two real kubelet nodes take about 35 s even for
# one sample each (the cluster tests exercise the same nodes in CI).
FULL_ONLY = {
    "kubelet_peer": "two real kubelet nodes: full mode only",
    "dra": "a real kubelet node and kube-scheduler: full mode only",
    "training_faults": "PaddlePaddle and torchrun jobs on three real kubelet nodes: full mode only",
    "goodput": "the PaddlePaddle job for 20 minutes twice: full mode only",
    "fleet_scale": "500 nodes and 5,000 pods take about 3 minutes even quick (CI runs that size "
    "as tests/cluster/test_fleet_scale.py): full mode only",
}


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


@dataclass
class Outcome:
    status: str  # ok, failed, skipped
    seconds: float = 0.0
    returncode: int | None = None
    detail: str = ""
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)


def parse_figure(line: str) -> tuple[str, float, str] | None:
    parts = line.split()
    if len(parts) != 3:
        return None
    try:
        return parts[0], float(parts[1]), parts[2]
    except ValueError:
        return None


def run_benchmark(name: str, script: Path, args: list[str], limit: float) -> Outcome:
    if not script.is_file():
        return Outcome("failed", detail=f"{script.relative_to(REPO)} does not exist")
    started = time.monotonic()
    outcome = Outcome("ok")
    process = subprocess.Popen(
        [sys.executable, str(script), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    killed = threading.Event()

    def overrun() -> None:
        killed.set()
        process.kill()

    timer = threading.Timer(limit, overrun)
    timer.start()
    try:
        assert process.stdout is not None
        for raw in process.stdout:
            line = raw.rstrip("\n")
            figure = parse_figure(line)
            if figure is None:
                if line.strip():
                    print(f"[{name}] {line}", file=sys.stderr, flush=True)
                continue
            key, value, unit = figure
            outcome.figures[key] = {"value": value, "unit": unit}
            print(line, flush=True)
        returncode = process.wait()
    finally:
        timer.cancel()
    outcome.seconds = round(time.monotonic() - started, 1)
    outcome.returncode = returncode
    if returncode != 0:
        outcome.status = "failed"
        outcome.detail = (
            f"killed after the {limit:.0f}s limit" if killed.is_set()
            else f"exited with status {returncode}"
        )  # fmt: skip
    return outcome


def machine(mode: str) -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory_mib = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_mib = int(line.split()[1]) // 1024
    return {
        "mode": mode,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_model": cpu or platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_mib": memory_mib,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "nvidia_plugin_version": build_nvidia_plugin.DEFAULT_VERSION,
    }


def _git(*args: str) -> str:
    try:
        done = subprocess.run(
            ["git", *args],
            cwd=REPO, capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small runs, under 2 minutes")
    parser.add_argument(
        "--only", action="append", choices=[name for name, _ in BENCHMARKS], metavar="NAME",
        help="run only this benchmark (repeatable): " + ", ".join(n for n, _ in BENCHMARKS),
    )  # fmt: skip
    parser.add_argument("--output", type=Path, default=BENCH / "results.json")
    args = parser.parse_args()
    mode = "quick" if args.quick else "full"
    limit = TIME_LIMIT_S[mode]
    started = time.monotonic()
    outcomes: dict[str, Outcome] = {}
    figures: dict[str, dict[str, Any]] = {}
    for name, script in BENCHMARKS:
        if args.only and name not in args.only:
            continue
        extra = ["--quick"] if args.quick else []
        if args.quick and name in FULL_ONLY and not args.only:
            log(f"{name}: {FULL_ONLY[name]} (or name it with --only)")
            outcomes[name] = Outcome("skipped", detail=FULL_ONLY[name])
            continue
        if name in PEERS:
            absent = [n for n in PEERS[name] if build_nvidia_plugin.built(name=n) is None]
            if args.quick and absent:
                why = (
                    f"NVIDIA's {' and '.join(absent)} {build_nvidia_plugin.DEFAULT_VERSION} "
                    "not built, so the side by side is skipped; build with "
                    "`.venv/bin/python bench/build_nvidia_plugin.py`"
                )
                log(f"{name}: {why}")
                outcomes[name] = Outcome("skipped", detail=why)
                continue
            if not args.quick:
                extra = ["--build"]
        log(f"{name}: running {script} {' '.join(extra)}".rstrip())
        allowed = limit if args.quick else FULL_TIME_LIMIT_S.get(name, limit)
        outcome = run_benchmark(name, BENCH / script, extra, allowed)
        outcomes[name] = outcome
        for key, value in outcome.figures.items():
            figures[key if key not in figures else f"{name}.{key}"] = {**value, "benchmark": name}
        if outcome.status == "ok":
            log(f"{name}: ok in {outcome.seconds:.1f}s, {len(outcome.figures)} figures")
        else:
            log(f"{name}: FAILED ({outcome.detail}) after {outcome.seconds:.1f}s")
    total = time.monotonic() - started
    failed = [name for name, outcome in outcomes.items() if outcome.status == "failed"]
    results = {
        "machine": machine(mode),
        "seconds": round(total, 1),
        "figures": figures,
        "benchmarks": {
            name: {k: v for k, v in asdict(outcome).items() if k != "figures"}
            for name, outcome in outcomes.items()
        },
        "failed": failed,
    }
    partial = args.output.with_name(f".{args.output.name}.tmp")
    partial.write_text(json.dumps(results, indent=2) + "\n")
    partial.replace(args.output)
    log(f"{len(figures)} figures in {total:.0f}s ({mode}); written to {args.output}")
    if failed:
        log(f"failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
