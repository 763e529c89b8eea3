"""Device-plugin figures: Allocate latency over a real unix socket with 1,000 advertised slice
ids, and the time from a kubelet restart to every resource registered again.

    .venv/bin/python bench/plugin_bench.py [--quick] [--calls 10000] [--restarts 20]

`--quick` is `--calls 1000 --restarts 5`.

Prints one `name value unit` line per figure.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchstats import percentile  # noqa: E402

from edl_agent import log  # noqa: E402
from edl_agent._proto.deviceplugin.v1beta1 import api_pb2  # noqa: E402
from edl_agent.agent import Agent  # noqa: E402
from edl_agent.config import load_settings  # noqa: E402
from edl_agent.sim.profile import load_profile  # noqa: E402
from edl_agent.sim.tree import build_tree  # noqa: E402
from tests.kubelet_standin import KubeletStandIn  # noqa: E402

RESOURCE = "nvidia.com/gpu"
REPLICAS = 125  # 8 GPUs x 125 = 1,000 advertised ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="--calls 1000 --restarts 5")
    parser.add_argument("--calls", type=int, help="Allocate calls (default 10,000)")
    parser.add_argument("--restarts", type=int, help="kubelet restarts (default 20)")
    args = parser.parse_args()
    calls = args.calls or (1000 if args.quick else 10_000)
    restarts = args.restarts or (5 if args.quick else 20)
    log.configure("error")
    with tempfile.TemporaryDirectory(prefix="edl-bench-") as tmp:
        tree = Path(tmp) / "node"
        build_tree(load_profile("dgx-h100"), tree)
        kubelet = KubeletStandIn(Path(tmp) / "kubelet")
        kubelet.start()
        settings = load_settings(
            overrides={
                "host_root": str(tree),
                "plugin": {"kubelet_dir": str(kubelet.directory)},
                "sharing": [{"resource": RESOURCE, "replicas": REPLICAS}],
                "faults": {"state_dir": str(Path(tmp) / "state")},
            }
        )
        agent = Agent.discover(settings)
        thread = threading.Thread(target=agent.run)
        thread.start()
        try:
            kubelet.wait_registered({RESOURCE})
            ids = list(agent.state.snapshot().resources[RESOURCE].device_ids)
            print(f"advertised_ids {len(ids)} ids")
            allocate_latencies(kubelet, ids, calls)
            restart_latencies(kubelet, restarts)
        finally:
            agent.stop.set()
            thread.join()
            kubelet.stop()
    return 0


def allocate_latencies(kubelet: KubeletStandIn, ids: list[str], calls: int) -> None:
    rng = random.Random(7)  # noqa: S311 - a repeatable sample, not a secret
    latencies = []
    with kubelet.plugin(RESOURCE) as stub:
        for _ in range(calls):
            request = api_pb2.AllocateRequest(
                container_requests=[
                    api_pb2.ContainerAllocateRequest(devices_ids=rng.sample(ids, 4))
                ]
            )
            started = time.perf_counter()
            stub.Allocate(request, timeout=5)
            latencies.append((time.perf_counter() - started) * 1000)
    print(f"allocate_p50 {statistics.median(latencies):.3f} ms")
    print(f"allocate_p99 {percentile(latencies, 99):.3f} ms")


def restart_latencies(kubelet: KubeletStandIn, restarts: int) -> None:
    seconds = []
    for _ in range(restarts):
        seen = len(kubelet.registrations)
        started = time.monotonic()
        kubelet.restart()
        kubelet.wait_registered({RESOURCE}, after=seen)
        seconds.append(time.monotonic() - started)
    print(f"reregister_p50 {statistics.median(seconds) * 1000:.1f} ms")
    print(f"reregister_max {max(seconds) * 1000:.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
