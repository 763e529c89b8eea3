"""FaultTolerancePolicy: parsing (the AITrainingJob block verbatim, one-line errors), the CRD
schema against the parser, decision tables, record and status, and hypothesis properties."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import re
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.restarter.core.decide import Action, Decision, decide
from edl_agent.restarter.core.policy import (
    Backoff,
    ExceptionalEvent,
    ExitCodes,
    Fence,
    PodIdentity,
    Policy,
    RestartPolicy,
    RestartScope,
    Rule,
)
from edl_agent.restarter.core.record import JobRecord
from edl_agent.restarter.core.selector import LabelSelector, Operator, Requirement
from edl_agent.restarter.core.spec import parse_policy, policy_spec_keys
from edl_agent.restarter.core.status import LAST_ACTIONS, fit, read_job, record_decision
from edl_agent.typed import SchemaError

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "daemonset"
T0 = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
SELECTING = {"selector": {"matchLabels": {"app": "resnet"}}, "jobLabel": "job"}
# An AITrainingJob replica spec's fault-tolerance block, exactly as users write it.
AITJ_BLOCK = """
faultTolerantPolicy:
  - exitCodes: 129,101
    restartPolicy: ExitCode
    restartScope: Pod
  - exceptionalEvent: nodeNotReady,PodForceDeleted
    restartPolicy: OnNodeFail
    restartScope: Pod
restartLimit: 100
restartPolicy: OnNodeFailWithExitCode
restartTimeLimit: 60
restartTimeout: 864000
"""


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def spec(**changes: Any) -> dict[str, Any]:
    return {**copy.deepcopy(SELECTING), **yaml.safe_load(AITJ_BLOCK), **changes}


def policy(**changes: Any) -> Policy:
    return parse_policy(spec(**changes))


def pod(index: int = 3, replica_type: str = "worker", job: str = "resnet") -> PodIdentity:
    ref = PodRef("training", f"{job}-{replica_type}-{index}", uid=f"uid-{index}")
    return PodIdentity(job, replica_type, index, ref)


def exit_fault(code: int | None, t: float = 0, container: str = "trainer", **kw: Any) -> Fault:
    return Fault(
        id=kw.pop("id", f"exit-{code}-{t}"),
        kind=FaultKind.CONTAINER_EXIT,
        node="n1",
        observed_at=at(t),
        container=container,
        exit_code=code,
        **kw,
    )


def event_fault(kind: FaultKind, t: float = 0, **kw: Any) -> Fault:
    return Fault(id=kw.pop("id", f"{kind}-{t}"), kind=kind, node="n1", observed_at=at(t), **kw)


def run(
    p: Policy, fault: Fault, who: PodIdentity | None = None, *, now: float | None = None, **kw: Any
) -> Decision:
    record = kw.pop("record", JobRecord())
    when = at(now) if now is not None else fault.observed_at
    return decide(fault=fault, pod=who or pod(), policy=p, record=record, now=when)


# --- exit codes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "canonical"),
    [
        (137, "137"),
        ("129,101", "101,129"),
        ("1-100", "1-100"),
        ("1,3-5,200", "1,3-5,200"),
        (" 1 , 3 - 5 ", "1,3-5"),
        ("5,1-3,4,129,129", "1-5,129"),
        ("0", "0"),
        ("0-255", "0-255"),
    ],
)
def test_exit_codes_parse(value: int | str, canonical: str) -> None:
    assert str(ExitCodes.parse(value)) == canonical


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("256", "exit codes run from 0 to 255, not 256"),
        (10001, "exit codes run from 0 to 255, not 10001"),
        (-1, "exit codes run from 0 to 255, not -1"),
        ("1-300", "exit codes run from 0 to 255, not 300"),
        ("100-3", "range 100-3 in '100-3' runs backwards"),
        ("1,,2", "'' in '1,,2' is not a code or a range such as 1-100"),
        ("", "'' in '' is not a code or a range such as 1-100"),
        ("x1", "'x1' in 'x1' is not a code or a range such as 1-100"),
    ],
)
def test_exit_codes_reject(value: int | str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ExitCodes.parse(value)


@given(st.sets(st.integers(0, 255), min_size=1))
def test_exit_codes_are_the_set_written(codes: set[int]) -> None:
    written = ",".join(str(c) for c in sorted(codes, reverse=True))
    parsed = ExitCodes.parse(written)
    assert {c for c in range(-1, 257) if c in parsed} == codes
    assert ExitCodes.parse(str(parsed)) == parsed


# --- parsing -------------------------------------------------------------------------------------


def test_the_aitrainingjob_block_parses_verbatim() -> None:
    p = parse_policy({**SELECTING, **yaml.safe_load(AITJ_BLOCK)})
    assert p.rules == (
        Rule(RestartPolicy.EXIT_CODE, RestartScope.POD, ExitCodes(((101, 101), (129, 129)))),
        Rule(
            RestartPolicy.ON_NODE_FAIL,
            RestartScope.POD,
            events=frozenset({ExceptionalEvent.NODE_NOT_READY, ExceptionalEvent.POD_FORCE_DELETED}),
        ),
    )
    assert p.gate is RestartPolicy.ON_NODE_FAIL_WITH_EXIT_CODE
    assert (p.restart_limit, p.restart_time_limit, p.restart_timeout) == (100, 60, 864000)
    assert p.backoff == Backoff(10, 300)


def test_the_example_policy_parses() -> None:
    example = yaml.safe_load((DEPLOY / "example-policy.yaml").read_text())
    p = parse_policy(example["spec"])
    assert p.replica_index_label == "training.kubeflow.org/replica-index"
    assert len(p.rules) == 2


@pytest.mark.parametrize(
    ("codes", "events", "canonical"),
    [
        (137, "nodeNotReady", "137"),
        ("1-100", ["PodEvicted", "deviceUnhealthy"], "1-100"),
        ("1,3-5,200", " nodeNotReady , PodEvicted ", "1,3-5,200"),
    ],
)
def test_exit_codes_and_events_in_every_form(codes: Any, events: Any, canonical: str) -> None:
    rule = {"exitCodes": codes, "exceptionalEvent": events, "restartPolicy": "Always"}
    (parsed,) = policy(faultTolerantPolicy=[rule]).rules
    assert str(parsed.exit_codes) == canonical
    assert parsed.events is not None
    assert len(parsed.events) == (1 if events == "nodeNotReady" else 2)


def test_defaults() -> None:
    p = parse_policy({**SELECTING, "restartPolicy": "OnFailure"})
    assert p.rules == (Rule(RestartPolicy.ON_FAILURE, RestartScope.POD),)
    assert not p.rules_given
    assert p.gate is None
    assert (p.restart_limit, p.restart_time_limit, p.restart_timeout) == (10, 600, None)
    inherited = parse_policy(
        {**SELECTING, "restartPolicy": "ExitCode", "restartScope": "All"}
        | {"faultTolerantPolicy": [{"exitCodes": "1-3"}]}
    )
    assert inherited.rules[0].restart_policy is RestartPolicy.EXIT_CODE
    assert inherited.rules[0].restart_scope is RestartScope.ALL


POLICIES = "Always, OnFailure, OnNodeFail, OnNodeFailWithExitCode, ExitCode, Never"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"restartLimit": -1}, "spec.restartLimit: must be at least 0, got -1"),
        ({"restartLimit": 5000}, "spec.restartLimit: must be at most 1000, got 5000"),
        ({"restartLimit": "100"}, "spec.restartLimit: expected an integer, got str '100'"),
        ({"restartTimeout": 0}, "spec.restartTimeout: must be at least 1, got 0"),
        ({"restartTimeLimit": -5}, "spec.restartTimeLimit: must be at least 0, got -5"),
        ({"restartPolicy": "Sometimes"}, f"spec.restartPolicy: expected one of {POLICIES}"),
        (
            {"restartLimt": 3},
            "spec.restartLimt: unknown key, did you mean spec.restartLimit? (known keys: backoff, ",
        ),
        ({"jobLabel": None}, "spec.jobLabel: expected a string, got nothing"),
        ({"backoff": {"initialSeconds": 60, "maxSeconds": 30}}, "spec.backoff.maxSeconds: must"),
        ({"selector": {}}, "spec.selector: an empty selector would cover every pod"),
        (
            {"selector": {"matchExpressions": [{"key": "a", "operator": "In"}]}},
            "spec.selector.matchExpressions[0].values: In and NotIn need values",
        ),
        (
            {"faultTolerantPolicy": [{"exitCodes": "1", "restartPolicy": "Sometimes"}]},
            "spec.faultTolerantPolicy[0].restartPolicy: expected one of",
        ),
        (
            {"faultTolerantPolicy": [{"exitCodes": "129,10001", "restartPolicy": "ExitCode"}]},
            "spec.faultTolerantPolicy[0].exitCodes: exit codes run from 0 to 255, not 10001",
        ),
        (
            {"faultTolerantPolicy": [{"exitCodes": "100-3", "restartPolicy": "ExitCode"}]},
            "spec.faultTolerantPolicy[0].exitCodes: range 100-3 in '100-3' runs backwards",
        ),
        (
            {"faultTolerantPolicy": [{"exitCodes": True, "restartPolicy": "ExitCode"}]},
            "spec.faultTolerantPolicy[0].exitCodes: expected an integer, got bool True",
        ),
        (
            {"faultTolerantPolicy": [{"restartPolicy": "ExitCode"}]},
            "spec.faultTolerantPolicy[0].exitCodes: an ExitCode rule needs exitCodes",
        ),
        (
            {"faultTolerantPolicy": [{"restartPolicy": "OnNodeFail", "exitCodes": 1}]},
            "spec.faultTolerantPolicy[0].exitCodes: an OnNodeFail rule matches no container",
        ),
        (
            {"faultTolerantPolicy": [{"restartPolicy": "OnFailure", "exceptionalEvent": "x"}]},
            "spec.faultTolerantPolicy[0].exceptionalEvent: expected events among nodeNotReady",
        ),
        (
            {"faultTolerantPolicy": [{"restartPolicy": "OnFailure", "exceptionalEvent": []}]},
            "spec.faultTolerantPolicy[0].exceptionalEvent: names no event",
        ),
        (
            {"faultTolerantPolicy": [{"restartScope": "All"}]},
            "spec.faultTolerantPolicy[0].exitCodes: an OnNodeFailWithExitCode rule needs",
        ),
        (
            {"faultTolerantPolicy": [], "restartPolicy": "ExitCode"},
            "spec.restartPolicy: without faultTolerantPolicy rules, restartPolicy is the rule",
        ),
    ],
)
def test_bad_specs_name_the_key(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(SchemaError) as caught:
        policy(**changes)
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


def test_a_rule_without_policy_needs_the_spec_s() -> None:
    block = {**SELECTING, "faultTolerantPolicy": [{"exitCodes": "1"}]}
    with pytest.raises(SchemaError, match=r"^spec.faultTolerantPolicy\[0\].restartPolicy: requ"):
        parse_policy(block)


# --- the CRD against the parser ------------------------------------------------------------------


@functools.cache
def crd_spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load((DEPLOY / "crd-faulttolerancepolicy.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]  # type: ignore[no-any-return]


def test_the_crd_has_exactly_the_keys_the_parser_reads() -> None:
    schema = crd_spec_schema()
    props = schema["properties"]
    levels = {
        "spec": props,
        "selector": props["selector"]["properties"],
        "matchExpressions": props["selector"]["properties"]["matchExpressions"]["items"][
            "properties"
        ],
        "faultTolerantPolicy": props["faultTolerantPolicy"]["items"]["properties"],
        "backoff": props["backoff"]["properties"],
    }
    for level, keys in policy_spec_keys().items():
        assert sorted(levels[level]) == sorted(keys), level
    rule = levels["faultTolerantPolicy"]
    assert rule["restartPolicy"]["enum"] == [str(p) for p in RestartPolicy]
    assert props["restartPolicy"]["enum"] == [str(p) for p in RestartPolicy]
    assert rule["restartScope"]["enum"] == [str(s) for s in RestartScope]
    assert props["restartLimit"]["maximum"] == 1000


@given(
    st.lists(
        st.tuples(st.integers(0, 300), st.none() | st.integers(0, 300)), min_size=1, max_size=4
    ),
    st.sampled_from([",", ", ", " ,"]),
)
def test_the_crd_exit_code_pattern_agrees_with_the_parser(
    spans: list[tuple[int, int | None]], sep: str
) -> None:
    pattern = crd_spec_schema()["properties"]["faultTolerantPolicy"]["items"]["properties"][
        "exitCodes"
    ]["pattern"]
    text = sep.join(str(lo) if hi is None else f"{lo}-{hi}" for lo, hi in spans)
    backwards = any(hi is not None and lo > hi for lo, hi in spans)
    try:
        ExitCodes.parse(text)
        parsed = True
    except ValueError:
        parsed = False
    # The API server cannot afford to compare the ends of a range: only the parser can.
    assert parsed == (re.search(pattern, text) is not None and not backwards)


# --- matching and decisions ----------------------------------------------------------------------

NOT_READY = FaultKind.NODE_NOT_READY
FORCE_DELETED = FaultKind.POD_FORCE_DELETED
EVICTED = FaultKind.POD_EVICTED
DEVICE = FaultKind.DEVICE_UNHEALTHY


@pytest.mark.parametrize(
    ("fault", "action", "rule", "reason"),
    [
        (exit_fault(129), Action.RESTART, 0, "faultTolerantPolicy[0] (ExitCode) matches exit "),
        (exit_fault(101), Action.RESTART, 0, "restart pod resnet/worker/3 (1 of 100 for replic"),
        (exit_fault(1), Action.IGNORE, None, "exit with code 1 of container trainer matches no"),
        (exit_fault(None), Action.IGNORE, None, "exit with an unknown code of container trainer"),
        (event_fault(NOT_READY), Action.RESTART, 1, "faultTolerantPolicy[1] (OnNodeFail) match"),
        (event_fault(FORCE_DELETED), Action.RESTART, 1, "matches PodForceDeleted on n1: restart"),
        (event_fault(EVICTED), Action.IGNORE, None, "PodEvicted on n1 matches no rule"),
        (
            event_fault(DEVICE, device_ids=("GPU-1",)),
            Action.IGNORE,
            None,
            "deviceUnhealthy (GPU-1) on n1 matches no rule",
        ),
    ],
)
def test_the_aitrainingjob_block_decides(
    fault: Fault, action: Action, rule: int | None, reason: str
) -> None:
    decision = run(policy(), fault)
    assert (decision.action, decision.rule) == (action, rule)
    assert reason in decision.reason
    assert decision.scope is (RestartScope.POD if action is Action.RESTART else None)


ALWAYS_ALL = {"restartPolicy": "Always", "restartScope": "All"}


@pytest.mark.parametrize(
    ("rules", "fault", "action", "rule"),
    [
        # OnFailure: any non-zero code, no events, code 0 only when listed.
        ([{"restartPolicy": "OnFailure"}], exit_fault(1), Action.RESTART, 0),
        ([{"restartPolicy": "OnFailure"}], exit_fault(None), Action.RESTART, 0),
        ([{"restartPolicy": "OnFailure"}], exit_fault(0), Action.IGNORE, None),
        ([{"restartPolicy": "OnFailure", "exitCodes": "0-3"}], exit_fault(0), Action.RESTART, 0),
        ([{"restartPolicy": "OnFailure"}], event_fault(NOT_READY), Action.IGNORE, None),
        # OnNodeFail without events: all four; exits never.
        ([{"restartPolicy": "OnNodeFail"}], event_fault(DEVICE), Action.RESTART, 0),
        ([{"restartPolicy": "OnNodeFail"}], event_fault(EVICTED), Action.RESTART, 0),
        ([{"restartPolicy": "OnNodeFail"}], exit_fault(137), Action.IGNORE, None),
        # OnNodeFailWithExitCode: the listed codes and the events.
        (
            [{"restartPolicy": "OnNodeFailWithExitCode", "exitCodes": 137}],
            event_fault(FORCE_DELETED),
            Action.RESTART,
            0,
        ),
        (
            [{"restartPolicy": "OnNodeFailWithExitCode", "exitCodes": 137}],
            exit_fault(1),
            Action.IGNORE,
            None,
        ),
        # Never matches what it names; naming nothing, everything; first match wins.
        ([{"restartPolicy": "Never", "exitCodes": "1-127"}, ALWAYS_ALL], exit_fault(1), "N", 0),
        ([{"restartPolicy": "Never", "exitCodes": "1-127"}, ALWAYS_ALL], exit_fault(137), "R", 1),
        (
            [{"restartPolicy": "Never", "exitCodes": "1-127"}, ALWAYS_ALL],
            event_fault(NOT_READY),
            Action.RESTART,
            1,
        ),
        (
            [{"restartPolicy": "Never", "exceptionalEvent": "PodEvicted"}, ALWAYS_ALL],
            event_fault(EVICTED),
            Action.NEVER,
            0,
        ),
        (
            [{"restartPolicy": "Never", "exceptionalEvent": "PodEvicted"}, ALWAYS_ALL],
            exit_fault(3),
            Action.RESTART,
            1,
        ),
        ([{"restartPolicy": "Never"}, ALWAYS_ALL], event_fault(DEVICE), Action.NEVER, 0),
        ([{"restartPolicy": "Never"}, ALWAYS_ALL], exit_fault(9), Action.NEVER, 0),
        # containerName narrows exits to that container.
        (
            [{"restartPolicy": "ExitCode", "exitCodes": 1, "containerName": "sidecar"}],
            exit_fault(1),
            Action.IGNORE,
            None,
        ),
        (
            [{"restartPolicy": "ExitCode", "exitCodes": 1, "containerName": "trainer"}],
            exit_fault(1),
            Action.RESTART,
            0,
        ),
        (
            [{"restartPolicy": "Never", "containerName": "sidecar"}, ALWAYS_ALL],
            exit_fault(1, container="sidecar"),
            Action.NEVER,
            0,
        ),
    ],
)
def test_rules_match(
    rules: list[dict[str, Any]], fault: Fault, action: Action | str, rule: int | None
) -> None:
    expected = {"N": Action.NEVER, "R": Action.RESTART}.get(str(action), action)
    p = parse_policy({**SELECTING, "faultTolerantPolicy": rules})
    decision = run(p, fault)
    assert (decision.action, decision.rule) == (expected, rule)


@pytest.mark.parametrize(
    ("gate", "fault", "action", "reason"),
    [
        ("Never", exit_fault(129), Action.NEVER, "spec.restartPolicy Never does not restart exit"),
        ("Never", event_fault(NOT_READY), Action.NEVER, "does not restart nodeNotReady on n1"),
        ("ExitCode", event_fault(NOT_READY), Action.NEVER, "ExitCode does not restart nodeNot"),
        ("ExitCode", exit_fault(129), Action.RESTART, "faultTolerantPolicy[0]"),
        ("OnNodeFail", exit_fault(129), Action.NEVER, "OnNodeFail does not restart exit with"),
        ("OnNodeFail", event_fault(NOT_READY), Action.RESTART, "faultTolerantPolicy[1]"),
    ],
)
def test_spec_restart_policy_gates_the_rules(
    gate: str, fault: Fault, action: Action, reason: str
) -> None:
    decision = run(policy(restartPolicy=gate), fault)
    assert decision.action is action
    assert reason in decision.reason


def test_without_rules_spec_restart_policy_is_the_rule() -> None:
    p = parse_policy({**SELECTING, "restartPolicy": "Always", "restartScope": "Replica"})
    decision = run(p, event_fault(EVICTED))
    assert (decision.action, decision.scope) == (Action.RESTART, RestartScope.REPLICA)
    assert decision.reason.startswith("spec.restartPolicy Always matches PodEvicted on n1")
    assert "restart replica type 'worker' of job resnet" in decision.reason


# --- limit, window, backoff, stale ---------------------------------------------------------------


def replay(p: Policy, steps: list[tuple[Fault, PodIdentity, float]]) -> list[Decision]:
    """Decide each (fault, pod, now) in turn, carrying the record."""
    record, decisions = JobRecord(), []
    for fault, who, now in steps:
        decision = decide(fault=fault, pod=who, policy=p, record=record, now=at(now))
        record = decision.record
        decisions.append(decision)
    return decisions


NO_BACKOFF = {"backoff": {"initialSeconds": 0, "maxSeconds": 0}}


def test_restart_limit_counts_per_replica_type() -> None:
    p = policy(restartLimit=2, **NO_BACKOFF)
    steps = [(exit_fault(129, t), pod(t), t) for t in (10, 20, 30)]
    steps.append((exit_fault(129, 40), pod(0, "master"), 40))
    actions = [d.action for d in replay(p, steps)]
    assert actions == [Action.RESTART, Action.RESTART, Action.LIMIT_EXCEEDED, Action.RESTART]
    refused = replay(p, steps)[2]
    assert refused.reason.endswith(
        "but replica type 'worker' of job resnet has had 2 restarts in 864000s, restartLimit is 2"
    )
    assert refused.record == replay(p, steps)[1].record


def test_restart_timeout_is_a_sliding_window() -> None:
    p = policy(restartLimit=2, restartTimeout=100, **NO_BACKOFF)
    times = [0, 10, 50, 100, 109, 111]
    steps = [(exit_fault(129, t), pod(i), t) for i, t in enumerate(times)]
    actions = [d.action for d in replay(p, steps)]
    # 100: the restart at 0 no longer counts; 109: those at 10 and 100 do; 111: only 100's.
    assert actions == [
        Action.RESTART,
        Action.RESTART,
        Action.LIMIT_EXCEEDED,
        Action.RESTART,
        Action.LIMIT_EXCEEDED,
        Action.RESTART,
    ]


def test_restart_limit_zero_restarts_nothing() -> None:
    assert run(policy(restartLimit=0), exit_fault(129)).action is Action.LIMIT_EXCEEDED


def test_consecutive_failures_of_a_slot_back_off_and_recover() -> None:
    p = policy(restartTimeLimit=60, backoff={"initialSeconds": 10, "maxSeconds": 25})
    record = JobRecord()
    seen = []
    # (fault time, decision time): each replacement fails 5 s after its restart.
    for fault_at, now in [(0, 0), (5, 5), (5, 15), (20, 20), (20, 40), (45, 70), (150, 150)]:
        d = decide(fault=exit_fault(129, fault_at), pod=pod(), policy=p, record=record, now=at(now))
        record = d.record
        seen.append((d.action, d.until))
    assert seen == [
        (Action.RESTART, None),
        (Action.BACKOFF, at(15)),  # 2nd in a row: 10 s after the fault
        (Action.RESTART, None),
        (Action.BACKOFF, at(40)),  # 3rd: 20 s
        (Action.RESTART, None),
        (Action.RESTART, None),  # 4th would wait 40 s, capped at 25 s: 45 + 25 = 70
        (Action.RESTART, None),  # ran 80 s > restartTimeLimit: a new streak, at once
    ]
    assert [last.consecutive for last in record.last_restarts] == [1]


def test_a_job_owned_pods_exit_is_the_jobs_to_decide_but_its_node_fault_is_ours() -> None:
    p = policy()
    owner = "Job training/resnet"

    exited = decide(
        fault=exit_fault(129), pod=pod(), policy=p, record=JobRecord(), now=at(0), exit_owner=owner
    )
    unmatched = decide(
        fault=exit_fault(3), pod=pod(), policy=p, record=JobRecord(), now=at(0), exit_owner=owner
    )
    node = decide(
        fault=event_fault(NOT_READY), pod=pod(), policy=p, record=JobRecord(), now=at(0),
        exit_owner=owner,
    )  # fmt: skip

    assert exited.action is Action.OWNER_DECIDES
    assert owner in exited.reason
    assert "podFailurePolicy" in exited.reason
    assert exited.record == JobRecord()  # no restart charged
    assert unmatched.action is Action.IGNORE  # a rule that matches nothing decides nothing
    assert node.action is Action.RESTART  # the Job does not see a dead node: the pod is deleted


def test_a_rack_failure_restarts_every_slot_at_once() -> None:
    p = policy()
    steps = [(event_fault(NOT_READY, 0, id=f"n{i}"), pod(i), 1) for i in range(20)]
    assert {d.action for d in replay(p, steps)} == {Action.RESTART}


def test_a_wider_restart_is_each_covered_slot_s_previous_restart() -> None:
    rules = [{"restartPolicy": "ExitCode", "exitCodes": 129, "restartScope": "Replica"}]
    p = policy(faultTolerantPolicy=rules, restartTimeLimit=60)
    d1, d2, d3 = replay(
        p,
        [
            (exit_fault(129, 0), pod(3), 0),
            (exit_fault(129, 30), pod(5), 30),  # worker 5 was replaced at 0 too
            (exit_fault(129, 30), pod(0, "master"), 30),  # another type: not covered
        ],
    )
    assert (d1.action, d2.action, d3.action) == (Action.RESTART, Action.BACKOFF, Action.RESTART)
    assert d2.until == at(40)


def test_stale_faults_are_dropped() -> None:
    p = parse_policy({**SELECTING, "restartPolicy": "Always", "restartScope": "All"})
    fault = event_fault(NOT_READY, 0, pods=(pod(1).pod, pod(2).pod))  # type: ignore[arg-type]
    first, again, other_pod, later = replay(
        p,
        [(fault, pod(1), 1), (fault, pod(1), 2), (fault, pod(2), 2), (exit_fault(1, 3), pod(2), 9)],
    )
    assert first.action is Action.RESTART
    assert again.action is other_pod.action is Action.STALE
    assert other_pod.reason.startswith("nodeNotReady on n1 was observed before the All restart")
    assert other_pod.record == first.record
    assert later.action is Action.BACKOFF  # observed after the restart: a new fault


def test_a_fault_observed_after_now_is_taken_as_observed_now() -> None:
    """A clock ahead of the restarter's cannot date the slot's record into the future: the
    fault counts as observed now, it is stale once acted on, and a fault of the replacement
    observed after the restart on a good clock is a new one (with the record at the reported
    time it would be judged stale until then)."""
    p = policy()
    fault = exit_fault(129, 3600)  # the agent's clock is an hour ahead of the restarter's
    first = run(p, fault, now=5)
    assert first.action is Action.RESTART
    assert first.record.last_restarts[0].at == at(5)
    assert first.fault.observed_at == at(5)
    assert run(p, first.fault, now=6, record=first.record).action is Action.STALE
    replacement = exit_fault(129, 600, id="replacement")  # ten minutes later, a good clock
    assert run(p, replacement, now=600, record=first.record).action is Action.RESTART


def test_forgotten_restarts_still_make_old_faults_stale() -> None:
    p = policy(restartTimeLimit=60, **NO_BACKOFF)
    old = exit_fault(129, 0)
    _, d2 = replay(p, [(old, pod(1), 0), (exit_fault(129, 4000), pod(2), 4000)])
    assert [last.slot for last in d2.record.last_restarts] == ["2"]
    assert d2.record.forgotten_until == at(0)
    assert run(p, old, pod(1), now=4001, record=d2.record).action is Action.STALE


def test_identify_places_a_pod_by_its_labels() -> None:
    p = policy(replicaTypeLabel="type", replicaIndexLabel="index")
    ref = PodRef("training", "resnet-worker-7")
    labels = {"app": "resnet", "job": "resnet", "type": "worker", "index": "7"}
    assert p.identify(ref, labels) == PodIdentity("resnet", "worker", 7, ref)
    assert p.identify(ref, labels | {"index": "x"}) == PodIdentity("resnet", "worker", None, ref)
    assert p.identify(ref, labels | {"app": "other"}) is None
    assert p.identify(ref, {"app": "resnet"}) is None
    assert PodIdentity("resnet", "worker", None, ref).slot == "resnet-worker-7"


def test_label_selectors() -> None:
    selector = LabelSelector(
        {"app": "resnet"},
        (
            Requirement("tier", Operator.IN, ("a", "b")),
            Requirement("skip", Operator.DOES_NOT_EXIST),
            Requirement("zone", Operator.NOT_IN, ("z",)),
            Requirement("job", Operator.EXISTS),
        ),
    )
    assert str(selector) == "app=resnet,tier in (a,b),!skip,zone notin (z),job"
    assert selector.matches({"app": "resnet", "tier": "a", "job": ""})
    assert not selector.matches({"app": "resnet", "tier": "c", "job": ""})
    assert not selector.matches({"app": "resnet", "tier": "a", "job": "", "skip": "1"})
    assert not selector.matches({"app": "resnet", "tier": "a", "job": "", "zone": "z"})


# --- status --------------------------------------------------------------------------------------


def test_status_keeps_counts_actions_and_the_limit_condition() -> None:
    p = policy(restartLimit=1, **NO_BACKOFF)
    status: dict[str, Any] = {}
    decisions = replay(
        p,
        [
            (exit_fault(129, 1), pod(1), 1),
            (exit_fault(129, 2), pod(2), 2),
            (exit_fault(1, 3), pod(2), 3),
        ],
    )
    for d in decisions:
        status = record_decision(status, d, now=d.fault.observed_at)
    (job,) = status["jobs"]
    assert status["restarts"] == job["restarts"] == 1
    assert job["replicaTypes"] == [
        {"name": "worker", "restarts": 1, "restartTimes": ["2026-05-01T12:00:01.000000Z"]}
    ]
    assert [a["action"] for a in job["lastActions"]] == ["Restart", "LimitExceeded", "Ignore"]
    assert job["lastActions"][0]["pod"] == "training/resnet-worker-1"
    (condition,) = job["conditions"]
    assert condition["type"] == "RestartLimitExceeded"
    assert (condition["status"], condition["reason"]) == ("True", "LimitReached")
    assert read_job(status, "resnet") == decisions[-1].record
    assert read_job(status, "other") == JobRecord()


def test_status_clears_the_condition_and_collapses_repeated_backoffs() -> None:
    p = policy(restartLimit=1, restartTimeout=100, restartTimeLimit=600)
    status: dict[str, Any] = {}
    steps = [
        (exit_fault(129, 0), pod(1), 0),
        (exit_fault(129, 50), pod(1), 50),  # limit
        (exit_fault(129, 150), pod(1), 150),  # window passed; 2nd in a row: backoff
        (exit_fault(129, 150), pod(1), 155),
        (exit_fault(129, 150), pod(1), 160),  # restart
    ]
    record = JobRecord()
    for fault, who, now in steps:
        d = decide(fault=fault, pod=who, policy=p, record=record, now=at(now))
        record = d.record
        status = record_decision(status, d, now=at(now))
    (job,) = status["jobs"]
    assert [a["action"] for a in job["lastActions"]] == [
        "Restart",
        "LimitExceeded",
        "Backoff",
        "Restart",
    ]
    assert job["lastActions"][2]["time"] == "2026-05-01T12:02:35.000000Z"
    (condition,) = job["conditions"]
    assert (condition["status"], condition["reason"]) == ("False", "Restarted")
    assert condition["lastTransitionTime"] == "2026-05-01T12:02:40.000000Z"


def test_status_ignores_stale_faults_and_keeps_the_newest_actions() -> None:
    p = parse_policy({**SELECTING, "restartPolicy": "OnFailure"})
    status: dict[str, Any] = {}
    record = JobRecord()
    for i in range(LAST_ACTIONS + 5):
        d = decide(fault=exit_fault(0, i), pod=pod(i), policy=p, record=record, now=at(i))
        status = record_decision(status, d, now=at(i))
    (job,) = status["jobs"]
    assert len(job["lastActions"]) == LAST_ACTIONS
    assert job["lastActions"][-1]["slot"] == str(LAST_ACTIONS + 4)
    restart = decide(fault=exit_fault(1, 99), pod=pod(1), policy=p, record=record, now=at(99))
    after = record_decision(status, restart, now=at(99))
    stale = decide(fault=exit_fault(1, 99), pod=pod(1), policy=p, record=restart.record, now=at(99))
    assert stale.action is Action.STALE
    assert record_decision(after, stale, now=at(100)) == after


# --- properties ----------------------------------------------------------------------------------

KINDS = st.sampled_from(list(FaultKind))
RULES = st.fixed_dictionaries(
    {"restartPolicy": st.sampled_from(list(RestartPolicy))},
    optional={
        "restartScope": st.sampled_from(list(RestartScope)),
        "exitCodes": st.sampled_from([1, "1-127", "128-255", "0,137,143"]),
        "exceptionalEvent": st.sampled_from(
            ["nodeNotReady", "PodEvicted,deviceUnhealthy", "deviceDegraded"]
        ),
        "containerName": st.sampled_from(["trainer", "sidecar"]),
    },
)


def valid_rule(rule: dict[str, Any]) -> dict[str, Any]:
    policy_ = RestartPolicy(rule["restartPolicy"])
    if policy_.needs_exit_codes:
        rule.setdefault("exitCodes", 129)
    if policy_ in (RestartPolicy.ON_NODE_FAIL, RestartPolicy.GRACEFUL):
        rule.pop("exitCodes", None)
        rule.pop("containerName", None)
    if policy_ is RestartPolicy.GRACEFUL and rule.get("exceptionalEvent") != "deviceDegraded":
        rule.pop("exceptionalEvent", None)
    if policy_ in (RestartPolicy.EXIT_CODE, RestartPolicy.ON_FAILURE):
        rule.pop("exceptionalEvent", None)
    return rule


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    rules = [valid_rule(r) for r in draw(st.lists(RULES, min_size=1, max_size=4))]
    return parse_policy(
        {**SELECTING, "faultTolerantPolicy": rules}
        | {
            "restartLimit": draw(st.integers(0, 4)),
            "restartTimeLimit": draw(st.integers(0, 120)),
            "backoff": draw(
                st.sampled_from([{"initialSeconds": 0}, {"initialSeconds": 5, "maxSeconds": 40}])
            ),
        }
        | draw(st.sampled_from([{}, {"restartTimeout": 50}, {"restartTimeout": 500}]))
    )


@st.composite
def faults(draw: st.DrawFn) -> tuple[Fault, PodIdentity, float]:
    """A fault, its pod and how long after its observation it is decided (agent clocks skew)."""
    kind = draw(KINDS)
    t = draw(st.integers(0, 1000))
    who = pod(draw(st.integers(0, 3)), draw(st.sampled_from(["worker", "master"])))
    if kind is FaultKind.CONTAINER_EXIT:
        code = draw(st.none() | st.sampled_from([0, 1, 2, 129, 137, 200]))
        fault = exit_fault(code, t, container=draw(st.sampled_from(["trainer", "sidecar"])))
    else:
        fault = event_fault(kind, t)
    return fault, who, draw(st.integers(-2, 30))


@given(policies(), st.lists(faults(), max_size=25))
@settings(max_examples=300)
def test_property_restarts_never_exceed_the_limit_in_any_window(
    p: Policy, steps: list[tuple[Fault, PodIdentity, float]]
) -> None:
    record, clock = JobRecord(), T0
    restarted: dict[str, list[datetime]] = defaultdict(list)
    for fault, who, lag in sorted(steps, key=lambda s: s[0].observed_at):
        clock = max(clock, fault.observed_at + timedelta(seconds=lag))
        d = decide(fault=fault, pod=who, policy=p, record=record, now=clock)
        if d.action is Action.BACKOFF:
            assert d.until is not None
            assert d.until > clock
            clock = d.until
            # Looked at again as decided (a time ahead of the clock was taken as the clock's).
            d = decide(fault=d.fault, pod=who, policy=p, record=record, now=clock)
            assert d.action is not Action.BACKOFF
        if d.action is Action.RESTART:
            restarted[who.replica_type].append(clock)  # recorded at now, never later
            again = decide(fault=fault, pod=who, policy=p, record=d.record, now=clock)
            assert again.action is Action.STALE  # acted on once
        else:
            assert d.record == record
        record = d.record
    for times in restarted.values():
        window = timedelta(seconds=p.restart_timeout or 10**9)
        for start in times:
            inside = [t for t in times if start <= t < start + window]
            assert len(inside) <= p.restart_limit
    assert record.restarts == sum(len(t) for t in restarted.values())


@given(policies(), faults(), st.booleans())
def test_property_never_never_restarts(
    p: Policy, step: tuple[Fault, PodIdentity, float], as_gate: bool
) -> None:
    fault, who, _ = step
    if as_gate:
        p = dataclasses.replace(p, gate=RestartPolicy.NEVER)
    else:
        p = dataclasses.replace(p, rules=(Rule(RestartPolicy.NEVER), *p.rules))
    d = run(p, fault, who)
    assert (d.action, d.rule) == (Action.NEVER, None if as_gate else 0)


@given(policies(), faults(), st.lists(RULES, max_size=3))
def test_property_the_first_matching_rule_wins(
    p: Policy, step: tuple[Fault, PodIdentity, float], more: list[dict[str, Any]]
) -> None:
    fault, who, _ = step
    d = run(p, fault, who)
    matching = [i for i, rule in enumerate(p.rules) if rule.matches(fault)]
    if d.rule is not None:
        assert d.rule == matching[0]
    elif d.action is Action.IGNORE:
        assert not matching
    extra = [valid_rule(r) for r in more]
    rules = parse_policy({**SELECTING, "faultTolerantPolicy": extra}).rules if extra else ()
    extended = dataclasses.replace(p, rules=p.rules + rules)
    if matching:  # rules after the first match change nothing
        assert run(extended, fault, who) == d


def test_fence_defaults_to_force_and_names_a_bad_value() -> None:
    assert policy().fence is Fence.FORCE
    assert policy(fence="Wait").fence is Fence.WAIT
    with pytest.raises(SchemaError, match=r"spec\.fence"):
        policy(fence="Later")


def _big_status(jobs: int, template_bytes: tuple[int, ...]) -> dict[str, Any]:
    """A status of `jobs` jobs with full last actions; job 0 has a pending restart for each
    size in `template_bytes`, each pod with a template of about that many bytes."""
    action = {"time": "2026-05-01T12:00:00.000000Z", "action": "Restart", "reason": "r" * 300}
    entries: list[dict[str, Any]] = [
        {"name": f"job-{j}", "restarts": 1, "lastActions": [dict(action)] * LAST_ACTIONS}
        for j in range(jobs)
    ]
    entries[0]["pendingRestarts"] = [
        {
            "faultId": f"f{n}",
            "pods": [{"name": f"p{n}", "uid": f"u{n}", "template": {"spec": {"x": "t" * size}}}],
        }
        for n, size in enumerate(template_bytes)
    ]
    return {"restarts": jobs, "jobs": entries}


def _size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")))


def test_a_status_within_its_budget_is_left_as_it_is() -> None:
    status = _big_status(3, (100,))
    before = copy.deepcopy(status)
    assert fit(status, budget=_size(status)) == []
    assert status == before


def test_past_its_budget_the_status_loses_last_actions_first_and_keeps_every_record() -> None:
    status = _big_status(200, (100, 100))
    records = [(j["name"], j["restarts"], j.get("pendingRestarts")) for j in status["jobs"]]
    budget = _size(status) // 2
    dropped = fit(status, budget=budget)
    assert _size(status) <= budget
    assert dropped == [f"{200 * (LAST_ACTIONS - 1)} last actions"]
    assert all(len(j["lastActions"]) == 1 for j in status["jobs"])
    assert [(j["name"], j["restarts"], j.get("pendingRestarts")) for j in status["jobs"]] == records


def test_then_pod_templates_go_largest_first() -> None:
    status = _big_status(2, (5_000, 200_000, 1_000))
    dropped = fit(status, budget=20_000)
    assert _size(status) <= 20_000
    assert dropped[-1] == "the pod template of p1"
    pods = [p for r in status["jobs"][0]["pendingRestarts"] for p in r["pods"]]
    assert ["template" in p for p in pods] == [True, False, True]
    assert [p["uid"] for p in pods] == ["u0", "u1", "u2"]  # the restart records stay
