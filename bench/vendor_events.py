"""Vendor health through libraries and events: an Ascend fault event → the NPU Unhealthy in
ListAndWatch, beside the same fault found by polling `npu-smi`; and the vendor tools an idle
agent starts in a minute, per vendor and source.

    .venv/bin/python bench/vendor_events.py [--quick] [--injections 20] [--window 60]

The agent runs as its own process (`edl-agent run`) on a simulated node with a kubelet stand-in.

- Fault → ListAndWatch: a chip is made Critical with fault code 0x8C03A000 (RestartNPU) by
  `ascend_tree.set_npu_health`, which is what `edl-agent simulate inject` does: the fake
  libdcmi.so raises the fault event and the tool's output shows it. On the node with the
  library, the agent's DCMI subscription sees the event; with the library removed, the agent
  polls `npu-smi` every `health.poll_seconds` (1 s). Each fault waits a random part of the poll
  interval first, so that faults land at every point of the poll loop; after each, the chip
  reads OK again and the bench waits for Healthy.
- Idle launches: each node idles for a window (60 s, 5 s with --quick) after registering; the
  agent's own `edl_vendor_tool_runs_total` (every vendor tool it starts, for discovery and
  health) is read from /metrics before and after, scaled to a minute.

Prints one `name value unit` line per figure.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import polled_bench  # noqa: E402

from edl_agent.sim import ascend_dcmi, ascend_tree  # noqa: E402
from tests.kubelet_standin import KubeletStandIn  # noqa: E402

RESTART_NPU = 0x8C03A000
NPU_RESOURCE = "huawei.com/Ascend910"
# figure name, profile, resource, whether the DCMI library stays
IDLE_NODES = [
    ("ascend_dcmi", "ascend-910bx8", NPU_RESOURCE, True),
    ("ascend_npu_smi", "ascend-910bx8", NPU_RESOURCE, False),
    ("hygon_rocm_smi", "hygon-k100x8", "hygon.com/dcunum", True),
    ("kunlunxin_xpu_smi", "kunlun-p800x8", "kunlunxin.com/xpu", True),
]


@dataclass
class Node:
    tree: Path
    kubelet: KubeletStandIn
    metrics_port: int

    def tool_runs(self) -> float:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "edl_vendor_tool_runs_total"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="--injections 3 --window 5")
    parser.add_argument("--injections", type=int, help="faults per source (default 20)")
    parser.add_argument("--window", type=float, help="idle seconds per node (default 60)")
    parser.add_argument("--poll-seconds", type=float, default=1.0, help="health.poll_seconds")
    args = parser.parse_args()
    injections = args.injections or (3 if args.quick else 20)
    window = args.window or (5.0 if args.quick else 60.0)

    figures: dict[str, list[float]] = {}
    for source, library in (("dcmi_event", True), ("npu_smi_poll", False)):
        log(f"ascend-910bx8 through {source}: {injections} faults")
        figures[source] = fault_latencies(library, injections, args.poll_seconds)
        print(f"npu_{source}_fault_to_listandwatch_p50 {ms(statistics.median(figures[source]))} ms")
        print(f"npu_{source}_fault_to_listandwatch_max {ms(max(figures[source]))} ms")
    ratio = statistics.median(figures["npu_smi_poll"]) / statistics.median(figures["dcmi_event"])
    print(f"npu_event_vs_poll_speedup_p50 {ratio:.1f} x")

    for name, profile, resource, library in IDLE_NODES:
        log(f"{profile} ({name}): idle for {window:g} s")
        with idle_node(profile, resource, library=library, poll_seconds=args.poll_seconds) as node:
            time.sleep(3.0)  # settle: the first polls and the start's discovery are over
            before = node.tool_runs()
            time.sleep(window)
            launched = node.tool_runs() - before
        print(f"idle_tool_launches_per_minute_{name} {launched * 60 / window:.1f} launches")
    print(f"vendor_poll_interval {args.poll_seconds * 1000:.0f} ms")
    return 0


def fault_latencies(library: bool, injections: int, poll_seconds: float) -> list[float]:
    return polled_bench.measure(
        profile="ascend-910bx8",
        resource=NPU_RESOURCE,
        fault=lambda tree, chip: ascend_tree.set_npu_health(tree, chip, "Critical", [RESTART_NPU]),
        recover=lambda tree, chip: ascend_tree.set_npu_health(tree, chip, "OK"),
        injections=injections,
        poll_seconds=poll_seconds,
        prepare=None if library else ascend_dcmi.remove,
    )


@contextlib.contextmanager
def idle_node(profile: str, resource: str, *, library: bool, poll_seconds: float) -> Iterator[Node]:
    port = _free_port()
    with polled_bench.agent_on(
        profile,
        resource,
        poll_seconds=poll_seconds,
        metrics_addr=f"127.0.0.1:{port}",
        prepare=None if library else ascend_dcmi.remove,
    ) as (tree, kubelet):
        yield Node(tree, kubelet, port)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def log(message: str) -> None:
    print(f"[vendor_events] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
