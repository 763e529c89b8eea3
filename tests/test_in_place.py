"""Whether kubelet restarts an exited container in place: the pod's restartPolicy, init and
sidecar containers, and container restart rules (KEP-5307, KEP-5532)."""

from __future__ import annotations

from typing import Any

import pytest

from edl_agent.faults.in_place import restarts_in_place


def pod(
    policy: str | None = "Always",
    *,
    main: dict[str, Any] | None = None,
    init: dict[str, Any] | None = None,
    phase: str = "Running",
    deleting: bool = False,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main", **(main or {})}]}
    if policy is not None:
        spec["restartPolicy"] = policy
    if init is not None:
        spec["initContainers"] = [{"name": "init", **init}]
    metadata: dict[str, Any] = {"name": "p", "namespace": "ns"}
    if deleting:
        metadata["deletionTimestamp"] = "2026-05-01T12:00:00Z"
    return {"metadata": metadata, "spec": spec, "status": {"phase": phase}}


def rules(policy: str, *rules: tuple[str, str, list[int]]) -> dict[str, Any]:
    """A container's own restartPolicy and restartPolicyRules (action, operator, values)."""
    return {
        "restartPolicy": policy,
        "restartPolicyRules": [
            {"action": action, "exitCodes": {"operator": operator, "values": values}}
            for action, operator, values in rules
        ],
    }


RETRIABLE = rules("Never", ("Restart", "In", [42]))
NO_CODES = {"restartPolicy": "Never", "restartPolicyRules": [{"action": "Restart"}]}
NO_OWN_POLICY = {
    "restartPolicyRules": [{"action": "Restart", "exitCodes": {"operator": "In", "values": [5]}}]
}


@pytest.mark.parametrize(
    ("case", "the_pod", "container", "code", "expected"),
    [
        # The pod's policy.
        ("Always, failure", pod("Always"), "main", 1, True),
        ("Always, success", pod("Always"), "main", 0, True),
        ("Always by default", pod(None), "main", 1, True),
        ("OnFailure, failure", pod("OnFailure"), "main", 137, True),
        ("OnFailure, success", pod("OnFailure"), "main", 0, False),
        ("Never", pod("Never"), "main", 1, False),
        ("an unknown policy", pod("Sometimes"), "main", 1, False),
        # A pod that finished or is going away runs nothing again.
        ("phase Failed", pod("Always", phase="Failed"), "main", 1, False),
        ("phase Succeeded", pod("OnFailure", phase="Succeeded"), "main", 1, False),
        ("being deleted", pod("Always", deleting=True), "main", 1, False),
        # Containers the spec does not name (ephemeral ones).
        ("not in the spec", pod("Always"), "debug", 1, False),
        # Init containers.
        ("init, Never", pod("Never", init={}), "init", 1, False),
        ("init, OnFailure", pod("OnFailure", init={}), "init", 1, True),
        ("init, Always, failure", pod("Always", init={}), "init", 1, True),
        ("init, completed", pod("Always", init={}), "init", 0, False),
        ("sidecar, Never pod", pod("Never", init={"restartPolicy": "Always"}), "init", 1, True),
        ("sidecar, exit 0", pod("Never", init={"restartPolicy": "Always"}), "init", 0, True),
        # The container's own policy (KEP-5307) overrides the pod's.
        (
            "own Always in a Never pod",
            pod("Never", main={"restartPolicy": "Always"}),
            "main",
            1,
            True,
        ),
        (
            "own Never in an Always pod",
            pod("Always", main={"restartPolicy": "Never"}),
            "main",
            1,
            False,
        ),
        (
            "own OnFailure, success",
            pod("Always", main={"restartPolicy": "OnFailure"}),
            "main",
            0,
            False,
        ),
        # Restart rules: In.
        ("In matches", pod("Never", main=RETRIABLE), "main", 42, True),
        ("In misses: own Never", pod("Never", main=RETRIABLE), "main", 1, False),
        (
            "In misses: own OnFailure",
            pod("Never", main=rules("OnFailure", ("Restart", "In", [42]))),
            "main",
            1,
            True,
        ),
        (
            "In misses, exit 0, own OnFailure",
            pod("Never", main=rules("OnFailure", ("Restart", "In", [42]))),
            "main",
            0,
            False,
        ),
        # NotIn.
        (
            "NotIn matches",
            pod("Never", main=rules("Never", ("Restart", "NotIn", [0, 3]))),
            "main",
            1,
            True,
        ),
        (
            "NotIn misses",
            pod("Never", main=rules("Never", ("Restart", "NotIn", [0, 3]))),
            "main",
            3,
            False,
        ),
        (
            "NotIn, no values: any",
            pod("Never", main=rules("Never", ("Restart", "NotIn", []))),
            "main",
            9,
            True,
        ),
        # The first matching rule wins; a later one is not read.
        (
            "no rule matches: own Always",
            pod("Never", main=rules("Always", ("Restart", "In", [42]), ("Restart", "NotIn", [7]))),
            "main",
            7,
            True,
        ),
        (
            "unknown operator",
            pod("Never", main=rules("Never", ("Restart", "Maybe", [1]))),
            "main",
            1,
            False,
        ),
        (
            "unknown action",
            pod("Never", main=rules("Never", ("Ignore", "In", [1]))),
            "main",
            1,
            False,
        ),
        # KEP-5532: RestartAllContainers restarts the pod's containers in place.
        (
            "RestartAllContainers",
            pod("Never", main=rules("Never", ("RestartAllContainers", "In", [88]))),
            "main",
            88,
            True,
        ),
        ("a rule with no exit codes", pod("Never", main=NO_CODES), "main", 1, False),
        ("rules, no own policy: the pod's", pod("OnFailure", main=NO_OWN_POLICY), "main", 1, True),
        (
            "rules in a finished pod",
            pod("Never", main=RETRIABLE, phase="Failed"),
            "main",
            42,
            False,
        ),
    ],
)
def test_restarts_in_place(
    case: str, the_pod: dict[str, Any], container: str, code: int, expected: bool
) -> None:
    assert restarts_in_place(the_pod, container, code) is expected, case


def test_the_first_matching_rule_decides_even_against_a_later_one() -> None:
    """Rules in order: `In [1] → Restart` before `NotIn [1] → ...`; an exit 1 stops at the
    first. An exit 2 goes to the second, and one no rule matches to the container's policy."""
    ordered = pod(
        "Never",
        main=rules("Never", ("Restart", "In", [1]), ("RestartAllContainers", "NotIn", [1, 2])),
    )
    assert restarts_in_place(ordered, "main", 1)
    assert restarts_in_place(ordered, "main", 3)
    assert not restarts_in_place(ordered, "main", 2)
