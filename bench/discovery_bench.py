"""Discovery figures: how long reading a node takes, per simulated profile
(edl_agent/sim/profiles/*.yaml).

    .venv/bin/python bench/discovery_bench.py [--quick] [--repeat 50] [--cli-runs 3]

For each profile, in a fresh process (so that the NVIDIA backend really loads its library):
`discovery_<profile>_first` is the first discover_node() call (library load and NVML init
included), `discovery_<profile>_p50` the median of the repeats after it. `discover_cli_<profile>`
is the wall time of the whole command `edl-agent discover --simulate <profile> --format json`
(Python start-up, building the simulated tree and printing included).

Prints one `name value unit` line per figure.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from edl_agent.sim.profile import profile_names  # noqa: E402


def figure_name(profile: str) -> str:
    return profile.replace("-", "_").replace(".", "_")


def one_profile(profile: str, repeat: int) -> None:
    """In this process: build `profile`'s tree, discover it once cold and `repeat` times warm."""
    from edl_agent import log
    from edl_agent.config import load_settings
    from edl_agent.devices.discovery import discover_node
    from edl_agent.sim.profile import load_profile
    from edl_agent.sim.tree import build_tree

    log.configure("error")
    loaded = load_profile(profile)
    with tempfile.TemporaryDirectory(prefix="edl-bench-") as tmp:
        tree = Path(tmp) / "node"
        build_tree(loaded, tree)
        settings = load_settings(
            overrides={"host_root": str(tree), "node_name": "bench"}, defaults=loaded.config
        )
        started = time.perf_counter()
        inventory = discover_node(settings)
        first = time.perf_counter() - started
        seconds = []
        for _ in range(repeat):
            started = time.perf_counter()
            discover_node(settings)
            seconds.append(time.perf_counter() - started)
    name = figure_name(profile)
    devices = sum(len(report.devices) for report in inventory.reports)
    print(f"discovery_{name}_devices {devices} devices")
    print(f"discovery_{name}_first {first * 1000:.2f} ms")
    print(f"discovery_{name}_p50 {statistics.median(seconds) * 1000:.2f} ms")


def cli_seconds(profile: str, runs: int) -> float:
    command = [sys.executable, "-m", "edl_agent.cli", "discover", "--simulate", profile]
    seconds = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(
            [*command, "--format", "json", "--log-level", "error"],
            cwd=REPO, stdout=subprocess.DEVNULL, check=True, timeout=120,
        )  # fmt: skip
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="--repeat 5 --cli-runs 1")
    parser.add_argument("--repeat", type=int, help="warm discoveries per profile (default 50)")
    parser.add_argument("--cli-runs", type=int, help="CLI runs per profile (default 3)")
    parser.add_argument("--one", metavar="PROFILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    repeat = args.repeat or (5 if args.quick else 50)
    if args.one:
        one_profile(args.one, repeat)
        return 0
    runs = args.cli_runs or (1 if args.quick else 3)
    for profile in profile_names():
        print(f"[discovery] {profile}", file=sys.stderr, flush=True)
        child = [sys.executable, __file__, "--one", profile, "--repeat", str(repeat)]
        subprocess.run(child, cwd=REPO, check=True, timeout=300)
        seconds = cli_seconds(profile, runs)
        print(f"discover_cli_{figure_name(profile)} {seconds * 1000:.0f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
