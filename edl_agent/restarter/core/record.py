"""What the restarter remembers of a job between decisions: the restarts that count towards
restartLimit and the newest restart of each unit it restarted (for backoff and stale faults).

Pure and immutable; `status` stores it in the policy's status. Its size is bounded: at most
restartLimit times per replica type, and one last restart per unit, forgotten after
restartTimeLimit (or an hour, if longer) — `forgotten_until` keeps what forgetting would lose.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from edl_agent.restarter.core.policy import PodIdentity, Policy, RestartScope

MIN_RETENTION = timedelta(hours=1)


@dataclass(frozen=True)
class LastRestart:
    """The newest restart of one unit: the job (All), a replica type, or one slot (Pod)."""

    scope: RestartScope
    at: datetime
    replica_type: str = ""
    slot: str = ""
    consecutive: int = 1
    """Restarts in a row of this unit's slots, this one included (see restartTimeLimit)."""

    def covers(self, pod: PodIdentity) -> bool:
        match self.scope:
            case RestartScope.ALL:
                return True
            case RestartScope.REPLICA:
                return self.replica_type == pod.replica_type
            case RestartScope.POD:
                return (self.replica_type, self.slot) == (pod.replica_type, pod.slot)

    def contains(self, other: LastRestart) -> bool:
        """Whether this restart restarted every slot that `other` did."""
        match self.scope:
            case RestartScope.ALL:
                return True
            case RestartScope.REPLICA:
                return (
                    other.scope is not RestartScope.ALL and other.replica_type == self.replica_type
                )
            case RestartScope.POD:
                return other.scope is RestartScope.POD and (other.replica_type, other.slot) == (
                    self.replica_type,
                    self.slot,
                )


@dataclass(frozen=True)
class ReplicaCount:
    restarts: int = 0
    """Restarts charged to this replica type, ever."""
    times: tuple[datetime, ...] = ()
    """When its restarts that may still count towards restartLimit happened, oldest first."""


@dataclass(frozen=True)
class JobRecord:
    replicas: Mapping[str, ReplicaCount] = field(default_factory=dict)
    last_restarts: tuple[LastRestart, ...] = ()
    forgotten_until: datetime | None = None
    """The newest forgotten restart: faults observed up to then are stale."""

    @property
    def restarts(self) -> int:
        return sum(count.restarts for count in self.replicas.values())

    @property
    def last_restart_time(self) -> datetime | None:
        return max((last.at for last in self.last_restarts), default=None)

    def covering(self, pod: PodIdentity) -> LastRestart | None:
        """The newest restart that replaced this pod's slot."""
        covering = [last for last in self.last_restarts if last.covers(pod)]
        return max(covering, key=lambda last: last.at, default=None)

    def counting(self, replica_type: str, *, policy: Policy, now: datetime) -> int:
        """Restarts charged to `replica_type` that still count towards restartLimit at `now`."""
        times = self.replicas.get(replica_type, ReplicaCount()).times
        if policy.restart_timeout is None:
            return len(times)
        start = now - timedelta(seconds=policy.restart_timeout)
        return sum(1 for t in times if t > start)

    def with_restart(
        self,
        pod: PodIdentity,
        *,
        scope: RestartScope,
        at: datetime,
        consecutive: int,
        policy: Policy,
        now: datetime,
    ) -> JobRecord:
        """This record after restarting `scope` around `pod` at `at`, charged to its type."""
        unit = {
            RestartScope.ALL: {},
            RestartScope.REPLICA: {"replica_type": pod.replica_type},
            RestartScope.POD: {"replica_type": pod.replica_type, "slot": pod.slot},
        }[scope]
        new = LastRestart(scope, at, consecutive=consecutive, **unit)
        retention = max(timedelta(seconds=policy.restart_time_limit), MIN_RETENTION)
        kept: list[LastRestart] = []
        forgotten_until = self.forgotten_until
        for last in self.last_restarts:
            if new.contains(last) and last.at <= new.at:
                continue  # superseded: no slot's newest covering restart is `last` any more
            if last.at <= now - retention:
                forgotten_until = (
                    last.at if forgotten_until is None else max(forgotten_until, last.at)
                )
                continue
            kept.append(last)
        old = self.replicas.get(pod.replica_type, ReplicaCount())
        times = sorted((*old.times, at))
        if policy.restart_timeout is not None:
            start = now - timedelta(seconds=policy.restart_timeout)
            times = [t for t in times if t > start]
        count = ReplicaCount(
            old.restarts + 1, tuple(times[max(0, len(times) - policy.restart_limit) :])
        )
        return JobRecord(
            replicas={**self.replicas, pod.replica_type: count},
            last_restarts=(*kept, new),
            forgotten_until=forgotten_until,
        )
