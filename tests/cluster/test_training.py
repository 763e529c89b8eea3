"""Training keeps going through a fault: a real PaddlePaddle elastic job (tests/training/train.py
under `paddle.distributed.launch`, etcd rendezvous, elastic level 1) on three real kubelet v1.37
nodes whose runtime runs the pods' processes (testnode exec mode), with kube-controller-manager
(a dead node goes NotReady), kube-scheduler, an agent on each node (simulated dgx-h100) and the
restarter under a FaultTolerancePolicy like the README's AITrainingJob example.

One job of three workers (one launcher per pod, one GPU each) goes through the faults in turn;
after each, the trainers' own logs must show a formation of three resuming from the newest
checkpoint and making steps:
- XID 95 (a reset-class memory error) on the GPU a worker holds: the agent reports it, the
  restarter replaces the pod, the job re-forms with the replacement;
- XID 94 (a contained error: the GPU warns, Degraded) on the GPU a worker holds: the policy's
  Graceful rule evicts the pod, its trainer saves the step it finished on SIGTERM, the job
  resumes from exactly there (no step lost) with the replacement on another GPU;
- the same warning on the worker whose trainer does not save on SIGTERM (the third; it dies of
  it, as a trainer nobody taught would): replaced, the job resumes from the last periodic
  checkpoint, losing at most its interval, as after any other fault;
- a launcher exits 1: kubelet restarts it in place (its restart rules), the restarter does not
  replace anything;
- the warning while a PodDisruptionBudget allows no disruption: the eviction is refused (an
  Event), the pod trains on with no copy beside it; once the budget is lifted it leaves as
  gracefully (no step lost);
- a launcher exits 101 (a policy code): the pod ends (its restart rules leave 101 to us), the
  restarter replaces it;
- a worker pod force-deleted: replaced;
- a node dies (kubelet and runtime stop): NotReady, its worker replaced on another node;
- the baseline: the same XID with the restarter stopped, measured over a fixed window.
The faults go round the workers, and one that restarts a worker waits until its last restart is
older than the policy's restartTimeLimit (60 s): within it, a restart is one more in a row, which
the policy backs off, and the figures would show that wait.

A second job runs to its end: every worker's pod must end Succeeded, with nothing replaced. The
workers' container restart rules are read from deploy/examples/paddle-elastic-job.yaml, so both
tests run the rules as shipped (a rule that restarts exit 0 too would start a finished trainer
again forever, and the second test would never see a pod Succeed).

Each scenario's timeline (fault → replacement Running → training resumed at full size, steps
lost) is printed in pytest's terminal summary; with TRAINING_FIGURES_FILE=FILE set they are also
written there as JSON (bench/training_faults.py runs rounds of this test that way).

The trainer's environment comes from scripts/trainer-env (PaddlePaddle, cached in .cache)."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import k8sbinaries
import pytest
import testcluster
import testnode
import yaml
from k8s_test_helpers import GPU_RESOURCE, KwokCluster, bound_tokens, wait_for
from kubelet_helpers import NodeAgent, pod_devices
from kubernetes import client
from scheduler import Process, ProcessError, free_port, spawn, start_scheduler
from test_e2e import (  # fixtures too: pytest finds them among the module's names
    _TIMELINES,
    AGENT_SA,
    AUDIENCE,
    JOB,
    POOL_LABEL,
    _summary,
    policy_body,
    processes,
    reporting_agent,
    spawn_restarter,
    worker_labels,
)
from test_restarter import GROUP, PLURAL, VERSION, install_policy_crd

from edl_agent.kube_time import parse_time
from edl_agent.restarter.core.replacement import REPLACES_ANNOTATION
from edl_agent.sim import inject
from tests.training.progress import Recovery, Report, parse, progressing, recovery

__all__ = ["_summary", "processes"]

pytestmark = pytest.mark.kubelet

REPO = Path(__file__).resolve().parents[2]
TRAIN_PY = REPO / "tests" / "training" / "train.py"
EXAMPLE = REPO / "deploy" / "examples" / "paddle-elastic-job.yaml"
WORLD = 3
XID = 95
WARNED_XID = 94  # Degraded: the pod leaves gracefully
IGNORES_SIGTERM = 2  # the worker whose trainer does not save on SIGTERM
CHECKPOINT_EVERY = 50  # train.py's default: steps between rank 0's periodic checkpoints
MERGE = "application/merge-patch+json"
STARTUP = 180.0
RECOVERY = 150.0  # fault → training back at full size; Paddle's own share is ~17 s
BASELINE_WINDOW = 45.0
PROGRESS_STEPS = 30
STEPS_TO_END = 300  # the job that runs to its end: a few seconds of steps at world size 3
END = 300.0  # start → every pod Succeeded

# --- the trainers' logs -------------------------------------------------------------------------


class TrainerLogs:
    """Every report the trainers printed, read from the pods' log files on every node (kept once
    read: a deleted pod's logs go with it)."""

    def __init__(self, nodes: list[testnode.Node]) -> None:
        self._nodes = nodes
        self._seen: dict[tuple[str, float, int, int, str], Report] = {}

    def reports(self) -> list[Report]:
        for node in self._nodes:
            for path in _logs(node.host_path("/var/log/pods")):
                try:
                    text = path.read_text(errors="replace")
                except OSError:
                    continue
                for report in parse(text, source=path.parent.parent.name):
                    key = (report.source, report.t, report.rank, report.step, report.event)
                    self._seen.setdefault(key, report)
        return sorted(self._seen.values(), key=lambda r: r.t)


def _logs(root: Path) -> list[Path]:
    """The pods' log files under `root`; a pod's directory removed while it is listed (kubelet
    cleaning up after a replaced pod) makes the listing start again."""
    for _ in range(10):
        try:
            return list(root.glob("*/*/*.log"))
        except OSError:
            continue
    return []


# --- fixtures -----------------------------------------------------------------------------------


def trainer_env(trainer: str) -> Path:
    """The python of a trainer's environment (scripts/trainer-env paddle|torch installs it once,
    into .cache)."""
    done = subprocess.run(
        [str(REPO / "scripts" / "trainer-env"), trainer],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"scripts/trainer-env {trainer} failed:\n{done.stderr[-2000:]}", pytrace=False)
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def trainer_python() -> Path:
    """The Paddle trainer's python."""
    return trainer_env("paddle")


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[str]:
    """An etcd of its own for Paddle's rendezvous; its client URL."""
    binary = k8sbinaries.find("etcd")
    if binary is None:
        pytest.fail("etcd is missing: run scripts/k8s-binaries", pytrace=False)
    port, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    process = spawn(
        "etcd",
        [
            str(binary),
            f"--data-dir={tmp_path / 'etcd-data'}",
            f"--listen-client-urls={url}",
            f"--advertise-client-urls={url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=default=http://127.0.0.1:{peer}",
        ],
        tmp_path / "etcd",
    )
    wait_for(f"etcd on {url}", lambda: _answers(f"{url}/health", process), bool, timeout=30)
    yield f"127.0.0.1:{port}"
    process.stop()


@pytest.fixture
def managed_scheduler(
    k8s_managed_plane: testcluster.ControlPlane, tmp_path: Path
) -> Iterator[Process]:
    try:
        process = start_scheduler(
            k8s_managed_plane.kubeconfig, tmp_path / "kube-scheduler", timeout=90.0
        )
    except ProcessError as exc:
        pytest.fail(str(exc), pytrace=False)
    yield process
    process.stop()


@pytest.fixture
def policy_crd(k8s_managed: KwokCluster) -> None:
    install_policy_crd(k8s_managed.api)


# --- the job ------------------------------------------------------------------------------------


@dataclass
class Job:
    """The training job and what its scenarios share. Its pods are found by `selector` and told
    apart by `index_label`; `owned`: a controller (a Job) makes each worker again, under a new
    name with the same index, where the restarter replaces a bare pod by a named successor."""

    k8s: KwokCluster
    nodes: dict[str, testnode.Node]
    agents: dict[str, NodeAgent]
    restarter: Process
    logs: TrainerLogs
    workdir: Path
    timelines: list[dict[str, Any]] = field(default_factory=list)
    selector: str = f"{POOL_LABEL}-job={JOB}"
    index_label: str = "training.edl.io/replica-index"
    policy: str = JOB
    owned: bool = False

    def pods(self) -> list[Any]:
        """The job's live pods (not being deleted), by replica index."""
        listed = self.k8s.core.list_namespaced_pod(
            self.k8s.namespace, label_selector=self.selector
        ).items
        return sorted(
            (p for p in listed if p.metadata.deletion_timestamp is None),
            key=lambda p: p.metadata.labels[self.index_label],
        )

    def worker(self, index: int) -> Any:
        return next(p for p in self.pods() if p.metadata.labels[self.index_label] == str(index))

    def successor_running(self, victim: Any) -> bool:
        """The worker that takes `victim`'s place is Running."""
        if not self.owned:
            return replacement_running(self, victim.metadata.name)
        index = victim.metadata.labels[self.index_label]
        return any(
            p.metadata.labels.get(self.index_label) == index
            and p.metadata.uid != victim.metadata.uid
            and p.status.phase == "Running"
            for p in self.pods()
        )


def shipped_restart_rules() -> list[dict[str, Any]]:
    """The trainer container's restart rules as deploy/examples/paddle-elastic-job.yaml ships
    them (one set, the same for every worker)."""
    documents = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    found = {
        json.dumps(container["restartPolicyRules"], sort_keys=True)
        for document in documents
        if document["kind"] == "Pod"
        for container in document["spec"]["containers"]
    }
    assert len(found) == 1, f"the example's workers disagree on their restart rules: {found}"
    rules: list[dict[str, Any]] = json.loads(found.pop())
    return rules


def worker_pod(
    index: int,
    *,
    node: str | None,
    pool: str,
    python: Path,
    etcd: str,
    workdir: Path,
    steps: int | None = None,
    ignore_sigterm: bool = False,
) -> dict[str, Any]:
    """A worker: one launcher with one GPU, with the shipped restart rules: kubelet restarts the
    launcher in place on a failed exit except the policy's codes (129, 101), which end the pod
    for the restarter; exit 0 ends the pod Succeeded. `steps`: the trainer exits 0 after that
    many (else it trains on until the test ends); `ignore_sigterm`: its trainer does not save
    on SIGTERM (it dies of it, as a trainer nobody taught to save does)."""
    labels = {**worker_labels(index), f"{POOL_LABEL}-job": JOB}
    launcher = [
        str(python),
        "-m",
        "paddle.distributed.launch",
        f"--master=etcd://{etcd}",
        f"--nnodes=2:{WORLD}",
        "--elastic_level=1",
        "--max_restart=200",
        "--elastic_timeout=10",
        f"--job_id={JOB}",
        f"--log_dir={workdir}/launch-logs/$(POD_NAME)",
        str(TRAIN_PY),
        f"--checkpoints={workdir}/checkpoints",
        *([] if steps is None else [f"--steps={steps}"]),
        *(["--ignore-sigterm"] if ignore_sigterm else []),
    ]
    spec: dict[str, Any] = {
        "nodeSelector": {POOL_LABEL: pool},
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 5,
        "containers": [
            {
                "name": "trainer",
                "image": "registry.invalid/edl/paddle-trainer:test",
                "command": launcher,
                "env": [
                    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "HOME", "value": str(workdir / "home")},
                    {"name": "PYTHONUNBUFFERED", "value": "1"},
                ],
                "resources": {"limits": {GPU_RESOURCE: "1"}},
                "restartPolicy": "Never",
                "restartPolicyRules": shipped_restart_rules(),
            }
        ],
    }
    if node is not None:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{JOB}-worker-{index}", "labels": labels},
        "spec": spec,
    }


def start_restarter_and_agents(
    k8s: KwokCluster,
    plane: testcluster.ControlPlane,
    nodes: dict[str, testnode.Node],
    tmp_path: Path,
    processes: list[Process],
    *restarter_args: str,
) -> tuple[Process, dict[str, NodeAgent]]:
    """The restarter (admin credentials: its RBAC is proven in test_e2e.py; `restarter_args`
    added to its command) and an agent on each node reporting to it with a token bound to a pod
    on its node; returns once every node has its 8 GPUs allocatable."""
    k8s.create_service_account(AGENT_SA)
    restarter, intake_port = spawn_restarter(
        k8s, plane.kubeconfig, tmp_path, processes, *restarter_args
    )
    agents = {}
    for name, node in nodes.items():
        [intake_token] = bound_tokens(
            k8s.core, k8s.namespace, name, AGENT_SA, [[AUDIENCE]], command=["sleep", "infinity"]
        )
        directory = tmp_path / f"agent-{name}"
        directory.mkdir()
        agents[name] = reporting_agent(
            node,
            directory,
            kubeconfig=plane.kubeconfig,
            intake_token=intake_token,
            intake_port=intake_port,
            processes=processes,
        )
    for name in nodes:
        wait_for(
            f"{name}: GPUs allocatable",
            lambda n=name: k8s.core.read_node(n).status.allocatable or {},
            lambda allocatable: allocatable.get(GPU_RESOURCE) == "8",
            timeout=STARTUP,
            alive=agents[name].process,
        )
    return restarter, agents


def _answers(url: str, process: Process) -> bool:
    process.check_alive()
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:  # noqa: S310 - http on loopback
            return bool(answer.status == 200)
    except OSError:
        return False


# --- scenarios ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    name: str
    fault_at: float
    replacement_running_at: float | None
    recovered: Recovery | None
    note: str = ""

    def lines(self) -> list[str]:
        def at(t: float | None) -> str:
            return "—" if t is None else f"+{t - self.fault_at:7.2f} s"

        found = self.recovered
        rows = [
            f"{'fault':<38} {at(self.fault_at)}  {self.note}".rstrip(),
            f"{'replacement Running':<38} {at(self.replacement_running_at)}",
            f"{'training resumed at world size ' + str(WORLD):<38} "
            + (at(found.resumed_at) if found else "—"),
        ]
        if found is not None and found.going_again_at < found.resumed_at:
            rows.insert(
                2,
                f"{'training going on at world size ' + str(found.going_again_world):<38} "
                + at(found.going_again_at),
            )
        if found is not None:
            rows.append(
                f"{'steps lost':<38} {found.steps_lost} (newest step {found.last_step_before}, "
                f"resumed from checkpoint {found.resumed_from})"
            )
        return rows

    def figures(self) -> dict[str, Any]:
        found = self.recovered
        return {
            "scenario": self.name,
            "fault_to_replacement_running_s": (
                None
                if self.replacement_running_at is None
                else round(self.replacement_running_at - self.fault_at, 3)
            ),
            "fault_to_training_resumed_s": (
                None if found is None else round(found.resumed_at - self.fault_at, 3)
            ),
            "fault_to_training_going_s": (
                None if found is None else round(found.going_again_at - self.fault_at, 3)
            ),
            "steps_lost": None if found is None else found.steps_lost,
            "note": self.note,
        }


def report(job: Job, outcome: Outcome) -> None:
    title = f"training through faults: {outcome.name} (t=0 at the fault)"
    lines = outcome.lines()
    print(f"\n{title}")
    print("\n".join(lines))
    _TIMELINES.append((title, lines))
    job.timelines.append(outcome.figures())


def training_at_full_size(job: Job, since: float) -> None:
    """Until the trainers report steps at world size WORLD made after `since`."""
    wait_for(
        f"training at world size {WORLD}",
        job.logs.reports,
        lambda reports: progressing(reports, WORLD, since, PROGRESS_STEPS),
        timeout=STARTUP,
    )


def wait_resumed(job: Job, fault_at: float, what: str) -> Recovery:
    found: Recovery = wait_for(
        f"training resumed at world size {WORLD} after {what}",
        lambda: recovery(job.logs.reports(), fault_at, WORLD),
        bool,
        timeout=RECOVERY,
    )
    return found


def replacement_running(job: Job, old_name: str) -> bool:
    """A replacement of `old_name` (named by the restarter's annotation) is Running."""
    return any(
        (p.metadata.annotations or {}).get(REPLACES_ANNOTATION) == old_name
        and p.status.phase == "Running"
        for p in job.pods()
    )


def replaced_scenario(job: Job, name: str, victim: Any, fault: Callable[[], str]) -> Outcome:
    """Inject `fault` (it returns a note) against pod `victim`; the restarter must replace it
    and training resume at full size."""
    fault_at = time.time()
    note = fault()
    seen: dict[str, Any] = {}

    def observe() -> bool:
        if "running" not in seen and job.successor_running(victim):
            seen["running"] = time.time()
        found = seen.get("resumed") or recovery(job.logs.reports(), fault_at, WORLD)
        if found is not None:
            seen["resumed"] = found
        return "running" in seen and found is not None

    try:
        wait_for(f"{name}: a Running replacement and training resumed", observe, bool, RECOVERY)
    finally:
        report(job, Outcome(name, fault_at, seen.get("running"), seen.get("resumed"), note))
    return Outcome(name, fault_at, seen["running"], seen["resumed"], note)


def gpu_of(job: Job, pod: Any) -> str:
    [gpu] = pod_devices(job.nodes[pod.spec.node_name], job.k8s.namespace, pod.metadata.name)[
        "trainer"
    ][GPU_RESOURCE]
    return str(gpu)


def xid_on(job: Job, pod: Any, code: int = XID) -> str:
    node = pod.spec.node_name
    agent = job.agents[node]
    gpu = gpu_of(job, pod)
    index = next(d["index"] for d in agent.devices() if d["id"] == gpu)
    inject.inject_xid(agent.tree, index, code)
    return f"XID {code} on GPU {index} of {pod.metadata.name} ({node})"


# --- the tests ----------------------------------------------------------------------------------


def pool_of_nodes(
    k8s: KwokCluster, kubelet_nodes: Callable[..., testnode.Node], tmp_path: Path
) -> tuple[Path, dict[str, testnode.Node]]:
    """The job's work directory (checkpoints, HOME) and its WORLD exec-mode kubelet nodes, each
    labelled for the test's pool (the workers' nodeSelector)."""
    workdir = tmp_path / "train"
    (workdir / "checkpoints").mkdir(parents=True)
    (workdir / "home").mkdir()
    nodes = {}
    for _ in range(WORLD):
        node = kubelet_nodes(exec_mode=True)
        k8s.core.patch_node(
            node.name, {"metadata": {"labels": {POOL_LABEL: k8s.namespace}}}, _content_type=MERGE
        )
        nodes[node.name] = node
    return workdir, nodes


def start_job(
    k8s: KwokCluster,
    plane: testcluster.ControlPlane,
    kubelet_nodes: Callable[..., testnode.Node],
    *,
    trainer_python: Path,
    etcd: str,
    processes: list[Process],
    tmp_path: Path,
    steps: int | None = None,
    ignoring_sigterm: frozenset[int] = frozenset(),
) -> Job:
    """Three exec-mode kubelet nodes with an agent each, the restarter and the policy, and one
    worker created on each node (`steps`: see `worker_pod`; `ignoring_sigterm`: the indexes of
    the workers whose trainers do not save on SIGTERM)."""
    ns = k8s.namespace
    workdir, nodes = pool_of_nodes(k8s, kubelet_nodes, tmp_path)
    restarter, agents = start_restarter_and_agents(k8s, plane, nodes, tmp_path, processes)
    objects = client.CustomObjectsApi(k8s.api)
    objects.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, policy_body(ns))
    job = Job(k8s, nodes, agents, restarter, TrainerLogs(list(nodes.values())), workdir)
    for index, node_name in enumerate(nodes):
        k8s.core.create_namespaced_pod(
            ns,
            worker_pod(
                index,
                node=node_name,
                pool=ns,
                python=trainer_python,
                etcd=etcd,
                workdir=workdir,
                steps=steps,
                ignore_sigterm=index in ignoring_sigterm,
            ),
        )
    return job


@pytest.mark.timeout(900)
def test_a_job_runs_to_its_end_and_every_pod_succeeds(  # noqa: PLR0917 - fixtures
    k8s_managed: KwokCluster,
    k8s_managed_plane: testcluster.ControlPlane,
    managed_kubelet_nodes: Callable[..., testnode.Node],
    managed_scheduler: Process,
    policy_crd: None,
    trainer_python: Path,
    etcd: str,
    processes: list[Process],
    tmp_path: Path,
) -> None:
    """The shipped restart rules let a finished job end: each launcher exits 0 after the last
    step and its pod Succeeds; nothing is restarted after that and nothing replaced."""
    k8s = k8s_managed
    job = start_job(
        k8s,
        k8s_managed_plane,
        managed_kubelet_nodes,
        trainer_python=trainer_python,
        etcd=etcd,
        processes=processes,
        tmp_path=tmp_path,
        steps=STEPS_TO_END,
    )
    created = {p.metadata.name: p.metadata.uid for p in job.pods()}
    assert len(created) == WORLD

    def phases() -> dict[str, str]:
        return {p.metadata.name: p.status.phase for p in job.pods()}

    def ended(found: dict[str, str]) -> bool:
        if "Failed" in found.values():
            pytest.fail(f"a worker's pod failed: {found}", pytrace=False)
        return len(found) == WORLD and set(found.values()) == {"Succeeded"}

    wait_for("every worker's pod Succeeded", phases, ended, timeout=END)
    done = job.pods()
    assert {p.metadata.name: p.metadata.uid for p in done} == created, "a pod was replaced"
    for pod in done:
        [status] = pod.status.container_statuses
        assert status.state.terminated is not None
        assert status.state.terminated.exit_code == 0
        assert not (pod.metadata.annotations or {}).get(REPLACES_ANNOTATION)
    last = [r for r in job.logs.reports() if r.event == "step"]
    assert max(r.step for r in last) == STEPS_TO_END
    # A restart after the end would start a trainer again: it prints "start" once more.
    finished_at = max(r.t for r in last if r.step == STEPS_TO_END)
    again = [r for r in job.logs.reports() if r.event == "start" and r.t > finished_at]
    assert not again, f"trainers started again after the job ended: {again}"
    objects = client.CustomObjectsApi(k8s.api)
    policy = objects.get_namespaced_custom_object(GROUP, VERSION, k8s.namespace, PLURAL, JOB)
    assert not (policy.get("status") or {}).get("restarts"), policy.get("status")


@pytest.mark.timeout(1500)
def test_training_keeps_going_through_faults(  # noqa: PLR0917 - fixtures
    k8s_managed: KwokCluster,
    k8s_managed_plane: testcluster.ControlPlane,
    managed_kubelet_nodes: Callable[..., testnode.Node],
    managed_scheduler: Process,
    policy_crd: None,
    trainer_python: Path,
    etcd: str,
    processes: list[Process],
    tmp_path: Path,
) -> None:
    k8s = k8s_managed
    ns = k8s.namespace
    started = time.time()
    job = start_job(
        k8s,
        k8s_managed_plane,
        managed_kubelet_nodes,
        trainer_python=trainer_python,
        etcd=etcd,
        processes=processes,
        tmp_path=tmp_path,
        ignoring_sigterm=frozenset({IGNORES_SIGTERM}),
    )
    logs = job.logs
    restarter = job.restarter

    # --- training makes progress with world size 3 -------------------------------------------
    training_at_full_size(job, started)

    try:
        # The scenarios go round the workers, and each waits until its worker's last restart is
        # older than the policy's restartTimeLimit (see `out_of_its_streak`).
        # --- XID on the GPU a worker holds
        victim = job.worker(0)
        replaced_scenario(job, f"XID {XID} on a worker's GPU", victim, lambda: xid_on(job, victim))

        # --- a warned fault: the pod leaves gracefully, its trainer saving on SIGTERM
        victim = job.worker(1)
        worn = (victim.spec.node_name, gpu_of(job, victim))
        outcome = replaced_scenario(
            job,
            f"XID {WARNED_XID} (the GPU Degraded): a graceful replacement",
            victim,
            lambda: xid_on(job, victim, WARNED_XID),
        )
        assert outcome.recovered is not None
        assert outcome.recovered.steps_lost == 0, outcome.lines()
        successor = job.worker(1)
        assert (successor.spec.node_name, gpu_of(job, successor)) != worn

        # --- a warned fault on a worker whose trainer does not save on SIGTERM: the job resumes
        # from its last periodic checkpoint, as after any other fault
        victim = job.worker(IGNORES_SIGTERM)
        outcome = replaced_scenario(
            job,
            f"XID {WARNED_XID} on a worker whose trainer does not save on SIGTERM",
            victim,
            lambda: xid_on(job, victim, WARNED_XID),
        )
        assert outcome.recovered is not None
        assert outcome.recovered.steps_lost <= CHECKPOINT_EVERY, outcome.lines()

        # --- a launcher exits 1: kubelet restarts it in place
        victim = job.worker(0)
        fault_at = time.time()
        note = _exit(job, victim, 1)
        found = wait_resumed(job, fault_at, "an exit 1")
        outcome = Outcome("a launcher exits 1 (restarted in place)", fault_at, None, found, note)
        report(job, outcome)
        again = k8s.read_pod(victim.metadata.name)
        assert again.metadata.uid == victim.metadata.uid, "the pod itself must stay"
        assert again.status.container_statuses[0].restart_count >= 1
        assert not any(
            (p.metadata.annotations or {}).get(REPLACES_ANNOTATION) == victim.metadata.name
            for p in job.pods()
        ), "an in-place restart must not also be replaced"

        # --- a warned fault while a PodDisruptionBudget allows no disruption: the pod stays and
        # trains on until the budget allows one, then leaves as gracefully
        out_of_its_streak(job, 0)
        victim = job.worker(0)
        refused_until_lifted(job, victim)
        outcome = replaced_scenario(
            job,
            f"XID {WARNED_XID} held by a disruption budget, then the budget lifted",
            victim,
            lambda: _lift_budget(job),
        )
        assert outcome.recovered is not None
        assert outcome.recovered.steps_lost == 0, outcome.lines()
        _drop_budget(job)

        # --- a launcher exits 101 (a policy code)
        out_of_its_streak(job, 1)
        victim = job.worker(1)
        replaced_scenario(
            job,
            "a launcher exits 101",
            victim,
            lambda: _exit(job, victim, 101),
        )

        # --- a worker pod force-deleted -----------------------------------------------------------
        out_of_its_streak(job, 2)
        victim = job.worker(2)
        replaced_scenario(
            job,
            "a worker pod force-deleted",
            victim,
            lambda: _force_delete(job, victim),
        )

        # --- a node dies
        out_of_its_streak(job, 0)
        victim = job.worker(0)
        dead = victim.spec.node_name
        replaced_scenario(
            job, "a node dies (kubelet and runtime stop)", victim, lambda: _kill(job, dead)
        )
        assert all(p.spec.node_name != dead for p in job.pods())

        # --- the baseline: the same XID, no restarter
        assert restarter.stop() == 0
        victim = job.worker(1)
        fault_at = time.time()
        note = xid_on(job, victim)
        deadline = fault_at + BASELINE_WINDOW
        while time.time() < deadline:
            time.sleep(1.0)  # a fixed window is the measurement itself: what happens without us
        still = k8s.read_pod(victim.metadata.name)
        reports = [r for r in logs.reports() if r.t > fault_at and r.event == "step"]
        worlds = sorted({r.world for r in reports})
        outcome = Outcome(
            "baseline: the same XID, restarter stopped",
            fault_at,
            None,
            None,
            f"{note}; after {BASELINE_WINDOW:.0f} s: pod {still.status.phase}, not replaced; "
            f"trainers' world sizes since: {worlds or 'none'}",
        )
        report(job, outcome)
        assert still.metadata.deletion_timestamp is None
        assert not any(
            (p.metadata.annotations or {}).get(REPLACES_ANNOTATION) == victim.metadata.name
            for p in job.pods()
        )
    finally:
        figures = os.environ.get("TRAINING_FIGURES_FILE")
        if figures:
            Path(figures).write_text(json.dumps(job.timelines, indent=2) + "\n")
        for pod in job.pods():
            k8s.core.delete_namespaced_pod(pod.metadata.name, ns, grace_period_seconds=0)


BUDGET = f"{JOB}-workers"


def out_of_its_streak(job: Job, index: int) -> None:
    """Wait until worker `index`'s last restart is older than the policy's restartTimeLimit. A
    restart within it is one more in a row, which the policy backs off (its guard against a
    crash loop): the scenario would measure that wait, not the way back."""
    objects = client.CustomObjectsApi(job.k8s.api)
    limit = objects.get_namespaced_custom_object(
        GROUP, VERSION, job.k8s.namespace, PLURAL, job.policy
    )["spec"]["restartTimeLimit"]

    def since_last() -> float:
        policy = objects.get_namespaced_custom_object(
            GROUP, VERSION, job.k8s.namespace, PLURAL, job.policy
        )
        times = [
            moment.timestamp()
            for entry in (policy.get("status") or {}).get("jobs") or []
            for last in entry.get("lastRestarts") or []
            if last.get("slot") == str(index)
            and (moment := parse_time(last.get("time"))) is not None
        ]
        return time.time() - max(times, default=0.0)

    wait_for(f"worker {index}'s restarts no longer in a row", since_last, lambda s: s > limit, 90)


def refused_until_lifted(job: Job, victim: Any) -> None:
    """A PodDisruptionBudget that keeps every worker (minAvailable 3) is in force when the GPU of
    `victim` turns Degraded: the eviction is refused, told by an Event, and the pod trains on
    with no copy beside it."""
    k8s = job.k8s
    budgets = client.PolicyV1Api(k8s.api)
    budgets.create_namespaced_pod_disruption_budget(
        k8s.namespace,
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": BUDGET},
            "spec": {
                "minAvailable": WORLD,
                "selector": {"matchLabels": {f"{POOL_LABEL}-job": JOB}},
            },
        },
    )

    def computed() -> Any:
        return budgets.read_namespaced_pod_disruption_budget(BUDGET, k8s.namespace)

    wait_for(
        "the budget's status (no disruption allowed)",
        computed,
        lambda b: (
            b.status is not None
            and b.status.observed_generation == b.metadata.generation
            and b.status.current_healthy == WORLD
            and b.status.disruptions_allowed == 0
        ),
        timeout=30,
    )
    fault_at = time.time()
    xid_on(job, victim, WARNED_XID)
    name = victim.metadata.name

    def refusals() -> list[Any]:
        return list(
            k8s.core.list_namespaced_event(
                k8s.namespace,
                field_selector=f"involvedObject.name={name},reason=EvictionRefused",
            ).items
        )

    wait_for("the refusal's Event", refusals, bool, timeout=30)
    still = k8s.read_pod(name)
    assert still.metadata.deletion_timestamp is None, "the budget must hold the pod"
    assert not any(
        (p.metadata.annotations or {}).get(REPLACES_ANNOTATION) == name for p in job.pods()
    ), "no second copy while the budget holds"
    since = wait_for(
        "steps since the fault",
        lambda: [r for r in job.logs.reports() if r.event == "step" and r.t > fault_at],
        bool,
        timeout=30,
    )
    assert {r.world for r in since} == {WORLD}, "training goes on at full size"


def _lift_budget(job: Job) -> str:
    client.PolicyV1Api(job.k8s.api).patch_namespaced_pod_disruption_budget(
        BUDGET, job.k8s.namespace, {"spec": {"minAvailable": WORLD - 1}}, _content_type=MERGE
    )
    return f"budget {BUDGET} lifted to minAvailable {WORLD - 1}"


def _drop_budget(job: Job) -> None:
    client.PolicyV1Api(job.k8s.api).delete_namespaced_pod_disruption_budget(
        BUDGET, job.k8s.namespace
    )


def _exit(job: Job, pod: Any, code: int) -> str:
    node = job.nodes[pod.spec.node_name]
    node.exit_container(job.k8s.namespace, pod.metadata.name, "trainer", code)
    return f"{pod.metadata.name}'s launcher exits {code} ({pod.spec.node_name})"


def _force_delete(job: Job, pod: Any) -> str:
    job.k8s.core.delete_namespaced_pod(pod.metadata.name, job.k8s.namespace, grace_period_seconds=0)
    return f"{pod.metadata.name} force-deleted ({pod.spec.node_name})"


def _kill(job: Job, node: str) -> str:
    job.nodes[node].stop(delete_node=False)
    return f"node {node} stopped (its Node object stays)"
