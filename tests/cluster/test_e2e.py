"""End to end on real kubelet nodes: a container exit with a policy's exit code, and an XID 79 on
the GPU a training worker holds, each get that worker replaced — the second on the other node.

Everything that decides is a real process: the session's etcd + kube-apiserver, two kubelet v1.37
nodes with our fake container runtime (scripts/testnode.py), a kube-scheduler started for this
module (scheduler.py), on each node `edl-agent run` on a simulated dgx-h100 serving that node's
kubelet, and `edl-agent restarter`. Kubelet admits and allocates the pods through the agents,
lists them on its pod-resources API and reports health in the pods' status; the fake runtime
makes a container exit with a chosen code, and kubelet reports it as it would a real exit.
Workers are first placed by spec.nodeName, as a gang scheduler would have placed them; the
replacements are bound by the real scheduler.

Credentials are the deployment's: each agent uses tokens bound to a pod of ServiceAccount
edl-agent on its node, under deploy/daemonset/agent-rbac.yaml (RBAC and the admission policy
that confines it to its own Node); one of them has audience edl-restarter for the fault intake.
The restarter uses ServiceAccount edl-restarter under deploy/daemonset/restarter-rbac.yaml.

The scenario: a job of four workers with one GPU each, two per node, and a FaultTolerancePolicy
with `exitCodes: 129,101 → ExitCode` and `exceptionalEvent: deviceUnhealthy → OnNodeFail`.
First worker-1's container exits with 129: kubelet reports it, the agent reports the exit, the
restarter replaces worker-1 with worker-1-r1, which the scheduler binds and kubelet runs with a
GPU. Then XID 79 on worker-0's GPU: kubelet shows the device Unhealthy in worker-0's status,
the agent reports a DeviceUnhealthy fault naming worker-0, and worker-0-r1 is bound to the other
node (a node anti-affinity to the failed one) and runs there with a GPU of that node. The
measured timelines (t=0 at each injection) are printed and shown in pytest's terminal summary.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import testcluster
import testnode
from k8s_test_helpers import GPU_RESOURCE, KwokCluster, bound_tokens, wait_for
from kubelet_helpers import (
    NodeAgent,
    created_containers,
    extended,
    log_entries,
    logged_at,
    node_agent,
    pod_devices,
    resource_health,
)
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families
from scheduler import Process, free_port, spawn, tail
from test_node_labels import install_manifest, sa_client
from test_restarter import GROUP, PLURAL, VERSION, crd, restarter_rbac  # noqa: F401 - fixtures

from edl_agent.labels.condition import CONDITION_TYPE
from edl_agent.restarter.core.replacement import REPLACES_ANNOTATION, RESTART_COUNT_ANNOTATION
from edl_agent.sim import inject
from tests.waiting import WaitTimeout

EDL_AGENT = str(Path(sys.executable).with_name("edl-agent"))
AGENT_SA, RESTARTER_SA = "edl-agent", "edl-restarter"
AUDIENCE = "edl-restarter"
LEASE = "edl-restarter"
PROFILE = "dgx-h100"
XID = 79
EXIT_CODE = 129
JOB_LABEL, TYPE_LABEL, INDEX_LABEL = (
    "training.edl.io/job-name",
    "training.edl.io/replica-type",
    "training.edl.io/replica-index",
)
JOB = "llm-pretrain"
# Every pod of the job carries a nodeSelector for this label, which only this test's nodes
# have: the scheduler cannot place a replacement on another test's node.
POOL_LABEL = "edl.test/e2e-pool"
# Generous: CI runs this on 2 cores next to etcd, kube-apiserver, kwok and kube-scheduler.
STARTUP_TIMEOUT = 90.0
STEP_TIMEOUT = 60.0
FORBIDDEN = 403
NOT_FOUND = 404
OK = 200
MERGE = "application/merge-patch+json"
AGENT_FAULT = "agent: {} fault in the outbox"
SCHEDULER_BOUND = "kube-scheduler: bound (its log)"
BOUND = re.compile(
    r"^I(?P<month>\d\d)(?P<day>\d\d) (?P<clock>\d\d:\d\d:\d\d\.\d+) .*"
    r'"Successfully bound pod to node" pod="(?P<pod>[^"]+)" node="(?P<node>[^"]+)" '
    r"evaluatedNodes=(?P<evaluated>\d+) feasibleNodes=(?P<feasible>\d+)",
    re.MULTILINE,
)

pytestmark = pytest.mark.kubelet

# Timelines measured in this session, for the terminal summary.
_TIMELINES: list[tuple[str, list[str]]] = []


class _TimelineSummary:
    """A plugin registered by this module: the measured timelines at the end of pytest's
    output, so that CI logs show them without -s."""

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        for title, lines in _TIMELINES:
            terminalreporter.write_sep("-", title)
            for line in lines:
                terminalreporter.write_line(line)


@pytest.fixture(scope="module", autouse=True)
def _summary(request: pytest.FixtureRequest) -> None:
    manager = request.config.pluginmanager
    if not manager.has_plugin("edl-e2e-timeline"):
        manager.register(_TimelineSummary(), "edl-e2e-timeline")


# --- a timeline -------------------------------------------------------------------------------


@dataclass
class Timeline:
    """Moments (wall-clock seconds, comparable with the processes' log timestamps) by name."""

    t0: float = 0.0
    moments: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def mark(self, what: str, at: float, note: str = "") -> float:
        self.moments.setdefault(what, at)
        if note:
            self.notes.setdefault(what, note)
        return self.moments[what]

    def lines(self) -> list[str]:
        ordered = sorted(self.moments.items(), key=lambda item: item[1])
        width = max(len(what) for what, _ in ordered)
        return [
            f"t={at - self.t0:+8.3f}s  {what:<{width}}  {self.notes.get(what, '')}".rstrip()
            for what, at in ordered
        ]

    def assert_order(self, *steps: str) -> None:
        times = [(step, self.moments[step]) for step in steps]
        for (a, ta), (b, tb) in itertools.pairwise(times):
            assert ta <= tb, f"{a} (t={ta - self.t0:+.3f}s) after {b} (t={tb - self.t0:+.3f}s)"


# --- processes, logs and credentials ----------------------------------------------------------


def wait_logged(
    process: Process, what: str, match: Callable[[dict[str, Any]], bool], timeout: float
) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        process.check_alive()
        return next((e for e in log_entries(process.log) if match(e)), None)

    try:
        entry: dict[str, Any] = wait_for(f"{process.name} to log {what}", found, bool, timeout)
    except WaitTimeout as exc:
        raise AssertionError(
            f"{exc}\n{process.name} log {process.log}:\n{tail(process.log)}"
        ) from None
    return entry


def write_kubeconfig(path: Path, plane: testcluster.ControlPlane, token: str, user: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "edl-test",
                "cluster": {"server": plane.server, "certificate-authority": str(plane.ca_file)},
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "edl-test", "context": {"cluster": "edl-test", "user": user}}],
        "current-context": "edl-test",
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)
    return path


def agent_tokens(k8s: KwokCluster, node: str) -> tuple[str, str]:
    """Two tokens of the agent's pod on `node`, as kubelet projects them: one for the API server,
    one with audience edl-restarter for the fault intake. Both name the node."""
    audiences: list[list[str]] = [[], [AUDIENCE]]
    api_token, intake_token = bound_tokens(k8s.core, k8s.namespace, node, AGENT_SA, audiences)
    return api_token, intake_token


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    """Processes a test starts; stopped (SIGTERM, wait, SIGKILL) in reverse order afterwards."""
    started: list[Process] = []
    yield started
    codes = {}
    for process in reversed(started):
        codes[process.name] = process.stop()
        print(f"\n--- {process.name} (exit {codes[process.name]}), log {process.log}:")
        print("\n".join(line[:300] for line in tail(process.log, 10).splitlines()))
    assert all(not p.alive() for p in started)
    # SIGTERM is a clean stop for both edl-agent commands.
    assert codes == dict.fromkeys(codes, 0), f"unclean exits: {codes}"


@pytest.fixture
def agent_rbac(k8s: KwokCluster) -> Iterator[list[str]]:
    """deploy/daemonset/agent-rbac.yaml for this test (see install_manifest); yields a list for
    the nodes the agent runs as, whose Events (in `default`) are removed afterwards."""
    undo = install_manifest(k8s)
    nodes: list[str] = []
    yield nodes
    for step in undo:
        step()
    for node in nodes:
        k8s.core.delete_collection_namespaced_event(
            "default", field_selector=f"involvedObject.name={node}"
        )


@pytest.fixture
def policy(k8s: KwokCluster, crd: Any) -> Iterator[dict[str, Any]]:  # noqa: F811 - fixture
    """The job's FaultTolerancePolicy; afterwards it and the restarter's Lease are deleted (no
    namespace controller runs to remove them with the namespace)."""
    objects = client.CustomObjectsApi(k8s.api)
    body = policy_body(k8s.namespace)
    created: dict[str, Any] = objects.create_namespaced_custom_object(
        GROUP, VERSION, k8s.namespace, PLURAL, body, field_validation="Strict"
    )
    yield created
    for delete in (
        lambda: objects.delete_namespaced_custom_object(GROUP, VERSION, k8s.namespace, PLURAL, JOB),
        lambda: k8s.coordination.delete_namespaced_lease(LEASE, k8s.namespace),
    ):
        try:
            delete()
        except ApiException as exc:
            if exc.status != NOT_FOUND:
                raise


@dataclass
class PodLog:
    """Every event of the test namespace's pods, with the wall-clock time it was seen."""

    events: list[tuple[float, str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> list[tuple[float, str, Any]]:
        with self.lock:
            return list(self.events)

    def first(self, match: Callable[[str, Any], bool]) -> tuple[float, Any] | None:
        return next(((t, pod) for t, kind, pod in self.snapshot() if match(kind, pod)), None)


@pytest.fixture
def pod_log(k8s: KwokCluster) -> Iterator[PodLog]:
    """A watch on the namespace's pods on its own thread (stopped after the test)."""
    seen = PodLog()
    stream = watch.Watch()
    listed = threading.Event()

    def run() -> None:
        core = client.CoreV1Api(k8s.api)
        version = core.list_namespaced_pod(k8s.namespace).metadata.resource_version
        listed.set()
        with contextlib.suppress(Exception):  # ends when stopped (or the test ends)
            for event in stream.stream(
                core.list_namespaced_pod,
                k8s.namespace,
                resource_version=version,
                timeout_seconds=600,
            ):
                with seen.lock:
                    seen.events.append((time.time(), event["type"], event["object"]))

    thread = threading.Thread(target=run, name="pod-log", daemon=True)
    thread.start()
    listed.wait(30)
    yield seen
    stream.stop()
    thread.join(timeout=10)


# --- the scenario -----------------------------------------------------------------------------


def worker_labels(index: int) -> dict[str, str]:
    return {"app": JOB, JOB_LABEL: JOB, TYPE_LABEL: "worker", INDEX_LABEL: str(index)}


def create_worker(
    k8s: KwokCluster, index: int, node: str, pool: str, restart_policy: str = "Never"
) -> Any:
    """A worker with one GPU, placed on `node` by spec.nodeName (scheduled before the test),
    with the pool's nodeSelector that its replacement keeps."""
    name = f"{JOB}-worker-{index}"
    body = client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels=worker_labels(index)),
        spec=client.V1PodSpec(
            node_name=node,
            node_selector={POOL_LABEL: pool},
            restart_policy=restart_policy,
            termination_grace_period_seconds=5,
            containers=[
                client.V1Container(
                    name="trainer",
                    image="registry.invalid/edl/trainer:test",
                    resources=client.V1ResourceRequirements(limits={GPU_RESOURCE: "1"}),
                )
            ],
        ),
    )
    return k8s.core.create_namespaced_pod(k8s.namespace, body)


def policy_body(namespace: str) -> dict[str, Any]:
    """deploy/daemonset/example-policy.yaml's shape, with deviceUnhealthy among the events and
    a Graceful rule for degraded devices."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "FaultTolerancePolicy",
        "metadata": {"name": JOB, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": {"app": JOB}},
            "jobLabel": JOB_LABEL,
            "replicaTypeLabel": TYPE_LABEL,
            "replicaIndexLabel": INDEX_LABEL,
            "faultTolerantPolicy": [
                {"exitCodes": "129,101", "restartPolicy": "ExitCode", "restartScope": "Pod"},
                {
                    "exceptionalEvent": "deviceUnhealthy,nodeNotReady,PodForceDeleted",
                    "restartPolicy": "OnNodeFail",
                    "restartScope": "Pod",
                },
                {"exceptionalEvent": "deviceDegraded", "restartPolicy": "Graceful"},
            ],
            "restartPolicy": "OnNodeFailWithExitCode",
            "restartLimit": 100,
            "restartTimeLimit": 60,
            "restartTimeout": 864000,
        },
    }


def condition_of(node: Any) -> Any:
    return next(
        (c for c in (node.status and node.status.conditions) or [] if c.type == CONDITION_TYPE),
        None,
    )


def job_status(objects: client.CustomObjectsApi, namespace: str) -> dict[str, Any]:
    body = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, JOB)
    return dict(body.get("status") or {})


def pod_or_none(k8s: KwokCluster, name: str) -> Any:
    try:
        return k8s.read_pod(name)
    except ApiException as exc:
        if exc.status == NOT_FOUND:
            return None
        raise


def wait_rbac(k8s: KwokCluster, agent_api: client.ApiClient, node: str, other: str) -> None:
    """RBAC and the admission policy reach the API server's caches a moment after creation:
    wait until the agent may read its node and the policy denies it another node."""
    core = client.CoreV1Api(agent_api)

    def settled() -> bool:
        try:
            core.read_node(node)
        except ApiException:
            return False
        try:
            core.patch_node(
                other,
                {"metadata": {"labels": {"edl.io/probe": "1"}}},
                dry_run="All",
                _content_type=MERGE,
            )
        except ApiException as exc:
            return exc.status == FORBIDDEN and "only change the node" in str(exc.body)
        return False

    wait_for("the agent's RBAC and admission policy", settled, bool, timeout=STARTUP_TIMEOUT)


@dataclass
class Scene:
    """What the phases of the scenario share."""

    k8s: KwokCluster
    nodes: dict[str, testnode.Node]
    agents: dict[str, NodeAgent]
    restarter: Process
    kube_scheduler: Process
    pod_log: PodLog
    objects: client.CustomObjectsApi


@pytest.mark.timeout(600)
def test_exit_code_and_xid79_replace_workers_on_real_kubelets(  # noqa: PLR0917 - fixtures
    k8s: KwokCluster,
    k8s_control_plane: testcluster.ControlPlane,
    kube_scheduler: Process,
    kubelet_nodes: Callable[..., testnode.Node],
    restarter_rbac: None,  # noqa: F811 - the fixture imported above
    agent_rbac: list[str],
    policy: dict[str, Any],
    processes: list[Process],
    pod_log: PodLog,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    ns = k8s.namespace
    objects = client.CustomObjectsApi(k8s.api)

    # --- the cluster: two real kubelet nodes in this test's pool ---------------------------
    pool = ns
    nodes = {}
    for _ in range(2):
        node = kubelet_nodes()
        k8s.core.patch_node(
            node.name, {"metadata": {"labels": {POOL_LABEL: pool}}}, _content_type=MERGE
        )
        nodes[node.name] = node
        agent_rbac.append(node.name)
    node_a, node_b = nodes

    # --- credentials and the restarter ------------------------------------------------------
    restarter, intake_port = start_restarter(k8s, k8s_control_plane, tmp_path, processes)

    # --- an agent on each node ------------------------------------------------------------------
    agents = {}
    for name, node in nodes.items():
        api_token, intake_token = agent_tokens(k8s, name)
        agent_api = sa_client(k8s.api, api_token)
        wait_rbac(k8s, agent_api, name, next(n for n in nodes if n != name))
        agent_api.close()
        directory = tmp_path / f"agent-{name}"
        directory.mkdir()
        kubeconfig = write_kubeconfig(
            directory / "kubeconfig", k8s_control_plane, api_token, AGENT_SA
        )
        agents[name] = reporting_agent(
            node,
            directory,
            kubeconfig=kubeconfig,
            intake_token=intake_token,
            intake_port=intake_port,
            processes=processes,
        )
    for name, agent in agents.items():
        wait_for(
            f"{name}: 8 GPUs allocatable, the agent's labels and condition True",
            lambda n=name: k8s.core.read_node(n),
            lambda n: (
                extended(n.status.allocatable).get(GPU_RESOURCE) == 8
                and (n.metadata.labels or {}).get("nvidia.com/gpu.count") == "8"
                and getattr(condition_of(n), "status", None) == "True"
            ),
            timeout=STARTUP_TIMEOUT,
        )
        assert agent.process is not None
        agent.process.check_alive()

    # --- the job (its policy is the `policy` fixture) -----------------------------------------
    placement = {0: node_a, 1: node_a, 2: node_b, 3: node_b}
    for index, node_name in placement.items():
        create_worker(k8s, index, node_name, pool)
    for index in placement:
        k8s.wait_pod_phase(f"{JOB}-worker-{index}", "Running", timeout=STARTUP_TIMEOUT)
    uids = {index: k8s.read_pod(f"{JOB}-worker-{index}").metadata.uid for index in placement}
    scene = Scene(k8s, nodes, agents, restarter, kube_scheduler, pod_log, objects)

    # --- phase 0: an exit kubelet restarts in place is not also a replacement ------------------
    in_place_phase(scene, node_b, pool)

    # --- phase 1: worker-1's container exits with 129 -------------------------------------------
    exited = f"{JOB}-worker-1"
    timeline = Timeline()
    try:
        exit_phase(scene, timeline, exited, node_a)
    finally:
        _report(timeline, request.node, f"e2e timeline: exit 129 of {exited} -> replacement")
    assert job_status(objects, ns)["restarts"] == 1

    # --- phase 2: XID 79 on worker-0's GPU --------------------------------------------------------
    victim = f"{JOB}-worker-0"
    timeline = Timeline()
    try:
        xid_phase(scene, timeline, victim, node_a, node_b)
    finally:
        _report(timeline, request.node, f"e2e timeline: XID {XID} under {victim} -> replacement")

    # --- the outcome --------------------------------------------------------------------------
    replacement = k8s.read_pod(f"{victim}-r1")
    assert replacement.spec.node_name == node_b
    assert replacement.metadata.annotations[RESTART_COUNT_ANNOTATION] == "1"
    assert replacement.metadata.annotations[REPLACES_ANNOTATION] == victim
    terms = (
        replacement.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
    )
    assert any(
        f.key == "metadata.name" and f.operator == "NotIn" and node_a in f.values
        for term in terms.node_selector_terms
        for f in term.match_fields or []
    ), "the replacement must keep away from the failed node"
    assert replacement.metadata.labels.items() >= worker_labels(0).items()

    status = job_status(objects, ns)
    [job] = status["jobs"]
    assert (status["restarts"], job["name"], job["restarts"]) == (2, JOB, 2)
    restarts = [a for a in job["lastActions"] if a["action"] == "Restart"]
    assert sorted((a["pod"], a["fault"]) for a in restarts) == [
        (f"{ns}/{victim}", "DeviceUnhealthy"),
        (f"{ns}/{exited}", "ContainerExit"),
    ], job["lastActions"]
    # Nobody else was touched.
    for index in (2, 3):
        pod = k8s.read_pod(f"{JOB}-worker-{index}")
        assert pod.metadata.uid == uids[index]
        assert pod.metadata.deletion_timestamp is None
        assert pod.status.phase == "Running"
    for name in (f"{victim}-r2", f"{exited}-r2"):
        assert pod_or_none(k8s, name) is None  # one fault, one replacement
    for agent in agents.values():
        outbox = agent.directory / "state" / "outbox"
        assert sorted(p.name for p in outbox.glob("*.json")) == [], "a fault was not acknowledged"


def reporting_agent(
    node: testnode.Node,
    directory: Path,
    *,
    kubeconfig: Path,
    intake_token: str,
    intake_port: int,
    processes: list[Process],
    extra: tuple[str, ...] = (),
) -> NodeAgent:
    """`edl-agent run` (simulated dgx-h100) on `node`, reporting to the restarter's intake with
    `intake_token` (`extra`: more arguments); added to `processes`."""
    (directory / "intake-token").write_text(intake_token)
    agent = node_agent(
        node,
        PROFILE,
        directory,
        f"--restarter-address=127.0.0.1:{intake_port}",
        f"--set=node.kubeconfig={kubeconfig}",
        f"--set=faults.token_file={directory / 'intake-token'}",
        *extra,
    )
    assert agent.process is not None
    processes.append(agent.process)
    return agent


def start_restarter(
    k8s: KwokCluster,
    plane: testcluster.ControlPlane,
    tmp_path: Path,
    processes: list[Process],
) -> tuple[Process, int]:
    """`edl-agent restarter` with its RBAC, leader election and metrics, ready to act."""
    ns = k8s.namespace
    restarter_token = k8s.mint_token(RESTARTER_SA)
    restarter_kubeconfig = write_kubeconfig(
        tmp_path / "restarter.kubeconfig", plane, restarter_token, RESTARTER_SA
    )
    restarter_api = sa_client(k8s.api, restarter_token)
    wait_for(
        "the restarter's RBAC",
        lambda: _may(lambda: client.CoreV1Api(restarter_api).list_namespaced_pod(ns, limit=1)),
        bool,
        timeout=STARTUP_TIMEOUT,
    )
    restarter_api.close()
    return spawn_restarter(k8s, restarter_kubeconfig, tmp_path, processes)


def spawn_restarter(
    k8s: KwokCluster,
    kubeconfig: Path,
    tmp_path: Path,
    processes: list[Process],
    *extra: str,
) -> tuple[Process, int]:
    """`edl-agent restarter` with `kubeconfig` (and `extra` arguments), once it leads and is
    ready; its intake port."""
    ns = k8s.namespace
    intake_port, metrics_port = free_port(), free_port()
    argv = [
        EDL_AGENT,
        "restarter",
        f"--kubeconfig={kubeconfig}",
        f"--listen=127.0.0.1:{intake_port}",
        f"--agent-service-account={ns}/{AGENT_SA}",
        f"--namespace={ns}",
        f"--audience={AUDIENCE}",
        f"--lease-namespace={ns}",
        f"--lease-name={LEASE}",
        f"--metrics-addr=127.0.0.1:{metrics_port}",
        "--log-format=json",
        *extra,
    ]
    restarter = spawn("restarter", argv, tmp_path / "restarter")
    processes.append(restarter)
    wait_for(
        f"the restarter's fault intake on port {intake_port}",
        lambda: _accepts(restarter, intake_port),
        bool,
        timeout=STARTUP_TIMEOUT,
    )
    wait_for(
        f"the restarter to hold Lease {ns}/{LEASE}",
        lambda: _lease_holder(k8s, LEASE),
        bool,
        timeout=STARTUP_TIMEOUT,
    )
    # Ready once it acts (the leader) and has listed pods, nodes and policies: a fault that came
    # before would find no policy covering its pod.
    wait_for(
        "the restarter's /readyz",
        lambda: _readyz(restarter, metrics_port),
        lambda answer: answer[0] == OK and "standby" not in answer[1],
        timeout=STARTUP_TIMEOUT,
    )
    return restarter, intake_port


def _first(what: str, fetch: Callable[[], Any], done: Callable[[Any], bool]) -> Callable[[], Any]:
    """A task for a background thread: poll until `done`, then (wall-clock time, value)."""

    def task() -> tuple[float, Any]:
        deadline = time.monotonic() + STEP_TIMEOUT
        while True:
            value = fetch()
            if done(value):
                return time.time(), value
            if time.monotonic() > deadline:
                raise WaitTimeout(f"timed out after {STEP_TIMEOUT:.0f}s waiting for {what}")
            time.sleep(0.05)

    return task


def _report(timeline: Timeline, item: pytest.Item, title: str) -> None:
    """Print the timeline (visible with -s), keep it for the terminal summary and record it in
    the test's user_properties (junit XML), as the record_property fixture would, without that
    fixture's warning under junit_family xunit2 (an error here: filterwarnings = error).

    Times come from where each step shows: the test's own watches and polls (the pods, the
    Node), the agents' and the restarter's log timestamps, the fake runtime's CreateContainer
    log; all one machine clock.
    """
    if not timeline.moments:
        return
    lines = timeline.lines()
    title = f"{title} (t=0 at the injection)"
    print(f"\n{title}")
    for line in lines:
        print(f"  {line}")
    _TIMELINES.append((title, lines))
    item.user_properties.append((f"timeline {title}", "\n".join(lines)))


def in_place_phase(scene: Scene, node: str, pool: str) -> None:
    """A worker of the job with restartPolicy OnFailure exits with 129, a code the policy
    restarts: kubelet restarts the container in place, the agent reports the exit, and the
    restarter records it as InPlace without replacing the pod (nor charging the limit)."""
    k8s, ns = scene.k8s, scene.k8s.namespace
    name = f"{JOB}-worker-4"
    create_worker(k8s, 4, node, pool, restart_policy="OnFailure")
    k8s.wait_pod_phase(name, "Running", timeout=STARTUP_TIMEOUT)
    uid = k8s.read_pod(name).metadata.uid
    scene.nodes[node].exit_container(ns, name, "trainer", EXIT_CODE)

    def restarted_in_place(pod: Any) -> bool:
        [status] = pod.status.container_statuses or [None]
        last = getattr(getattr(status, "last_state", None), "terminated", None)
        return bool(
            status is not None
            and status.restart_count >= 1
            and last is not None
            and last.exit_code == EXIT_CODE
            and status.state.running is not None
        )

    wait_for(
        "kubelet to restart it in place",
        lambda: k8s.read_pod(name),
        restarted_in_place,
        STEP_TIMEOUT,
    )
    observed = wait_logged(
        scene.agents[node].process,
        "the agent's ContainerExit fault",
        lambda e: e.get("event") == "fault observed" and e.get("pods") == [f"{ns}/{name}"],
        STEP_TIMEOUT,
    )
    assert observed["exit_code"] == EXIT_CODE
    job = wait_for(
        "the restarter's InPlace decision",
        lambda: job_status(scene.objects, ns).get("jobs", [{}])[0],
        lambda job: any(
            a["action"] == "InPlace" and a["pod"] == f"{ns}/{name}"
            for a in job.get("lastActions", [])
        ),
        timeout=STEP_TIMEOUT,
    )
    assert not any(a["action"] == "Restart" for a in job.get("lastActions", [])), job
    assert job.get("restarts", 0) == 0
    # Nothing in the restarter's hands: what it decided for this exit is all done by now.
    wait_for(
        "the restarter's queue empty",
        lambda: _queue_depth(scene.restarter),
        lambda depth: depth == 0,
        STEP_TIMEOUT,
    )
    assert pod_or_none(k8s, f"{name}-r1") is None
    pod = k8s.read_pod(name)
    assert pod.metadata.uid == uid
    assert pod.metadata.deletion_timestamp is None
    k8s.core.delete_namespaced_pod(name, ns)  # its GPU back for the replacements to come
    wait_for("worker-4 gone", lambda: pod_or_none(k8s, name), lambda pod: pod is None, STEP_TIMEOUT)


def exit_phase(scene: Scene, timeline: Timeline, pod: str, node: str) -> None:
    """Worker `pod`'s container exits with 129 through the fake runtime; kubelet reports it, the
    agent reports it, the restarter replaces the pod."""
    ns = scene.k8s.namespace
    injected = "container exits 129 (fake runtime)"
    timeline.t0 = time.time()
    answer = scene.nodes[node].exit_container(ns, pod, "trainer", EXIT_CODE)
    timeline.mark(injected, timeline.t0, f"{pod} on {node}, container {answer['id']}")
    at, _ = _seen(
        scene,
        f"kubelet to report {pod} terminated with {EXIT_CODE}",
        lambda _kind, p: p.metadata.name == pod and _terminated_with(p, EXIT_CODE),
    )
    timeline.mark("kubelet: terminated, exitCode 129", at)
    observed = wait_logged(
        scene.agents[node].process,
        "the ContainerExit fault",
        lambda e: e.get("event") == "fault observed" and e.get("kind") == "ContainerExit",
        STEP_TIMEOUT,
    )
    assert observed["pods"] == [f"{ns}/{pod}"]
    assert observed["exit_code"] == EXIT_CODE
    timeline.mark(AGENT_FAULT.format("ContainerExit"), logged_at(observed), observed["fault_id"])
    bound_to = _follow_replacement(scene, timeline, observed["fault_id"], pod)
    timeline.assert_order(injected, "kubelet: terminated, exitCode 129")
    assert_causal_order(timeline, injected, AGENT_FAULT.format("ContainerExit"))
    assert bound_to in scene.nodes


def xid_phase(scene: Scene, timeline: Timeline, pod: str, node: str, other: str) -> None:
    """XID 79 on the GPU `pod` holds on `node`: kubelet shows it Unhealthy in the pod's status,
    the agent reports a DeviceUnhealthy fault, the replacement goes to `other`."""
    ns = scene.k8s.namespace
    agent = scene.agents[node]
    [gpu] = pod_devices(scene.nodes[node], ns, pod)["trainer"][GPU_RESOURCE]
    index = next(d["index"] for d in agent.devices() if d["id"] == gpu)
    injected = f"XID {XID} injected"
    with ThreadPoolExecutor(max_workers=1) as pool:
        timeline.t0 = time.time()
        inject.inject_xid(agent.tree, index, XID)
        timeline.mark(injected, timeline.t0, f"GPU {index} ({gpu}) of {pod} on {node}")
        in_condition = pool.submit(
            _first(
                f"{CONDITION_TYPE}=False on {node}",
                lambda: scene.k8s.core.read_node(node),
                lambda n: getattr(condition_of(n), "status", None) == "False",
            )
        )
        at, _ = _seen(
            scene,
            f"kubelet to show {gpu} Unhealthy in {pod}'s status",
            lambda _kind, p: (
                p.metadata.name == pod and (GPU_RESOURCE, gpu, "Unhealthy") in resource_health(p)
            ),
        )
        timeline.mark("kubelet: allocatedResourcesStatus Unhealthy", at)
        condition_at, node_object = in_condition.result(STEP_TIMEOUT + 5)
    condition = condition_of(node_object)
    timeline.mark(f"{CONDITION_TYPE}=False", condition_at, f"reason {condition.reason}")
    assert condition.reason == f"XID{XID}"
    assert gpu in condition.message
    observed = wait_logged(
        agent.process,
        "the DeviceUnhealthy fault",
        lambda e: e.get("event") == "fault observed" and e.get("kind") == "DeviceUnhealthy",
        STEP_TIMEOUT,
    )
    assert observed["pods"] == [f"{ns}/{pod}"]
    assert observed["devices"] == [gpu]
    timeline.mark(AGENT_FAULT.format("DeviceUnhealthy"), logged_at(observed), observed["fault_id"])
    bound_to = _follow_replacement(scene, timeline, observed["fault_id"], pod, feasible=1)
    assert bound_to == other
    assert_causal_order(timeline, injected, AGENT_FAULT.format("DeviceUnhealthy"))
    timeline.assert_order(injected, "kubelet: allocatedResourcesStatus Unhealthy")
    timeline.assert_order(injected, f"{CONDITION_TYPE}=False")


def assert_causal_order(timeline: Timeline, injected: str, agent_fault: str) -> None:
    """The orders that causality guarantees, whatever the lag of each observer.

    A moment is either the time its source logged it (the agents, the restarter, kube-scheduler,
    the fake runtime; one machine clock) or the time this test's pod watch received it (later
    than it happened, by a lag that grows under load). Two source times follow cause and effect;
    watch times follow each other (one ordered stream); a source time precedes the watch time of
    anything it caused. A watch time never bounds a source time, so no such pair is asserted.
    """
    decision = "restarter: fault accepted, decision"
    container = "replacement's container created (runtime)"
    timeline.assert_order(injected, agent_fault, decision, SCHEDULER_BOUND)
    timeline.assert_order(decision, container)
    timeline.assert_order(
        "replacement created", "replacement bound", "replacement Running (kubelet)"
    )
    timeline.assert_order(decision, "replacement created")
    timeline.assert_order(SCHEDULER_BOUND, "replacement Running (kubelet)")
    timeline.assert_order(container, "replacement Running (kubelet)")


def klog_time(line: re.Match[str]) -> float:
    """The wall-clock time in a klog header (local time, no year: this year's)."""
    clock = datetime.strptime(line["clock"], "%H:%M:%S.%f").time()
    year = datetime.now().year
    return datetime.combine(
        datetime(year, int(line["month"]), int(line["day"])).date(), clock
    ).timestamp()


def _terminated_with(pod: Any, code: int) -> bool:
    for status in (pod.status and pod.status.container_statuses) or []:
        terminated = status.state and status.state.terminated
        if terminated is not None and terminated.exit_code == code:
            return True
    return False


def _seen(scene: Scene, what: str, match: Callable[[str, Any], bool]) -> tuple[float, Any]:
    found: tuple[float, Any] = wait_for(
        what, lambda: scene.pod_log.first(match), bool, timeout=STEP_TIMEOUT
    )
    return found


def _follow_replacement(
    scene: Scene, timeline: Timeline, fault_id: str, old: str, feasible: int | None = None
) -> str:
    """The restarter's decision on `fault_id` and the replacement of `old` up to its container
    running with a GPU; the node it was bound to."""
    ns = scene.k8s.namespace
    decision = wait_logged(
        scene.restarter,
        "the decision",
        # An agent's device fault is known to the restarter by an id scoped to its node
        # (`agent/<node>/<id>`); an exit by the id the restarter's watcher derives too.
        lambda e: e.get("event") == "decision" and str(e.get("fault_id")).endswith(fault_id),
        STEP_TIMEOUT,
    )
    timeline.mark("restarter: fault accepted, decision", logged_at(decision), decision["action"])
    assert decision["action"] == "Restart", decision
    assert decision["pod"] == f"{ns}/{old}"
    replaced = wait_logged(
        scene.restarter,
        "the replacement",
        lambda e: e.get("event") == "pod replaced" and e.get("old") == f"{ns}/{old}",
        STEP_TIMEOUT,
    )
    timeline.mark("restarter: pod replaced", logged_at(replaced), str(replaced.get("new", "")))
    new_name = f"{old}-r1"
    gone, _ = _seen(
        scene, f"{old} gone", lambda kind, p: p.metadata.name == old and kind == "DELETED"
    )
    timeline.mark("old pod gone", gone)
    created, _ = _seen(
        scene,
        f"{new_name} created",
        lambda kind, p: kind == "ADDED" and p.metadata.name == new_name,
    )
    timeline.mark("replacement created", created, new_name)
    bound, pod = _seen(
        scene,
        f"{new_name} bound by the scheduler",
        lambda _kind, p: p.metadata.name == new_name and bool(p.spec.node_name),
    )
    node = str(pod.spec.node_name)
    line = wait_for(
        f"kube-scheduler to log the binding of {new_name}",
        lambda: next(
            (
                match
                for match in BOUND.finditer(scene.kube_scheduler.log.read_text(errors="replace"))
                if match["pod"] == f"{ns}/{new_name}"
            ),
            None,
        ),
        bool,
        timeout=STEP_TIMEOUT,
    )
    assert line["node"] == node
    if feasible is not None:
        assert int(line["feasible"]) == feasible, line[0]
    timeline.mark(
        "replacement bound",
        bound,
        f"to {node} (kube-scheduler: {line['feasible']} of {line['evaluated']} nodes feasible)",
    )
    timeline.mark(SCHEDULER_BOUND, klog_time(line), f"to {node}")
    [container] = wait_for(
        f"{new_name}'s CreateContainer on {node}",
        lambda: created_containers(scene.nodes[node], ns, new_name),
        bool,
        timeout=STEP_TIMEOUT,
    )
    gpus = container["envs"]["NVIDIA_VISIBLE_DEVICES"].split(",")
    assert len(gpus) == 1, container["envs"]
    assert pod_devices(scene.nodes[node], ns, new_name)["trainer"][GPU_RESOURCE] == gpus
    timeline.mark(
        "replacement's container created (runtime)",
        datetime.fromisoformat(container["time"]).timestamp(),
        f"NVIDIA_VISIBLE_DEVICES={gpus[0]}",
    )
    running, _ = _seen(
        scene,
        f"{new_name} Running",
        lambda _kind, p: p.metadata.name == new_name and p.status.phase == "Running",
    )
    timeline.mark("replacement Running (kubelet)", running)
    return node


def _lease_holder(k8s: KwokCluster, name: str) -> str | None:
    try:
        lease = k8s.coordination.read_namespaced_lease(name, k8s.namespace)
    except ApiException as exc:
        if exc.status == NOT_FOUND:
            return None
        raise
    return lease.spec.holder_identity or None


def _readyz(process: Process, port: int) -> tuple[int | None, str]:
    process.check_alive()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as answer:
            return int(answer.status), answer.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        with contextlib.closing(exc):
            return int(exc.code), exc.read().decode(errors="replace")
    except OSError as exc:
        return None, str(exc)


def _queue_depth(restarter: Process) -> float | None:
    """`edl_restarter_queue_depth`: the faults and tasks it holds until what it decided is done."""
    restarter.check_alive()
    [port] = [a.rpartition(":")[2] for a in restarter.popen.args if a.startswith("--metrics-addr=")]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "edl_restarter_queue_depth":
                return float(sample.value)
    return None


def _accepts(process: Process, port: int) -> bool:
    process.check_alive()
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _may(call: Callable[[], object]) -> bool:
    try:
        call()
    except ApiException:
        return False
    return True
