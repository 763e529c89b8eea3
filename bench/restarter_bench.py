"""Restarter figures on a real API server with KWOK: 1,000 nodes and 10,000 running pods under
one FaultTolerancePolicy, the restarter running as its own process (`edl-agent restarter`).

    .venv/bin/python bench/restarter_bench.py [--quick] [--nodes 1000] [--pods 10000]

  restarter_fault_to_replacement_p50/p99   a container exits (KWOK, exit 137) → its replacement
                                           pod exists; both seen on one watch of the pods
  restarter_burst_drain_seconds            --burst containers exit at once → the last
                                           replacement exists (from the first exit seen)
  restarter_not_ready_to_replacement       a node turns NotReady → the last of its pods'
                                           replacements exists; minus the node grace too
  restarter_api_writes_per_restart         the restarter's own writes to the API during the
                                           burst (edl_restarter_api_writes_total), per restart
  restarter_sync_seconds, restarter_rss    the restarter's start (list + watch of everything)
                                           and its memory with all the pods cached

Prints one `name value unit` line per figure; progress goes to stderr. --quick: 100 nodes,
1,000 pods, 30 timed faults and a burst of 90 (about half a minute). Needs scripts/k8s-binaries.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import yaml
from kubernetes import client

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

import testcluster  # noqa: E402
from benchstats import percentile  # noqa: E402

NAMESPACE = "bench"
GROUP, VERSION, PLURAL = "edl.io", "v1alpha1", "faulttolerancepolicies"
KWOK_NODE = {testcluster.KWOK_NODE_ANNOTATION: testcluster.KWOK_NODE_ANNOTATION_VALUE}
FAIL = "pod-container-running-failed.stage.kwok.x-k8s.io"
NOT_READY = "node-not-ready.stage.kwok.x-k8s.io"
WORKERS_PER_JOB = 8


def progress(message: str) -> None:
    print(f"restarter-bench: {message}", file=sys.stderr, flush=True)


def figure(name: str, value: float, unit: str) -> None:
    print(f"{name} {value:.4g} {unit}", flush=True)


class Cluster:
    def __init__(self, plane: testcluster.ControlPlane) -> None:
        config = client.Configuration()
        config.host = plane.server
        config.ssl_ca_cert = str(plane.ca_file)
        config.api_key = {"authorization": plane.token}
        config.api_key_prefix = {"authorization": "Bearer"}
        config.connection_pool_maxsize = 32
        self.api = client.ApiClient(config)
        self.core: Any = client.CoreV1Api(self.api)
        self.objects: Any = client.CustomObjectsApi(self.api)

    def parallel(self, calls: list[Callable[[], object]], what: str) -> float:
        started = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            for future in [pool.submit(call) for call in calls]:
                future.result()
        took = time.monotonic() - started
        progress(f"{what}: {len(calls)} in {took:.1f}s")
        return took

    def raw(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        response = method(*args, _preload_content=False, **kwargs)
        data: dict[str, Any] = json.loads(response.data)
        return data


def install_policy(cluster: Cluster) -> None:
    crd = yaml.safe_load((REPO / "deploy/daemonset/crd-faulttolerancepolicy.yaml").read_text())
    extensions = client.ApiextensionsV1Api(cluster.api)
    extensions.create_custom_resource_definition(crd)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = extensions.read_custom_resource_definition(crd["metadata"]["name"]).status
        if any(c.type == "Established" and c.status == "True" for c in status.conditions or []):
            break
        time.sleep(0.2)
    cluster.core.create_namespace({"metadata": {"name": NAMESPACE}})


def make_policies(cluster: Cluster, jobs: int) -> None:
    """One policy per job, as a training operator makes them (a policy's status grows with
    the jobs it has restarted)."""

    def policy(job: str) -> dict[str, Any]:
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "FaultTolerancePolicy",
            "metadata": {"name": job, "namespace": NAMESPACE},
            "spec": {
                "selector": {"matchLabels": {"app": "train", "bench/job": job}},
                "jobLabel": "bench/job",
                "replicaTypeLabel": "bench/type",
                "replicaIndexLabel": "bench/index",
                "restartLimit": 1000,
                "backoff": {"initialSeconds": 0, "maxSeconds": 0},
                "faultTolerantPolicy": [
                    {"restartPolicy": "ExitCode", "exitCodes": "137"},
                    {"restartPolicy": "OnNodeFail", "exceptionalEvent": "nodeNotReady"},
                ],
            },
        }

    def create(job: str) -> Callable[[], object]:
        return lambda: create_policy(cluster, NAMESPACE, policy(job))

    cluster.parallel([create(job_name(i)) for i in range(jobs)], "policies created")


def create_policy(cluster: Cluster, namespace: str, body: dict[str, Any]) -> object:
    """Create a FaultTolerancePolicy; again while the CRD's REST mapping still lags its
    Established condition."""
    for _ in range(50):
        try:
            return cluster.raw(
                cluster.objects.create_namespaced_custom_object,
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                body,
            )
        except client.exceptions.ApiException as exc:
            if exc.status != 404:
                raise
            time.sleep(0.2)
    raise SystemExit("the FaultTolerancePolicy CRD never became usable")


def job_name(job: int) -> str:
    return f"job{job:05d}"


def make_nodes(cluster: Cluster, count: int, pattern: str = "kwok-node-{:04d}") -> list[str]:
    names = [pattern.format(i) for i in range(count)]

    def create(name: str) -> Callable[[], object]:
        resources = {"cpu": "96", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": "8"}
        body = {
            "metadata": {
                "name": name,
                "annotations": KWOK_NODE,
                "labels": {"kubernetes.io/hostname": name, "type": "kwok"},
            },
            "status": {"capacity": resources, "allocatable": resources},
        }
        return lambda: cluster.raw(cluster.core.create_node, body)

    cluster.parallel([create(n) for n in names], "nodes created")
    return names


def make_pods(cluster: Cluster, nodes: list[str], count: int) -> list[str]:
    names = [f"{job_name(i // WORKERS_PER_JOB)}-worker-{i % WORKERS_PER_JOB}" for i in range(count)]

    def create(index: int, name: str) -> Callable[[], object]:
        body = {
            "metadata": {
                "name": name,
                "labels": {
                    "app": "train",
                    "bench/job": job_name(index // WORKERS_PER_JOB),
                    "bench/type": "worker",
                    "bench/index": str(index % WORKERS_PER_JOB),
                },
                "annotations": {
                    f"{FAIL}/exit-code": "137",
                    f"{FAIL}/delay": "0",
                    f"{FAIL}/jitter-delay": "0",
                },
            },
            "spec": {
                "nodeName": nodes[index % len(nodes)],
                "restartPolicy": "Never",
                "containers": [{"name": "worker", "image": "fake"}],
            },
        }
        return lambda: cluster.raw(cluster.core.create_namespaced_pod, NAMESPACE, body)

    cluster.parallel([create(i, n) for i, n in enumerate(names)], "pods created")
    started = time.monotonic()
    while True:
        running = sum(
            1
            for p in cluster.raw(cluster.core.list_namespaced_pod, NAMESPACE)["items"]
            if (p.get("status") or {}).get("phase") == "Running"
        )
        if running == count:
            break
        progress(f"KWOK runs {running} of {count} pods ({time.monotonic() - started:.0f}s)")
        time.sleep(5)
    progress(f"all {count} pods Running after {time.monotonic() - started:.1f}s")
    return names


class Watch:
    """One watch of the bench's pods and of the nodes: when each exit and each pod was seen."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.exited: dict[str, float] = {}
        self.added: dict[str, float] = {}
        self.not_ready: dict[str, float] = {}
        self.changed = threading.Condition()
        self._responses: list[Any] = []
        pods_rv = cluster.raw(cluster.core.list_namespaced_pod, NAMESPACE, limit=1)
        nodes_rv = cluster.raw(cluster.core.list_node, limit=1)
        self._threads = [
            threading.Thread(
                target=self._run,
                args=(cluster.core.list_namespaced_pod, (NAMESPACE,), pods_rv, self._pod),
                daemon=True,
            ),
            threading.Thread(
                target=self._run,
                args=(cluster.core.list_node, (), nodes_rv, self._node),
                daemon=True,
            ),
        ]
        for thread in self._threads:
            thread.start()

    def _run(
        self,
        method: Callable[..., Any],
        args: tuple[str, ...],
        listed: dict[str, Any],
        handle: Callable[[dict[str, Any], float], None],
    ) -> None:
        response = method(
            *args,
            watch=True,
            resource_version=listed["metadata"]["resourceVersion"],
            timeout_seconds=3600,
            _preload_content=False,
        )
        self._responses.append(response)
        try:
            for line in response:
                if line.strip():
                    handle(json.loads(line)["object"], time.monotonic())
        except Exception:  # the stream is closed at the end
            return

    def _pod(self, pod: dict[str, Any], now: float) -> None:
        name = pod["metadata"]["name"]
        with self.changed:
            if name not in self.added:
                self.added[name] = now
            for status in (pod.get("status") or {}).get("containerStatuses") or []:
                if (status.get("state") or {}).get("terminated") and name not in self.exited:
                    self.exited[name] = now
            self.changed.notify_all()

    def _node(self, node: dict[str, Any], now: float) -> None:
        name = node["metadata"]["name"]
        conditions = (node.get("status") or {}).get("conditions") or []
        ready = next((c for c in conditions if c.get("type") == "Ready"), None)
        if ready is not None and ready.get("status") != "True":
            with self.changed:
                self.not_ready.setdefault(name, now)
                self.changed.notify_all()

    def wait(self, what: str, done: Callable[[], bool], timeout: float) -> None:
        with self.changed:
            if not self.changed.wait_for(done, timeout):
                raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")

    def close(self) -> None:
        for response in self._responses:
            # A stream whose connection already ended has no socket left to shut (EBADF).
            with contextlib.suppress(OSError):
                (getattr(response, "shutdown", None) or response.close)()


def node_fails(cluster: Cluster, node: str) -> None:
    """What the node lifecycle controller does when a kubelet stops posting status: Ready turns
    Unknown, lastTransitionTime now. KWOK lets go of the node first; its own not-ready stage
    would date the transition back to the node's creation and so skip the grace."""
    annotations = dict.fromkeys(KWOK_NODE)
    cluster.raw(cluster.core.patch_node, node, {"metadata": {"annotations": annotations}})
    time.sleep(1)
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    ready = {
        "type": "Ready",
        "status": "Unknown",
        "reason": "NodeStatusUnknown",
        "message": "Kubelet stopped posting node status.",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
    cluster.raw(
        cluster.core.patch_node_status,
        node,
        {"status": {"conditions": [ready]}},
        _content_type="application/strategic-merge-patch+json",
    )


def fail(cluster: Cluster, name: str) -> None:
    cluster.raw(
        cluster.core.patch_namespaced_pod,
        name,
        NAMESPACE,
        {"metadata": {"labels": {FAIL: "true"}}},
    )


class RestarterProcess:
    def __init__(self, plane: testcluster.ControlPlane, grace: float, log: Path) -> None:
        self.port = testcluster.free_port()
        self._log = log.open("wb")
        argv = [
            sys.executable, "-m", "edl_agent.cli", "restarter",
            "--kubeconfig", str(plane.kubeconfig), "--namespace", NAMESPACE,
            "--listen", "", "--no-leader-elect", "--metrics-addr", f"127.0.0.1:{self.port}",
            "--node-grace-seconds", str(grace), "--log-level", "warning",
        ]  # fmt: skip
        self.started = time.monotonic()
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        self.ps = psutil.Process(self.process.pid)

    def wait_ready(self, timeout: float = 300) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"the restarter exited with {self.process.returncode}")
            try:
                url = f"http://127.0.0.1:{self.port}/readyz"
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return time.monotonic() - self.started
            except OSError:
                pass
            time.sleep(0.1)
        raise SystemExit("the restarter never became ready")

    def writes(self) -> float:
        """edl_restarter_api_writes_total, all kinds together, as its /metrics says now."""
        url = f"http://127.0.0.1:{self.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("edl_restarter_api_writes_total{")
        )

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


def sequential(cluster: Cluster, watch: Watch, pods: Iterator[str], count: int) -> list[float]:
    latencies = []
    for _ in range(count):
        name = next(pods)
        fail(cluster, name)
        watch.wait(f"{name}-r1", lambda n=name: f"{n}-r1" in watch.added, 30)  # type: ignore[misc]
        with watch.changed:
            latencies.append(watch.added[f"{name}-r1"] - watch.exited[name])
    return latencies


def burst(cluster: Cluster, watch: Watch, names: list[str]) -> tuple[float, float]:
    cluster.parallel([lambda n=n: fail(cluster, n) for n in names], "burst of exits asked")  # type: ignore[misc]
    watch.wait(
        "the burst's replacements",
        lambda: all(f"{n}-r1" in watch.added for n in names),
        120,
    )
    with watch.changed:
        first = min(watch.exited[n] for n in names)
        last_exit = max(watch.exited[n] for n in names)
        done = max(watch.added[f"{n}-r1"] for n in names)
    return done - first, done - last_exit


def not_ready(
    cluster: Cluster, watch: Watch, nodes: list[str], names: list[str], grace: float
) -> None:
    node = nodes[-1]  # its pods were not touched before unless pods < 2 x nodes
    on_node = [n for i, n in enumerate(names) if i % len(nodes) == len(nodes) - 1]
    node_fails(cluster, node)
    watch.wait(
        "the replacements of the NotReady node's pods",
        lambda: all(f"{n}-r1" in watch.added for n in on_node),
        grace + 60,
    )
    with watch.changed:
        took = max(watch.added[f"{n}-r1"] for n in on_node) - watch.not_ready[node]
    figure("restarter_not_ready_to_replacement", took, "s")
    figure("restarter_not_ready_beyond_grace", took - grace, "s")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="100 nodes, 1,000 pods, burst 90")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=10_000)
    parser.add_argument("--faults", type=int, default=200, help="sequential faults timed")
    parser.add_argument("--burst", type=int, default=500, help="faults at once")
    parser.add_argument("--grace", type=float, default=5.0, help="the restarter's node grace")
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.pods, args.faults, args.burst, args.grace = 100, 1000, 30, 90, 2.0
    with tempfile.TemporaryDirectory(prefix="edl-restarter-bench-") as scratch:
        directory = Path(scratch)
        plane = testcluster.start(directory / "plane", attached=True)
        restarter: RestarterProcess | None = None
        watch: Watch | None = None
        try:
            cluster = Cluster(plane)
            install_policy(cluster)
            make_policies(cluster, -(-args.pods // WORKERS_PER_JOB))
            nodes = make_nodes(cluster, args.nodes)
            names = make_pods(cluster, nodes, args.pods)
            restarter = RestarterProcess(plane, args.grace, directory / "restarter.log")
            figure("restarter_sync_seconds", restarter.wait_ready(), "s")
            figure("restarter_rss", restarter.ps.memory_info().rss / 2**20, "MiB")
            watch = Watch(cluster)
            # One pod per job for the timed faults, so that no two share a job's record.
            singles = iter(names[::WORKERS_PER_JOB])
            latencies = sequential(cluster, watch, singles, args.faults)
            figure("restarter_fault_to_replacement_p50", statistics.median(latencies) * 1000, "ms")
            figure("restarter_fault_to_replacement_p99", percentile(latencies, 99) * 1000, "ms")
            burst_names = [n for _, n in zip(range(args.burst), singles, strict=False)]
            writes_before = restarter.writes()
            drained, after_last = burst(cluster, watch, burst_names)
            figure(f"restarter_burst{len(burst_names)}_drain_seconds", drained, "s")
            figure(f"restarter_burst{len(burst_names)}_after_last_exit", after_last, "s")
            time.sleep(1)  # the last deletes
            writes = restarter.writes() - writes_before
            figure("restarter_api_writes_per_restart", writes / len(burst_names), "writes")
            not_ready(cluster, watch, nodes, names, args.grace)
            figure("restarter_rss_after", restarter.ps.memory_info().rss / 2**20, "MiB")
            cpu = restarter.ps.cpu_times()
            figure("restarter_cpu_seconds", cpu.user + cpu.system, "s")
        finally:
            if watch is not None:
                watch.close()
            if restarter is not None:
                restarter.stop()
            plane.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
