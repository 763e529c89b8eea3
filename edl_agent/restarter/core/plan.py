"""Decisions for a batch of faults covered by one policy, and what recording them takes. Pure.

The controller hands a policy's waiting faults here together, with the policy object as last
read: each is decided against the status as the ones before it left it, and the whole batch is
recorded with one status write. What comes back says what to write, which pods to replace
once the write succeeded (the Restarts, recorded as pendingRestarts), and which faults to look
at again later (the Backoffs, recorded as pendingBackoffs). Pending restarts whose pods are all
gone are dropped in the same write, so finishing a restart costs no write of its own.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from edl_agent.faults.in_place import restarts_in_place
from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.faults.pod_faults import exit_counting_owner, pod_created, pod_ref
from edl_agent.restarter.core.decide import Action, Decision, decide, describe
from edl_agent.restarter.core.policy import Mode, Policy, RestartScope
from edl_agent.restarter.core.spec import parse_policy
from edl_agent.restarter.core.status import (
    PendingRestart,
    apply_decision,
    drop_pending,
    find_job,
    fit,
    pending_restarts,
    read_job,
    update_totals,
)
from edl_agent.typed import SchemaError

Pod = Mapping[str, Any]
# Decisions that change nothing but the record: one seen again (a re-list after a restart) is
# not recorded twice.
_ONCE = frozenset({Action.IN_PLACE, Action.OWNER_DECIDES})


@dataclass(frozen=True)
class Task:
    """One pod of a fault, to decide about under the policy `policy` (its name)."""

    fault: Fault
    pod: Pod
    ref: PodRef
    policy: str


@dataclass
class Plan:
    status: dict[str, Any] | None = None
    """The status to write (with the resourceVersion read); None: nothing to record."""
    decisions: list[tuple[Task, Decision]] = field(default_factory=list)
    restarts: list[PendingRestart] = field(default_factory=list)
    """The Restarts recorded, with the pods each replaces."""
    backoffs: list[tuple[Fault, datetime]] = field(default_factory=list)
    finished: int = 0
    """Pending restarts of earlier runs dropped as done."""
    dropped: list[str] = field(default_factory=list)
    """What `status.fit` left out of the status to keep it within its budget."""
    dry_run: bool = False
    """The policy's mode is DryRun: the decisions are only to be told (nothing to write)."""


def plan(
    obj: Mapping[str, Any],
    tasks: Sequence[Task],
    *,
    members: Callable[[Policy, Decision, Pod], list[Pod]],
    replaced: Callable[[PodRef], bool],
    now: datetime,
    gone: Callable[[PodRef], Mapping[str, Any] | None] = lambda _ref: None,
) -> Plan:
    """Decide `tasks` in order against the policy object `obj`.

    `members(policy, decision, pod)`: the other live pods a Restart of `decision.scope` around
    `pod` replaces. `replaced(ref)`: whether that pod is gone or replaced (its pending restart,
    if any, is done). `gone(ref)`: the `status.pod_template` of a pod the API no longer has,
    recorded with the decision so that whoever carries it out can make its replacement."""
    result = Plan()
    try:
        policy = parse_policy(obj.get("spec"))
    except (SchemaError, ValueError):
        return result  # the policy watch marks it SpecValid=False; it covers nothing
    status: dict[str, Any] = copy.deepcopy(dict(obj.get("status") or {}))
    changed = False
    for task in tasks:
        labels = (task.pod.get("metadata") or {}).get("labels") or {}
        identity = policy.identify(task.ref, labels)
        if identity is None:
            continue  # the policy no longer covers the pod
        fault = task.fault
        in_place = (
            fault.kind is FaultKind.CONTAINER_EXIT
            and fault.container is not None
            and restarts_in_place(task.pod, fault.container, fault.exit_code or 0)
        )
        decision = decide(
            fault=fault,
            pod=identity,
            policy=policy,
            record=read_job(status, identity.job),
            now=now,
            in_place=in_place,
            created=pod_created(task.pod),
            exit_owner=exit_counting_owner(task.pod),
        )
        if decision.action is Action.RESTART and _recorded(
            status,
            identity.job,
            fault.id,
            action=str(Action.RESTART),
            replicaType=identity.replica_type,
            slot=identity.slot,
        ):
            # The same fault again after its restart was recorded (an agent resending what a
            # killed leader recorded but never acknowledged): its time may have moved with it
            # (dated on receipt), so its id says it was acted on.
            decision = Decision(
                Action.STALE,
                f"{describe(fault)} restarted {identity} already",
                fault,
                identity,
                read_job(status, identity.job),
            )
        result.decisions.append((task, decision))
        targets: list[Pod] = []
        if decision.action is Action.RESTART:
            targets = [task.pod]
            if decision.scope is not RestartScope.POD:
                targets += members(policy, decision, task.pod)
        if decision.action in _ONCE and _recorded(status, identity.job, fault.id):
            continue  # seen again (a re-list after a restart): nothing new to record
        refs = [pod_ref(t) for t in targets]
        # A Backoff keeps its own pod's template; a Restart those of the pods it replaces.
        kept = [task.ref] if decision.action is Action.BACKOFF else refs
        templates = {r.uid: t for r in kept if (t := gone(r)) is not None}
        graceful = decision.rule is not None and policy.rules[decision.rule].graceful
        changed = (
            apply_decision(
                status,
                decision,
                now=now,
                targets=refs,
                templates=templates,
                fence=policy.fence,
                graceful=graceful,
            )
            or changed
        )
        if decision.action is Action.RESTART:
            pending = PendingRestart(
                job=identity.job,
                fault_id=fault.id,
                fault=fault.kind,
                node=fault.node,
                at=now,
                pods=tuple(refs),
                templates=templates,
                fence=policy.fence,
                graceful=graceful,
            )
            result.restarts.append(pending)
        elif decision.action is Action.BACKOFF and decision.until is not None:
            # As decided: a time from a clock ahead, taken as now, stays what it was taken as.
            result.backoffs.append((decision.fault, decision.until))
    if policy.mode is Mode.DRY_RUN:
        return Plan(decisions=result.decisions, dry_run=True)  # told, never written or done
    just_recorded = {(p.job, p.fault_id) for p in result.restarts}
    done = [
        (pending.job, pending.fault_id)
        for pending in pending_restarts({"metadata": obj.get("metadata"), "status": status})
        if (pending.job, pending.fault_id) not in just_recorded
        and all(replaced(p) for p in pending.pods)
    ]
    if done:
        drop_pending(status, done)
        result.finished = len(done)
    if changed or result.finished:
        update_totals(status)
        result.dropped = fit(status)
        result.status = status
    return result


def tidy(obj: Mapping[str, Any], *, replaced: Callable[[PodRef], bool]) -> dict[str, Any] | None:
    """The status without the pending restarts whose pods are all gone; None: none are."""
    done = plan(obj, (), members=lambda *_: [], replaced=replaced, now=datetime.min)
    return done.status


def _recorded(status: Mapping[str, Any], job: str, fault_id: str, **fields: str) -> bool:
    """Whether the job's last actions hold a decision about `fault_id` already (one whose
    entry also has `fields`, e.g. `action="Restart", slot="3"`, when given)."""
    entry = find_job(status, job) or {}
    return any(
        a.get("faultId") == fault_id and all(a.get(k) == v for k, v in fields.items())
        for a in entry.get("lastActions") or []
    )
