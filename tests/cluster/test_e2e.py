"""End to end: an XID 79 on the GPU a training worker holds gets that worker replaced elsewhere.

Everything that decides is a real process: the session's etcd + kube-apiserver + KWOK, a
kube-scheduler started for this module (scheduler.py), `edl-agent run --simulate dgx-h100` whose
Node is one of the KWOK nodes, and `edl-agent restarter`. Kubelet is played by two in-process
stand-ins on real unix sockets: the device-plugin registration (whose ListAndWatch the test
reads) and the pod-resources API (which says which pod holds which GPU). Pods are first placed by
setting spec.nodeName, as a gang scheduler would have placed them; the replacement is bound by the
real scheduler.

Credentials are the deployment's: the agent uses tokens bound to a pod of ServiceAccount
edl-agent on its node, under deploy/daemonset/agent-rbac.yaml (RBAC and the admission policy
that confines it to its own Node); one of them has audience edl-restarter for the fault intake.
The restarter uses ServiceAccount edl-restarter under deploy/daemonset/restarter-rbac.yaml.

The scenario: a job of four workers on four GPU nodes (two on the agent's node, holding GPUs 3
and 5), a FaultTolerancePolicy whose rule `exceptionalEvent: deviceUnhealthy, restartPolicy:
OnNodeFail` replaces the pod of an unhealthy device. XID 79 on GPU 3 must turn it Unhealthy in
ListAndWatch, turn the Node's AcceleratorHealthy condition False, reach the restarter as a
DeviceUnhealthy fault naming worker-0, and get worker-0 deleted and replaced by worker-0-r1,
which the scheduler binds to another node (the replacement has a node anti-affinity to the
failed one); the policy's status counts one restart, and the other workers are untouched. The
measured timeline (t=0 at the injection) is printed and shown in pytest's terminal summary.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
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
from k8s_test_helpers import GPU_RESOURCE, KwokCluster, WaitTimeout, bound_tokens, wait_for
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from scheduler import Process, ProcessError, free_port, spawn, start_scheduler, tail
from test_node_labels import install_manifest, sa_client
from test_restarter import GROUP, PLURAL, VERSION, crd, restarter_rbac  # noqa: F401 - fixtures

from edl_agent.labels.condition import CONDITION_TYPE
from edl_agent.restarter.actuator import REPLACES_ANNOTATION, RESTART_COUNT_ANNOTATION
from edl_agent.sim import inject
from tests.kubelet_standin import KubeletStandIn, Watch
from tests.podresources_standin import PodResourcesStandIn

EDL_AGENT = str(Path(sys.executable).with_name("edl-agent"))
AGENT_SA, RESTARTER_SA = "edl-agent", "edl-restarter"
AUDIENCE = "edl-restarter"
LEASE = "edl-restarter"
PROFILE = "dgx-h100"
FAULTY_GPU, BYSTANDER_GPU = 3, 5
XID = 79
JOB_LABEL, TYPE_LABEL, INDEX_LABEL = (
    "training.edl.io/job-name",
    "training.edl.io/replica-type",
    "training.edl.io/replica-index",
)
JOB = "llm-pretrain"
# Every pod of the job carries a nodeSelector for this label, which only this test's nodes
# have: the scheduler cannot place a replacement on another test's node.
POOL_LABEL = "edl.test/e2e-pool"
WORKERS = 4
# Generous: CI runs this on 2 cores next to etcd, kube-apiserver, kwok and kube-scheduler.
STARTUP_TIMEOUT = 90.0
STEP_TIMEOUT = 60.0
FORBIDDEN = 403
NOT_FOUND = 404
OK = 200
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
MERGE = "application/merge-patch+json"
AGENT_FAULT = "agent: DeviceUnhealthy fault in the outbox"
BOUND = re.compile(
    r'"Successfully bound pod to node" pod="(?P<pod>[^"]+)" node="(?P<node>[^"]+)" '
    r"evaluatedNodes=(?P<evaluated>\d+) feasibleNodes=(?P<feasible>\d+)"
)
GPU_ROW = re.compile(r"^nvidia\s+gpu\s+(\d+)\s+(GPU-\S+)\s")

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


def log_entries(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a structlog log (other lines, such as tracebacks, are skipped)."""
    entries = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                entries.append(json.loads(line))
    return entries


def logged_at(entry: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(entry["timestamp"])).timestamp()


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


def restarter_help() -> str:
    result = subprocess.run(
        [EDL_AGENT, "restarter", "--help"], capture_output=True, text=True, check=True, timeout=60
    )
    return result.stdout


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kube_scheduler(
    k8s_control_plane: testcluster.ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Process]:
    """A real kube-scheduler (admin kubeconfig, no leader election) for this module only."""
    try:
        process = start_scheduler(
            k8s_control_plane.kubeconfig,
            tmp_path_factory.mktemp("kube-scheduler"),
            timeout=STARTUP_TIMEOUT,
        )
    except ProcessError as exc:
        pytest.fail(str(exc), pytrace=False)
    yield process
    process.stop()
    assert not process.alive()


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
def kubelet() -> Iterator[tuple[KubeletStandIn, PodResourcesStandIn]]:
    """Kubelet's device-plugin registration and pod-resources sockets, in a short directory:
    a unix socket path must stay under 108 bytes, and pytest's tmp_path is long."""
    directory = Path(tempfile.mkdtemp(prefix="edl-e2e-"))
    registration = KubeletStandIn(directory / "device-plugins")
    registration.directory.mkdir()
    pod_resources = PodResourcesStandIn(directory / "pod-resources" / "kubelet.sock")
    pod_resources.socket.parent.mkdir()
    registration.start()
    pod_resources.start()
    yield registration, pod_resources
    pod_resources.stop()
    registration.stop()
    shutil.rmtree(directory, ignore_errors=True)


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


def create_worker(k8s: KwokCluster, index: int, node: str, pool: str) -> Any:
    """A worker with one GPU, placed on `node` by spec.nodeName (scheduled before the test),
    with the pool's nodeSelector that its replacement keeps."""
    name = f"{JOB}-worker-{index}"
    body = client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels=worker_labels(index)),
        spec=client.V1PodSpec(
            node_name=node,
            node_selector={POOL_LABEL: pool},
            restart_policy="Never",
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
    """deploy/daemonset/example-policy.yaml's shape, with deviceUnhealthy among the events."""
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


def untaint_ready(k8s: KwokCluster, node: Any) -> Any:
    """Do the node lifecycle controller's part (no controller-manager runs): the API server's
    TaintNodesByCondition admission taints every new Node node.kubernetes.io/not-ready:NoSchedule,
    and that controller lifts the taint once the Node is Ready, as KWOK makes it."""
    taints = [t for t in node.spec.taints or [] if t.key != NOT_READY_TAINT]
    if len(taints) == len(node.spec.taints or []):
        return node
    body = [{"key": t.key, "value": t.value, "effect": t.effect} for t in taints]
    return k8s.core.patch_node(
        node.metadata.name, {"spec": {"taints": body or None}}, _content_type=MERGE
    )


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


@pytest.mark.timeout(600)
def test_xid79_replaces_the_worker_on_another_node(  # noqa: PLR0917 - fixtures
    k8s: KwokCluster,
    k8s_control_plane: testcluster.ControlPlane,
    kube_scheduler: Process,
    restarter_rbac: None,  # noqa: F811 - the fixture imported above
    agent_rbac: list[str],
    policy: dict[str, Any],
    kubelet: tuple[KubeletStandIn, PodResourcesStandIn],
    processes: list[Process],
    pod_log: PodLog,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    ns = k8s.namespace
    registration, pod_resources = kubelet
    objects = client.CustomObjectsApi(k8s.api)

    # --- the cluster: four GPU nodes in this test's pool ---------------------------------
    pool = ns
    names = [k8s.unique_name(f"gpu-{i}") for i in range(WORKERS)]
    for name in names:
        k8s.create_gpu_node(name, labels={POOL_LABEL: pool}, wait_ready=False)
    for name in names:
        node = k8s.wait_node_ready(name, timeout=STARTUP_TIMEOUT)
        assert node.status.allocatable[GPU_RESOURCE] == "8"
        node = untaint_ready(k8s, node)
        assert not node.spec.taints, f"{name} has taints the workers do not tolerate"
    agent_node = names[0]
    agent_rbac.append(agent_node)

    # --- credentials -------------------------------------------------------------------------
    api_token, intake_token = agent_tokens(k8s, agent_node)
    agent_api = sa_client(k8s.api, api_token)
    wait_rbac(k8s, agent_api, agent_node, names[1])
    agent_api.close()
    agent_kubeconfig = write_kubeconfig(
        tmp_path / "agent.kubeconfig", k8s_control_plane, api_token, AGENT_SA
    )
    intake_token_file = tmp_path / "edl-agent-token"
    intake_token_file.write_text(intake_token)
    restarter_token = k8s.mint_token(RESTARTER_SA)
    restarter_kubeconfig = write_kubeconfig(
        tmp_path / "restarter.kubeconfig", k8s_control_plane, restarter_token, RESTARTER_SA
    )
    restarter_api = sa_client(k8s.api, restarter_token)
    wait_for(
        "the restarter's RBAC",
        lambda: _may(lambda: client.CoreV1Api(restarter_api).list_namespaced_pod(ns, limit=1)),
        bool,
        timeout=STARTUP_TIMEOUT,
    )
    restarter_api.close()

    # --- the job (its policy is the `policy` fixture) -------------------------------------
    placement = {0: agent_node, 1: agent_node, 2: names[1], 3: names[2]}
    for index, node_name in placement.items():
        create_worker(k8s, index, node_name, pool)
    for index in placement:
        k8s.wait_pod_phase(f"{JOB}-worker-{index}", "Running", timeout=STARTUP_TIMEOUT)
    victim = f"{JOB}-worker-0"
    uids = {index: k8s.read_pod(f"{JOB}-worker-{index}").metadata.uid for index in placement}

    # --- the restarter -----------------------------------------------------------------------
    intake_port = free_port()
    argv = [
        EDL_AGENT,
        "restarter",
        f"--kubeconfig={restarter_kubeconfig}",
        f"--listen=127.0.0.1:{intake_port}",
        f"--agent-service-account={ns}/{AGENT_SA}",
        f"--namespace={ns}",
        f"--audience={AUDIENCE}",
        "--log-format=json",
    ]
    options = restarter_help()
    # Leader election, as deployed: a Lease in the restarter's (here the test's) namespace.
    leader_election = "--lease-namespace" in options
    if leader_election:
        argv += [f"--lease-namespace={ns}", f"--lease-name={LEASE}"]
        if "--leader-elect" in options:
            argv.append("--leader-elect")
    metrics_port = free_port() if "--metrics-addr" in options else None
    if metrics_port is not None:
        argv.append(f"--metrics-addr=127.0.0.1:{metrics_port}")
    restarter = spawn("restarter", argv, tmp_path / "restarter")
    processes.append(restarter)
    wait_for(
        f"the restarter's fault intake on port {intake_port}",
        lambda: _accepts(restarter, intake_port),
        bool,
        timeout=STARTUP_TIMEOUT,
    )
    if leader_election:
        wait_for(
            f"the restarter to hold Lease {ns}/{LEASE}",
            lambda: _lease_holder(k8s, LEASE),
            bool,
            timeout=STARTUP_TIMEOUT,
        )
    if metrics_port is not None:
        # Ready once it acts (the leader) and has listed pods, nodes and policies: a fault
        # that came before would find no policy covering its pod.
        wait_for(
            "the restarter's /readyz",
            lambda: _readyz(restarter, metrics_port),
            lambda answer: answer[0] == OK and "standby" not in answer[1],
            timeout=STARTUP_TIMEOUT,
        )

    # --- the agent -----------------------------------------------------------------------------
    sim_tmp = tmp_path / "sim"
    sim_tmp.mkdir()
    argv = [
        EDL_AGENT,
        "run",
        f"--simulate={PROFILE}",
        f"--node-name={agent_node}",
        f"--kubelet-dir={registration.directory}",
        f"--state-dir={tmp_path / 'agent-state'}",
        f"--restarter-address=127.0.0.1:{intake_port}",
        f"--metrics-addr=127.0.0.1:{free_port()}",
        f"--set=node.kubeconfig={agent_kubeconfig}",
        f"--set=faults.token_file={intake_token_file}",
        f"--set=pod_resources_socket={pod_resources.socket}",
        "--log-format=json",
    ]
    agent = spawn(
        "agent",
        argv,
        tmp_path / "agent",
        env={**os.environ, "TMPDIR": str(sim_tmp)},
        separate_stdout=True,
    )
    processes.append(agent)
    registration.wait_registered({GPU_RESOURCE}, timeout=STARTUP_TIMEOUT)
    assert agent.stdout is not None
    ids = {int(m[1]): m[2] for m in map(GPU_ROW.match, agent.stdout.read_text().splitlines()) if m}
    assert sorted(ids) == list(range(8)), f"the agent's inventory: {agent.stdout.read_text()}"
    [tree] = sim_tmp.glob(f"edl-sim-{PROFILE}-*")
    # Kubelet's record of the allocations: GPU 3 to worker-0, GPU 5 to worker-1 (same node).
    pod_resources.assign(
        {
            (ns, victim): {"trainer": {GPU_RESOURCE: [ids[FAULTY_GPU]]}},
            (ns, f"{JOB}-worker-1"): {"trainer": {GPU_RESOURCE: [ids[BYSTANDER_GPU]]}},
        }
    )
    wait_for(
        "the agent's labels and condition True",
        lambda: k8s.core.read_node(agent_node),
        lambda n: (
            (n.metadata.labels or {}).get("nvidia.com/gpu.count") == "8"
            and getattr(condition_of(n), "status", None) == "True"
        ),
        timeout=STARTUP_TIMEOUT,
    )
    law = registration.watch(GPU_RESOURCE)
    timeline = Timeline()
    try:
        first = law.next(timeout=STEP_TIMEOUT)
        assert {d.health for d in first.devices} == {"Healthy"}
        _run_timeline(
            timeline,
            k8s=k8s,
            law=law,
            tree=tree,
            agent=agent,
            restarter=restarter,
            kube_scheduler=kube_scheduler,
            pod_log=pod_log,
            ids=ids,
            agent_node=agent_node,
            victim=victim,
            objects=objects,
        )
    finally:
        law.cancel()
        _report(timeline, request.node)

    # --- the outcome ------------------------------------------------------------------------
    replacement_name = f"{victim}-r1"
    replacement = k8s.read_pod(replacement_name)
    bound_to = replacement.spec.node_name
    assert bound_to != agent_node
    assert bound_to in names
    assert replacement.metadata.annotations[RESTART_COUNT_ANNOTATION] == "1"
    assert replacement.metadata.annotations[REPLACES_ANNOTATION] == victim
    terms = (
        replacement.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
    )
    assert any(
        f.key == "metadata.name" and f.operator == "NotIn" and agent_node in f.values
        for term in terms.node_selector_terms
        for f in term.match_fields or []
    ), "the replacement must keep away from the failed node"
    assert replacement.metadata.labels.items() >= worker_labels(0).items()

    status = job_status(objects, ns)
    [job] = status["jobs"]
    assert (status["restarts"], job["name"], job["restarts"]) == (1, JOB, 1)
    restarts = [a for a in job["lastActions"] if a["action"] == "Restart"]
    assert len(restarts) == 1, job["lastActions"]
    assert restarts[0]["fault"] == "DeviceUnhealthy"
    assert restarts[0]["pod"] == f"{ns}/{victim}"
    assert restarts[0]["faultId"] == timeline.notes[AGENT_FAULT]  # the agent's fault id

    # Nobody else was touched: worker-1 holds a healthy GPU on the same node.
    for index in (1, 2, 3):
        pod = k8s.read_pod(f"{JOB}-worker-{index}")
        assert pod.metadata.uid == uids[index]
        assert pod.metadata.deletion_timestamp is None
        assert pod.status.phase == "Running"
    assert pod_or_none(k8s, f"{victim}-r2") is None  # one fault, one replacement
    outbox = tmp_path / "agent-state" / "outbox"
    assert sorted(p.name for p in outbox.glob("*.json")) == [], "the fault was not acknowledged"


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


def _report(timeline: Timeline, item: pytest.Item) -> None:
    """Print the timeline (visible with -s), keep it for the terminal summary and record it in
    the test's user_properties (junit XML), as the record_property fixture would, without that
    fixture's warning under junit_family xunit2 (an error here: filterwarnings = error).

    Times come from where each step shows: the test's own watches and polls (ListAndWatch, the
    Node, the pods), or the agent's and the restarter's log timestamps; all one machine clock.
    """
    if not timeline.moments:
        return
    lines = timeline.lines()
    title = f"e2e timeline: XID {XID} on GPU {FAULTY_GPU} -> replacement (t=0 at the injection)"
    print(f"\n{title}")
    for line in lines:
        print(f"  {line}")
    _TIMELINES.append((title, lines))
    item.user_properties.append(("timeline", "\n".join(lines)))
    for what, at in timeline.moments.items():
        item.user_properties.append((f"t[{what}]", round(at - timeline.t0, 3)))


def _run_timeline(
    timeline: Timeline,
    *,
    k8s: KwokCluster,
    law: Watch,
    tree: Path,
    agent: Process,
    restarter: Process,
    kube_scheduler: Process,
    pod_log: PodLog,
    ids: dict[int, str],
    agent_node: str,
    victim: str,
    objects: client.CustomObjectsApi,
) -> None:
    """Inject the XID, then wait for each step and put it on the timeline; assert the order.

    The device-plugin stream and the node condition are watched from the moment of injection on
    threads of their own, so that each is timed when it happens, not when the test gets to it.
    """
    gpu = ids[FAULTY_GPU]
    injected = f"XID {XID} injected on GPU {FAULTY_GPU}"
    with ThreadPoolExecutor(max_workers=2) as pool:
        timeline.t0 = time.time()
        inject.inject_xid(tree, FAULTY_GPU, XID)
        timeline.mark(injected, timeline.t0, gpu)
        in_law = pool.submit(
            lambda: (
                law.until(
                    lambda update: any(
                        gpu == d.ID and d.health == "Unhealthy" for d in update.devices
                    ),
                    timeout=STEP_TIMEOUT,
                ),
                time.time(),
            )
        )
        in_condition = pool.submit(
            _first(
                f"{CONDITION_TYPE}=False on {agent_node}",
                lambda: k8s.core.read_node(agent_node),
                lambda n: getattr(condition_of(n), "status", None) == "False",
            )
        )
        unhealthy, law_at = in_law.result(STEP_TIMEOUT + 5)
        timeline.mark("Unhealthy in ListAndWatch", law_at, gpu)
        condition_at, node = in_condition.result(STEP_TIMEOUT + 5)
    condition = condition_of(node)
    timeline.mark(f"{CONDITION_TYPE}=False", condition_at, f"reason {condition.reason}")
    assert [d.ID for d in unhealthy.devices if d.health == "Unhealthy"] == [gpu]
    assert condition.reason == f"XID{XID}"
    assert gpu in condition.message

    observed = wait_logged(
        agent,
        "the DeviceUnhealthy fault",
        lambda e: e.get("event") == "fault observed" and e.get("kind") == "DeviceUnhealthy",
        STEP_TIMEOUT,
    )
    assert observed["pods"] == [f"{k8s.namespace}/{victim}"]
    assert observed["devices"] == [gpu]
    fault_id = observed["fault_id"]
    timeline.mark(AGENT_FAULT, logged_at(observed), fault_id)

    decision = wait_logged(
        restarter,
        "the decision",
        lambda e: e.get("event") == "decision" and e.get("fault_id") == fault_id,
        STEP_TIMEOUT,
    )
    timeline.mark("restarter: fault accepted, decision", logged_at(decision), decision["action"])
    assert decision["action"] == "Restart", decision
    assert decision["pod"] == f"{k8s.namespace}/{victim}"
    replaced = wait_logged(
        restarter,
        "the replacement",
        lambda e: e.get("event") == "pod replaced" and e.get("old") == f"{k8s.namespace}/{victim}",
        STEP_TIMEOUT,
    )
    timeline.mark("restarter: pod replaced", logged_at(replaced), str(replaced.get("new", "")))

    def seen(what: str, match: Callable[[str, Any], bool]) -> tuple[float, Any]:
        found: tuple[float, Any] = wait_for(
            what, lambda: pod_log.first(match), bool, timeout=STEP_TIMEOUT
        )
        return found

    new_name = f"{victim}-r1"
    deleting, _ = seen(
        f"{victim} deleted",
        lambda kind, pod: (
            pod.metadata.name == victim
            and (kind == "DELETED" or pod.metadata.deletion_timestamp is not None)
        ),
    )
    timeline.mark("old pod deleted (deletionTimestamp)", deleting, victim)
    gone, _ = seen(
        f"{victim} gone", lambda kind, pod: pod.metadata.name == victim and kind == "DELETED"
    )
    timeline.mark("old pod gone", gone)
    created, _ = seen(
        f"{new_name} created", lambda kind, pod: kind == "ADDED" and pod.metadata.name == new_name
    )
    timeline.mark("replacement created", created, new_name)
    bound, pod = seen(
        f"{new_name} bound by the scheduler",
        lambda _kind, pod: pod.metadata.name == new_name and bool(pod.spec.node_name),
    )
    timeline.mark("replacement bound", bound, f"to {pod.spec.node_name}")
    # The scheduler's own account: the failed node was evaluated and found infeasible.
    line = wait_for(
        f"kube-scheduler to log the binding of {new_name}",
        lambda: next(
            (
                match
                for match in BOUND.finditer(kube_scheduler.log.read_text(errors="replace"))
                if match["pod"] == f"{k8s.namespace}/{new_name}"
            ),
            None,
        ),
        bool,
        timeout=STEP_TIMEOUT,
    )
    assert line["node"] == pod.spec.node_name
    assert int(line["feasible"]) == WORKERS - 1, line[0]  # the pool without the failed node
    timeline.notes["replacement bound"] += (
        f" (kube-scheduler: {line['feasible']} of {line['evaluated']} nodes feasible)"
    )
    running, _ = seen(
        f"{new_name} Running",
        lambda _kind, pod: pod.metadata.name == new_name and pod.status.phase == "Running",
    )
    timeline.mark("replacement Running (KWOK)", running)
    counted_at, _ = _first(
        "one restart in the policy's status",
        lambda: job_status(objects, k8s.namespace),
        lambda status: status.get("restarts") == 1,
    )()
    timeline.mark("policy status: restarts 1 (seen)", counted_at)

    timeline.assert_order(
        injected,
        AGENT_FAULT,
        "restarter: fault accepted, decision",
        "replacement created",
        "replacement bound",
        "replacement Running (KWOK)",
    )
    # The old pod goes after the decision; before or after its replacement is created is the
    # actuator's choice (creating first leaves nothing half done when the restarter dies).
    timeline.assert_order(
        "restarter: fault accepted, decision", "old pod deleted (deletionTimestamp)", "old pod gone"
    )
    timeline.assert_order(injected, "Unhealthy in ListAndWatch")
    timeline.assert_order(injected, f"{CONDITION_TYPE}=False")


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
