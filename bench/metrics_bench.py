"""Metrics figures: /metrics scrape latency over HTTP for an 8-GPU dgx-h100 node with pod
attribution through a pod-resources stand-in on a real unix socket, and the process's RSS
after many scrapes (it should stay flat).

    .venv/bin/python bench/metrics_bench.py [--quick] [--scrapes 1000] [--soak 10000] [--pods 8]

`--quick` is `--scrapes 200 --soak 3000`. Prints one `name value unit` line per figure.
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchstats import percentile  # noqa: E402

from edl_agent import log  # noqa: E402
from edl_agent.config import load_settings  # noqa: E402
from edl_agent.devices.discovery import discover_node  # noqa: E402
from edl_agent.health.model import DeviceTelemetry  # noqa: E402
from edl_agent.health.state import DeviceState  # noqa: E402
from edl_agent.kubelet.podresources import PodResourcesClient  # noqa: E402
from edl_agent.metrics.collectors import EdlCollector, build_registry  # noqa: E402
from edl_agent.metrics.inputs import AgentCounts, HealthCounts  # noqa: E402
from edl_agent.metrics.server import MetricsServer  # noqa: E402
from edl_agent.sim.profile import load_profile  # noqa: E402
from edl_agent.sim.tree import build_tree  # noqa: E402
from tests.podresources_standin import PodResourcesStandIn  # noqa: E402

RESOURCE = "nvidia.com/gpu"
REPLICAS = 4  # time-slicing, so that several pods can hold one GPU


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="--scrapes 200 --soak 3000")
    parser.add_argument("--scrapes", type=int, help="timed scrapes (default 1,000)")
    parser.add_argument("--soak", type=int, help="scrapes for the RSS figure (default 10,000)")
    parser.add_argument("--pods", type=int, default=8, help="pods holding one GPU replica each")
    args = parser.parse_args()
    scrapes = args.scrapes or (200 if args.quick else 1_000)
    soak_scrapes = args.soak or (3_000 if args.quick else 10_000)
    log.configure("error")
    with tempfile.TemporaryDirectory(prefix="edl-bench-") as tmp:
        tree = Path(tmp) / "node"
        build_tree(load_profile("dgx-h100"), tree)
        settings = load_settings(
            overrides={
                "host_root": str(tree),
                "sharing": [{"resource": RESOURCE, "replicas": REPLICAS}],
            }
        )
        state = DeviceState(discover_node(settings))
        replicas: dict[str, list[str]] = {}
        for unit in state.snapshot().units[RESOURCE].values():
            replicas.setdefault(unit.device_id, []).append(unit.id)
        by_gpu = [sorted(ids) for _, ids in sorted(replicas.items())]
        standin = PodResourcesStandIn(Path(tmp) / "pod-resources" / "kubelet.sock")
        standin.start()
        standin.assign(
            {
                ("bench", f"pod-{i}"): {
                    "main": {RESOURCE: [by_gpu[i % len(by_gpu)][i // len(by_gpu) % REPLICAS]]}
                }
                for i in range(args.pods)
            }
        )
        client = PodResourcesClient(standin.socket, timeout=2.0)
        gpus = [d.id for d in state.snapshot().devices.values()]
        collector = EdlCollector(
            snapshot=state.snapshot,
            telemetry=lambda: [
                DeviceTelemetry(g, 45.0, 350.0, 60.0, 40_000.0, 81_559.0, 0, 0) for g in gpus
            ],
            health_counts=lambda: HealthCounts(xid_errors={(gpus[0], 13): 2}),
            agent_counts=lambda: AgentCounts(discovery_seconds=0.01, registrations=1),
            pods=lambda: client.pod_devices(state.snapshot().units),
        )
        server = MetricsServer("127.0.0.1:0", build_registry(collector))
        server.start()
        try:
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            size, series = scrape(connection)
            print(f"scrape_bytes {size} bytes")
            print(f"healthy_series {series} series")
            latencies = []
            for _ in range(scrapes):
                started = time.perf_counter()
                scrape(connection)
                latencies.append(time.perf_counter() - started)
            print(f"scrape_p50 {percentile(latencies, 50) * 1000:.3f} ms")
            print(f"scrape_p99 {percentile(latencies, 99) * 1000:.3f} ms")
            print(f"scrape_mean {statistics.fmean(latencies) * 1000:.3f} ms")
            soak(connection, soak_scrapes)
            connection.close()
            print(f"pod_resources_list_calls {standin.calls} calls")
        finally:
            server.stop()
            client.close()
            standin.stop()
    return 0


def scrape(connection: http.client.HTTPConnection) -> tuple[int, int]:
    connection.request("GET", "/metrics")
    response = connection.getresponse()
    body = response.read()
    assert response.status == 200, body
    return len(body), body.count(b"\nedl_device_healthy{")


def soak(connection: http.client.HTTPConnection, scrapes: int) -> None:
    process = psutil.Process()
    warmup = 100
    for _ in range(warmup):
        scrape(connection)
    before = process.memory_info().rss
    for _ in range(scrapes - warmup):
        scrape(connection)
    after = process.memory_info().rss
    print(f"rss_after_{warmup} {before / 2**20:.1f} MiB")
    print(f"rss_after_{scrapes} {after / 2**20:.1f} MiB")
    print(f"rss_growth {(after - before) / 2**20:.2f} MiB")


if __name__ == "__main__":
    sys.exit(main())
