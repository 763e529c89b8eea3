"""The restarter at a fleet's size, on a real etcd + kube-apiserver + KWOK: thousands of nodes,
tens of thousands of pods over hundreds of jobs under their FaultTolerancePolicies (several per
namespace, several namespaces), two restarter replicas with leader election, and one agent per
node holding a TLS channel to the intake with a token bound to its agent pod (fleet_agents.py,
a process of its own).

    .venv/bin/python bench/fleet_scale.py [--quick] [--nodes 5000] [--pods 50000] [--jobs 500]
        [--relay on|off] [--steady-seconds 300] [--idle-seconds 600] [--rack 500]
        [--loads burst,steady,idle,kill,rack] [--set KEY=VALUE ...]

The loads, in this order (or those --loads names), each fault naming a pod never faulted before
(DeviceUnhealthy from the agent on that pod's node, which the policies' OnNodeFail rule
restarts):
  burst    one report from every node outside the rack, all within one second
  steady   --rate (10) reports a second for --steady-seconds
  idle     --idle-seconds with every channel open at the start and nothing sent (the intake
           closes connections idle for its idle timeout, 5 minutes)
  kill     the steady load for --kill-seconds, the leader SIGKILLed a third of the way in (its
           Deployment, here the bench, starts another replica; the standby takes over)
  rack     --rack nodes NotReady at once (Ready=Unknown, as the node lifecycle controller
           posts it) with the storm guard at 5 %: held; then all come back but 5 % of the fleet:
           the storm is over, and the pods of the nodes still down are replaced once, the others
           never

Figures (`name value unit` lines; progress on stderr), per load: report → replacement created
(the report's first send in the agents' process to the replacement's ADDED on the bench's pod
watch, both CLOCK_MONOTONIC) p50/p99; the intake's answering call p50/p99; lost (a faulted pod
never replaced) and doubled (replaced more than once, or a pod replaced that was not faulted).
Then the restarter's figures: start → ready, failover → the new leader ready, RSS and what the
pod cache costs per pod, CPU per 1,000 faults, fds, threads, its API requests (the API server's
audit log, the restarter's service account only) at idle and per fault, TokenReviews per report,
and etcd's and kube-apiserver's memory. The exit status is 1 when a fault was lost or doubled,
or a pod replaced unasked. --quick: 500 nodes, 5,000 pods, 50 jobs, short loads (about 3
minutes). Needs scripts/k8s-binaries.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from kubernetes import client

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "scripts"), str(REPO), str(REPO / "tests" / "cluster")]

import testcluster  # noqa: E402
from benchstats import percentile  # noqa: E402
from chaos_harness import RestarterFleet  # noqa: E402
from idle_minute import audit_requests, with_audit  # noqa: E402
from intake_storm import make_certificate  # noqa: E402
from restarter_bench import KWOK_NODE, Cluster, create_policy, install_policy, make_nodes  # noqa: E402

from edl_agent.restarter.core.pod_cache import slim_pod  # noqa: E402
from edl_agent.restarter.core.replacement import (  # noqa: E402
    BASE_NAME_ANNOTATION,
    RESTART_COUNT_ANNOTATION,
)

GROUP, VERSION, PLURAL = "edl.io", "v1alpha1", "faulttolerancepolicies"
SYSTEM = "edl-system"
AGENT_SA, RESTARTER_SA = "edl-agent", "edl-restarter"
RESTARTER_USER = f"system:serviceaccount:{SYSTEM}:{RESTARTER_SA}"
AUDIENCE = "edl-restarter"
SERVER_NAME = "edl-restarter.test"
STORM_SHARE = 0.05
GRACE = 10.0  # longer than making a rack of 500 nodes NotReady takes
APP = "train"


def progress(message: str) -> None:
    print(f"fleet-scale: {message}", file=sys.stderr, flush=True)


def figure(name: str, value: float, unit: str) -> None:
    print(f"{name} {value:.4g} {unit}", flush=True)


# --- the fleet ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pod:
    namespace: str
    name: str
    node: str
    uid: str = ""


@dataclass
class Fleet:
    nodes: list[str]
    pods: list[Pod]
    tokens: dict[str, str] = field(default_factory=dict)

    def by_node(self) -> dict[str, list[Pod]]:
        found: dict[str, list[Pod]] = defaultdict(list)
        for pod in self.pods:
            found[pod.node].append(pod)
        return found


def namespaces(count: int) -> list[str]:
    return [f"team-{i}" for i in range(count)]


def make_namespaces(cluster: Cluster, names: Iterable[str]) -> None:
    for name in (SYSTEM, *names):
        cluster.core.create_namespace({"metadata": {"name": name}})


def make_policies(cluster: Cluster, spaces: list[str], per_namespace: int) -> None:
    def policy(namespace: str, number: int) -> Callable[[], object]:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "FaultTolerancePolicy",
            "metadata": {"name": f"policy-{number}", "namespace": namespace},
            "spec": {
                "selector": {"matchLabels": {"app": APP, "bench/policy": f"policy-{number}"}},
                "jobLabel": "bench/job",
                "replicaTypeLabel": "bench/type",
                "replicaIndexLabel": "bench/index",
                "restartLimit": 1000,
                "backoff": {"initialSeconds": 0, "maxSeconds": 0},
                "faultTolerantPolicy": [{"restartPolicy": "OnNodeFail", "restartScope": "Pod"}],
            },
        }

        return lambda: create_policy(cluster, namespace, body)

    calls = [policy(ns, n) for ns in spaces for n in range(per_namespace)]
    cluster.parallel(calls, "policies created")


def make_pods(
    cluster: Cluster,
    nodes: list[str],
    spaces: list[str],
    *,
    jobs: int,
    per_namespace: int,
    count: int,
) -> list[Pod]:
    """`count` workers over `jobs` jobs; job j in namespace j % namespaces under policy
    (j // namespaces) % per_namespace; the workers spread over the nodes."""
    per_job = max(1, count // jobs)
    made: list[Pod] = []
    lock = threading.Lock()

    def create(index: int) -> Callable[[], object]:
        job = min(index // per_job, jobs - 1)
        namespace = spaces[job % len(spaces)]
        policy = (job // len(spaces)) % per_namespace
        worker = index - job * per_job
        node = nodes[index % len(nodes)]
        name = f"job{job:04d}-w{worker}"
        body = {
            "metadata": {
                "name": name,
                "labels": {
                    "app": APP,
                    "bench/policy": f"policy-{policy}",
                    "bench/job": f"job{job:04d}",
                    "bench/type": "worker",
                    "bench/index": str(worker),
                },
            },
            "spec": {
                "nodeName": node,
                "restartPolicy": "Never",
                "containers": [{"name": "worker", "image": "registry.invalid/train:1"}],
            },
        }

        def call() -> object:
            created = cluster.raw(cluster.core.create_namespaced_pod, namespace, body)
            with lock:
                made.append(Pod(namespace, name, node, created["metadata"]["uid"]))
            return created

        return call

    cluster.parallel([create(i) for i in range(count)], "pods created")
    return made


def make_agents(cluster: Cluster, nodes: list[str]) -> dict[str, str]:
    """An agent pod on every node (KWOK runs it) and a token for the restarter's audience bound
    to it, as kubelet projects it into the DaemonSet's pod."""
    cluster.core.create_namespaced_service_account(SYSTEM, {"metadata": {"name": AGENT_SA}})
    tokens: dict[str, str] = {}
    lock = threading.Lock()

    def agent(node: str) -> Callable[[], object]:
        def call() -> object:
            pod = cluster.raw(
                cluster.core.create_namespaced_pod,
                SYSTEM,
                {
                    "metadata": {"name": f"edl-agent-{node}", "labels": {"app": "edl-agent"}},
                    "spec": {
                        "nodeName": node,
                        "serviceAccountName": AGENT_SA,
                        "containers": [{"name": "agent", "image": "registry.invalid/edl:1"}],
                    },
                },
            )
            request = {
                "spec": {
                    "audiences": [AUDIENCE],
                    "expirationSeconds": 6 * 3600,
                    "boundObjectRef": {
                        "kind": "Pod",
                        "apiVersion": "v1",
                        "name": pod["metadata"]["name"],
                        "uid": pod["metadata"]["uid"],
                    },
                }
            }
            answer = cluster.raw(
                cluster.core.create_namespaced_service_account_token, AGENT_SA, SYSTEM, request
            )
            with lock:
                tokens[node] = answer["status"]["token"]
            return answer

        return call

    cluster.parallel([agent(n) for n in nodes], "agent pods and their tokens made")
    return tokens


def restarter_kubeconfig(cluster: Cluster, plane: testcluster.ControlPlane, path: Path) -> None:
    """The restarter's own identity, a service account, so that the audit log tells its requests
    from the bench's."""
    cluster.core.create_namespaced_service_account(SYSTEM, {"metadata": {"name": RESTARTER_SA}})
    client.RbacAuthorizationV1Api(cluster.api).create_cluster_role_binding(
        {
            "metadata": {"name": "bench-restarter"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "cluster-admin",
            },
            "subjects": [{"kind": "ServiceAccount", "name": RESTARTER_SA, "namespace": SYSTEM}],
        }
    )
    answer = cluster.raw(
        cluster.core.create_namespaced_service_account_token,
        RESTARTER_SA,
        SYSTEM,
        {"spec": {"expirationSeconds": 6 * 3600}},
    )
    testcluster._write_kubeconfig(
        path, plane.server, plane.ca_file, answer["status"]["token"], user=RESTARTER_USER
    )


def wait_running(cluster: Cluster, spaces: list[str], timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        waiting = [
            ns
            for ns in (SYSTEM, *spaces)
            if cluster.raw(
                cluster.core.list_namespaced_pod,
                ns,
                field_selector="status.phase!=Running",
                limit=1,
            )["items"]
        ]
        if not waiting:
            return time.monotonic() - started
        progress(f"KWOK has pods still to run in {', '.join(waiting)}")
        time.sleep(5)
    raise SystemExit("KWOK did not run every pod in time")


# --- what the restarter does --------------------------------------------------------------------


class Ledger:
    """Every replacement pod of the bench's jobs (by its base name and restart count), seen on
    one watch of the pods of every namespace from the moment it starts."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.replacements: dict[tuple[str, str], list[tuple[int, str, float]]] = defaultdict(list)
        self.changed = threading.Condition()
        self._stop = threading.Event()
        self._response: Any = None
        listed = cluster.raw(cluster.core.list_pod_for_all_namespaces, limit=1)
        self._version = listed["metadata"]["resourceVersion"]
        self._thread = threading.Thread(target=self._run, name="ledger", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._response = self.cluster.core.list_pod_for_all_namespaces(
                    watch=True,
                    label_selector=f"app={APP}",
                    resource_version=self._version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=600,
                    _preload_content=False,
                )
                for line in self._response:
                    if line.strip():
                        self._seen(json.loads(line), time.monotonic())
            except Exception as exc:  # the stream is closed at the end
                if self._stop.is_set():
                    return
                progress(f"the ledger's watch ended ({type(exc).__name__}); watching again")
                time.sleep(0.5)

    def _seen(self, event: dict[str, Any], now: float) -> None:
        pod = event["object"]
        metadata = pod.get("metadata") or {}
        self._version = metadata.get("resourceVersion", self._version)
        if event["type"] != "ADDED":
            return
        annotations = metadata.get("annotations") or {}
        base = annotations.get(BASE_NAME_ANNOTATION)
        if base is None:
            return
        count = int(annotations.get(RESTART_COUNT_ANNOTATION, "0"))
        with self.changed:
            self.replacements[(metadata["namespace"], base)].append((count, metadata["uid"], now))
            self.changed.notify_all()

    def first(self, pod: Pod) -> float | None:
        with self.changed:
            seen = self.replacements.get((pod.namespace, pod.name))
            return min(at for _, _, at in seen) if seen else None

    def wait(self, pods: list[Pod], timeout: float) -> bool:
        def done() -> bool:
            return all((p.namespace, p.name) in self.replacements for p in pods)

        with self.changed:
            return self.changed.wait_for(done, timeout)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError, AttributeError):
            self._response.shutdown()


@dataclass
class Verdict:
    lost: int = 0
    doubled: int = 0
    unasked: int = 0  # a pod replaced that no fault was about


def judge(ledger: Ledger, faulted: set[tuple[str, str]]) -> Verdict:
    verdict = Verdict()
    with ledger.changed:
        for key in faulted:
            seen = ledger.replacements.get(key, [])
            if not seen:
                verdict.lost += 1
            verdict.doubled += max(0, len({uid for _, uid, _ in seen}) - 1)
        verdict.unasked = sum(1 for key in ledger.replacements if key not in faulted)
    return verdict


class Agents:
    """The fleet_agents.py process."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "fleet_agents.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            preexec_fn=testcluster._die_with_parent(),  # noqa: PLW1509 - only prctl
        )
        self.ps = psutil.Process(self.process.pid)

    def ask(self, command: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def answer(self, op: str) -> dict[str, Any]:
        assert self.process.stdout is not None
        while line := self.process.stdout.readline():
            message: dict[str, Any] = json.loads(line)
            if message["op"] == op:
                return message
        raise SystemExit(f"the agents' process ended (waiting for {op!r})")

    def send(self, batch: str, faults: list[tuple[Pod, float]]) -> list[dict[str, Any]]:
        self.ask(
            {
                "op": "send",
                "batch": batch,
                "faults": [
                    {
                        "id": f"{batch}/{p.namespace}/{p.name}",
                        "node": p.node,
                        "namespace": p.namespace,
                        "pod": p.name,
                        "uid": p.uid,
                        "at": at,
                    }
                    for p, at in faults
                ],
            }
        )
        answers = []
        assert self.process.stdout is not None
        while line := self.process.stdout.readline():
            message = json.loads(line)
            if message["op"] == "answer":
                answers.append(message)
            elif message["op"] == "sent":
                return answers
        raise SystemExit("the agents' process ended while sending")

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.ask({"op": "close"})
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# --- the audit log -------------------------------------------------------------------------------

AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["ResponseStarted", "ResponseComplete", "Panic"],
    "rules": [{"level": "Metadata", "users": [RESTARTER_USER]}, {"level": "None"}],
}


def audit_next_plane(directory: Path) -> Path:
    """The API server of the next testcluster.start() logs the restarter's requests."""
    audit_log = directory / "audit.log"
    with_audit(directory / "audit-policy.yaml", audit_log, AUDIT_POLICY)
    return audit_log


def requests_between(audit_log: Path, start: float, end: float) -> Counter[str]:
    """The restarter's requests received within [start, end) (epoch seconds)."""
    return audit_requests(audit_log, start, end, user=RESTARTER_USER)


# --- the loads -----------------------------------------------------------------------------------


class Pool:
    """The pods not faulted yet, taken one node after another so that faults spread."""

    def __init__(self, fleet: Fleet, keep_off: set[str]) -> None:
        self._by_node = {n: list(p) for n, p in fleet.by_node().items() if n not in keep_off}
        self._order = [n for n in fleet.nodes if n in self._by_node]
        self._next = 0

    def take(self, count: int) -> list[Pod]:
        taken: list[Pod] = []
        misses = 0
        while len(taken) < count and misses < len(self._order):
            node = self._order[self._next % len(self._order)]
            self._next += 1
            if self._by_node[node]:
                taken.append(self._by_node[node].pop())
                misses = 0
            else:
                misses += 1
        if len(taken) < count:
            raise SystemExit(f"only {len(taken)} unfaulted pods left, {count} wanted")
        return taken

    def one_per_node(self) -> list[Pod]:
        return [self._by_node[n].pop() for n in self._order if self._by_node[n]]


@dataclass
class Bench:
    cluster: Cluster
    ledger: Ledger
    agents: Agents
    restarters: RestarterFleet
    audit_log: Path
    faulted: set[tuple[str, str]] = field(default_factory=set)

    def run_load(self, name: str, faults: list[tuple[Pod, float]], timeout: float) -> None:
        """Send `faults`, wait for their replacements, print the load's figures."""
        self.faulted.update((p.namespace, p.name) for p, _ in faults)
        progress(f"{name}: {len(faults)} reports over {max(at for _, at in faults):.1f}s")
        cpu = cpu_by_process()
        answers = self.agents.send(name, faults)
        if not self.ledger.wait([p for p, _ in faults], timeout):
            progress(f"{name}: not every replacement seen within {timeout:.0f}s")
        used = cpu_used(cpu)
        progress(
            f"{name}: CPU seconds by process: "
            + ", ".join(f"{k} {v:.1f}" for k, v in sorted(used.items(), key=lambda kv: -kv[1]))
        )
        self.figures(name, faults, answers)

    def figures(
        self, name: str, faults: list[tuple[Pod, float]], answers: list[dict[str, Any]]
    ) -> None:
        sent = {a["id"]: a for a in answers}
        latencies = []
        for pod, _ in faults:
            answer = sent.get(f"{name}/{pod.namespace}/{pod.name}")
            seen = self.ledger.first(pod)
            if answer is not None and seen is not None:
                latencies.append(seen - answer["sent"])
        verdicts = Counter(a["verdict"].split(":")[0] or "none" for a in answers)
        calls = [a["call_ms"] for a in answers if a["verdict"]]
        if latencies:
            figure(f"fleet_{name}_to_replacement_p50", statistics.median(latencies) * 1000, "ms")
            figure(f"fleet_{name}_to_replacement_p99", percentile(latencies, 99) * 1000, "ms")
            figure(f"fleet_{name}_to_last_replacement", max(latencies), "s")
        if calls:
            figure(f"fleet_{name}_intake_answer_p50", statistics.median(calls), "ms")
            figure(f"fleet_{name}_intake_answer_p99", percentile(calls, 99), "ms")
        retried = sum(a["attempts"] - 1 for a in answers)
        progress(f"{name}: verdicts {dict(verdicts)}, {retried} sends again")
        # DUPLICATE: a call answered after the agent had given up on it and sent it again.
        taken = verdicts["ACCEPTED"] + verdicts["DUPLICATE"]
        figure(f"fleet_{name}_not_taken", len(faults) - taken, "reports")
        figure(f"fleet_{name}_sends_again", retried, "calls")


def steady(pool: Pool, rate: float, seconds: float) -> list[tuple[Pod, float]]:
    count = int(rate * seconds)
    return [(pod, i / rate) for i, pod in enumerate(pool.take(count))]


def set_not_ready(cluster: Cluster, nodes: list[str], down: bool) -> None:
    """What the node lifecycle controller does when kubelets stop posting status: Ready turns
    Unknown, its lastTransitionTime now, so that the restarter's node grace runs from now
    (KWOK's own not-ready stage dates it back to the node's creation: no grace at all, and the
    first nodes of a rack would be acted on before the rest of it is seen). KWOK lets go of
    the nodes first (its annotation removed), and takes them back once they are Ready again."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    ready = {
        "type": "Ready",
        "status": "Unknown" if down else "True",
        "reason": "NodeStatusUnknown" if down else "KubeletReady",
        "message": "Kubelet stopped posting node status." if down else "kubelet is ready",
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
    annotations = {"metadata": {"annotations": dict.fromkeys(KWOK_NODE) if down else KWOK_NODE}}

    def annotate(node: str) -> object:
        return cluster.raw(cluster.core.patch_node, node, annotations)

    def post(node: str) -> object:
        return cluster.raw(
            cluster.core.patch_node_status,
            node,
            {"status": {"conditions": [ready]}},
            _content_type="application/strategic-merge-patch+json",
        )

    first, then = (annotate, post) if down else (post, annotate)
    cluster.parallel(
        [functools.partial(first, n) for n in nodes], "nodes let go" if down else "nodes Ready"
    )
    if down:
        time.sleep(1)  # KWOK's last heartbeat of them lands first
    cluster.parallel(
        [functools.partial(then, n) for n in nodes],
        "nodes NotReady" if down else "nodes taken back",
    )


def held_faults(restarters: RestarterFleet) -> float:
    """The leader's edl_restarter_held_faults now (0 while none leads or answers)."""
    leader = restarters.leader()
    if leader is None:
        return 0.0
    url = f"http://127.0.0.1:{leader.metrics_port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("edl_restarter_held_faults "):
            return float(line.split()[1])
    return 0.0


def rack_storm(bench: Bench, fleet: Fleet, rack: list[str]) -> None:
    """`rack` nodes NotReady at once (a storm at 5 %), their pods' faults held past the grace;
    then all Ready again but 5 % of the fleet, whose pods are then replaced once."""
    cluster, ledger = bench.cluster, bench.ledger
    on_rack = [p for p in fleet.pods if p.node in set(rack)]
    before = set(ledger.replacements)
    set_not_ready(cluster, rack, down=True)
    downed = time.monotonic()
    # Past their grace every pod on the rack is a node fault: seen held by the storm guard (the
    # leader's edl_restarter_held_faults), not replaced.
    deadline = downed + GRACE + 120
    while held_faults(bench.restarters) < len(on_rack):
        if time.monotonic() > deadline:
            raise SystemExit("the storm guard never held the rack's pods")
        time.sleep(0.2)
    figure("fleet_rack_held_after", time.monotonic() - downed, "s")
    held = [p for p in on_rack if (p.namespace, p.name) in ledger.replacements]
    figure("fleet_rack_replaced_while_storming", len(held), "pods")
    # The storm ends when the last of `back` is seen Ready: none of them is still down then.
    back = rack[: len(rack) - int(STORM_SHARE * len(fleet.nodes))]
    still = set(rack[len(back) :])
    expected = [p for p in on_rack if p.node in still and (p.namespace, p.name) not in before]
    set_not_ready(cluster, back, down=False)
    over = time.monotonic()
    progress(f"rack: {len(back)} nodes back; {len(expected)} pods on the {len(still)} still down")
    bench.faulted.update((p.namespace, p.name) for p in expected)
    if not ledger.wait(expected, 300):
        progress("rack: not every held replacement seen within 300 s")
    last = max((ledger.first(p) or over for p in expected), default=over)
    figure("fleet_rack_storm_over_to_last_replacement", last - over, "s")
    figure("fleet_rack_down_for", over - downed, "s")
    set_not_ready(cluster, sorted(still), down=False)


# --- the restarter's own figures -----------------------------------------------------------------


def leader_of(fleet: RestarterFleet, timeout: float) -> tuple[Any, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fleet.problem:
            raise SystemExit(fleet.problem)
        leader = fleet.leader()
        answer = leader.readyz() if leader is not None else None
        if answer is not None and answer[0] == 200 and answer[1].startswith("acting"):
            return leader, time.monotonic()
        time.sleep(0.1)
    raise SystemExit("no restarter replica became ready and leading")


def restarter_memory(leader: Any, restarters: RestarterFleet, pods: int) -> float:
    """The leader's RSS once it has listed everything (no agent connected yet), the standby's
    (which caches nothing), and what each pod adds over the standby; the leader's RSS."""
    standby = next(r for r in restarters.replicas() if r is not leader)
    rss = float(psutil.Process(leader.process.pid).memory_info().rss)
    baseline = psutil.Process(standby.process.pid).memory_info().rss
    figure("fleet_restarter_rss", rss / 2**20, "MiB")
    figure("fleet_restarter_standby_rss", baseline / 2**20, "MiB")
    figure("fleet_restarter_rss_per_pod_over_standby", (rss - baseline) / pods, "B")
    return rss


def usage(process: psutil.Process) -> dict[str, float]:
    cpu = process.cpu_times()
    return {
        "rss": process.memory_info().rss,
        "cpu": cpu.user + cpu.system,
        "fds": process.num_fds(),
        "threads": process.num_threads(),
    }


def cpu_by_process() -> dict[tuple[str, int], float]:
    """CPU seconds so far of this process and each of its descendants, by name (the restarter
    replicas and the agents' process by their command line) and pid."""
    found: dict[tuple[str, int], float] = {}
    me = psutil.Process()
    for process in (me, *me.children(recursive=True)):
        with contextlib.suppress(psutil.Error):
            line = " ".join(process.cmdline())
            if process is me:
                name = "bench"
            elif "fleet_agents" in line:
                name = "agents"
            elif "restarter" in line:
                name = "restarters"
            else:
                name = process.name()
            cpu = process.cpu_times()
            found[name, process.pid] = cpu.user + cpu.system
    return found


def cpu_used(before: dict[tuple[str, int], float]) -> dict[str, float]:
    """CPU seconds by name since `before` (a process gone since is left out: its last seconds
    are not known; one started since counts whole)."""
    used: dict[str, float] = defaultdict(float)
    for (name, pid), seconds in cpu_by_process().items():
        used[name] += seconds - before.get((name, pid), 0.0)
    return used


def plane_memory(prefix: str) -> None:
    me = psutil.Process()
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.name() in ("etcd", "kube-apiserver", "kwok"):
                name = child.name().replace("-", "_")
                figure(f"{prefix}_{name}_rss", child.memory_info().rss / 2**20, "MiB")


def cache_bytes(cluster: Cluster, spaces: list[str], sample: int) -> None:
    """What a pod costs in the restarter's cache whole (as the watch gives it) and slimmed
    (pod_cache.slim_pod, what it keeps): Python heap bytes per pod over a sample."""
    pods = cluster.raw(cluster.core.list_namespaced_pod, spaces[0], limit=sample)["items"]
    raw = [json.dumps(p) for p in pods]
    for name, build in (("whole", json.loads), ("slim", lambda t: slim_pod(json.loads(t)))):
        tracemalloc.start()
        kept = [build(text) for text in raw]
        size, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        figure(f"fleet_pod_cache_bytes_per_pod_{name}", size / len(kept), "B")
        del kept


# --- the run -------------------------------------------------------------------------------------


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="500 nodes, 5,000 pods, short loads")
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--pods", type=int, default=50_000)
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--namespaces", type=int, default=5)
    parser.add_argument("--policies-per-namespace", type=int, default=10)
    parser.add_argument("--rate", type=float, default=10.0, help="steady reports a second")
    parser.add_argument("--steady-seconds", type=float, default=300.0)
    parser.add_argument("--kill-seconds", type=float, default=90.0)
    parser.add_argument("--idle-seconds", type=float, default=600.0)
    parser.add_argument("--rack", type=int, default=500, help="nodes NotReady at once")
    parser.add_argument(
        "--relay",
        choices=("on", "off"),
        default="off",
        help="on: the intake's per-address gate in front of grpc, its cap set above the "
        "fleet's size (every agent here comes from 127.0.0.1); off (the default, as the "
        "restarter's): grpc alone",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a restarter setting for both replicas (`edl-agent restarter --set`), repeatable",
    )
    parser.add_argument(
        "--loads",
        default="burst,steady,idle,kill,rack",
        help="the loads to run, in their order (default: all)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="py-spy's stacks of the leader (holding the GIL) under the steady load",
    )
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.pods, args.jobs, args.rack = 500, 5000, 50, 50
        args.steady_seconds, args.kill_seconds, args.idle_seconds = 20.0, 20.0, 20.0
    if args.pods < args.jobs or args.rack * 2 > args.nodes:
        parser.error("need at least one pod per job and a rack of at most half the nodes")
    return args


def main() -> int:  # noqa: PLR0915 - one measurement, read top to bottom
    args = arguments()
    random.seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="edl-fleet-") as scratch:
        directory = Path(scratch)
        audit_log = audit_next_plane(directory)
        plane = testcluster.start(directory / "plane", attached=True)
        restarters: RestarterFleet | None = None
        ledger: Ledger | None = None
        agents: Agents | None = None
        try:
            cluster = Cluster(plane)
            spaces = namespaces(args.namespaces)
            install_policy(cluster)  # the CRD (and the `bench` namespace, unused here)
            make_namespaces(cluster, spaces)
            make_policies(cluster, spaces, args.policies_per_namespace)
            nodes = make_nodes(cluster, args.nodes, pattern="node-{:05d}")
            tokens = make_agents(cluster, nodes)
            pods = make_pods(
                cluster,
                nodes,
                spaces,
                jobs=args.jobs,
                per_namespace=args.policies_per_namespace,
                count=args.pods,
            )
            figure("fleet_pods_running_after", wait_running(cluster, spaces, 1800), "s")
            fleet = Fleet(nodes, pods, tokens)
            plane_memory("fleet_plane")
            cache_bytes(cluster, spaces, 1000)
            cert, key = make_certificate(directory)
            kubeconfig = directory / "restarter.kubeconfig"
            restarter_kubeconfig(cluster, plane, kubeconfig)
            port = testcluster.free_port()
            per_peer = args.nodes + 1000 if args.relay == "on" else 0
            flags = [
                "--listen", f"127.0.0.1:{port}", "--tls-cert", str(cert), "--tls-key", str(key),
                "--agent-service-account", f"{SYSTEM}/{AGENT_SA}", "--audience", AUDIENCE,
                "--node-grace-seconds", str(GRACE), "--storm-max-share", str(STORM_SHARE),
                "--log-level", "warning", "--log-format", "json",
                "--set", f"intake.max_connections_per_peer={per_peer}",
                "--set", f"intake.max_connections={max(8192, args.nodes + 1000)}",
                *[x for ns in spaces for x in ("--namespace", ns)],
                *[x for kv in args.set for x in ("--set", kv)],
            ]  # fmt: skip
            restarters = RestarterFleet(kubeconfig, SYSTEM, directory, size=2, flags=tuple(flags))
            restarters.start()
            leader, ready_at = leader_of(restarters, 600)
            figure("fleet_restarter_start_to_ready", ready_at - leader.started, "s")
            listed = restarter_memory(leader, restarters, len(pods))
            ledger = Ledger(cluster)
            agents = Agents()
            agents.ask(
                {
                    "op": "open",
                    "address": f"127.0.0.1:{port}",
                    "ca": str(cert),
                    "server_name": SERVER_NAME,
                    "tokens": tokens,
                }
            )
            opened = agents.answer("opened")
            figure("fleet_channels_open", opened["ready"], "channels")
            figure("fleet_channels_open_seconds", opened["seconds"], "s")
            with_channels = psutil.Process(leader.process.pid).memory_info().rss
            per_channel = (with_channels - listed) / max(1, opened["ready"])
            figure("fleet_restarter_rss_per_channel", per_channel, "B")
            bench = Bench(cluster, ledger, agents, restarters, audit_log)
            loads(bench, args, fleet, leader)
            verdict = judge(ledger, bench.faulted)
            figure("fleet_lost", verdict.lost, "faults")
            figure("fleet_doubled", verdict.doubled, "faults")
            figure("fleet_replaced_unasked", verdict.unasked, "pods")
            plane_memory("fleet_plane_after")
            return 1 if verdict.lost or verdict.doubled or verdict.unasked else 0
        finally:
            if agents is not None:
                agents.close()
            if ledger is not None:
                ledger.close()
            if restarters is not None:
                restarters.stop()
            plane.stop()


def loads(bench: Bench, args: argparse.Namespace, fleet: Fleet, leader: Any) -> None:
    rack = fleet.nodes[-args.rack :]
    pool = Pool(fleet, keep_off=set(rack))
    me = psutil.Process(leader.process.pid)
    at_ready = usage(me)
    figure("fleet_restarter_rss_with_channels", at_ready["rss"] / 2**20, "MiB")
    figure("fleet_restarter_fds", at_ready["fds"], "fds")
    figure("fleet_restarter_threads", at_ready["threads"], "threads")
    chosen = [name.strip() for name in args.loads.split(",") if name.strip()]
    runs: dict[str, Callable[[], None]] = {
        "burst": lambda: load_burst(bench, pool),
        "steady": lambda: load_steady(bench, args, pool, me),
        "idle": lambda: load_idle(bench, args, me),
        "kill": lambda: load_kill(bench, args, pool),
        "rack": lambda: rack_storm(bench, fleet, rack),
    }
    unknown = [name for name in chosen if name not in runs]
    if unknown:
        raise SystemExit(f"unknown loads: {', '.join(unknown)} (known: {', '.join(runs)})")
    for name in chosen:
        runs[name]()
    leader_now = bench.restarters.leader()
    if leader_now is not None and leader_now is not leader:
        rss = psutil.Process(leader_now.process.pid).memory_info().rss
        figure("fleet_new_leader_rss", rss / 2**20, "MiB")


def load_burst(bench: Bench, pool: Pool) -> None:
    wall = time.time()
    burst = [(pod, random.random()) for pod in pool.one_per_node()]  # noqa: S311
    bench.run_load("burst", burst, 900)
    reviews = requests_between(bench.audit_log, wall, time.time())
    figure("fleet_burst_token_reviews_per_report", reviews["create tokenreviews"] / len(burst), "")


def load_steady(bench: Bench, args: argparse.Namespace, pool: Pool, me: psutil.Process) -> None:
    profile = None
    if args.profile:
        profile = subprocess.Popen(
            ["py-spy", "record", "--pid", str(me.pid), "--rate", "100", "--format", "raw",
             "--threads", "--gil", "--output", args.profile, "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    wall, cpu = time.time(), usage(me)["cpu"]
    faults = steady(pool, args.rate, args.steady_seconds)
    bench.run_load("steady", faults, 120)
    if profile is not None:
        profile.send_signal(signal.SIGINT)
        profile.wait()
    took = time.time() - wall
    requests = requests_between(bench.audit_log, wall, time.time())
    figure(
        "fleet_restarter_cpu_per_1000_faults", (usage(me)["cpu"] - cpu) * 1000 / len(faults), "s"
    )
    figure("fleet_restarter_api_requests_per_fault", sum(requests.values()) / len(faults), "")
    progress(f"steady: the restarter's requests in {took:.0f}s: {dict(requests)}")


def load_idle(bench: Bench, args: argparse.Namespace, me: psutil.Process) -> None:
    at_idle = usage(me)
    wall = time.time()
    progress(f"idle: {args.idle_seconds:.0f}s with every channel open")
    time.sleep(args.idle_seconds)
    idle = requests_between(bench.audit_log, wall, time.time())
    after = usage(me)
    figure("fleet_idle_api_requests_per_minute", sum(idle.values()) * 60 / args.idle_seconds, "")
    figure("fleet_idle_rss_growth", (after["rss"] - at_idle["rss"]) / 2**20, "MiB")
    figure("fleet_idle_fds_before", at_idle["fds"], "fds")
    figure("fleet_idle_fds_after", after["fds"], "fds")
    figure("fleet_idle_threads_growth", after["threads"] - at_idle["threads"], "threads")
    figure("fleet_idle_cpu_percent", (after["cpu"] - at_idle["cpu"]) * 100 / args.idle_seconds, "%")
    progress(f"idle: the restarter's requests: {dict(idle)}")


def load_kill(bench: Bench, args: argparse.Namespace, pool: Pool) -> None:
    faults = steady(pool, args.rate, args.kill_seconds)
    bench.restarters.kill_leader_in(args.kill_seconds / 3)
    thread = threading.Thread(target=bench.run_load, args=("kill", faults, 180), daemon=True)
    thread.start()
    while bench.restarters.kills_pending():
        time.sleep(0.05)
    leader_of(bench.restarters, 120)
    figure("fleet_failover_to_ready", time.time() - bench.restarters.kills[-1].at, "s")
    thread.join()


if __name__ == "__main__":
    raise SystemExit(main())
