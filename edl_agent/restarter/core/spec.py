"""Read a FaultTolerancePolicy's spec into a `Policy`, with one-line errors naming the key.

The private classes below mirror the CRD's schema key for key (camelCase, as users write it),
so `typed.build` names wrong keys and types in the user's words; `parse_policy` then applies
the checks the schema cannot make (a backwards exit-code range) or that it makes only when
the API server validates (objects read from files or older servers) and the defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from edl_agent.restarter.core.policy import (
    DEFAULT_RESTART_LIMIT,
    DEFAULT_RESTART_TIME_LIMIT,
    GRACEFUL_EVENTS,
    Backoff,
    ExceptionalEvent,
    ExitCodes,
    Fence,
    Mode,
    Policy,
    RestartPolicy,
    RestartScope,
    Rule,
)
from edl_agent.restarter.core.selector import LabelSelector, Operator, Requirement
from edl_agent.typed import SchemaError, build

MAX_RESTART_LIMIT = 1000  # each counting restart is a timestamp in the status


@dataclass(frozen=True)
class _RequirementSpec:
    key: str
    operator: Operator
    values: tuple[str, ...] = ()


@dataclass(frozen=True)
class _SelectorSpec:
    matchLabels: dict[str, str] = field(default_factory=dict)
    matchExpressions: tuple[_RequirementSpec, ...] = ()


@dataclass(frozen=True)
class _RuleSpec:
    restartPolicy: RestartPolicy | None = None
    restartScope: RestartScope | None = None
    exitCodes: int | str | None = None
    containerName: str | None = None
    exceptionalEvent: str | tuple[str, ...] | None = None


@dataclass(frozen=True)
class _BackoffSpec:
    initialSeconds: int = 10
    maxSeconds: int = 300


@dataclass(frozen=True)
class _PolicySpec:
    selector: _SelectorSpec
    jobLabel: str
    replicaTypeLabel: str | None = None
    replicaIndexLabel: str | None = None
    restartPolicy: RestartPolicy | None = None
    restartScope: RestartScope | None = None
    restartLimit: int = DEFAULT_RESTART_LIMIT
    restartTimeLimit: int = DEFAULT_RESTART_TIME_LIMIT
    restartTimeout: int | None = None
    backoff: _BackoffSpec = field(default_factory=_BackoffSpec)
    faultTolerantPolicy: tuple[_RuleSpec, ...] = ()
    fence: Fence = Fence.FORCE
    mode: Mode = Mode.ACT


def parse_policy(spec: Any, where: str = "spec") -> Policy:
    """The Policy of a FaultTolerancePolicy's `spec`; SchemaError names the offending key."""
    raw = build(_PolicySpec, spec, where)
    _check_range(raw.restartLimit, 0, MAX_RESTART_LIMIT, f"{where}.restartLimit")
    _check_range(raw.restartTimeLimit, 0, None, f"{where}.restartTimeLimit")
    if raw.restartTimeout is not None:
        _check_range(raw.restartTimeout, 1, None, f"{where}.restartTimeout")
    backoff = _backoff(raw.backoff, f"{where}.backoff")
    selector = _selector(raw.selector, f"{where}.selector")
    default_scope = raw.restartScope or RestartScope.POD
    if raw.faultTolerantPolicy:
        rules = tuple(
            _rule(r, raw.restartPolicy, default_scope, f"{where}.faultTolerantPolicy[{i}]")
            for i, r in enumerate(raw.faultTolerantPolicy)
        )
        gate = raw.restartPolicy
    else:
        if raw.restartPolicy is None or raw.restartPolicy.needs_exit_codes:
            raise SchemaError(
                f"{where}.restartPolicy",
                "without faultTolerantPolicy rules, restartPolicy is the rule: "
                "one of Always, OnFailure, OnNodeFail, Graceful, Never",
            )
        rules = (Rule(raw.restartPolicy, default_scope),)
        gate = None
    return Policy(
        selector=selector,
        job_label=raw.jobLabel,
        rules=rules,
        rules_given=bool(raw.faultTolerantPolicy),
        replica_type_label=raw.replicaTypeLabel,
        replica_index_label=raw.replicaIndexLabel,
        gate=gate,
        restart_limit=raw.restartLimit,
        restart_time_limit=raw.restartTimeLimit,
        restart_timeout=raw.restartTimeout,
        backoff=backoff,
        fence=raw.fence,
        mode=raw.mode,
    )


def parse_events(value: str | tuple[str, ...] | list[str]) -> frozenset[ExceptionalEvent]:
    """`"nodeNotReady,PodForceDeleted"` or a list of names; ValueError names a bad one."""
    names = value.split(",") if isinstance(value, str) else list(value)
    events: set[ExceptionalEvent] = set()
    for name in (n.strip() for n in names):
        try:
            events.add(ExceptionalEvent(name))
        except ValueError:
            choices = ", ".join(ExceptionalEvent)
            raise ValueError(f"expected events among {choices}, got {name!r}") from None
    if not events:
        raise ValueError("names no event (omit it for the rule's default)")
    return frozenset(events)


def _rule(
    raw: _RuleSpec, inherited: RestartPolicy | None, default_scope: RestartScope, where: str
) -> Rule:
    policy = raw.restartPolicy or inherited
    if policy is None:
        raise SchemaError(
            f"{where}.restartPolicy", "required key is missing (spec.restartPolicy is not set)"
        )
    codes = None
    if raw.exitCodes is not None:
        try:
            codes = ExitCodes.parse(raw.exitCodes)
        except ValueError as exc:
            raise SchemaError(f"{where}.exitCodes", str(exc)) from None
    events = None
    if raw.exceptionalEvent is not None:
        try:
            events = parse_events(raw.exceptionalEvent)
        except ValueError as exc:
            raise SchemaError(f"{where}.exceptionalEvent", str(exc)) from None
    if codes is None and policy.needs_exit_codes:
        raise SchemaError(f"{where}.exitCodes", f"an {policy} rule needs exitCodes")
    _check_events_only(policy, codes, raw.containerName, where)
    graceful = policy is RestartPolicy.GRACEFUL
    if graceful and events is not None and not events <= GRACEFUL_EVENTS:
        raise SchemaError(
            f"{where}.exceptionalEvent",
            "a Graceful rule evicts a pod that still runs: deviceDegraded, deviceUnhealthy",
        )
    if events is not None and policy in (RestartPolicy.EXIT_CODE, RestartPolicy.ON_FAILURE):
        raise SchemaError(f"{where}.exceptionalEvent", f"an {policy} rule matches no events")
    if raw.containerName == "":
        raise SchemaError(f"{where}.containerName", "must not be empty")
    return Rule(policy, raw.restartScope or default_scope, codes, raw.containerName, events)


def _check_events_only(
    policy: RestartPolicy, codes: ExitCodes | None, container: str | None, where: str
) -> None:
    """OnNodeFail and Graceful rules match events only: no exit codes, no container."""
    why = {
        RestartPolicy.ON_NODE_FAIL: "an OnNodeFail rule matches no container exits; use "
        "OnNodeFailWithExitCode",
        RestartPolicy.GRACEFUL: "a Graceful rule matches no container exits",
    }.get(policy)
    if why is None:
        return
    for key, value in (("exitCodes", codes), ("containerName", container)):
        if value is not None:
            raise SchemaError(f"{where}.{key}", why)


def _selector(raw: _SelectorSpec, where: str) -> LabelSelector:
    requirements = []
    for i, r in enumerate(raw.matchExpressions):
        with_values = r.operator in (Operator.IN, Operator.NOT_IN)
        if with_values != bool(r.values):
            raise SchemaError(
                f"{where}.matchExpressions[{i}].values",
                "In and NotIn need values; Exists and DoesNotExist take none",
            )
        requirements.append(Requirement(r.key, r.operator, r.values))
    if not raw.matchLabels and not requirements:
        raise SchemaError(where, "an empty selector would cover every pod in the namespace")
    return LabelSelector(dict(raw.matchLabels), tuple(requirements))


def _backoff(raw: _BackoffSpec, where: str) -> Backoff:
    _check_range(raw.initialSeconds, 0, None, f"{where}.initialSeconds")
    _check_range(raw.maxSeconds, raw.initialSeconds, None, f"{where}.maxSeconds")
    return Backoff(raw.initialSeconds, raw.maxSeconds)


def _check_range(value: int, low: int, high: int | None, where: str) -> None:
    if value < low:
        raise SchemaError(where, f"must be at least {low}, got {value}")
    if high is not None and value > high:
        raise SchemaError(where, f"must be at most {high}, got {value}")


def policy_spec_keys() -> Mapping[str, tuple[str, ...]]:
    """The keys the parser reads at each level, for checking the CRD schema against them."""
    return {
        "spec": tuple(f.name for f in fields(_PolicySpec)),
        "selector": tuple(f.name for f in fields(_SelectorSpec)),
        "matchExpressions": tuple(f.name for f in fields(_RequirementSpec)),
        "faultTolerantPolicy": tuple(f.name for f in fields(_RuleSpec)),
        "backoff": tuple(f.name for f in fields(_BackoffSpec)),
    }
