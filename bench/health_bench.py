"""Health figures: injected XID → ListAndWatch update latency, and the agent's idle CPU and RSS.

    .venv/bin/python bench/health_bench.py [--quick] [--injections 1000] [--idle-seconds 30]

The agent runs as its own process (`edl-agent run`) on a simulated dgx-h100 with a kubelet
stand-in; XIDs go through the fake NVML library's fault file and arrive as real NVML events.
`--quick` is `--injections 40 --idle-seconds 5`. Prints one `name value unit` line per figure.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchstats import percentile  # noqa: E402

from edl_agent.sim import inject  # noqa: E402
from edl_agent.sim.profile import load_profile  # noqa: E402
from edl_agent.sim.tree import build_tree  # noqa: E402
from tests.kubelet_standin import KubeletStandIn  # noqa: E402

RESOURCE = "nvidia.com/gpu"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="--injections 40 --idle-seconds 5")
    parser.add_argument("--injections", type=int, help="XIDs injected (default 1,000)")
    parser.add_argument("--idle-seconds", type=float, help="idle CPU window (default 30)")
    args = parser.parse_args()
    injections = args.injections or (40 if args.quick else 1000)
    idle_seconds = args.idle_seconds or (5.0 if args.quick else 30.0)
    with tempfile.TemporaryDirectory(prefix="edl-bench-") as tmp:
        tree = Path(tmp) / "node"
        build_tree(load_profile("dgx-h100"), tree)
        kubelet = KubeletStandIn(Path(tmp) / "kubelet")
        kubelet.start()
        agent = subprocess.Popen(
            [
                sys.executable, "-m", "edl_agent.cli", "run", "--host-root", str(tree),
                "--state-dir", str(tree / "state"),
                "--kubelet-dir", str(kubelet.directory), "--metrics-addr", "127.0.0.1:0",
                "--log-level", "error", "--set", "health.quiet_seconds=0.05",
                "--set", 'health.xid_clears_by={"48": "quiet"}',  # recover at once: re-measure
            ],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            kubelet.wait_registered({RESOURCE}, timeout=60)
            idle(psutil.Process(agent.pid), idle_seconds)
            latencies(kubelet, tree, injections)
        finally:
            agent.terminate()
            agent.wait(timeout=20)
            kubelet.stop()
    return 0


def idle(process: psutil.Process, seconds: float) -> None:
    time.sleep(2)  # let start-up settle
    before = process.cpu_times()
    time.sleep(seconds)
    after = process.cpu_times()
    busy = (after.user - before.user) + (after.system - before.system)
    print(f"agent_idle_cpu {100 * busy / seconds:.3f} percent_of_a_core")
    print(f"agent_rss {process.memory_info().rss / 2**20:.1f} MiB")


def latencies(kubelet: KubeletStandIn, tree: Path, injections: int) -> None:
    watch = kubelet.watch(RESOURCE)
    ids = [d.ID for d in watch.next().devices]
    seconds = []
    for i in range(injections):
        gpu = i % len(ids)
        started = time.perf_counter()
        inject.inject_xid(tree, gpu, 48)
        watch.until(lambda u, g=gpu: _health(u, ids[g]) == "Unhealthy", timeout=10)
        seconds.append(time.perf_counter() - started)
        watch.until(lambda u, g=gpu: _health(u, ids[g]) == "Healthy", timeout=10)
    watch.cancel()
    print(f"xid_to_listandwatch_p50 {statistics.median(seconds) * 1000:.2f} ms")
    print(f"xid_to_listandwatch_p99 {percentile(seconds, 99) * 1000:.2f} ms")
    print(f"xid_to_listandwatch_max {max(seconds) * 1000:.2f} ms")


def _health(update: object, device_id: str) -> str:
    devices = getattr(update, "devices", [])
    return next((d.health for d in devices if device_id == d.ID), "")


if __name__ == "__main__":
    sys.exit(main())
