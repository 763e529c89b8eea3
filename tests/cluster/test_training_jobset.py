"""Training keeps going through faults on the stack users submit to, for each of two launchers:
the PaddlePaddle elastic job of deploy/examples/paddle-elastic-jobset.yaml (etcd rendezvous) and
the torchrun elastic job of deploy/examples/torchrun-elastic-jobset.yaml (c10d rendezvous on a
store of its own; tests/training/train_torch.py, a real torch CPU trainer over gloo). Each runs
its example's policy and JobSet as shipped (the trainer's python, paths, image, rendezvous
address and node pool set for this machine) on three real kubelet v1.37 nodes in exec mode,
with JobSet's controller, Kueue's manager (the JobSet admitted from a LocalQueue with a quota of
three GPUs), kube-controller-manager, kube-scheduler, an agent per node and the restarter.

One worker at a time goes through the faults; after each, the trainers' own logs must show a
formation of three resuming from the newest checkpoint, and no gang restart may have happened:
the other workers' pods are the same pods, the JobSet counts no restart. The faults: XID 95 on a
worker's GPU (the restarter deletes the pod and takes it out of its Job's selector: the Job
creates that index again at once), an exit kubelet restarts in place, exit 101 (the Job's to
count: it creates the index again after its backoff), a force delete, a node's death. Kueue:
the JobSet's workload stays admitted with its three GPUs reserved, never more, and a second job
that would need three more waits in the queue throughout.

The timelines are printed as test_training.py prints them (and written to
TRAINING_FIGURES_FILE when set: bench/training_faults.py). The trainers' environments come from
scripts/trainer-env (paddle, torch), cached in .cache."""

from __future__ import annotations

import copy
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jobstack
import pytest
import testcluster
import testnode
import yaml
from k8s_test_helpers import GPU_RESOURCE, KwokCluster, wait_for
from kubernetes import client, utils
from scheduler import Process, ProcessError, free_port, spawn
from test_e2e import POOL_LABEL, _summary, processes
from test_job_stack import (
    JOBSET_GROUP,
    JOBSET_VERSION,
    create_jobset,
    delete_jobsets,
    jobset,
    read_jobset,
)
from test_restarter import GROUP, PLURAL, VERSION
from test_training import (
    REPO,
    TRAIN_PY,
    WORLD,
    XID,
    Job,
    Outcome,
    TrainerLogs,
    _exit,
    _force_delete,
    _kill,
    etcd,
    managed_scheduler,
    out_of_its_streak,
    policy_crd,
    pool_of_nodes,
    replaced_scenario,
    report,
    start_restarter_and_agents,
    trainer_env,
    trainer_python,
    training_at_full_size,
    wait_resumed,
    xid_on,
)

__all__ = [
    "_summary",
    "etcd",
    "managed_scheduler",
    "policy_crd",
    "processes",
    "trainer_python",
]

pytestmark = pytest.mark.kubelet

PADDLE_EXAMPLE = REPO / "deploy" / "examples" / "paddle-elastic-jobset.yaml"
TORCH_EXAMPLE = REPO / "deploy" / "examples" / "torchrun-elastic-jobset.yaml"
TRAIN_TORCH_PY = REPO / "tests" / "training" / "train_torch.py"
QUEUE = "training"
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
WAITING = "waits-for-quota"
IMAGE = "registry.invalid/edl/trainer:test"  # the exec-mode runtime runs the command itself


def shipped(example: Path, kind: str) -> dict[str, Any]:
    [found] = [d for d in yaml.safe_load_all(example.read_text()) if d and d["kind"] == kind]
    return copy.deepcopy(found)


@dataclass
class Launcher:
    """One example's JobSet and what only this machine can say about it: `name` (the JobSet's
    and its policy's), `title` (its scenarios' prefix in the figures), `command` (the example's
    trainer command made to run here: the trainer's python, script, checkpoint directory and
    rendezvous address; the work directory is its argument)."""

    name: str
    title: str
    example: Path
    command: Callable[[list[str], Path], list[str]]


def paddle_command(shipped_command: list[str], python: Path, etcd: str, workdir: Path) -> list[str]:
    command = []
    for arg in shipped_command:
        if arg == "python":
            command.append(str(python))
        elif arg.startswith("--master=etcd://"):
            command.append(f"--master=etcd://{etcd}")
        elif arg == "train.py":
            command += [f"--log_dir={workdir}/launch-logs/$(POD_NAME)", str(TRAIN_PY)]
        elif arg.startswith("--checkpoints="):
            command.append(f"--checkpoints={workdir}/checkpoints")
        else:
            command.append(arg)
    return command


def torch_command(shipped_command: list[str], python: Path, store: str, workdir: Path) -> list[str]:
    command = []
    for arg in shipped_command:
        if arg == "torchrun":
            command += [str(python), "-m", "torch.distributed.run"]
        elif arg.startswith("--rdzv-endpoint="):
            command.append(f"--rdzv-endpoint={store}")
        elif arg == "train_torch.py":
            command.append(str(TRAIN_TORCH_PY))
        elif arg.startswith("--checkpoints="):
            command.append(f"--checkpoints={workdir}/checkpoints")
        else:
            command.append(arg)
    return command


def rendezvous_store(python: Path, directory: Path) -> tuple[Process, str]:
    """The torchrun example's rendezvous store (its Deployment's command as shipped) on a free
    loopback port; the process and its address."""
    deployment = shipped(TORCH_EXAMPLE, "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    [port] = [p["containerPort"] for p in container["ports"]]
    mine = free_port()
    program, *args = container["command"]
    assert program == "python", container["command"]
    argv = [str(python), *(a.replace(str(port), str(mine)) for a in args)]
    store = spawn("rendezvous-store", argv, directory, env={**os.environ, "TMPDIR": str(directory)})
    address = f"127.0.0.1:{mine}"
    wait_for(f"the rendezvous store on {address}", lambda: _listens(mine, store), bool, timeout=60)
    return store, address


def _listens(port: int, process: Process) -> bool:
    process.check_alive()
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(params=["paddle", "torchrun"])
def launcher(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Launcher]:
    if request.param == "paddle":
        python: Path = request.getfixturevalue("trainer_python")
        etcd_address: str = request.getfixturevalue("etcd")
        yield Launcher(
            "mnist-jobset",
            "JobSet",
            PADDLE_EXAMPLE,
            lambda command, workdir: paddle_command(command, python, etcd_address, workdir),
        )
        return
    python = trainer_env("torch")
    store, address = rendezvous_store(python, tmp_path / "rendezvous-store")
    yield Launcher(
        "torch-jobset",
        "torchrun",
        TORCH_EXAMPLE,
        lambda command, workdir: torch_command(command, python, address, workdir),
    )
    store.stop()


def localized_jobset(launcher: Launcher, *, workdir: Path, pool: str) -> dict[str, Any]:
    """The example's JobSet as shipped, with the launcher's command for this machine, an image
    (unused here), the node pool, and the trainer's HOME, TMPDIR and log settings."""
    body = shipped(launcher.example, "JobSet")
    [replicated] = body["spec"]["replicatedJobs"]
    pod = replicated["template"]["spec"]["template"]
    spec = pod["spec"]
    [container] = spec["containers"]
    container["command"] = launcher.command(container["command"], workdir)
    container["image"] = IMAGE
    scratch = workdir / "tmp"  # torchrun's log directories and torch's caches: never /tmp
    scratch.mkdir(exist_ok=True)
    container["env"] = [
        *container.get("env", []),
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "HOME", "value": str(workdir / "home")},
        {"name": "TMPDIR", "value": str(scratch)},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    container.pop("volumeMounts", None)  # the checkpoints are a host directory here
    spec.pop("volumes", None)
    spec["nodeSelector"] = {POOL_LABEL: pool}
    body["metadata"]["labels"][jobstack.QUEUE_LABEL] = QUEUE
    return body


@pytest.fixture
def stack(
    k8s_managed_plane: testcluster.ControlPlane, k8s_managed: KwokCluster, tmp_path: Path
) -> Iterator[None]:
    try:
        started = jobstack.start_stack(k8s_managed_plane, k8s_managed.api, tmp_path / "stack")
    except ProcessError as exc:
        pytest.fail(str(exc), pytrace=False)
    yield
    delete_jobsets(k8s_managed, *all_jobsets(k8s_managed))
    jobstack.remove_queue(k8s_managed.api, QUEUE)
    jobstack.stop_stack(started)


def all_jobsets(k8s: KwokCluster) -> list[str]:
    listed = client.CustomObjectsApi(k8s.api).list_namespaced_custom_object(
        JOBSET_GROUP, JOBSET_VERSION, k8s.namespace, "jobsets"
    )
    return [item["metadata"]["name"] for item in listed["items"]]


def start_jobset_job(
    k8s: KwokCluster,
    plane: testcluster.ControlPlane,
    kubelet_nodes: Callable[..., testnode.Node],
    *,
    launcher: Launcher,
    processes: list[Process],
    tmp_path: Path,
) -> Job:
    ns = k8s.namespace
    workdir, nodes = pool_of_nodes(k8s, kubelet_nodes, tmp_path)
    restarter, agents = start_restarter_and_agents(k8s, plane, nodes, tmp_path, processes)
    policy = shipped(launcher.example, "FaultTolerancePolicy")
    policy["metadata"]["namespace"] = ns
    client.CustomObjectsApi(k8s.api).create_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, policy
    )
    # The example's other objects (torchrun's rendezvous Service and Deployment): the API server
    # takes them as written; their command runs here as a process (`rendezvous_store`).
    for document in yaml.safe_load_all(launcher.example.read_text()):
        if document and document["kind"] not in {"FaultTolerancePolicy", "JobSet"}:
            utils.create_from_dict(k8s.api, document, namespace=ns, dry_run="All")
    jobstack.gpu_queue(k8s.api, ns, QUEUE, WORLD, GPU_RESOURCE)
    create_jobset(k8s, localized_jobset(launcher, workdir=workdir, pool=ns))
    return Job(
        k8s,
        nodes,
        agents,
        restarter,
        TrainerLogs(list(nodes.values())),
        workdir,
        selector=f"{JOBSET_LABEL}={launcher.name}",
        index_label=INDEX_LABEL,
        policy=launcher.name,
        owned=True,
    )


def uids(job: Job) -> dict[str, str]:
    return {p.metadata.labels[INDEX_LABEL]: p.metadata.uid for p in job.pods()}


def no_gang_restart(job: Job, before: dict[str, str], victim: Any, what: str) -> None:
    """Only the victim's index has a new pod; the JobSet counts no restart."""
    after = uids(job)
    index = victim.metadata.labels[INDEX_LABEL]
    others = {i: u for i, u in before.items() if i != index}
    assert {i: after.get(i) for i in others} == others, f"{what}: other workers were replaced"
    status = read_jobset(job.k8s, job.policy).get("status") or {}
    assert not status.get("restarts"), f"{what}: the JobSet restarted its gang: {status}"


def quota_held(job: Job) -> dict[str, int]:
    """The queue reserves the job's three GPUs, no more, and the second job still waits."""
    usage = jobstack.queue_usage(job.k8s.api, QUEUE, GPU_RESOURCE)
    assert usage["flavorsReservation"] == WORLD, usage
    assert usage["admittedWorkloads"] == 1, usage
    assert read_jobset(job.k8s, WAITING)["spec"].get("suspend") is True
    return usage


@pytest.mark.timeout(1500)
def test_a_jobset_trains_through_faults_without_a_gang_restart(  # noqa: PLR0917 - fixtures
    k8s_managed: KwokCluster,
    k8s_managed_plane: testcluster.ControlPlane,
    managed_kubelet_nodes: Callable[..., testnode.Node],
    managed_scheduler: Process,
    policy_crd: None,
    stack: None,
    launcher: Launcher,
    processes: list[Process],
    tmp_path: Path,
) -> None:
    k8s = k8s_managed
    started = time.time()
    job = start_jobset_job(
        k8s,
        k8s_managed_plane,
        managed_kubelet_nodes,
        launcher=launcher,
        processes=processes,
        tmp_path=tmp_path,
    )
    training_at_full_size(job, started)
    # A second job that needs three more GPUs than the queue has left: it waits throughout.
    create_jobset(k8s, jobset(WAITING, workers=WORLD, queue=QUEUE))
    wait_for(
        "the second job pending in the queue",
        lambda: jobstack.queue_usage(k8s.api, QUEUE, GPU_RESOURCE),
        lambda usage: usage["pendingWorkloads"] == 1,
        timeout=60,
    )
    quota_held(job)
    try:
        # --- XID on the GPU a worker holds: the Job makes the worker again at once
        before, victim = uids(job), job.worker(0)
        replaced_scenario(
            job,
            f"{launcher.title}: XID {XID} on a worker's GPU",
            victim,
            lambda: xid_on(job, victim),
        )
        no_gang_restart(job, before, victim, f"XID {XID}")
        quota_held(job)

        # --- an exit kubelet restarts in place
        before, victim = uids(job), job.worker(1)
        fault_at = time.time()
        note = _exit(job, victim, 1)
        found = wait_resumed(job, fault_at, "an exit 1")
        report(
            job,
            Outcome(
                f"{launcher.title}: a launcher exits 1 (restarted in place)",
                fault_at,
                None,
                found,
                note,
            ),
        )
        assert uids(job) == before, "an in-place restart replaces no pod"

        # --- a policy exit code: the Job's to count, after its backoff
        before = uids(job)
        replaced_scenario(
            job,
            f"{launcher.title}: a launcher exits 101 (the Job's backoff)",
            victim,
            lambda: _exit(job, victim, 101),
        )
        no_gang_restart(job, before, victim, "exit 101")

        # --- a force delete
        before, victim = uids(job), job.worker(2)
        replaced_scenario(
            job,
            f"{launcher.title}: a worker pod force-deleted",
            victim,
            lambda: _force_delete(job, victim),
        )
        no_gang_restart(job, before, victim, "force delete")
        quota_held(job)

        # --- a node dies
        out_of_its_streak(job, 0)
        before, victim = uids(job), job.worker(0)
        dead = victim.spec.node_name
        replaced_scenario(
            job,
            f"{launcher.title}: a node dies (kubelet and runtime stop)",
            victim,
            lambda: _kill(job, dead),
        )
        no_gang_restart(job, before, victim, "node death")
        assert all(p.spec.node_name != dead for p in job.pods())
        quota_held(job)

        # Nothing charged twice: the restarter counted its three replacements, the Job the one
        # exit it owns; no failure of ours was counted against the Job.
        batch = client.BatchV1Api(k8s.api)
        [worker_job] = batch.list_namespaced_job(
            k8s.namespace, label_selector=f"{JOBSET_LABEL}={launcher.name}"
        ).items
        assert (worker_job.status.failed or 0) == 1, worker_job.status
        policy = client.CustomObjectsApi(k8s.api).get_namespaced_custom_object(
            GROUP, VERSION, k8s.namespace, PLURAL, launcher.name
        )
        assert (policy.get("status") or {}).get("restarts") == 3, policy.get("status")
    finally:
        figures = os.environ.get("TRAINING_FIGURES_FILE")
        if figures:
            Path(figures).write_text(json.dumps(job.timelines, indent=2) + "\n")
