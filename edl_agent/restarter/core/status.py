"""The policy's status: per job its restart counts, what `record` remembers, the latest
decisions and conditions. Pure functions from the old status (as the API returned it) to the
new one; the caller writes it through the status subresource.

    status:
      restarts: 7                       # all jobs, ever
      lastRestartTime: ...
      jobs:
      - name: resnet
        restarts: 7
        lastRestartTime: ...
        replicaTypes: [{name: worker, restarts: 7, restartTimes: [...]}]
        lastRestarts: [{scope: Pod, replicaType: worker, slot: "3", time: ..., consecutive: 2}]
        forgottenUntil: ...             # only once a last restart was forgotten
        lastActions: [{time, action, reason, faultId, fault, pod, replicaType, slot, rule,
                       scope, until}]   # newest last, at most LAST_ACTIONS
        conditions: [{type: RestartLimitExceeded, status: "True", reason, message,
                      lastTransitionTime}]
        pendingRestarts: [{faultId, fault, node, time, pods: [{name, uid}]}]
                                        # written with the Restart decision, removed once its
                                        # pods are replaced: a restarter that dies in between
                                        # finishes the replacement when it starts again
        pendingBackoffs: [{faultId, fault, node, observedAt, pod: {name, uid}, container,
                           exitCode, reason, deviceIds, source, until}]
                                        # a Backoff with the fault it waits to restart for:
                                        # whichever replica leads at `until` decides it again

Times are RFC 3339 in UTC with microseconds: a stale-fault check compares them with fault
times, and whole seconds would make a fault look newer than the restart it caused.

The status is kept within `STATUS_BUDGET` bytes (`fit`): what arrives with a fault is bounded at
the intake already, and past the budget what decisions do not depend on goes first (last
actions, then the pod templates that the restarter also holds in memory), so that a status
write is never refused as too large and holds up every other decision of the policy.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.kube_time import format_micro_time
from edl_agent.kube_time import parse_time as parse_api_time
from edl_agent.restarter.core.decide import Action, Decision
from edl_agent.restarter.core.policy import Fence, RestartScope
from edl_agent.restarter.core.record import JobRecord, LastRestart, ReplicaCount

LAST_ACTIONS = 10
# etcd keeps objects up to 1.5 MiB by default, and the API server refuses requests over 3 MiB:
# the status stays well below, whatever the spec beside it holds.
STATUS_BUDGET = 512 * 1024
LIMIT_EXCEEDED = "RestartLimitExceeded"
_ZONED = re.compile(r"(Z|[+-]\d\d:\d\d)$")


def parse_time(text: str) -> datetime:
    """A time in our own status records (always written with a zone); ValueError otherwise."""
    moment = parse_api_time(text) if _ZONED.search(text) else None
    if moment is None:
        msg = f"time {text!r} is not an RFC 3339 time with a zone"
        raise ValueError(msg)
    return moment


def read_job(status: Mapping[str, Any] | None, job: str) -> JobRecord:
    """The record of `job` kept in `status` (empty when the job has none yet)."""
    entry = find_job(status, job)
    if entry is None:
        return JobRecord()
    replicas = {
        str(r["name"]): ReplicaCount(
            int(r.get("restarts", 0)), tuple(parse_time(t) for t in r.get("restartTimes", ()))
        )
        for r in entry.get("replicaTypes", ())
    }
    lasts = tuple(
        LastRestart(
            RestartScope(last["scope"]),
            parse_time(last["time"]),
            replica_type=str(last.get("replicaType", "")),
            slot=str(last.get("slot", "")),
            consecutive=int(last.get("consecutive", 1)),
        )
        for last in entry.get("lastRestarts", ())
    )
    forgotten = entry.get("forgottenUntil")
    return JobRecord(replicas, lasts, parse_time(forgotten) if forgotten else None)


@dataclass(frozen=True)
class PendingBackoff:
    """A Backoff recorded in the status: decide `fault` (about one pod) again at `until`."""

    job: str
    fault: Fault
    until: datetime
    template: Mapping[str, Any] | None = None
    """The pod as it was, when it was gone already at the decision (see `pod_template`)."""


@dataclass(frozen=True)
class PendingRestart:
    """A Restart decided and recorded whose pods may not all be replaced yet."""

    job: str
    fault_id: str
    fault: FaultKind
    node: str
    at: datetime
    pods: tuple[PodRef, ...]
    templates: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """uid → the pod as it was, for pods gone already at the decision (see `pod_template`)."""
    fence: Fence = Fence.FORCE
    """The policy's `fence` when it was decided: whether a pod on a NotReady node waits."""
    graceful: bool = False
    """Decided by a Graceful rule: each pod is evicted with its own grace, never deleted."""


def pod_template(pod: Mapping[str, Any]) -> dict[str, Any]:
    """What a replacement is made of, kept in the status for a pod the API no longer has (it
    was force-deleted or evicted): without it a restarter that starts later could not replace
    it. Names, labels, annotations, the controller flag of its owners, and its spec."""
    meta = pod.get("metadata") or {}
    kept = {k: meta[k] for k in ("name", "namespace", "uid", "labels", "annotations") if k in meta}
    if meta.get("ownerReferences"):
        kept["ownerReferences"] = meta["ownerReferences"]
    return {"metadata": kept, "spec": dict(pod.get("spec") or {})}


def record_decision(
    status: Mapping[str, Any] | None,
    decision: Decision,
    *,
    now: datetime,
    targets: Sequence[PodRef] = (),
    templates: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The status after `decision` (a Stale one changes nothing but a backoff it ends). A
    Restart's `targets`, the pods it replaces, are kept in pendingRestarts until
    `finish_restart`."""
    new: dict[str, Any] = copy.deepcopy(dict(status or {}))
    apply_decision(new, decision, now=now, targets=targets, templates=templates)
    update_totals(new)
    return new


def apply_decision(
    new: dict[str, Any],
    decision: Decision,
    *,
    now: datetime,
    targets: Sequence[PodRef] = (),
    templates: Mapping[str, Mapping[str, Any]] | None = None,
    fence: Fence = Fence.FORCE,
    graceful: bool = False,
) -> bool:
    """`record_decision` in place, without the totals (`update_totals` once for a batch).
    `templates`: uid → `pod_template` of the pods the API no longer has. Whether it changed
    anything (a Stale decision only ends a backoff of its fault, if there is one)."""
    templates = templates or {}
    if decision.action is Action.STALE:
        found = find_job(new, decision.pod.job)
        return found is not None and _drop_backoff(found, decision.fault.id)
    jobs: list[dict[str, Any]] = new.setdefault("jobs", [])
    entry = find_job(new, decision.pod.job)
    if entry is None:
        entry = {"name": decision.pod.job}
        jobs.append(entry)
    entry.update(_job_fields(decision.record))
    entry.pop("forgottenUntil", None)
    if decision.record.forgotten_until is not None:
        entry["forgottenUntil"] = format_micro_time(decision.record.forgotten_until)
    entry["lastActions"] = _actions(entry.get("lastActions", []), decision, now)
    _set_condition(entry, decision, now)
    _drop_backoff(entry, decision.fault.id)
    if decision.action is Action.BACKOFF and decision.until is not None:
        backoff = _backoff_entry(decision.fault, decision.pod.pod, decision.until)
        pod = decision.pod.pod
        if pod is not None and pod.uid in templates:
            backoff["template"] = dict(templates[pod.uid])
        entry.setdefault("pendingBackoffs", []).append(backoff)
    if decision.action is Action.RESTART and targets:
        pending: dict[str, Any] = {
            "faultId": decision.fault.id,
            "fault": str(decision.fault.kind),
            "node": decision.fault.node,
            "time": format_micro_time(now),
            "pods": [_pending_pod(t, templates) for t in targets],
        }
        if fence is Fence.WAIT:
            pending["fence"] = str(fence)
        if graceful:
            pending["graceful"] = True
        entry.setdefault("pendingRestarts", []).append(pending)
    return True


def _pending_pod(ref: PodRef, templates: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": ref.name, "uid": ref.uid}
    if ref.uid in templates:
        entry["template"] = dict(templates[ref.uid])
    return entry


def update_totals(new: dict[str, Any]) -> None:
    """The policy-wide restart count and last restart time, from its jobs."""
    jobs = new.get("jobs") or []
    new["restarts"] = sum(int(j.get("restarts", 0)) for j in jobs)
    times = [j["lastRestartTime"] for j in jobs if j.get("lastRestartTime")]
    if times:
        new["lastRestartTime"] = format_micro_time(max(parse_time(t) for t in times))


def pending_restarts(obj: Mapping[str, Any]) -> list[PendingRestart]:
    """The pending restarts in a policy (as the API returned it), oldest first."""
    namespace = str((obj.get("metadata") or {}).get("namespace", ""))
    found = []
    for job in (obj.get("status") or {}).get("jobs") or []:
        for entry in job.get("pendingRestarts") or []:
            try:
                kind = FaultKind(entry.get("fault", ""))
                at = parse_time(str(entry.get("time", "")))
            except ValueError:
                continue
            found.append(
                PendingRestart(
                    job=str(job.get("name", "")),
                    fault_id=str(entry.get("faultId", "")),
                    fault=kind,
                    node=str(entry.get("node", "")),
                    at=at,
                    pods=tuple(
                        PodRef(namespace, str(p.get("name", "")), str(p.get("uid", "")))
                        for p in entry.get("pods") or []
                    ),
                    templates={
                        str(p.get("uid", "")): p["template"]
                        for p in entry.get("pods") or []
                        if isinstance(p.get("template"), Mapping)
                    },
                    fence=Fence.WAIT if entry.get("fence") == Fence.WAIT else Fence.FORCE,
                    graceful=entry.get("graceful") is True,
                )
            )
    return sorted(found, key=lambda p: p.at)


def pending_backoffs(obj: Mapping[str, Any]) -> list[PendingBackoff]:
    """The backoffs recorded in a policy (as the API returned it), soonest first; an entry that
    cannot be read is skipped (and stays until a decision about its fault replaces it)."""
    namespace = str((obj.get("metadata") or {}).get("namespace", ""))
    found = []
    for job in (obj.get("status") or {}).get("jobs") or []:
        for entry in job.get("pendingBackoffs") or []:
            try:
                pod = entry.get("pod") or {}
                ref = PodRef(namespace, str(pod.get("name", "")), str(pod.get("uid", "")))
                code = entry.get("exitCode")
                fault = Fault(
                    id=str(entry["faultId"]),
                    kind=FaultKind(entry.get("fault", "")),
                    node=str(entry.get("node", "")),
                    observed_at=parse_time(str(entry.get("observedAt", ""))),
                    pods=(ref,) if ref.name else (),
                    container=entry.get("container"),
                    exit_code=None if code is None else int(code),
                    reason=str(entry.get("reason", "")),
                    device_ids=tuple(str(d) for d in entry.get("deviceIds") or ()),
                    source=str(entry.get("source", "")),
                )
                until = parse_time(str(entry.get("until", "")))
            except (KeyError, TypeError, ValueError):
                continue
            template = entry.get("template")
            found.append(
                PendingBackoff(
                    str(job.get("name", "")),
                    fault,
                    until,
                    template if isinstance(template, Mapping) else None,
                )
            )
    return sorted(found, key=lambda p: p.until)


def _backoff_entry(fault: Fault, pod: PodRef | None, until: datetime) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "faultId": fault.id,
        "fault": str(fault.kind),
        "node": fault.node,
        "observedAt": format_micro_time(fault.observed_at),
        "until": format_micro_time(until),
        "source": fault.source,
    }
    if pod is not None:
        entry["pod"] = {"name": pod.name, "uid": pod.uid}
    if fault.container is not None:
        entry["container"] = fault.container
    if fault.exit_code is not None:
        entry["exitCode"] = fault.exit_code
    if fault.reason:
        entry["reason"] = fault.reason
    if fault.device_ids:
        entry["deviceIds"] = list(fault.device_ids)
    return entry


def _drop_backoff(entry: dict[str, Any], fault_id: str) -> bool:
    """Remove the backoff of `fault_id` from a job's entry; whether there was one."""
    backoffs = entry.get("pendingBackoffs") or []
    left = [b for b in backoffs if b.get("faultId") != fault_id]
    if left:
        entry["pendingBackoffs"] = left
    else:
        entry.pop("pendingBackoffs", None)
    return len(left) != len(backoffs)


def finish_restart(
    status: Mapping[str, Any] | None, job: str, fault_ids: Iterable[str]
) -> dict[str, Any]:
    """The status without the pending restarts of `job` for `fault_ids`."""
    new: dict[str, Any] = copy.deepcopy(dict(status or {}))
    entry = find_job(new, job)
    done = set(fault_ids)
    if entry is not None and entry.get("pendingRestarts"):
        left = [p for p in entry["pendingRestarts"] if p.get("faultId") not in done]
        if left:
            entry["pendingRestarts"] = left
        else:
            del entry["pendingRestarts"]
    return new


def drop_pending(status: dict[str, Any], done: Iterable[tuple[str, str]]) -> None:
    """Remove, in place, the pending restarts named by (job, faultId)."""
    wanted = set(done)
    for entry in status.get("jobs") or []:
        pending = entry.get("pendingRestarts")
        if not pending:
            continue
        job = entry.get("name")
        left = [p for p in pending if (job, p.get("faultId")) not in wanted]
        if left:
            entry["pendingRestarts"] = left
        else:
            del entry["pendingRestarts"]


def forget_job(status: Mapping[str, Any] | None, job: str) -> dict[str, Any]:
    """The status without `job` (gone from the cluster); the totals stay."""
    new: dict[str, Any] = copy.deepcopy(dict(status or {}))
    new["jobs"] = [j for j in new.get("jobs", []) if j.get("name") != job]
    return new


def find_job(status: Mapping[str, Any] | None, job: str) -> Any:
    """The entry of `job` in `status` (None when it has none)."""
    jobs = (status or {}).get("jobs") or []
    return next((j for j in jobs if j.get("name") == job), None)


def _job_fields(record: JobRecord) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "restarts": record.restarts,
        "replicaTypes": [
            {
                "name": name,
                "restarts": count.restarts,
                "restartTimes": [format_micro_time(t) for t in count.times],
            }
            for name, count in sorted(record.replicas.items())
        ],
        "lastRestarts": [
            {
                "scope": str(last.scope),
                "replicaType": last.replica_type,
                "slot": last.slot,
                "time": format_micro_time(last.at),
                "consecutive": last.consecutive,
            }
            for last in record.last_restarts
        ],
    }
    if record.last_restart_time is not None:
        fields["lastRestartTime"] = format_micro_time(record.last_restart_time)
    return fields


def _actions(old: list[dict[str, Any]], decision: Decision, now: datetime) -> list[dict[str, Any]]:
    pod = decision.pod.pod
    action: dict[str, Any] = {
        "time": format_micro_time(now),
        "action": str(decision.action),
        "reason": decision.reason,
        "faultId": decision.fault.id,
        "fault": str(decision.fault.kind),
        "pod": f"{pod.namespace}/{pod.name}" if pod is not None else "",
        "replicaType": decision.pod.replica_type,
        "slot": decision.pod.slot,
    }
    if decision.rule is not None:
        action["rule"] = decision.rule
    if decision.scope is not None:
        action["scope"] = str(decision.scope)
    if decision.until is not None:
        action["until"] = format_micro_time(decision.until)
    actions = list(old)
    same = ("faultId", "action", "replicaType", "slot")
    if actions and all(actions[-1].get(k) == action[k] for k in same):
        actions.pop()  # a Backoff decided again: one entry, the latest time
    actions.append(action)
    return actions[-LAST_ACTIONS:]


def _set_condition(entry: dict[str, Any], decision: Decision, now: datetime) -> None:
    if decision.action is Action.LIMIT_EXCEEDED:
        state, reason = "True", "LimitReached"
    elif decision.action is Action.RESTART:
        state, reason = "False", "Restarted"
    else:
        return
    conditions: list[dict[str, Any]] = entry.setdefault("conditions", [])
    old = next((c for c in conditions if c.get("type") == LIMIT_EXCEEDED), None)
    if old is None and state == "False":
        return
    condition = {
        "type": LIMIT_EXCEEDED,
        "status": state,
        "reason": reason,
        "message": decision.reason,
        "lastTransitionTime": format_micro_time(now),
    }
    if old is not None and old.get("status") == state:
        condition["lastTransitionTime"] = old.get(
            "lastTransitionTime", condition["lastTransitionTime"]
        )
    conditions[:] = [c for c in conditions if c.get("type") != LIMIT_EXCEEDED] + [condition]


def fit(status: dict[str, Any], budget: int = STATUS_BUDGET) -> list[str]:
    """Bring `status` within `budget` bytes of JSON, in place, by dropping what no decision
    depends on: first the last actions (all but each job's newest, then those too; they only
    spare recording an in-place or owner's decision seen again a second time), then pod
    templates of pending restarts and backoffs, largest first (the restarter holds them in
    memory as well; only a restarter that starts anew after this write lacks them, and it
    replaces such a pod once its owner or a later fault makes it again). What was dropped, in
    words (empty: it fitted)."""
    dropped: list[str] = []
    if _size(status) <= budget:
        return dropped
    jobs = status.get("jobs") or []
    for keep in (1, 0):
        cut = 0
        for job in jobs:
            actions = job.get("lastActions") or []
            if len(actions) > keep:
                cut += len(actions) - keep
                job["lastActions"] = actions[len(actions) - keep :]
        if cut:
            dropped.append(f"{cut} last actions")
        if _size(status) <= budget:
            return dropped
    holders = [
        holder
        for job in jobs
        for holder in [
            *(p for pending in job.get("pendingRestarts") or [] for p in pending.get("pods") or []),
            *(job.get("pendingBackoffs") or []),
        ]
        if "template" in holder
    ]
    holders.sort(key=lambda h: _size(h["template"]), reverse=True)
    over = _size(status) - budget
    for holder in holders:
        if over <= 0:
            break
        over -= _size(holder.pop("template"))
        dropped.append(
            f"the pod template of {holder.get('name') or holder.get('pod', {}).get('name')}"
        )
    return dropped


def _size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")))
