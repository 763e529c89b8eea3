"""A node cut off from the control plane, with real kubelets, kube-controller-manager and
kube-scheduler: how many copies of a worker run, and how long until one runs again, under each
`fence` option and for a StatefulSet's pod.

Two kubelet v1.37 nodes whose runtime runs the pods' processes, an agent on each (simulated
dgx-h100), the restarter (node grace 2 s). The cut: node A's kubelet and agent stop while its
runtime and the worker's process go on, which is what a network partition looks like from the
control plane (the node lifecycle controller turns A NotReady 20 s after its last Lease renewal).
"The node is known gone": the operator stops A (its runtime and the worker go) and taints it
`node.kubernetes.io/out-of-service`, as Kubernetes documents for a node shut down for good.

A sampler reads every node's runtime every 0.1 s and keeps the most worker processes it saw
running at once:
- `fence: Force` (the default): the replacement runs on B while the old process still runs on
  the cut-off A: two copies, the price of the quicker recovery;
- `fence: Wait`: nothing is replaced while A is only cut off (the restarter announces
  `WaitingForNode` and looks again every round); once A is known gone, the replacement runs on
  B: never two copies;
- a StatefulSet's pod, whatever the fence: deleted gracefully, so it stays Terminating and its
  controller makes no second `-0`; once A is known gone, the pod garbage collector removes it and
  the StatefulSet controller makes the new one on B: never two copies.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import testcluster
import testnode
from k8s_test_helpers import GPU_RESOURCE, KwokCluster, wait_for
from kubelet_helpers import NodeAgent
from kubernetes import client
from scheduler import Process
from test_e2e import processes
from test_restarter import GROUP, PLURAL, VERSION
from test_training import managed_scheduler, policy_crd, start_restarter_and_agents

from edl_agent.restarter.adapters.nodes import OUT_OF_SERVICE_TAINT

__all__ = ["managed_scheduler", "policy_crd", "processes"]

# A cut-off node takes ~30 s to be NotReady; the scene starts two nodes and three processes.
pytestmark = [pytest.mark.kubelet, pytest.mark.timeout(400)]

APP = "fenced"
JOB_LABEL = "training.edl.io/job"
TYPE_LABEL = "training.edl.io/replica-type"
INDEX_LABEL = "apps.kubernetes.io/pod-index"  # what the StatefulSet controller sets
POOL_LABEL = "edl.io/test-pool"
WORKER = [sys.executable, "-c", "import time\nwhile True: time.sleep(1)"]
# Node lifecycle's grace (20 s) after the last Lease renewal (every 10 s), then ours (2 s).
STEP = 120.0
NODE_GRACE = "2"
SAMPLE_EVERY = 0.1
MERGE = "application/merge-patch+json"
CARRIED_OUT_AGAIN = "carrying out a recorded restart again"


# --- what runs where ----------------------------------------------------------------------------


class Copies:
    """Samples the worker processes running on the nodes' runtimes, on a thread of its own,
    and keeps the most seen at once (with when). A node stopped for good (`gone`) runs none."""

    def __init__(self, nodes: list[testnode.Node], namespace: str) -> None:
        self._nodes = nodes
        self._namespace = namespace
        self._gone: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.most = 0
        self.most_at = ""
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="copies", daemon=True)

    def __enter__(self) -> Copies:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def gone(self, node: testnode.Node) -> None:
        """Called before the node is stopped: from now on it counts as running nothing."""
        with self._lock:
            self._gone.add(node.name)

    def now(self) -> list[str]:
        """`node/pod (pid)` of each worker process running now."""
        running = []
        for node in self._nodes:
            with self._lock:
                if node.name in self._gone:
                    continue
            for view in node.containers():
                pid = int(view.get("pid") or 0)
                if (
                    view["namespace"] == self._namespace
                    and str(view["pod"]).startswith(APP)  # not the pods the agents' tokens name
                    and view["state"] == "CONTAINER_RUNNING"
                    and pid
                    and testcluster.pid_alive(pid)
                ):
                    running.append(f"{node.name}/{view['pod']} (pid {pid})")
        return running

    def sample(self) -> list[str]:
        running = self.now()
        with self._lock:
            if len(running) > self.most:
                self.most, self.most_at = len(running), ", ".join(running)
        return running

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except testnode.NodeError as exc:  # a node stopped without `gone` first
                self.error = exc
                return
            self._stop.wait(SAMPLE_EVERY)


# --- the scene ----------------------------------------------------------------------------------


@dataclass
class Scene:
    k8s: KwokCluster
    a: testnode.Node  # where the worker runs first, and what is cut off
    b: testnode.Node
    agents: dict[str, NodeAgent]
    restarter: Process
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, what: str) -> None:
        self.marks[what] = time.monotonic()

    def since(self, start: str, end: str) -> float:
        return self.marks[end] - self.marks[start]

    def cut_off_a(self) -> None:
        """A's kubelet and agent stop; its runtime and the worker go on."""
        self.mark("cut off")
        self.agents[self.a.name].stop()
        self.a.cut_off()

    def a_is_gone(self, copies: Copies) -> None:
        """What an operator does for a node that is down for good: it is stopped (runtime and
        worker with it), then tainted out-of-service."""
        copies.gone(self.a)
        self.a.stop(delete_node=False)
        self.k8s.core.patch_node(
            self.a.name,
            {
                "spec": {
                    "taints": [
                        *(t.to_dict() for t in self.k8s.core.read_node(self.a.name).spec.taints),
                        {"key": OUT_OF_SERVICE_TAINT, "value": "shutdown", "effect": "NoExecute"},
                    ]
                }
            },
            _content_type=MERGE,
        )
        self.mark("known gone")

    def wait_not_ready(self) -> None:
        wait_for(
            f"node {self.a.name} NotReady",
            lambda: self.k8s.core.read_node(self.a.name).status.conditions or [],
            lambda conditions: any(c.type == "Ready" and c.status != "True" for c in conditions),
            timeout=STEP,
        )
        self.mark("NotReady")

    def pods(self) -> list[Any]:
        return list(
            self.k8s.core.list_namespaced_pod(self.k8s.namespace, label_selector=f"app={APP}").items
        )

    def running_elsewhere(self, than_uid: str) -> Any:
        """The job's pod Running with another uid than `than_uid`."""
        found = wait_for(
            f"a Running pod of {APP} other than {than_uid}",
            self.pods,
            lambda pods: [
                p
                for p in pods
                if p.metadata.uid != than_uid
                and p.status.phase == "Running"
                and p.metadata.deletion_timestamp is None
            ],
            timeout=STEP,
            alive=self.restarter,
        )
        self.mark("replacement Running")
        return next(p for p in found if p.metadata.uid != than_uid and p.status.phase == "Running")

    def waiting_for_node(self, pod: str) -> None:
        wait_for(
            f"the WaitingForNode event about {pod}",
            lambda: [
                e
                for e in self.k8s.core.list_namespaced_event(self.k8s.namespace).items
                if e.involved_object.name == pod and e.reason == "WaitingForNode"
            ],
            bool,
            timeout=STEP,
            alive=self.restarter,
        )
        self.mark("WaitingForNode")

    def looked_again(self) -> None:
        """The restarter carried the waiting restart out again (and still waited): proof that
        it looked at the pod after its first decision, not just that nothing happened yet."""
        before = self._carried_out_again()
        wait_for(
            "the restarter to look at the waiting restart again",
            self._carried_out_again,
            lambda count: count > before,
            timeout=STEP,
            alive=self.restarter,
        )

    def _carried_out_again(self) -> int:
        count = 0
        for line in self.restarter.log.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            count += entry.get("event") == CARRIED_OUT_AGAIN
        return count

    def report(self, what: str) -> None:
        order = sorted(self.marks.items(), key=lambda item: item[1])
        start = self.marks["cut off"]
        steps = ", ".join(f"{name} +{at - start:.1f}s" for name, at in order)
        print(f"\n{what}: {steps}")
        if "known gone" in self.marks:
            took = self.since("known gone", "replacement Running")
            print(f"  node known gone → replacement Running: {took:.1f}s")


@pytest.fixture
def scene(  # noqa: PLR0917 - fixtures
    k8s_managed: KwokCluster,
    k8s_managed_plane: testcluster.ControlPlane,
    managed_kubelet_nodes: Callable[..., testnode.Node],
    managed_scheduler: Process,
    policy_crd: None,
    processes: list[Process],
    tmp_path: Path,
) -> Iterator[Scene]:
    a, b = managed_kubelet_nodes(exec_mode=True), managed_kubelet_nodes(exec_mode=True)
    for node in (a, b):
        k8s_managed.core.patch_node(
            node.name,
            {"metadata": {"labels": {POOL_LABEL: k8s_managed.namespace}}},
            _content_type=MERGE,
        )
    restarter, agents = start_restarter_and_agents(
        k8s_managed,
        k8s_managed_plane,
        {a.name: a, b.name: b},
        tmp_path,
        processes,
        f"--node-grace-seconds={NODE_GRACE}",
    )
    yield Scene(k8s_managed, a, b, agents, restarter)
    client.AppsV1Api(k8s_managed.api).delete_collection_namespaced_stateful_set(
        k8s_managed.namespace
    )


def make_policy(k8s: KwokCluster, fence: str) -> None:
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "FaultTolerancePolicy",
        "metadata": {"name": APP, "namespace": k8s.namespace},
        "spec": {
            "selector": {"matchLabels": {"app": APP}},
            "jobLabel": JOB_LABEL,
            "replicaTypeLabel": TYPE_LABEL,
            "replicaIndexLabel": INDEX_LABEL,
            "faultTolerantPolicy": [
                {
                    "exceptionalEvent": "nodeNotReady",
                    "restartPolicy": "OnNodeFail",
                    "restartScope": "Pod",
                }
            ],
            "restartLimit": 10,
            "fence": fence,
        },
    }
    client.CustomObjectsApi(k8s.api).create_namespaced_custom_object(
        GROUP, VERSION, k8s.namespace, PLURAL, body
    )


def worker_template(pool: str) -> dict[str, Any]:
    return {
        "metadata": {
            "labels": {"app": APP, JOB_LABEL: APP, TYPE_LABEL: "worker", INDEX_LABEL: "0"}
        },
        "spec": {
            "nodeSelector": {POOL_LABEL: pool},
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "worker",
                    "image": "registry.invalid/edl/worker:test",
                    "command": WORKER,
                    "resources": {"limits": {GPU_RESOURCE: "1"}},
                }
            ],
        },
    }


def start_bare_worker(scene: Scene) -> Any:
    template = worker_template(scene.k8s.namespace)
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{APP}-worker-0", **template["metadata"]},
        "spec": {**template["spec"], "nodeName": scene.a.name},
    }
    scene.k8s.core.create_namespaced_pod(scene.k8s.namespace, body)
    return scene.running_elsewhere("")


# --- the scenarios -----------------------------------------------------------------------------


def test_fence_force_recovers_while_the_cut_off_node_still_runs_the_old_copy(
    scene: Scene,
) -> None:
    make_policy(scene.k8s, "Force")
    old = start_bare_worker(scene)
    assert old.spec.node_name == scene.a.name
    with Copies([scene.a, scene.b], scene.k8s.namespace) as copies:
        scene.cut_off_a()
        scene.wait_not_ready()
        new = scene.running_elsewhere(old.metadata.uid)
        wait_for("the replacement's process", copies.sample, lambda now: len(now) == 2, 30)
    assert copies.error is None, copies.error
    assert new.spec.node_name == scene.b.name
    assert not [p for p in scene.pods() if p.metadata.uid == old.metadata.uid], (
        "Force: the old pod is force-deleted, not left Terminating"
    )
    assert copies.most == 2, f"two copies ran at once: {copies.most_at}"
    scene.report("fence Force")


def test_fence_wait_replaces_only_once_the_node_is_known_gone(scene: Scene) -> None:
    make_policy(scene.k8s, "Wait")
    old = start_bare_worker(scene)
    with Copies([scene.a, scene.b], scene.k8s.namespace) as copies:
        scene.cut_off_a()
        scene.wait_not_ready()
        scene.waiting_for_node(old.metadata.name)
        scene.looked_again()
        pods = scene.pods()
        assert [p.metadata.uid for p in pods] == [old.metadata.uid], (
            "nothing replaces the pod while its node is only cut off"
        )
        assert pods[0].metadata.deletion_timestamp is None, "a bare pod is left as it is"
        assert len(copies.sample()) == 1, "the old process still runs on the cut-off node"

        scene.a_is_gone(copies)
        new = scene.running_elsewhere(old.metadata.uid)
        wait_for("the replacement's process", copies.sample, lambda now: len(now) == 1, 30)
    assert copies.error is None, copies.error
    assert new.spec.node_name == scene.b.name
    assert copies.most == 1, f"two copies ran at once: {copies.most_at}"
    scene.report("fence Wait")


def test_a_statefulset_pod_is_never_run_twice(scene: Scene) -> None:
    """Whatever the fence (Force here), a StatefulSet's pod waits for its node."""
    make_policy(scene.k8s, "Force")
    k8s = scene.k8s
    apps = client.AppsV1Api(k8s.api)
    k8s.core.patch_node(
        scene.b.name, {"spec": {"unschedulable": True}}, _content_type=MERGE
    )  # -0 goes to A
    template = worker_template(k8s.namespace)
    apps.create_namespaced_stateful_set(
        k8s.namespace,
        {
            "metadata": {"name": APP},
            "spec": {
                "replicas": 1,
                "serviceName": APP,
                "selector": {"matchLabels": {"app": APP}},
                "template": {
                    "metadata": template["metadata"],
                    "spec": {**template["spec"], "restartPolicy": "Always"},
                },
            },
        },
    )
    old = scene.running_elsewhere("")
    assert (old.metadata.name, old.spec.node_name) == (f"{APP}-0", scene.a.name)
    k8s.core.patch_node(scene.b.name, {"spec": {"unschedulable": False}}, _content_type=MERGE)

    with Copies([scene.a, scene.b], k8s.namespace) as copies:
        scene.cut_off_a()
        scene.wait_not_ready()
        scene.waiting_for_node(old.metadata.name)
        # The restart is done once the pod is deleted gracefully: the restarter touches it no
        # more, and the StatefulSet makes no second -0 while this one is Terminating.
        [pod] = wait_for(
            f"{old.metadata.name} deleted gracefully (Terminating)",
            scene.pods,
            lambda pods: len(pods) == 1 and pods[0].metadata.deletion_timestamp is not None,
            timeout=STEP,
            alive=scene.restarter,
        )
        assert pod.metadata.uid == old.metadata.uid, "no second -0 while the first is there"
        assert len(copies.sample()) == 1, "the old process still runs on the cut-off node"

        scene.a_is_gone(copies)
        new = scene.running_elsewhere(old.metadata.uid)
        wait_for("the new -0's process", copies.sample, lambda now: len(now) == 1, 30)
    assert copies.error is None, copies.error
    assert (new.metadata.name, new.spec.node_name) == (f"{APP}-0", scene.b.name)
    assert copies.most == 1, f"two copies ran at once: {copies.most_at}"
    scene.report("StatefulSet")
