"""FaultTolerancePolicy: which faults replace which pods of a job, how often and how soon.

A policy (CRD `faulttolerancepolicies.edl.io`, version v1alpha1, namespaced) covers the pods
its `selector` selects in its namespace. Three label keys place a pod: `jobLabel` names its job
(required; a selected pod without that label belongs to no job and is never restarted),
`replicaTypeLabel` its replica type (worker, master; "" when the key is not set or the pod
lacks it) and `replicaIndexLabel` its index within the type. A *slot* is a replica type and an
index, the place a replacement takes over; without an index a pod's slot is its name.

**Rules** (`faultTolerantPolicy`, in AITrainingJob's words) are tried in order; the first that
matches a fault decides, and later rules are never consulted, even when that decision is not
to restart (a limit reached). What a rule matches, by its `restartPolicy`:

  ExitCode                exits with a code in exitCodes (required)
  OnFailure               exits with a code in exitCodes; without them, any non-zero code
  OnNodeFail              events in exceptionalEvent; without it, all four
  OnNodeFailWithExitCode  both: exits as ExitCode, events as OnNodeFail
  Always                  both: exits as OnFailure, events as OnNodeFail
  Never                   what it names (exitCodes and containerName, exceptionalEvent);
                          naming nothing, every fault. It matches and does not restart.
  Graceful                events in exceptionalEvent (deviceDegraded, deviceUnhealthy);
                          without it, deviceDegraded. The pod is evicted through the Eviction
                          API with its own grace (PodDisruptionBudgets hold; a refused eviction
                          waits and is tried again), so its trainer can save on SIGTERM.

`containerName` narrows exits to one container's. An exit with an unknown code matches only
rules without exitCodes; code 0 (no failure) only rules that list it and Never rules without
exitCodes. `exitCodes` is an integer or a string of codes and ranges, 0..255: "129,101",
"1-100", "1,3-5,200" (YAML reads unquoted `129,101` as that string). `exceptionalEvent` is
comma-joined: `nodeNotReady`, `PodForceDeleted`, `PodEvicted`, `deviceUnhealthy` — the faults
not of the program's making, from the fault kinds NodeNotReady, PodForceDeleted, PodEvicted and
DeviceUnhealthy — and `deviceDegraded` (DeviceDegraded: a device the pod holds warns of a fault
and still serves it), which only a rule that names it matches. (The parser also takes a list;
the CRD takes only the string, since the API server cannot validate a field that may be
either.)

`spec.restartPolicy` with rules is a gate: a fault of a class it does not restart (exits for
OnNodeFail, events for ExitCode and OnFailure, every fault for Never) is not restarted
whatever the rules say — `restartPolicy: Never` pauses a job's restarts and keeps its rules —
and it is the restartPolicy of rules that name none. Without rules it is the one rule (Always,
OnFailure, OnNodeFail or Never). `spec.restartScope` is the rules' default scope, else Pod.

**Scope** of a restart: `Pod` replaces the faulted pod; `Replica` every pod of the job with
its replica type; `All` every pod of the job that the policy selects.

**Counting.** Each restart is charged once, to the faulted pod's job and replica type,
whatever its scope (an All restart that a worker caused is a worker restart), as AITrainingJob
counts per replica spec. A fault that touches several pods is decided pod by pod; a pod that an
earlier restart already replaced is not charged again (stale, below).

**restartLimit** (default 10; 0 restarts nothing): a fault is restarted only while fewer than
restartLimit restarts charged to its job and replica type still count. **restartTimeout** is
how long a restart counts, in seconds: a sliding window (omitted: the job's whole life). So
`restartLimit: 100, restartTimeout: 864000` allows at most 100 restarts of a replica type in
any 10 days: a job on a cluster with occasional faults runs on for weeks, one that keeps
failing is given up on. A window rather than a deadline, because "no restarts after 10 days"
would take fault tolerance from the long jobs that need it most, while what costs is the rate
of restarts. A refused restart is LimitExceeded (condition RestartLimitExceeded on the job);
that fault is not retried later, the next fault is decided afresh.

**restartTimeLimit** (default 600) is how long, in seconds, a replacement must run without a
fault for its slot's failures to stop being consecutive: a fault observed less than
restartTimeLimit after the newest restart that covered its slot (its own Pod restart, a
Replica restart of its type or an All restart of its job) makes the next restart consecutive.
It is counted from the restart decision, so it includes scheduling and start-up. It drives the
backoff only; restartLimit counts every restart. AITrainingJob's 60 reads: a replacement that
survives a minute has recovered.

**backoff** (`initialSeconds` 10, `maxSeconds` 300): the first restart of a streak is
immediate; the n-th consecutive one waits initialSeconds * 2^(n-2), at most maxSeconds, from
the fault's observation. Inside the wait the decision is Backoff with `until`: decide again
then. Backoff is per slot, so a rack failure that takes twenty pods restarts them all at once;
only a slot that fails again soon waits. initialSeconds 0 turns backoff off.

**Stale faults.** A fault observed no later than the newest restart covering its slot is Stale:
that restart already replaced the pod (a fault reported twice, by an agent and a watcher, or
another pod of the same Replica or All restart). A fault observed "later" than the restarter's
now (a clock ahead of its own) is taken as observed now, so a restart is recorded at now and
never later: the fault that caused it is stale at once, and one bad clock cannot make the
faults of the slot's replacement look older than the restart (the intake also clamps times
more than `intake.MAX_CLOCK_AHEAD` ahead, and counts them). Agents' clocks must agree with the
restarter's to well under a restart's duration (NTP does). The record forgets a slot's last
restart after restartTimeLimit, or an hour if longer; faults observed before the newest
forgotten restart are stale too.

**Decisions** (`decide.decide`, pure): Stale, then the gate (Never), then the first matching
rule (none: Ignore; a Never rule: Never), then restartLimit (LimitExceeded), then backoff
(Backoff until), else Restart of the rule's scope, with the job's updated record.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from edl_agent.faults.model import Fault, FaultKind, PodRef
from edl_agent.restarter.core.selector import LabelSelector

DEFAULT_RESTART_LIMIT = 10
DEFAULT_RESTART_TIME_LIMIT = 600
MAX_EXIT_CODE = 255


class RestartPolicy(enum.StrEnum):
    ALWAYS = "Always"
    ON_FAILURE = "OnFailure"
    ON_NODE_FAIL = "OnNodeFail"
    ON_NODE_FAIL_WITH_EXIT_CODE = "OnNodeFailWithExitCode"
    EXIT_CODE = "ExitCode"
    NEVER = "Never"
    GRACEFUL = "Graceful"

    @property
    def restarts_exits(self) -> bool:
        return self in _RESTARTS_EXITS

    @property
    def restarts_events(self) -> bool:
        return self in _RESTARTS_EVENTS

    @property
    def needs_exit_codes(self) -> bool:
        return self in (RestartPolicy.EXIT_CODE, RestartPolicy.ON_NODE_FAIL_WITH_EXIT_CODE)


_RESTARTS_EXITS = frozenset(
    {RestartPolicy.EXIT_CODE, RestartPolicy.ON_NODE_FAIL_WITH_EXIT_CODE}
    | {RestartPolicy.ON_FAILURE, RestartPolicy.ALWAYS}
)
_RESTARTS_EVENTS = frozenset(
    {RestartPolicy.ON_NODE_FAIL, RestartPolicy.ON_NODE_FAIL_WITH_EXIT_CODE, RestartPolicy.ALWAYS}
    | {RestartPolicy.GRACEFUL}
)


class RestartScope(enum.StrEnum):
    POD = "Pod"
    REPLICA = "Replica"
    ALL = "All"


class Fence(enum.StrEnum):
    """When a pod on a NotReady node may be replaced: `Force` as soon as the node fault is
    decided (the old pod is force-deleted; while the node is only cut off, its copy may still
    run beside the replacement); `Wait` only once the node is known gone (the Node deleted, or
    tainted `node.kubernetes.io/out-of-service`): never two copies, but no recovery without
    that. A StatefulSet's pods always wait, whatever the policy says."""

    FORCE = "Force"
    WAIT = "Wait"


class Mode(enum.StrEnum):
    """`Act` carries out what the policy decides; `DryRun` only says it: an Event per decision
    that would act (reason `DryRun`, naming the rule and the pod) and a metric, and writes
    nothing else (no status, no pod), so a policy can be watched before it is trusted. Its
    decisions read the status as it is: a dry run's restarts are not counted towards
    restartLimit nor back off."""

    ACT = "Act"
    DRY_RUN = "DryRun"


class ExceptionalEvent(enum.StrEnum):
    NODE_NOT_READY = "nodeNotReady"
    POD_FORCE_DELETED = "PodForceDeleted"
    POD_EVICTED = "PodEvicted"
    DEVICE_UNHEALTHY = "deviceUnhealthy"
    DEVICE_DEGRADED = "deviceDegraded"


# What a rule that names no event matches: the four faults that stop a pod. A degraded device
# stops nothing (its pod still runs), so only a rule that names `deviceDegraded` acts on it.
ALL_EVENTS = frozenset(ExceptionalEvent) - {ExceptionalEvent.DEVICE_DEGRADED}
# What a Graceful rule may name (a pod that still runs, on a node that answers), and matches when
# it names nothing.
GRACEFUL_EVENTS = frozenset({ExceptionalEvent.DEVICE_DEGRADED, ExceptionalEvent.DEVICE_UNHEALTHY})
GRACEFUL_DEFAULT_EVENTS = frozenset({ExceptionalEvent.DEVICE_DEGRADED})
EVENT_OF_KIND: Mapping[FaultKind, ExceptionalEvent] = {
    FaultKind.NODE_NOT_READY: ExceptionalEvent.NODE_NOT_READY,
    FaultKind.POD_FORCE_DELETED: ExceptionalEvent.POD_FORCE_DELETED,
    FaultKind.POD_EVICTED: ExceptionalEvent.POD_EVICTED,
    FaultKind.DEVICE_UNHEALTHY: ExceptionalEvent.DEVICE_UNHEALTHY,
    FaultKind.DEVICE_DEGRADED: ExceptionalEvent.DEVICE_DEGRADED,
}
_RANGE = re.compile(r"(\d+)(?:\s*-\s*(\d+))?")


@dataclass(frozen=True)
class ExitCodes:
    """A set of exit codes as sorted, disjoint, non-adjacent inclusive ranges."""

    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def parse(cls, value: int | str) -> ExitCodes:
        """`137`, `"129,101"`, `"1-100"`, `"1, 3-5, 200"`; ValueError says what is wrong."""
        if isinstance(value, int):
            return cls.of([(value, value)])
        spans: list[tuple[int, int]] = []
        for part in value.split(","):
            found = _RANGE.fullmatch(part.strip())
            if found is None:
                msg = f"{part.strip()!r} in {value!r} is not a code or a range such as 1-100"
                raise ValueError(msg)
            low = int(found.group(1))
            high = int(found.group(2) or low)
            if low > high:
                msg = f"range {low}-{high} in {value!r} runs backwards"
                raise ValueError(msg)
            spans.append((low, high))
        return cls.of(spans)

    @classmethod
    def of(cls, spans: list[tuple[int, int]]) -> ExitCodes:
        merged: list[tuple[int, int]] = []
        for low, high in sorted(spans):
            if not 0 <= low <= high <= MAX_EXIT_CODE:
                msg = f"exit codes run from 0 to {MAX_EXIT_CODE}, not {high if low >= 0 else low}"
                raise ValueError(msg)
            if merged and low <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(high, merged[-1][1]))
            else:
                merged.append((low, high))
        return cls(tuple(merged))

    def __contains__(self, code: object) -> bool:
        return isinstance(code, int) and any(low <= code <= high for low, high in self.ranges)

    def __str__(self) -> str:
        return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self.ranges)


@dataclass(frozen=True)
class Rule:
    restart_policy: RestartPolicy
    restart_scope: RestartScope = RestartScope.POD
    exit_codes: ExitCodes | None = None
    container: str | None = None
    events: frozenset[ExceptionalEvent] | None = None
    """None: not named (all four, for the policies that restart events)."""

    def matches(self, fault: Fault) -> bool:
        """Whether this rule decides `fault` (see the module's table)."""
        event = EVENT_OF_KIND.get(fault.kind)
        if event is None:
            return self._takes_exits() and self._matches_exit(fault)
        return self._takes_events() and event in self.named_events

    @property
    def named_events(self) -> frozenset[ExceptionalEvent]:
        """The events this rule matches when it takes events at all."""
        if self.events is not None:
            return self.events
        if self.restart_policy is RestartPolicy.NEVER:
            return frozenset(ExceptionalEvent)  # naming nothing, a Never rule matches every fault
        return GRACEFUL_DEFAULT_EVENTS if self.graceful else ALL_EVENTS

    @property
    def graceful(self) -> bool:
        return self.restart_policy is RestartPolicy.GRACEFUL

    def _takes_exits(self) -> bool:
        if self.restart_policy is RestartPolicy.NEVER:
            names_exits = self.exit_codes is not None or self.container is not None
            return names_exits or self.events is None
        return self.restart_policy.restarts_exits

    def _takes_events(self) -> bool:
        if self.restart_policy is RestartPolicy.NEVER:
            names_exits = self.exit_codes is not None or self.container is not None
            return self.events is not None or not names_exits
        return self.restart_policy.restarts_events

    def _matches_exit(self, fault: Fault) -> bool:
        if self.container is not None and fault.container != self.container:
            return False
        if self.exit_codes is None:
            return fault.exit_code != 0 or self.restart_policy is RestartPolicy.NEVER
        return fault.exit_code in self.exit_codes


@dataclass(frozen=True)
class Backoff:
    initial_seconds: int = 10
    max_seconds: int = 300

    def delay_seconds(self, consecutive: int) -> int:
        """The wait before a restart that follows `consecutive` restarts in a row."""
        if consecutive < 1 or self.initial_seconds == 0:
            return 0
        # Capped before exponentiating: a long streak must not build a huge integer.
        doublings = min(consecutive - 1, self.max_seconds.bit_length())
        return min(self.initial_seconds << doublings, self.max_seconds)


@dataclass(frozen=True)
class PodIdentity:
    """Where a pod stands in its job: what counts and backoff are keyed by."""

    job: str
    replica_type: str = ""
    replica_index: int | None = None
    pod: PodRef | None = None

    @property
    def slot(self) -> str:
        if self.replica_index is not None:
            return str(self.replica_index)
        return self.pod.name if self.pod is not None else ""

    def __str__(self) -> str:
        return f"{self.job}/{self.replica_type}/{self.slot}"


@dataclass(frozen=True)
class Policy:
    selector: LabelSelector
    job_label: str
    rules: tuple[Rule, ...]
    rules_given: bool = True
    """False: `rules` is the one rule made of spec.restartPolicy and spec.restartScope."""
    replica_type_label: str | None = None
    replica_index_label: str | None = None
    gate: RestartPolicy | None = None
    restart_limit: int = DEFAULT_RESTART_LIMIT
    restart_time_limit: int = DEFAULT_RESTART_TIME_LIMIT
    restart_timeout: int | None = None
    backoff: Backoff = field(default_factory=Backoff)
    fence: Fence = Fence.FORCE
    mode: Mode = Mode.ACT

    def identify(self, pod: PodRef, labels: Mapping[str, str]) -> PodIdentity | None:
        """The pod's place in its job, or None when the policy does not cover the pod."""
        job = labels.get(self.job_label)
        if not job or not self.selector.matches(labels):
            return None
        replica_type = labels.get(self.replica_type_label, "") if self.replica_type_label else ""
        index = labels.get(self.replica_index_label, "") if self.replica_index_label else ""
        replica_index = int(index) if index.isdecimal() else None
        return PodIdentity(job, replica_type, replica_index, pod)

    def rule_name(self, index: int) -> str:
        if not self.rules_given:
            return f"spec.restartPolicy {self.rules[index].restart_policy}"
        return f"faultTolerantPolicy[{index}] ({self.rules[index].restart_policy})"
