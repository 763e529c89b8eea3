"""The restarter end to end on a real API server with KWOK nodes: the controller runs in-process
(admin credentials), watches the test's namespace, decides by FaultTolerancePolicy objects and
replaces pods. No scheduler runs, so replacements stay Pending; what matters is that they are
created (and how: name, count, env, anti-affinity) and that the old pods go."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_test_helpers import POD_FAIL_EXIT_CODE, POD_FAIL_LABEL, KwokCluster, wait_for
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from edl_agent.faults.model import PodRef
from edl_agent.restarter.adapters.actuator import Actuator
from edl_agent.restarter.adapters.kube_controller import connect
from edl_agent.restarter.adapters.watchers import DELETED_BY_ANNOTATION
from edl_agent.restarter.core.controller import Controller
from edl_agent.restarter.core.replacement import RESTART_COUNT_ANNOTATION, RESTART_COUNT_ENV
from edl_agent.restarter.core.status import LIMIT_EXCEEDED

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "daemonset"
CRD = yaml.safe_load((DEPLOY / "crd-faulttolerancepolicy.yaml").read_text())
RBAC = DEPLOY / "restarter-rbac.yaml"
GROUP, VERSION, PLURAL = "edl.io", "v1alpha1", "faulttolerancepolicies"
JOB, TYPE, INDEX = "edl.test/job", "edl.test/replica-type", "edl.test/replica-index"
NOT_FOUND = 404

MakePolicy = Callable[..., dict[str, Any]]


@pytest.fixture(scope="module")
def crd(k8s_api_client: client.ApiClient) -> Any:
    return install_policy_crd(k8s_api_client)


def install_policy_crd(api: client.ApiClient) -> Any:
    """Apply the FaultTolerancePolicy CRD on `api`'s server; the CRD once Established."""
    extensions = client.ApiextensionsV1Api(api)
    name = CRD["metadata"]["name"]
    extensions.patch_custom_resource_definition(
        name,
        CRD,
        field_manager="edl-tests",
        force=True,
        _content_type="application/apply-patch+yaml",
    )
    return wait_for(
        f"CRD {name} Established",
        lambda: extensions.read_custom_resource_definition(name),
        lambda crd: any(
            c.type == "Established" and c.status == "True" for c in crd.status.conditions or []
        ),
        timeout=30,
    )


@pytest.fixture
def controller(
    crd: Any, k8s: KwokCluster, k8s_api_client: client.ApiClient
) -> Iterator[Controller]:
    config = copy.copy(k8s_api_client.configuration)
    config.connection_pool_maxsize = 16
    api = client.ApiClient(config)
    running = connect(api, namespaces=[k8s.namespace], node_grace=1.0)
    running.start()
    assert running.wait_synced(30)
    yield running
    running.stop()
    api.close()


@pytest.fixture
def restarter_rbac(k8s: KwokCluster) -> Iterator[None]:
    """restarter-rbac.yaml for this test: `edl-system` becomes its namespace, cluster-wide
    objects get per-test names."""
    rbac = client.RbacAuthorizationV1Api(k8s.api)
    suffix = k8s.namespace
    undo: list[Callable[[], object]] = []
    for doc in yaml.safe_load_all(RBAC.read_text().replace("edl-system", k8s.namespace)):
        kind, meta = doc["kind"], doc["metadata"]
        if kind == "ServiceAccount":
            k8s.create_service_account(meta["name"])
            continue
        meta["name"] = name = f"{meta['name']}-{suffix}"
        if "roleRef" in doc:
            doc["roleRef"]["name"] += f"-{suffix}"
        if kind == "ClusterRole":
            rbac.create_cluster_role(doc)
            undo.append(lambda n=name: rbac.delete_cluster_role(n))
        elif kind == "ClusterRoleBinding":
            rbac.create_cluster_role_binding(doc)
            undo.append(lambda n=name: rbac.delete_cluster_role_binding(n))
        elif kind == "Role":
            rbac.create_namespaced_role(k8s.namespace, doc)
        elif kind == "RoleBinding":
            rbac.create_namespaced_role_binding(k8s.namespace, doc)
        else:
            raise AssertionError(f"unexpected {kind} in {RBAC}")
    yield
    for step in undo:
        step()


@pytest.fixture
def objects(k8s_api_client: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(k8s_api_client)


@pytest.fixture
def make_policy(
    controller: Controller, k8s: KwokCluster, objects: client.CustomObjectsApi
) -> Iterator[MakePolicy]:
    made: list[str] = []

    def make(name: str = "train", **spec: Any) -> dict[str, Any]:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "FaultTolerancePolicy",
            "metadata": {"name": name, "namespace": k8s.namespace},
            "spec": {
                "selector": {"matchLabels": {"app": "train"}},
                "jobLabel": JOB,
                "replicaTypeLabel": TYPE,
                "replicaIndexLabel": INDEX,
                "backoff": {"initialSeconds": 0, "maxSeconds": 0},
                **spec,
            },
        }
        created: dict[str, Any] = objects.create_namespaced_custom_object(
            GROUP, VERSION, k8s.namespace, PLURAL, body, field_validation="Strict"
        )
        made.append(name)
        wait_for(
            f"the controller to see policy {name}",
            lambda: controller.policies.knows(k8s.namespace, name),
            bool,
            timeout=10,
        )
        return created

    yield make
    for name in made:
        objects.delete_namespaced_custom_object(GROUP, VERSION, k8s.namespace, PLURAL, name)


def labels(job: str, replica_type: str, index: int) -> dict[str, str]:
    return {"app": "train", JOB: job, TYPE: replica_type, INDEX: str(index)}


def exit_pod(k8s: KwokCluster, name: str, code: int) -> None:
    """Ask KWOK to end the pod's containers with `code`; unlike `KwokCluster.exit_pod` this does
    not wait to see the exit, which the restarter may replace faster than one can poll."""
    patch = {
        "metadata": {
            "labels": {POD_FAIL_LABEL: "true"},
            "annotations": {POD_FAIL_EXIT_CODE: str(code)},
        }
    }
    k8s.core.patch_namespaced_pod(name, k8s.namespace, patch)


def pod_or_none(k8s: KwokCluster, name: str) -> Any:
    try:
        return k8s.read_pod(name)
    except ApiException as exc:
        if exc.status == NOT_FOUND:
            return None
        raise


def wait_pod(k8s: KwokCluster, name: str, timeout: float = 10.0) -> Any:
    return wait_for(f"pod {name}", lambda: pod_or_none(k8s, name), bool, timeout)


def wait_gone(k8s: KwokCluster, name: str, timeout: float = 15.0) -> None:
    wait_for(
        f"pod {name} gone or terminating",
        lambda: pod_or_none(k8s, name),
        lambda pod: pod is None or pod.metadata.deletion_timestamp is not None,
        timeout,
    )


def wait_deleted(k8s: KwokCluster, name: str, timeout: float = 15.0) -> None:
    """Until the pod is gone from the API (not only terminating)."""
    wait_for(
        f"pod {name} deleted", lambda: pod_or_none(k8s, name), lambda pod: pod is None, timeout
    )


def caught_up(k8s: KwokCluster, controller: Controller, timeout: float = 15.0) -> None:
    """Until `controller` has seen every pod change made so far and finished with every fault
    they gave: decided, recorded, and the decisions carried out. A pod created now (bound to no
    node, covered by no policy) comes after those changes in its pod watch, and its queue depth
    counts each fault from its arrival until what was decided about it is done."""
    mark = k8s.core.create_namespaced_pod(
        k8s.namespace,
        client.V1Pod(
            metadata=client.V1ObjectMeta(generate_name="caught-up-"),
            spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="none")]),
        ),
    )
    ref = PodRef(k8s.namespace, mark.metadata.name, mark.metadata.uid)
    wait_for(
        f"the restarter to see pod {ref.name}", lambda: controller.pods.find_pod(ref), bool, timeout
    )
    wait_for(
        "the restarter's queue empty", controller.queue_depth, lambda depth: depth == 0, timeout
    )


def decisions(controller: Controller, action: str, reason: str) -> float:
    """How many decisions of `action` about faults of kind `reason` the controller made."""
    labels = {"action": action, "reason": reason}
    found = controller.metrics.registry.get_sample_value("edl_restarter_decisions_total", labels)
    return found or 0.0


def job_status(objects: client.CustomObjectsApi, namespace: str, policy: str) -> Any:
    body = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, policy)
    jobs = (body.get("status") or {}).get("jobs") or []
    return jobs[0] if jobs else None


def wait_action(
    objects: client.CustomObjectsApi, namespace: str, policy: str, count: int
) -> dict[str, Any]:
    job: dict[str, Any] = wait_for(
        f"{count} decisions in {policy}'s status",
        lambda: job_status(objects, namespace, policy),
        lambda job: job is not None and len(job.get("lastActions", [])) >= count,
        timeout=10,
    )
    return job


def test_exit_137_replaces_the_pod_and_counts_the_restart(
    k8s: KwokCluster,
    make_policy: MakePolicy,
    objects: client.CustomObjectsApi,
    controller: Controller,
) -> None:
    make_policy(faultTolerantPolicy=[{"restartPolicy": "ExitCode", "exitCodes": "129,137"}])
    node = k8s.create_gpu_node()
    name = "resnet-worker-0"
    k8s.create_pod(name, node=node.metadata.name, labels=labels("resnet", "worker", 0))

    exits: list[float] = []  # when the old pod's exit first showed in the API

    def replacement() -> Any:
        if not exits:
            old = pod_or_none(k8s, name)
            state = old and old.status.container_statuses and old.status.container_statuses[0]
            if state and state.state.terminated:
                exits.append(time.monotonic())
        return pod_or_none(k8s, f"{name}-r1")

    asked = time.monotonic()
    exit_pod(k8s, name, 137)
    # Polled every 5 ms: the time is measured to that (and to a read's round trip).
    new = wait_for(f"pod {name}-r1", replacement, bool, timeout=10, poll=0.005)
    created = time.monotonic()
    after_exit = f"{created - exits[0]:.3f}s" if exits else "missed"
    print(
        f"\nfault→replacement: {after_exit} from the exit's visibility in the API "
        f"({created - asked:.3f}s from asking KWOK to exit the container)"
    )
    assert created - asked < 10

    assert new.metadata.labels.items() >= labels("resnet", "worker", 0).items()  # same labels
    assert new.metadata.annotations[RESTART_COUNT_ANNOTATION] == "1"
    assert new.spec.node_name is None
    for container in new.spec.containers:
        assert {(e.name, e.value) for e in container.env} >= {(RESTART_COUNT_ENV, "1")}
    assert new.spec.affinity is None  # an exit is no node fault
    wait_deleted(k8s, name)

    job = wait_action(objects, k8s.namespace, "train", 1)
    assert job["name"] == "resnet"
    assert job["restarts"] == 1
    assert job["lastActions"][-1]["action"] == "Restart"
    caught_up(k8s, controller)  # the deletion seen: what it gave is decided and carried out
    assert pod_or_none(k8s, f"{name}-r2") is None  # one fault, one replacement
    assert decisions(controller, "Restart", "ContainerExit") == 1


def test_an_exit_no_rule_matches_is_not_replaced_and_the_status_says_why(
    k8s: KwokCluster,
    make_policy: MakePolicy,
    objects: client.CustomObjectsApi,
    controller: Controller,
) -> None:
    make_policy(faultTolerantPolicy=[{"restartPolicy": "ExitCode", "exitCodes": "129,137"}])
    node = k8s.create_gpu_node()
    name = "resnet-worker-0"
    k8s.create_pod(name, node=node.metadata.name, labels=labels("resnet", "worker", 0))
    exit_pod(k8s, name, 1)
    job = wait_action(objects, k8s.namespace, "train", 1)
    action = job["lastActions"][-1]
    assert action["action"] == "Ignore"
    assert "exit with code 1 of container worker matches no rule" in action["reason"]
    assert job["restarts"] == 0
    caught_up(k8s, controller)  # the Ignore carried out (nothing), and no later fault pending
    assert pod_or_none(k8s, f"{name}-r1") is None
    assert k8s.read_pod(name).metadata.deletion_timestamp is None
    assert decisions(controller, "Ignore", "ContainerExit") == 1


def test_a_not_ready_node_gets_its_pod_force_deleted_and_replaced_elsewhere(
    k8s: KwokCluster,
    make_policy: MakePolicy,
    objects: client.CustomObjectsApi,
    controller: Controller,
) -> None:
    make_policy(restartPolicy="OnNodeFail")
    node = k8s.create_gpu_node().metadata.name
    name = "bert-worker-1"
    k8s.create_pod(name, node=node, labels=labels("bert", "worker", 1))
    started = time.monotonic()
    k8s.make_node_not_ready(node)
    new = wait_pod(k8s, f"{name}-r1", timeout=15)
    print(f"\nnode NotReady→replacement: {time.monotonic() - started:.3f}s (grace 1 s)")
    # Force-deleted right after its replacement is made: gone at once, not after a grace period.
    wait_deleted(k8s, name, 5)
    terms = new.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
    assert [
        (f.key, f.operator, f.values) for t in terms.node_selector_terms for f in t.match_fields
    ] == [("metadata.name", "NotIn", [node])]
    job = wait_action(objects, k8s.namespace, "train", 1)
    assert job["lastActions"][-1]["fault"] == "NodeNotReady"
    assert job["restarts"] == 1
    caught_up(k8s, controller)  # the deletion seen: what it gave is decided and carried out
    assert pod_or_none(k8s, f"{name}-r2") is None  # our own deletion is no PodForceDeleted
    assert decisions(controller, "Restart", "PodForceDeleted") == 0
    assert decisions(controller, "Restart", "NodeNotReady") == 1


def test_a_replacement_on_a_node_that_then_goes_not_ready_is_replaced_again(
    k8s: KwokCluster, make_policy: MakePolicy, objects: client.CustomObjectsApi
) -> None:
    """KWOK dates a node's Ready transition to its creation, before the replacement landed on
    it: the second NotReady fault must still count (dated on the restarter's clock, never
    before the pod), not be called stale."""
    make_policy(restartPolicy="OnNodeFail")
    first, second = (k8s.create_gpu_node().metadata.name for _ in range(2))
    name = "gpt-worker-0"
    k8s.create_pod(name, node=first, labels=labels("gpt", "worker", 0))
    k8s.make_node_not_ready(first)
    wait_pod(k8s, f"{name}-r1", timeout=15)
    # Bound to the other node, as a scheduler would (the replacement avoids the first).
    binding = client.V1Binding(
        metadata=client.V1ObjectMeta(name=f"{name}-r1"),
        target=client.V1ObjectReference(api_version="v1", kind="Node", name=second),
    )
    k8s.core.create_namespaced_binding(k8s.namespace, binding, _preload_content=False)
    k8s.wait_pod_phase(f"{name}-r1", "Running", timeout=30)
    k8s.make_node_not_ready(second)
    replacement = wait_pod(k8s, f"{name}-r2", timeout=15)
    terms = replacement.spec.affinity.node_affinity
    avoided = [
        value
        for term in terms.required_during_scheduling_ignored_during_execution.node_selector_terms
        for field in term.match_fields
        for value in field.values
    ]
    assert avoided == [second]  # the last failed node only: `first` may be back by now
    job = wait_action(objects, k8s.namespace, "train", 2)
    assert [a["fault"] for a in job["lastActions"][-2:]] == ["NodeNotReady", "NodeNotReady"]
    assert job["restarts"] == 2


def test_the_restart_limit_stops_the_third_restart(
    k8s: KwokCluster,
    make_policy: MakePolicy,
    objects: client.CustomObjectsApi,
    controller: Controller,
) -> None:
    make_policy(
        restartLimit=2, faultTolerantPolicy=[{"restartPolicy": "ExitCode", "exitCodes": 137}]
    )
    node = k8s.create_gpu_node().metadata.name
    for index in range(3):
        k8s.create_pod(f"gpt-worker-{index}", node=node, labels=labels("gpt", "worker", index))
    for index in range(2):
        exit_pod(k8s, f"gpt-worker-{index}", 137)
        wait_pod(k8s, f"gpt-worker-{index}-r1")
    exit_pod(k8s, "gpt-worker-2", 137)
    job = wait_action(objects, k8s.namespace, "train", 3)
    assert [a["action"] for a in job["lastActions"]] == ["Restart", "Restart", "LimitExceeded"]
    assert job["restarts"] == 2
    (condition,) = job["conditions"]
    assert (condition["type"], condition["status"]) == (LIMIT_EXCEEDED, "True")
    assert "restartLimit is 2" in condition["message"]
    caught_up(k8s, controller)  # the LimitExceeded carried out: nothing replaced
    assert pod_or_none(k8s, "gpt-worker-2-r1") is None
    assert k8s.read_pod("gpt-worker-2").metadata.deletion_timestamp is None


def test_scope_all_replaces_every_pod_of_the_job_once(
    k8s: KwokCluster,
    make_policy: MakePolicy,
    objects: client.CustomObjectsApi,
    controller: Controller,
) -> None:
    make_policy(
        faultTolerantPolicy=[{"restartPolicy": "ExitCode", "exitCodes": 137, "restartScope": "All"}]
    )
    node = k8s.create_gpu_node().metadata.name
    names = ["llm-master-0", "llm-worker-0", "llm-worker-1"]
    for name in names:
        _, replica_type, index = name.split("-")
        k8s.create_pod(name, node=node, labels=labels("llm", replica_type, int(index)))
    other = "other-worker-0"
    k8s.create_pod(other, node=node, labels=labels("other", "worker", 0))

    exit_pod(k8s, "llm-worker-0", 137)
    for name in names:
        assert wait_pod(k8s, f"{name}-r1").metadata.annotations[RESTART_COUNT_ANNOTATION] == "1"
        wait_deleted(k8s, name)
    caught_up(k8s, controller)  # the deletions seen: what they gave is decided and carried out
    for name in names:
        assert pod_or_none(k8s, f"{name}-r2") is None
    assert pod_or_none(k8s, f"{other}-r1") is None
    assert k8s.read_pod(other).metadata.deletion_timestamp is None
    job = wait_action(objects, k8s.namespace, "train", 1)
    assert job["restarts"] == 1
    assert [a["action"] for a in job["lastActions"]] == ["Restart"]


def test_the_restarter_works_with_only_its_rbac(
    crd: Any,
    restarter_rbac: None,
    k8s: KwokCluster,
    k8s_api_client: client.ApiClient,
    objects: client.CustomObjectsApi,
) -> None:
    """The same controller, as ServiceAccount edl-restarter bound by restarter-rbac.yaml."""
    config = client.Configuration()
    config.host = k8s_api_client.configuration.host
    config.ssl_ca_cert = k8s_api_client.configuration.ssl_ca_cert
    config.api_key = {"authorization": k8s.mint_token("edl-restarter")}
    config.api_key_prefix = {"authorization": "Bearer"}
    config.connection_pool_maxsize = 16
    api = client.ApiClient(config)
    running = connect(api, namespaces=[k8s.namespace], node_grace=1.0)
    running.start()
    try:
        assert running.wait_synced(30)
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "FaultTolerancePolicy",
            "metadata": {"name": "train", "namespace": k8s.namespace},
            "spec": {
                "selector": {"matchLabels": {"app": "train"}},
                "jobLabel": JOB,
                "replicaTypeLabel": TYPE,
                "replicaIndexLabel": INDEX,
                "restartPolicy": "Always",
            },
        }
        objects.create_namespaced_custom_object(GROUP, VERSION, k8s.namespace, PLURAL, body)
        wait_for("the policy", lambda: running.policies.knows(k8s.namespace, "train"), bool, 10)
        node = k8s.create_gpu_node().metadata.name
        k8s.create_pod("w-0", node=node, labels=labels("j", "worker", 0))
        k8s.create_pod("w-1", node=node, labels=labels("j", "worker", 1))
        exit_pod(k8s, "w-0", 3)
        wait_pod(k8s, "w-0-r1")
        wait_gone(k8s, "w-0")
        k8s.make_node_not_ready(node)
        assert wait_pod(k8s, "w-1-r1", timeout=15).spec.affinity is not None
        # Force-deleted right after its replacement is made: waited for, not raced.
        wait_for("w-1 gone", lambda: pod_or_none(k8s, "w-1"), lambda pod: pod is None, 5)
        job = wait_action(objects, k8s.namespace, "train", 2)
        assert job["restarts"] == 2
    finally:
        running.stop()
        api.close()


def test_a_force_deleted_or_evicted_pod_is_replaced(
    k8s: KwokCluster, make_policy: MakePolicy, objects: client.CustomObjectsApi
) -> None:
    make_policy(
        faultTolerantPolicy=[
            {"restartPolicy": "OnNodeFail", "exceptionalEvent": "PodForceDeleted,PodEvicted"}
        ]
    )
    node = k8s.create_gpu_node().metadata.name
    k8s.create_pod("a-worker-0", node=node, labels=labels("a", "worker", 0))
    k8s.create_pod("a-worker-1", node=node, labels=labels("a", "worker", 1))
    k8s.force_delete_pod("a-worker-0")
    new = wait_pod(k8s, "a-worker-0-r1")
    assert new.spec.affinity is None  # the pod was deleted, its node did not fail
    eviction = client.V1Eviction(
        metadata=client.V1ObjectMeta(name="a-worker-1", namespace=k8s.namespace)
    )
    k8s.core.create_namespaced_pod_eviction("a-worker-1", k8s.namespace, eviction)
    wait_pod(k8s, "a-worker-1-r1")
    job = wait_action(objects, k8s.namespace, "train", 2)
    assert [a["fault"] for a in job["lastActions"]] == ["PodForceDeleted", "PodEvicted"]


def test_a_policy_the_parser_refuses_gets_a_condition_and_restarts_nothing(
    k8s: KwokCluster,
    make_policy: MakePolicy,
    objects: client.CustomObjectsApi,
    controller: Controller,
) -> None:
    # The CRD's pattern admits a backwards range; the parser does not.
    make_policy(faultTolerantPolicy=[{"restartPolicy": "ExitCode", "exitCodes": "140-129"}])
    body = wait_for(
        "condition SpecValid",
        lambda: objects.get_namespaced_custom_object(
            GROUP, VERSION, k8s.namespace, PLURAL, "train"
        ),
        lambda body: bool((body.get("status") or {}).get("conditions")),
        timeout=10,
    )
    (condition,) = body["status"]["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == (
        "SpecValid",
        "False",
        "InvalidSpec",
    )
    assert "spec.faultTolerantPolicy[0].exitCodes" in condition["message"]
    node = k8s.create_gpu_node().metadata.name
    k8s.create_pod("b-worker-0", node=node, labels=labels("b", "worker", 0))
    k8s.exit_pod("b-worker-0", 137)  # waits for the exit to show
    caught_up(k8s, controller)  # the exit seen, and its fault decided about
    assert pod_or_none(k8s, "b-worker-0-r1") is None
    assert k8s.read_pod("b-worker-0").metadata.deletion_timestamp is None


def test_a_pod_that_reuses_the_name_is_neither_marked_nor_deleted(
    k8s: KwokCluster, k8s_api_client: client.ApiClient
) -> None:
    """The restarter deletes the pod it decided about, by uid: one made again under that name
    in between keeps running and carries no `deleted-by` tag that would hide its own faults."""
    node = k8s.create_gpu_node().metadata.name
    name = "reused-worker-0"
    old = k8s.create_pod(name, node=node)
    decided_about = k8s_api_client.sanitize_for_serialization(old)
    k8s.core.delete_namespaced_pod(name, k8s.namespace, grace_period_seconds=0)
    wait_for("the first pod gone", lambda: pod_or_none(k8s, name), lambda pod: pod is None, 15)
    again = k8s.create_pod(name, node=node)
    assert again.metadata.uid != old.metadata.uid
    Actuator(k8s_api_client).delete(decided_about, force=True, disruption="a test's fault")
    current = k8s.read_pod(name)
    assert current.metadata.uid == again.metadata.uid
    assert current.metadata.deletion_timestamp is None
    assert DELETED_BY_ANNOTATION not in (current.metadata.annotations or {})
    assert not [c for c in current.status.conditions or [] if c.type == "DisruptionTarget"]


def test_a_fault_in_hand_counts_in_the_queue_depth(
    k8s: KwokCluster,
    make_policy: MakePolicy,
    controller: Controller,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slow decision is work waiting too: the depth does not read 0 while one is in hand."""
    make_policy(faultTolerantPolicy=[{"restartPolicy": "ExitCode", "exitCodes": "137"}])
    node = k8s.create_gpu_node().metadata.name
    k8s.create_pod("slow-worker-0", node=node, labels=labels("slow", "worker", 0))
    release = threading.Event()
    in_hand = threading.Event()
    decide = controller.deciders.decide_batch

    def slow(*args: Any) -> None:
        in_hand.set()
        release.wait(30)
        decide(*args)

    monkeypatch.setattr(controller.deciders, "decide_batch", slow)
    assert controller.queue_depth() == 0
    exit_pod(k8s, "slow-worker-0", 137)
    assert in_hand.wait(15)
    assert controller.queue_depth() == 1
    release.set()
    wait_pod(k8s, "slow-worker-0-r1", timeout=15)
    wait_for("the depth back to 0", controller.queue_depth, lambda depth: depth == 0, 10)
