"""Polled-vendor health figure: a fault state the vendor reports (Kunlunxin `xpu-smi`; Hygon and
Ascend through the rocm_smi and DCMI libraries the simulated nodes have, their tools where a node
lacks them) → the device Unhealthy in ListAndWatch, per vendor. A fault state with no fault code
raises no event, so each is found by the poll; bench/vendor_events.py measures the event path.

    .venv/bin/python bench/polled_bench.py [--quick] [--injections 20] [--poll-seconds 1]

The agent runs as its own process (`edl-agent run`) on each simulated profile with a kubelet
stand-in; the fault is written into the simulated tool's output (as `edl-agent simulate inject
--health` does) and shows at the agent's next poll, so the figure is bounded by
`health.poll_seconds` (1 s by default: expect about half of it at p50). After each fault the
device reports healthy again and the bench waits for it to turn Healthy
(`health.quiet_seconds` is set tiny for that). Each fault waits a random part of the poll
interval first, so that faults do not all land at the same point of the poll loop.

Prints one `name value unit` line per figure.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


from edl_agent.sim import ascend_tree, hygon_tree, kunlunxin_tree  # noqa: E402
from edl_agent.sim.profile import load_profile  # noqa: E402
from edl_agent.sim.tree import build_tree  # noqa: E402
from tests.kubelet_standin import KubeletStandIn  # noqa: E402

# figure name, profile, resource, fault, recovery
VENDORS: list[tuple[str, str, str, Callable[[Path, int], None], Callable[[Path, int], None]]] = [
    (
        "xpu",
        "kunlun-p800x8",
        "kunlunxin.com/xpu",
        lambda root, i: kunlunxin_tree.set_xpu_state(root, i, "Fault"),
        lambda root, i: kunlunxin_tree.set_xpu_state(root, i, "Normal"),
    ),
    (
        "dcu",
        "hygon-k100x8",
        "hygon.com/dcunum",
        lambda root, i: hygon_tree.set_dcu_state(root, i, "Fault"),
        lambda root, i: hygon_tree.set_dcu_state(root, i, "Normal"),
    ),
    (
        "npu",
        "ascend-910bx8",
        "huawei.com/Ascend910",
        lambda root, i: ascend_tree.set_npu_health(root, i, "Critical"),
        lambda root, i: ascend_tree.set_npu_health(root, i, "OK"),
    ),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="--injections 2")
    parser.add_argument("--injections", type=int, help="faults per vendor (default 20)")
    parser.add_argument("--poll-seconds", type=float, default=1.0, help="health.poll_seconds")
    args = parser.parse_args()
    injections = args.injections or (2 if args.quick else 20)
    for name, profile, resource, fault, recover in VENDORS:
        print(f"[polled] {profile}: {injections} faults", file=sys.stderr, flush=True)
        seconds = measure(
            profile=profile,
            resource=resource,
            fault=fault,
            recover=recover,
            injections=injections,
            poll_seconds=args.poll_seconds,
        )
        print(f"polled_{name}_fault_to_listandwatch_p50 {statistics.median(seconds) * 1000:.0f} ms")
        print(f"polled_{name}_fault_to_listandwatch_max {max(seconds) * 1000:.0f} ms")
    print(f"polled_poll_interval {args.poll_seconds * 1000:.0f} ms")
    return 0


def measure(
    *,
    profile: str,
    resource: str,
    fault: Callable[[Path, int], None],
    recover: Callable[[Path, int], None],
    injections: int,
    poll_seconds: float,
    prepare: Callable[[Path], None] | None = None,
) -> list[float]:
    """Seconds from each `fault` to the device Unhealthy in ListAndWatch (`recover` after each,
    waiting for Healthy); `prepare` changes the tree before the agent starts."""
    with agent_on(profile, resource, poll_seconds=poll_seconds, prepare=prepare) as (tree, kubelet):
        watch = kubelet.watch(resource)
        count = len(watch.next(timeout=10).devices)
        seconds = []
        rng = random.Random(11)  # noqa: S311 - a repeatable sample, not a secret
        for i in range(injections):
            device = i % count
            # A random phase against the poll loop, else every fault lands at the same point of
            # the interval (just after the poll that saw the last recovery).
            time.sleep(rng.uniform(0, poll_seconds))
            started = time.perf_counter()
            fault(tree, device)
            watch.until(lambda u: _unhealthy(u) == 1, timeout=10 + 3 * poll_seconds)
            seconds.append(time.perf_counter() - started)
            recover(tree, device)
            watch.until(lambda u: _unhealthy(u) == 0, timeout=10 + 3 * poll_seconds)
        watch.cancel()
    return seconds


@contextlib.contextmanager
def agent_on(
    profile: str,
    resource: str,
    *,
    poll_seconds: float,
    metrics_addr: str = "127.0.0.1:0",
    prepare: Callable[[Path], None] | None = None,
) -> Iterator[tuple[Path, KubeletStandIn]]:
    """`edl-agent run` on a simulated `profile` (its tree changed by `prepare` first) beside a
    kubelet stand-in, once `resource` is registered: (the tree, the stand-in)."""
    with tempfile.TemporaryDirectory(prefix="edl-bench-") as tmp:
        tree = Path(tmp) / "node"
        build_tree(load_profile(profile), tree)
        if prepare is not None:
            prepare(tree)
        kubelet = KubeletStandIn(Path(tmp) / "kubelet")
        kubelet.start()
        agent = subprocess.Popen(
            [
                sys.executable, "-m", "edl_agent.cli", "run", "--host-root", str(tree),
                "--kubelet-dir", str(kubelet.directory), "--metrics-addr", metrics_addr,
                "--state-dir", str(Path(tmp) / "state"), "--log-level", "error",
                "--set", f"health.poll_seconds={poll_seconds}",
                "--set", "health.quiet_seconds=0.001",
            ],
            cwd=REPO, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            kubelet.wait_registered({resource}, timeout=60)
            yield tree, kubelet
        finally:
            agent.terminate()
            agent.wait(timeout=20)
            kubelet.stop()


def _unhealthy(update: object) -> int:
    return sum(d.health != "Healthy" for d in getattr(update, "devices", []))


if __name__ == "__main__":
    sys.exit(main())
