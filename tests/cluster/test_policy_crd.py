"""The FaultTolerancePolicy CRD on the real API server: it installs and becomes Established,
takes the example policy (the pasted AITrainingJob block), rejects malformed policies with a
422 that names the field, shows its printer columns, and keeps the restarter's status through
the status subresource exactly as `status` wrote it."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_test_helpers import KwokCluster, wait_for
from kube_tools import Kubectl
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from manifests import dry_run_warnings

from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.restarter.core.decide import Action, decide
from edl_agent.restarter.core.policy import ExceptionalEvent, PodIdentity
from edl_agent.restarter.core.record import JobRecord
from edl_agent.restarter.core.spec import parse_policy
from edl_agent.restarter.core.status import read_job, record_decision

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "daemonset"
CRD = yaml.safe_load((DEPLOY / "crd-faulttolerancepolicy.yaml").read_text())
EXAMPLE = yaml.safe_load((DEPLOY / "example-policy.yaml").read_text())
GROUP, VERSION, PLURAL = "edl.io", "v1alpha1", "faulttolerancepolicies"
INVALID = 422
T0 = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)

Create = Callable[[dict[str, Any]], dict[str, Any]]


@pytest.fixture(scope="module")
def crd(k8s_api_client: client.ApiClient) -> Any:
    """The CRD, applied server-side (as `kubectl apply --server-side`) and Established."""
    extensions = client.ApiextensionsV1Api(k8s_api_client)
    name = CRD["metadata"]["name"]
    extensions.patch_custom_resource_definition(
        name,
        CRD,
        field_manager="edl-tests",
        force=True,
        _content_type="application/apply-patch+yaml",
    )

    def established(crd: Any) -> bool:
        return any(
            c.type == "Established" and c.status == "True" for c in crd.status.conditions or []
        )

    return wait_for(
        f"CRD {name} Established",
        lambda: extensions.read_custom_resource_definition(name),
        established,
        timeout=30,
    )


@pytest.fixture
def objects(k8s_api_client: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(k8s_api_client)


@pytest.fixture
def create(crd: Any, k8s: KwokCluster, objects: client.CustomObjectsApi) -> Iterator[Create]:
    """Create a policy in the test's namespace (strict field validation); deleted afterwards."""
    made: list[str] = []

    def create(body: dict[str, Any]) -> dict[str, Any]:
        body = copy.deepcopy(body)
        body["metadata"]["namespace"] = k8s.namespace
        created: dict[str, Any] = objects.create_namespaced_custom_object(
            GROUP, VERSION, k8s.namespace, PLURAL, body, field_validation="Strict"
        )
        made.append(created["metadata"]["name"])
        return created

    yield create
    for name in made:
        objects.delete_namespaced_custom_object(GROUP, VERSION, k8s.namespace, PLURAL, name)


def policy_with(name: str, **spec_changes: Any) -> dict[str, Any]:
    body = copy.deepcopy(EXAMPLE)
    body["metadata"]["name"] = name
    body["spec"].update(spec_changes)
    return body


def test_the_example_policy_is_accepted_and_reads_back_as_written(create: Create) -> None:
    created = create(EXAMPLE)
    assert created["spec"] == EXAMPLE["spec"]  # no defaults added, nothing pruned
    assert parse_policy(created["spec"]) == parse_policy(EXAMPLE["spec"])
    rules = [{"exitCodes": 137, "restartPolicy": "ExitCode"}, {"restartPolicy": "Always"}]
    created = create(policy_with("int-exit-code", faultTolerantPolicy=rules))
    assert created["spec"]["faultTolerantPolicy"][0]["exitCodes"] == 137


def rule(**fields: Any) -> dict[str, Any]:
    return {"faultTolerantPolicy": [fields]}


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        (
            rule(restartPolicy="Sometimes", exitCodes="1"),
            "faultTolerantPolicy[0].restartPolicy",
            "",
        ),
        (rule(restartPolicy="ExitCode", exitCodes="1,256"), "faultTolerantPolicy[0].exitCodes", ""),
        (rule(restartPolicy="ExitCode", exitCodes=300), "faultTolerantPolicy[0].exitCodes", ""),
        (rule(restartPolicy="ExitCode", exitCodes="1-"), "faultTolerantPolicy[0].exitCodes", ""),
        ({"restartLimit": -1}, "restartLimit", "greater than or equal to 0"),
        ({"restartTimeout": 0}, "restartTimeout", "greater than or equal to 1"),
        (
            rule(restartPolicy="OnNodeFail", exceptionalEvent="nodeNotReady,Foo"),
            "faultTolerantPolicy[0].exceptionalEvent",
            "",
        ),
        # CEL rules
        (
            rule(restartPolicy="ExitCode"),
            "faultTolerantPolicy[0].exitCodes",
            "ExitCode and OnNodeFailWithExitCode rules need exitCodes",
        ),
        (
            rule(restartPolicy="OnNodeFail", exitCodes="1"),
            "faultTolerantPolicy[0].exitCodes",
            "an OnNodeFail rule matches no exit codes",
        ),
        (
            rule(restartPolicy="Graceful", containerName="trainer"),
            "faultTolerantPolicy[0].restartPolicy",
            "a Graceful rule matches no container exits",
        ),
        (
            rule(restartPolicy="Graceful", exceptionalEvent="deviceDegraded, nodeNotReady"),
            "faultTolerantPolicy[0].exceptionalEvent",
            "a Graceful rule evicts a pod that still runs",
        ),
        (
            rule(restartPolicy="OnFailure", exceptionalEvent="PodEvicted"),
            "faultTolerantPolicy[0].exceptionalEvent",
            "ExitCode and OnFailure rules match no exceptional events",
        ),
        (
            {"faultTolerantPolicy": [], "restartPolicy": "ExitCode"},
            "restartPolicy",
            "without faultTolerantPolicy rules, restartPolicy is the rule",
        ),
        (
            rule(restartScope="All") | {"restartPolicy": "ExitCode"},
            "faultTolerantPolicy",
            "a rule without restartPolicy takes spec.restartPolicy",
        ),
        (
            {"backoff": {"initialSeconds": 60, "maxSeconds": 30}},
            "backoff.maxSeconds",
            "maxSeconds must not be below initialSeconds",
        ),
        ({"selector": {}}, "selector", "an empty selector would cover every pod"),
    ],
)
def test_malformed_policies_are_rejected_naming_the_field(
    create: Create, changes: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(ApiException) as caught:
        create(policy_with("malformed", **changes))
    assert caught.value.status == INVALID
    body = json.loads(caught.value.body)
    causes = {c["field"]: c["message"] for c in body["details"]["causes"]}
    assert f"spec.{field}" in causes, causes
    assert message in causes[f"spec.{field}"]
    # Every rejection the API server makes, the parser makes too.
    with pytest.raises(ValueError, match=r"^spec\."):
        parse_policy(policy_with("malformed", **changes)["spec"])


def test_unknown_fields_are_refused_under_strict_validation(create: Create) -> None:
    with pytest.raises(ApiException) as caught:
        create(policy_with("typo", restartLimt=3))
    assert 'unknown field "spec.restartLimt"' in json.loads(caught.value.body)["message"]


def test_printer_columns(
    create: Create, k8s: KwokCluster, objects: client.CustomObjectsApi
) -> None:
    create(EXAMPLE)
    response = objects.list_namespaced_custom_object(
        GROUP,
        VERSION,
        k8s.namespace,
        PLURAL,
        _headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
        _preload_content=False,
    )
    table = json.loads(response.data)
    columns = [c["name"] for c in table["columnDefinitions"]]
    assert columns == [
        "Name",
        "Policy",
        "Mode",
        "Limit",
        "Window",
        "Restarts",
        "Last Restart",
        "Age",
    ]
    (row,) = table["rows"]
    assert row["cells"][:5] == ["resnet50-pretrain", "OnNodeFailWithExitCode", None, 100, 864000]


def test_the_status_subresource_keeps_what_the_restarter_records(
    create: Create, k8s: KwokCluster, objects: client.CustomObjectsApi
) -> None:
    created = create(EXAMPLE)
    name = created["metadata"]["name"]
    policy = parse_policy(created["spec"])
    worker = PodIdentity("resnet", "worker", 3, PodRef(k8s.namespace, "resnet-worker-3"))
    status: dict[str, Any] = {}
    record = JobRecord()
    for i, code in enumerate([129, 129, 1, 101]):
        fault = Fault(
            id=f"f{i}",
            kind=FaultKind.CONTAINER_EXIT,
            node="n1",
            observed_at=T0 + timedelta(seconds=30 * i, microseconds=123),
            container="trainer",
            exit_code=code,
        )
        now = fault.observed_at + timedelta(seconds=1)
        decision = decide(fault=fault, pod=worker, policy=policy, record=record, now=now)
        record = decision.record
        status = record_decision(status, decision, now=now)
    assert [a["action"] for a in status["jobs"][0]["lastActions"]] == [
        str(Action.RESTART),
        str(Action.BACKOFF),
        str(Action.IGNORE),
        str(Action.RESTART),  # 89 s after the last restart: past restartTimeLimit, no wait
    ]

    current = objects.get_namespaced_custom_object(GROUP, VERSION, k8s.namespace, PLURAL, name)
    current["status"] = status
    current["spec"]["restartLimit"] = 1  # the status endpoint ignores spec changes
    objects.replace_namespaced_custom_object_status(
        GROUP, VERSION, k8s.namespace, PLURAL, name, current
    )
    stored = objects.get_namespaced_custom_object(GROUP, VERSION, k8s.namespace, PLURAL, name)
    assert stored["status"] == status
    assert stored["spec"]["restartLimit"] == 100
    assert read_job(stored["status"], "resnet") == record

    stored["status"] = {"restarts": 999}  # and the main resource ignores status changes
    objects.replace_namespaced_custom_object(GROUP, VERSION, k8s.namespace, PLURAL, name, stored)
    again = objects.get_namespaced_custom_object(GROUP, VERSION, k8s.namespace, PLURAL, name)
    assert again["status"] == status


def server_dry_run(example: Path, namespace: str, kubectl: Kubectl) -> list[dict[str, Any]]:
    """`kubectl create --dry-run=server` of a file of deploy/examples: what the API server would
    store, one object per document, after it warned of nothing (it drops fields it does not
    know, with a warning)."""
    tried = kubectl("create", "--dry-run=server", "-n", namespace, f"-f={example}", "-o=json")
    made, text, decoder = [], tried.stdout.strip(), json.JSONDecoder()
    while text:  # one JSON object per document, one after the other
        item, end = decoder.raw_decode(text)
        made.append(item)
        text = text[end:].lstrip()
    assert not dry_run_warnings(tried.stderr), tried.stderr
    return made


def test_the_paddle_elastic_example_passes_a_server_side_dry_run(
    crd: Any, k8s: KwokCluster, kubectl: Kubectl
) -> None:
    """deploy/examples/paddle-elastic-job.yaml: a policy the CRD and our parser accept, and
    worker pods whose container restart rules the API server keeps (it would drop fields it
    does not know)."""
    example = DEPLOY.parent / "examples" / "paddle-elastic-job.yaml"
    made = server_dry_run(example, k8s.namespace, kubectl)
    assert [m["kind"] for m in made] == ["FaultTolerancePolicy", "Pod", "Pod", "Pod"]
    rules = parse_policy(made[0]["spec"]).rules
    assert [rule.restart_policy.value for rule in rules] == ["ExitCode", "OnNodeFail", "Graceful"]
    shipped = [d for d in yaml.safe_load_all(example.read_text()) if d and d["kind"] == "Pod"]
    for pod, written in zip(made[1:], shipped, strict=True):
        [container] = pod["spec"]["containers"]
        [as_written] = written["spec"]["containers"]
        assert container["restartPolicyRules"] == as_written["restartPolicyRules"]
        # Exit 0 ends the pod: a finished launcher is not restarted.
        assert 0 in container["restartPolicyRules"][0]["exitCodes"]["values"]


def test_the_quick_start_gpu_pod_passes_a_server_side_dry_run(
    crd: Any, k8s: KwokCluster, kubectl: Kubectl
) -> None:
    """deploy/examples/gpu-pod.yaml, the README's first workload: a policy the CRD and our
    parser accept that covers the pod and replaces it when its GPU turns Unhealthy, and a pod
    asking one `nvidia.com/gpu`."""
    policy, pod = server_dry_run(
        DEPLOY.parent / "examples" / "gpu-pod.yaml", k8s.namespace, kubectl
    )
    assert (policy["kind"], pod["kind"]) == ("FaultTolerancePolicy", "Pod")
    assert policy["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    [rule] = parse_policy(policy["spec"]).rules
    assert rule.events is not None
    assert ExceptionalEvent.DEVICE_UNHEALTHY in rule.events
    [container] = pod["spec"]["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
