"""The restart decision: fault + pod + policy + the job's record + now → action and reason.

A purely computational function (semantics in `policy`). The steps, in order: a stale fault
is dropped; the spec's gate; the first matching rule (none: Ignore; Never: Never); an exit
kubelet restarts in place (InPlace: the restarter does not replace the pod for it as well);
the limit; the backoff; else Restart, with the record to persist. Persist `Decision.record`
(with the policy's resourceVersion as precondition), and the pods to replace with it, before
replacing them: a restarter that dies between the two finishes the replacement when it starts
again, and the retried fault is stale.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from datetime import datetime, timedelta

from edl_agent.faults.bounds import named_ids
from edl_agent.faults.model import Fault, FaultKind
from edl_agent.restarter.core.policy import (
    EVENT_OF_KIND,
    PodIdentity,
    Policy,
    RestartPolicy,
    RestartScope,
)
from edl_agent.restarter.core.record import JobRecord


class Action(enum.StrEnum):
    RESTART = "Restart"  # replace the pods of `scope` now
    BACKOFF = "Backoff"  # a restart, but not before `until`: decide again then
    LIMIT_EXCEEDED = "LimitExceeded"  # a rule says restart, restartLimit says no
    NEVER = "Never"  # a Never rule or the spec's gate declines
    IGNORE = "Ignore"  # no rule matches
    STALE = "Stale"  # an earlier restart already replaced the pod
    IN_PLACE = "InPlace"  # a rule says restart, and kubelet restarts the container in place
    OWNER_DECIDES = "OwnerDecides"  # a rule says restart, but the pod's Job counts its exits


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    fault: Fault
    pod: PodIdentity
    record: JobRecord
    """The job's record after this decision (changed only by Restart)."""
    rule: int | None = None
    """Index in `Policy.rules` of the rule that decided; None for Stale, Ignore and the gate."""
    scope: RestartScope | None = None
    until: datetime | None = None
    """Backoff: when the restart may happen."""


def decide(  # noqa: PLR0911 - one return per step of the ladder
    *,
    fault: Fault,
    pod: PodIdentity,
    policy: Policy,
    record: JobRecord,
    now: datetime,
    in_place: bool = False,
    created: datetime | None = None,
    exit_owner: str | None = None,
) -> Decision:
    """What to do about `fault` for `pod` (one of the fault's pods, covered by `policy`).
    `in_place`: kubelet restarts the exited container itself (`faults.in_place`). `created`:
    the pod's creationTimestamp; a pod made in or after the second of its slot's last restart
    is that restart's replacement, and nothing about it is stale by that restart (exit times
    have whole seconds, so its fast crash would otherwise look older than the restart).
    `exit_owner`: the controller that counts the pod's exits itself (a Job): an exit is its to
    decide, never a restart of ours."""
    if fault.observed_at > now:  # a clock ahead of ours: its record must not be in the future
        fault = dataclasses.replace(fault, observed_at=now)
    what = describe(fault)

    def decision(
        action: Action,
        reason: str,
        *,
        rule: int | None = None,
        scope: RestartScope | None = None,
        until: datetime | None = None,
    ) -> Decision:
        return Decision(action, reason, fault, pod, record, rule=rule, scope=scope, until=until)

    last = record.covering(pod)
    if last is not None and fault.observed_at <= last.at and not _born_after(created, last.at):
        return decision(
            Action.STALE,
            f"{what} was observed before the {last.scope} restart at {last.at.isoformat()} "
            f"that replaced {pod}",
        )
    if record.forgotten_until is not None and fault.observed_at <= record.forgotten_until:
        return decision(Action.STALE, f"{what} is older than the job's record")
    gate = policy.gate
    if gate is not None and not _gate_admits(gate, fault):
        return decision(Action.NEVER, f"spec.restartPolicy {gate} does not restart {what}")
    index = next((i for i, rule in enumerate(policy.rules) if rule.matches(fault)), None)
    if index is None:
        return decision(Action.IGNORE, f"{what} matches no rule")
    rule = policy.rules[index]
    matched = f"{policy.rule_name(index)} matches {what}"
    if rule.restart_policy is RestartPolicy.NEVER:
        return decision(Action.NEVER, matched, rule=index)
    scope = rule.restart_scope
    if in_place:
        return decision(
            Action.IN_PLACE,
            f"{matched}, but kubelet restarts the container in place (the pod's or the "
            "container's restart policy); the pod is not replaced for it",
            rule=index,
            scope=scope,
        )
    if exit_owner is not None and fault.kind is FaultKind.CONTAINER_EXIT:
        return decision(
            Action.OWNER_DECIDES,
            f"{matched}, but {exit_owner} owns the pod and has counted this exit itself (its "
            "backoffLimit and podFailurePolicy decide); the pod is neither restarted nor deleted",
            rule=index,
            scope=scope,
        )
    counting = record.counting(pod.replica_type, policy=policy, now=now)
    if counting >= policy.restart_limit:
        window = f" in {policy.restart_timeout}s" if policy.restart_timeout is not None else ""
        return decision(
            Action.LIMIT_EXCEEDED,
            f"{matched}, but {_type(pod)} has had {counting} restarts{window}, "
            f"restartLimit is {policy.restart_limit}",
            rule=index,
            scope=scope,
        )
    in_a_row = 0
    if last is not None and fault.observed_at - last.at < timedelta(
        seconds=policy.restart_time_limit
    ):
        in_a_row = last.consecutive
    delay = policy.backoff.delay_seconds(in_a_row)
    until = fault.observed_at + timedelta(seconds=delay)
    if delay > 0 and now < until:
        return decision(
            Action.BACKOFF,
            f"{matched}: restart {in_a_row + 1} in a row of {pod} waits until {until.isoformat()}",
            rule=index,
            scope=scope,
            until=until,
        )
    updated = record.with_restart(
        pod, scope=scope, at=now, consecutive=in_a_row + 1, policy=policy, now=now
    )
    return Decision(
        Action.RESTART,
        f"{matched}: restart {_target(scope, pod)} "
        f"({counting + 1} of {policy.restart_limit} for {_type(pod)})",
        fault,
        pod,
        updated,
        rule=index,
        scope=scope,
    )


def describe(fault: Fault) -> str:
    """The fault in a few words: `exit with code 137 of container trainer`, `nodeNotReady on n1`."""
    event = EVENT_OF_KIND.get(fault.kind)
    if event is not None:
        devices = f" ({_some(fault.device_ids)})" if fault.device_ids else ""
        return f"{event}{devices} on {fault.node}"
    code = "an unknown code" if fault.exit_code is None else f"code {fault.exit_code}"
    container = f" of container {fault.container}" if fault.container else ""
    return f"exit with {code}{container}"


def _some(ids: tuple[str, ...], shown: int = 4) -> str:
    """The first `shown` ids, and how many more the fault named (a reason goes into Events and
    the status)."""
    named = named_ids(ids)
    if named <= shown:
        return ", ".join(ids)
    return f"{', '.join(ids[:shown])}, +{named - shown} more"


def _born_after(created: datetime | None, restart: datetime) -> bool:
    return created is not None and created >= restart.replace(microsecond=0)


def _gate_admits(gate: RestartPolicy, fault: Fault) -> bool:
    if fault.kind in EVENT_OF_KIND:
        return gate.restarts_events
    return gate.restarts_exits


def _type(pod: PodIdentity) -> str:
    return f"replica type {pod.replica_type!r} of job {pod.job}"


def _target(scope: RestartScope, pod: PodIdentity) -> str:
    match scope:
        case RestartScope.POD:
            return f"pod {pod}"
        case RestartScope.REPLICA:
            return f"replica type {pod.replica_type!r} of job {pod.job}"
        case RestartScope.ALL:
            return f"job {pod.job}"
