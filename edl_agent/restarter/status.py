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

Times are RFC 3339 in UTC with microseconds: a stale-fault check compares them with fault
times, and whole seconds would make a fault look newer than the restart it caused.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from edl_agent.faults.model import FaultKind, PodRef
from edl_agent.kube_time import format_micro_time
from edl_agent.kube_time import parse_time as parse_api_time
from edl_agent.restarter.decide import Action, Decision
from edl_agent.restarter.policy import RestartScope
from edl_agent.restarter.record import JobRecord, LastRestart, ReplicaCount

LAST_ACTIONS = 10
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
    entry = _find(status, job)
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
class PendingRestart:
    """A Restart decided and recorded whose pods may not all be replaced yet."""

    job: str
    fault_id: str
    fault: FaultKind
    node: str
    at: datetime
    pods: tuple[PodRef, ...]


def record_decision(
    status: Mapping[str, Any] | None,
    decision: Decision,
    *,
    now: datetime,
    targets: Sequence[PodRef] = (),
) -> dict[str, Any]:
    """The status after `decision` (a Stale one changes nothing). A Restart's `targets`, the
    pods it replaces, are kept in pendingRestarts until `finish_restart`."""
    new: dict[str, Any] = copy.deepcopy(dict(status or {}))
    if decision.action is Action.STALE:
        return new
    jobs: list[dict[str, Any]] = new.setdefault("jobs", [])
    entry = _find(new, decision.pod.job)
    if entry is None:
        entry = {"name": decision.pod.job}
        jobs.append(entry)
    entry.update(_job_fields(decision.record))
    entry.pop("forgottenUntil", None)
    if decision.record.forgotten_until is not None:
        entry["forgottenUntil"] = format_micro_time(decision.record.forgotten_until)
    entry["lastActions"] = _actions(entry.get("lastActions", []), decision, now)
    _set_condition(entry, decision, now)
    if decision.action is Action.RESTART and targets:
        entry.setdefault("pendingRestarts", []).append(
            {
                "faultId": decision.fault.id,
                "fault": str(decision.fault.kind),
                "node": decision.fault.node,
                "time": format_micro_time(now),
                "pods": [{"name": t.name, "uid": t.uid} for t in targets],
            }
        )
    new["restarts"] = sum(int(j.get("restarts", 0)) for j in jobs)
    times = [j["lastRestartTime"] for j in jobs if j.get("lastRestartTime")]
    if times:
        new["lastRestartTime"] = format_micro_time(max(parse_time(t) for t in times))
    return new


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
                )
            )
    return sorted(found, key=lambda p: p.at)


def finish_restart(
    status: Mapping[str, Any] | None, job: str, fault_ids: Iterable[str]
) -> dict[str, Any]:
    """The status without the pending restarts of `job` for `fault_ids`."""
    new: dict[str, Any] = copy.deepcopy(dict(status or {}))
    entry = _find(new, job)
    done = set(fault_ids)
    if entry is not None and entry.get("pendingRestarts"):
        left = [p for p in entry["pendingRestarts"] if p.get("faultId") not in done]
        if left:
            entry["pendingRestarts"] = left
        else:
            del entry["pendingRestarts"]
    return new


def forget_job(status: Mapping[str, Any] | None, job: str) -> dict[str, Any]:
    """The status without `job` (gone from the cluster); the totals stay."""
    new: dict[str, Any] = copy.deepcopy(dict(status or {}))
    new["jobs"] = [j for j in new.get("jobs", []) if j.get("name") != job]
    return new


def _find(status: Mapping[str, Any] | None, job: str) -> Any:
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
