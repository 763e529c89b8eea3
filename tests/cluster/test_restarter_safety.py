"""The restarter's safety on a real API server: a restarter that dies mid-replacement and starts
again finishes the job once; two restarter processes elect one leader on a Lease and the other
takes over when it is killed; the storm guard holds node-failure restarts while too many nodes
fail; decisions show in the metrics and as Events."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import testcluster
from k8s_test_helpers import NODE_NOT_READY_LABEL, KwokCluster, wait_for
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_restarter import (  # fixtures too: pytest finds them among the module's names
    GROUP,
    PLURAL,
    VERSION,
    MakePolicy,
    caught_up,
    controller,
    crd,
    decisions,
    exit_pod,
    job_status,
    labels,
    make_policy,
    objects,
    pod_or_none,
    wait_deleted,
    wait_gone,
    wait_pod,
)

from edl_agent.restarter.adapters.events import EventWriter
from edl_agent.restarter.adapters.kube_controller import connect
from edl_agent.restarter.adapters.leader import LEADER_LABEL
from edl_agent.restarter.core.checkpoint import ANNOTATION as CHECKPOINT
from edl_agent.restarter.core.controller import Controller
from edl_agent.restarter.core.storm import StormGuard

LEASE = "edl-restarter"
STANDING_BY = "standing by: the lease holder renewed"
UNLABELLED = "could not label the restarter's pod"
__all__ = ["controller", "crd", "make_policy", "objects"]


def policy_body(namespace: str, name: str = "train", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "FaultTolerancePolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": {"app": "train"}},
            "jobLabel": "edl.test/job",
            "replicaTypeLabel": "edl.test/replica-type",
            "replicaIndexLabel": "edl.test/replica-index",
            "backoff": {"initialSeconds": 0, "maxSeconds": 0},
            **spec,
        },
    }


def new_controller(api: client.ApiClient, namespace: str, **kwargs: Any) -> Controller:
    config = copy.copy(api.configuration)
    config.connection_pool_maxsize = 16
    running = connect(client.ApiClient(config), namespaces=[namespace], **kwargs)
    running.start()
    assert running.wait_synced(30)
    return running


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus exposition, parsed by prometheus_client's parser."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def events(k8s: KwokCluster, reason: str) -> list[Any]:
    return [e for e in k8s.core.list_namespaced_event(k8s.namespace).items if e.reason == reason]


# --- killed mid-replacement ----------------------------------------------------------------


class Killed(SystemExit):
    """Ends the worker thread where it stands, as SIGKILL ends the process (a thread's
    SystemExit is silent; nothing after it runs)."""


# The Killed worker thread is reported by pytest; here that is the point.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("where", ["before-creating", "after-creating"])
def test_a_restarter_killed_mid_replacement_finishes_once_when_started_again(
    where: str,
    crd: Any,
    k8s: KwokCluster,
    k8s_api_client: client.ApiClient,
    objects: client.CustomObjectsApi,
) -> None:
    """Scope All over three pods; the first restarter dies at the second pod: before creating
    its replacement, or after creating it but before deleting the pod."""
    spec = {
        "faultTolerantPolicy": [
            {"restartPolicy": "ExitCode", "exitCodes": "137", "restartScope": "All"}
        ]
    }
    objects.create_namespaced_custom_object(
        GROUP, VERSION, k8s.namespace, PLURAL, policy_body(k8s.namespace, **spec)
    )
    node = k8s.create_gpu_node().metadata.name
    names = [f"llm-worker-{i}" for i in range(3)]
    for index, name in enumerate(names):
        k8s.create_pod(name, node=node, labels=labels("llm", "worker", index))

    first = new_controller(k8s_api_client, k8s.namespace)
    calls = {"replace": 0, "delete": 0}
    actuator: Any = first.port
    replace, delete = actuator.replace, actuator.delete

    def dying_replace(pod: Any, **kwargs: Any) -> Any:
        calls["replace"] += 1
        if where == "before-creating" and calls["replace"] == 2:
            raise Killed
        return replace(pod, **kwargs)

    def dying_delete(pod: Any, **kwargs: Any) -> None:
        calls["delete"] += 1
        if where == "after-creating" and calls["delete"] == 2:
            raise Killed
        delete(pod, **kwargs)

    actuator.replace = dying_replace
    actuator.delete = dying_delete
    try:
        wait_for("the policy", lambda: first.policies.knows(k8s.namespace, "train"), bool, 10)
        exit_pod(k8s, "llm-worker-0", 137)
        wait_for("the first restarter to die", first.workers_alive, lambda alive: not alive)
    finally:
        first.stop()

    job = job_status(objects, k8s.namespace, "train")
    assert job["restarts"] == 1
    (pending,) = job["pendingRestarts"]
    assert sorted(p["name"] for p in pending["pods"]) == names
    half_done = pod_or_none(k8s, "llm-worker-1-r1") is not None
    assert half_done == (where == "after-creating")
    assert pod_or_none(k8s, "llm-worker-2-r1") is None  # the third pod was not reached

    second = new_controller(k8s_api_client, k8s.namespace)
    try:
        assert second.recovered.wait(30)
        for name in names:
            wait_pod(k8s, f"{name}-r1")
            wait_deleted(k8s, name)
        job = wait_for(
            "the pending restart to be done",
            lambda: job_status(objects, k8s.namespace, "train"),
            lambda job: not job.get("pendingRestarts"),
            timeout=10,
        )
        # The deletions seen: any duplicate they gave is decided and carried out.
        caught_up(k8s, second)
        for name in names:
            assert pod_or_none(k8s, f"{name}-r2") is None
        assert decisions(second, "Restart", "ContainerExit") == 0  # finished, not decided again
        job = job_status(objects, k8s.namespace, "train")
        assert job["restarts"] == 1
        assert [a["action"] for a in job["lastActions"]] == ["Restart"]
    finally:
        second.stop()


# --- metrics and Events ------------------------------------------------------------------


def test_decisions_show_in_the_metrics_and_as_events(
    k8s: KwokCluster, make_policy: MakePolicy, controller: Controller
) -> None:
    make_policy(
        restartLimit=1, faultTolerantPolicy=[{"restartPolicy": "ExitCode", "exitCodes": "137"}]
    )
    node = k8s.create_gpu_node().metadata.name
    for index in range(2):
        k8s.create_pod(f"m-worker-{index}", node=node, labels=labels("m", "worker", index))
    exit_pod(k8s, "m-worker-0", 137)
    wait_pod(k8s, "m-worker-0-r1")
    exit_pod(k8s, "m-worker-1", 137)
    metric = (
        "edl_restarter_decisions_total",
        (("action", "LimitExceeded"), ("reason", "ContainerExit")),
    )
    depth = ("edl_restarter_queue_depth", ())
    text = wait_for(
        "the LimitExceeded decision in the metrics, and nothing in hand",
        lambda: _exposition(controller),
        lambda text: samples(text).get(metric) == 1 and samples(text).get(depth) == 0,
        timeout=10,
    )
    found = samples(text)
    restart = (("action", "Restart"), ("reason", "ContainerExit"))
    assert found[("edl_restarter_decisions_total", restart)] == 1
    latency = (("fault", "ContainerExit"),)
    assert found[("edl_restarter_fault_to_replacement_seconds_count", latency)] == 1
    # KWOK's exit happens well within the 10 s bucket on any machine that runs these tests.
    assert (
        found[("edl_restarter_fault_to_replacement_seconds_bucket", (*latency, ("le", "10.0")))]
        == 1
    )
    restarted = wait_for("a Restarted event", lambda: events(k8s, "Restarted"), bool, timeout=10)
    assert restarted[0].involved_object.kind == "FaultTolerancePolicy"
    assert "m-worker-0" in restarted[0].message
    limited = wait_for(
        "a RestartLimitExceeded event", lambda: events(k8s, "RestartLimitExceeded"), bool, 10
    )
    assert limited[0].type == "Warning"


def _exposition(controller: Controller) -> str:
    return generate_latest(controller.metrics.registry).decode()


# --- the storm guard ---------------------------------------------------------------------


def test_the_storm_guard_holds_node_restarts_until_the_storm_is_over(
    crd: Any,
    k8s: KwokCluster,
    k8s_api_client: client.ApiClient,
    objects: client.CustomObjectsApi,
) -> None:
    nodes = [k8s.create_gpu_node().metadata.name for _ in range(4)]
    total = len(k8s.core.list_node().items)
    # Two NotReady nodes are a storm, one is not, however many nodes other tests left.
    guard = StormGuard(max_share=1.5 / total, min_nodes=2)
    objects.create_namespaced_custom_object(
        GROUP,
        VERSION,
        k8s.namespace,
        PLURAL,
        policy_body(k8s.namespace, restartPolicy="OnNodeFail"),
    )
    for index, node in enumerate(nodes):
        k8s.create_pod(f"s-worker-{index}", node=node, labels=labels("s", "worker", index))
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "name": LEASE,
        "namespace": k8s.namespace,
    }
    config = copy.copy(k8s_api_client.configuration)
    api = client.ApiClient(config)
    running = connect(
        api,
        namespaces=[k8s.namespace],
        node_grace=1.0,
        storm=guard,
        events=EventWriter(api, instance="test"),
        storm_object=lease,
    )
    running.start()
    try:
        assert running.wait_synced(30)
        wait_for("the policy", lambda: running.policies.knows(k8s.namespace, "train"), bool, 10)
        k8s.core.patch_node(nodes[0], {"metadata": {"labels": {NODE_NOT_READY_LABEL: "true"}}})
        k8s.make_node_not_ready(nodes[1])
        k8s.wait_node_ready(nodes[0], False)
        wait_for(
            "the RestartStormPaused event", lambda: events(k8s, "RestartStormPaused"), bool, 10
        )
        assert running.metrics.registry.get_sample_value("edl_restarter_storm_paused") == 1
        # Past the node grace both pods fault: without the guard both would be replaced.
        wait_for(
            "both node faults held by the storm guard",
            lambda: running.metrics.registry.get_sample_value("edl_restarter_held_faults"),
            lambda held: held == 2,
            timeout=15,
        )
        caught_up(k8s, running)
        assert pod_or_none(k8s, "s-worker-0-r1") is None
        assert pod_or_none(k8s, "s-worker-1-r1") is None

        k8s.make_node_ready(nodes[0])  # one NotReady node left: no storm
        wait_pod(k8s, "s-worker-1-r1", timeout=15)
        over = wait_for(
            "the RestartStormOver event", lambda: events(k8s, "RestartStormOver"), bool, 10
        )
        assert "1 of 2 held faults" in over[0].message
        wait_deleted(k8s, "s-worker-1")
        caught_up(k8s, running)  # the released fault carried out, and what its deletion gave
        assert pod_or_none(k8s, "s-worker-0-r1") is None  # its node came back
        assert k8s.read_pod("s-worker-0").metadata.deletion_timestamp is None
        assert running.metrics.registry.get_sample_value("edl_restarter_storm_paused") == 0
    finally:
        running.stop()
        api.close()


# --- leader election between two processes ---------------------------------------------


def free_port() -> int:
    return testcluster.free_port()


class RestarterProcess:
    def __init__(
        self,
        plane: testcluster.ControlPlane,
        namespace: str,
        identity: str,
        log: Path,
        env: dict[str, str] | None = None,
    ):
        self.identity = identity
        self.port = free_port()
        self.log = log
        argv = [
            sys.executable,
            "-m",
            "edl_agent.cli",
            "restarter",
            "--kubeconfig",
            str(plane.kubeconfig),
            "--namespace",
            namespace,
            "--listen",
            "",
            "--metrics-addr",
            f"127.0.0.1:{self.port}",
            "--lease-namespace",
            namespace,
            "--identity",
            identity,
            "--lease-duration-seconds",
            "3",
            "--renew-deadline-seconds",
            "2",
            "--retry-period-seconds",
            "0.5",
            "--node-grace-seconds",
            "1",
            "--log-format",
            "json",
            "--log-level",
            "debug",
        ]
        self._out = log.open("wb")
        self.process = subprocess.Popen(
            argv, stdout=self._out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def ready(self) -> tuple[int, str] | None:
        """/readyz's status code and text (None while nothing answers)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as r:
                return int(r.status), r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError:
            return None

    def logged(self, event: str) -> int:
        """How many times the process has logged `event` so far (its JSON lines)."""
        count = 0
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            count += isinstance(entry, dict) and entry.get("event") == event
        return count

    def metric(self, name: str) -> float | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return None
        return samples(text).get((name, ()))

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._out.close()
        return self.process.returncode


def holder(k8s: KwokCluster) -> str | None:
    try:
        lease = k8s.coordination.read_namespaced_lease(LEASE, k8s.namespace)
    except ApiException:
        return None
    return lease.spec.holder_identity


def test_two_restarters_elect_one_leader_and_the_standby_takes_over(
    crd: Any,
    k8s: KwokCluster,
    k8s_control_plane: testcluster.ControlPlane,
    objects: client.CustomObjectsApi,
    tmp_path: Path,
) -> None:
    objects.create_namespaced_custom_object(
        GROUP,
        VERSION,
        k8s.namespace,
        PLURAL,
        policy_body(
            k8s.namespace, faultTolerantPolicy=[{"restartPolicy": "ExitCode", "exitCodes": "137"}]
        ),
    )
    node = k8s.create_gpu_node().metadata.name
    for index in range(2):
        k8s.create_pod(f"e-worker-{index}", node=node, labels=labels("e", "worker", index))
    replicas = {
        name: RestarterProcess(k8s_control_plane, k8s.namespace, name, tmp_path / f"{name}.log")
        for name in ("restarter-a", "restarter-b")
    }
    try:
        leader = wait_for("a leader", lambda: holder(k8s), bool, timeout=30)
        standby = next(name for name in replicas if name != leader)
        wait_for(
            "both replicas serving metrics",
            lambda: [replicas[n].metric("edl_restarter_leader") for n in (leader, standby)],
            lambda values: values == [1.0, 0.0],
            timeout=30,
        )
        exit_pod(k8s, "e-worker-0", 137)
        wait_pod(k8s, "e-worker-0-r1", timeout=15)
        # Twice since, the standby has seen the leader renew the Lease, and stood by.
        seen = replicas[standby].logged(STANDING_BY)
        wait_for(
            "the standby to see two renewals of the leader",
            lambda: replicas[standby].logged(STANDING_BY),
            lambda count: count >= seen + 2,
            timeout=15,
        )
        assert replicas[standby].metric("edl_restarter_leader") == 0.0

        killed = time.monotonic()
        os.kill(replicas[leader].process.pid, signal.SIGKILL)
        replicas[leader].process.wait()
        wait_for("the standby to lead", lambda: holder(k8s), lambda h: h == standby, timeout=15)
        took = time.monotonic() - killed
        print(f"\nleader killed → standby holds the lease: {took:.2f}s (lease 3 s, retry 0.5 s)")
        assert took < 3 + 2 * 0.5 + 2  # the lease duration, a retry period, slack for 2 cores
        exit_pod(k8s, "e-worker-1", 137)
        wait_pod(k8s, "e-worker-1-r1", timeout=15)
        job = job_status(objects, k8s.namespace, "train")
        assert job["restarts"] == 2
        assert replicas[standby].metric("edl_restarter_leader") == 1.0

        # A graceful stop releases the Lease.
        assert replicas[standby].stop() == 0
        lease = k8s.coordination.read_namespaced_lease(LEASE, k8s.namespace)
        assert not lease.spec.holder_identity
    finally:
        for replica in replicas.values():
            replica.stop()
        for replica in replicas.values():
            text = replica.log.read_text(errors="replace")
            assert "Traceback" not in text, text[-3000:]


def test_a_pod_force_deleted_while_no_replica_leads_is_replaced_by_the_next_leader(
    crd: Any,
    k8s: KwokCluster,
    k8s_control_plane: testcluster.ControlPlane,
    objects: client.CustomObjectsApi,
    tmp_path: Path,
) -> None:
    """A list shows nothing of a pod deleted while nobody watched: the next leader watches the
    pod events since the checkpoint its predecessor kept on the Lease."""
    objects.create_namespaced_custom_object(
        GROUP,
        VERSION,
        k8s.namespace,
        PLURAL,
        policy_body(k8s.namespace, faultTolerantPolicy=[{"restartPolicy": "OnNodeFail"}]),
    )
    node = k8s.create_gpu_node().metadata.name
    k8s.create_pod("f-worker-0", node=node, labels=labels("f", "worker", 0))
    first = RestarterProcess(k8s_control_plane, k8s.namespace, "first", tmp_path / "first.log")
    second: RestarterProcess | None = None
    try:
        wait_for("the first to lead", lambda: holder(k8s), lambda h: h == "first", timeout=30)
        wait_for(
            "a checkpoint on the Lease",
            lambda: k8s.coordination.read_namespaced_lease(LEASE, k8s.namespace),
            lambda lease: CHECKPOINT in (lease.metadata.annotations or {}),
            timeout=30,
        )
        os.kill(first.process.pid, signal.SIGKILL)
        first.process.wait()
        k8s.core.delete_namespaced_pod("f-worker-0", k8s.namespace, grace_period_seconds=0)
        wait_gone(k8s, "f-worker-0")
        second = RestarterProcess(
            k8s_control_plane, k8s.namespace, "second", tmp_path / "second.log"
        )
        wait_for("the second to lead", lambda: holder(k8s), lambda h: h == "second", timeout=30)
        wait_pod(k8s, "f-worker-0-r1", timeout=30)
        job = job_status(objects, k8s.namespace, "train")
        assert job["restarts"] == 1
        assert job["lastActions"][-1]["fault"] == "PodForceDeleted"
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_the_leader_labels_its_pod_once_it_exists_and_is_not_ready_until_then(
    crd: Any, k8s: KwokCluster, k8s_control_plane: testcluster.ControlPlane, tmp_path: Path
) -> None:
    """Its pod appearing only after it began leading (two 404s) does not leave the intake
    Service without an endpoint for the whole term: the label is tried again until it sticks."""
    pod = "restarter-pod-late"
    replica = RestarterProcess(
        k8s_control_plane,
        k8s.namespace,
        "restarter-late",
        tmp_path / "late.log",
        env={"POD_NAMESPACE": k8s.namespace, "POD_NAME": pod},
    )
    try:
        wait_for("a leader", lambda: holder(k8s), lambda h: h == "restarter-late", timeout=30)
        waiting = wait_for(
            "/readyz: leading, but not labelled",
            replica.ready,
            lambda answer: answer is not None and "not labelled" in answer[1],
            timeout=30,
        )
        assert waiting[0] == 503
        wait_for(
            "two failed tries to label the pod",
            lambda: replica.logged(UNLABELLED),
            lambda count: count >= 2,
            timeout=15,
        )
        node = k8s.create_gpu_node().metadata.name
        k8s.create_pod(pod, node=node)
        wait_for(
            "the leader label on its pod",
            lambda: (k8s.read_pod(pod).metadata.labels or {}).get(LEADER_LABEL),
            lambda value: value == "true",
            timeout=40,
        )
        wait_for("/readyz 200", replica.ready, lambda a: a is not None and a[0] == 200, timeout=10)
    finally:
        assert replica.stop() == 0
    text = replica.log.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]
