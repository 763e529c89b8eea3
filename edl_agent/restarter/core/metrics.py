"""The restarter's Prometheus metrics, in a registry of its own (served by `MetricsServer`).

edl_restarter_decisions_total{action,reason}      decisions; reason = the fault's kind
edl_restarter_dry_run_decisions_total{action,reason}  the same for policies in mode DryRun
edl_restarter_fault_to_replacement_seconds{fault} fault observed → replacement created
edl_restarter_replacement_errors_total            replacements the API refused
edl_restarter_node_waits_total                    pods whose replacement waits for their node
edl_restarter_evictions_refused_total             graceful evictions a disruption budget refused
edl_restarter_api_writes_total{what}              writes made: status, create, disruption,
                                                  delete, evict, release
edl_restarter_intake_faults_total{outcome}        reported faults: accepted, duplicate, deferred
edl_restarter_intake_refusals_total{reason}       reports refused (token, account, node),
                                                  connections refused (too many)
edl_restarter_intake_trimmed_total{field}         faults cut to the intake's bounds, or dated
                                                  ahead of its clock (field observed_at)
edl_restarter_queue_depth                         faults waiting for or in a decision
edl_restarter_dispatcher_round_timestamp_seconds  the dispatcher's last round (faults, due
                                                  backoffs, storm guard, recorded restarts)
edl_restarter_leader                              1 while this replica leads
edl_restarter_storm_paused                        1 while the storm guard holds restarts
edl_restarter_nodes_not_ready                     NotReady nodes the watch sees
edl_restarter_held_faults                         node faults the storm guard holds
edl_part_up{part}                                 1 while a supervised part runs
edl_part_restarts_total{part}                     times a part died and was run again
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from edl_agent.runtime.supervisor import PartStatus


@dataclass(frozen=True)
class IntakeCounts:
    accepted: int = 0
    duplicates: int = 0
    refused: Mapping[str, int] = field(default_factory=dict)  # by Refusal value
    review_errors: int = 0
    sink_errors: int = 0
    deferred: int = 0  # answered "retry later": the pod cache did not show it yet
    trimmed: Mapping[str, int] = field(default_factory=dict)  # by field (faults.bounds)


# Replacements are created in tens of milliseconds; node faults include the node grace.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RestarterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "edl_restarter_decisions",
            "Decisions the restarter made, by action and by the kind of fault decided on.",
            ["action", "reason"],
            registry=r,
        )
        self.fault_to_replacement = Histogram(
            "edl_restarter_fault_to_replacement_seconds",
            "Time from a fault's observation to its replacement pod's creation.",
            ["fault"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.dry_run_decisions = Counter(
            "edl_restarter_dry_run_decisions",
            "Decisions about faults under policies in mode DryRun (told, never carried out), by "
            "action and the fault's kind.",
            ["action", "reason"],
            registry=r,
        )
        self.replacement_errors = Counter(
            "edl_restarter_replacement_errors",
            "Pod replacements the API refused or that failed (retried on restart).",
            registry=r,
        )
        self.node_waits = Counter(
            "edl_restarter_node_waits",
            "Pods on a NotReady node whose replacement waits until the node is known gone "
            "(a StatefulSet's pods, a policy's fence: Wait); each pod counted once.",
            registry=r,
        )
        self.evictions_refused = Counter(
            "edl_restarter_evictions_refused",
            "Evictions of a graceful restart that the Eviction API refused (a "
            "PodDisruptionBudget allowed no disruption then); each is tried again later.",
            registry=r,
        )
        self.api_writes = Counter(
            "edl_restarter_api_writes",
            "Writes the restarter made to the API: a policy's status, a replacement created, "
            "a controller-owned pod marked DisruptionTarget, a pod deleted, a pod evicted, a "
            "Job's pod released from its Job.",
            ["what"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "edl_restarter_queue_depth",
            "Faults and pods waiting for a decision, or being decided about and acted on.",
            registry=r,
        )
        self.dispatcher_round = Gauge(
            "edl_restarter_dispatcher_round_timestamp_seconds",
            "When the dispatcher last ran a round (Unix time, by the restarter's clock): faults "
            "taken in, the storm guard's news, backoffs due, the recorded restarts looked at "
            "again. It runs one only for a reason: it stands still while nothing comes and "
            "nothing is due, and while the dispatcher is down.",
            registry=r,
        )
        self.leader = Gauge(
            "edl_restarter_leader", "1 while this replica holds the leader Lease.", registry=r
        )
        self.storm_paused = Gauge(
            "edl_restarter_storm_paused",
            "1 while the storm guard holds node-failure restarts.",
            registry=r,
        )
        self.nodes_not_ready = Gauge(
            "edl_restarter_nodes_not_ready", "NotReady nodes the restarter sees.", registry=r
        )
        self.held_faults = Gauge(
            "edl_restarter_held_faults",
            "Node-failure faults the storm guard holds back.",
            registry=r,
        )

    def watch_parts(self, statuses: Callable[[], list[PartStatus]]) -> None:
        """Export the supervisor's parts (read at each scrape), named as the agent's are."""
        self.registry.register(_PartsCollector(statuses))

    def watch_intake(self, counts: Callable[[], IntakeCounts]) -> None:
        """Export the intake's counts (read at each scrape)."""
        self.registry.register(_IntakeCollector(counts))


class _PartsCollector(Collector):
    def __init__(self, statuses: Callable[[], list[PartStatus]]) -> None:
        self._statuses = statuses

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "edl_part_up",
            "1 while a supervised part of the restarter runs (leader-election, dispatcher, "
            "decider-<n>, pods/<namespace>, nodes, policies/<namespace>, node-grace, events, "
            "intake, leader-label), 0 while it waits to be started again.",
            labels=["part"],
        )
        restarts = CounterMetricFamily(
            "edl_part_restarts",
            "Times a supervised part of the restarter died and was started again.",
            labels=["part"],
        )
        for status in self._statuses():
            up.add_metric([status.name], 1 if status.up else 0)
            restarts.add_metric([status.name], status.restarts)
        yield up
        yield restarts

    def describe(self) -> Iterator[Metric]:
        return iter(())


class _IntakeCollector(Collector):
    def __init__(self, counts: Callable[[], IntakeCounts]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        counts = self._counts()
        faults = CounterMetricFamily(
            "edl_restarter_intake_faults",
            "Faults agents reported, by outcome.",
            labels=["outcome"],
        )
        faults.add_metric(["accepted"], counts.accepted)
        faults.add_metric(["duplicate"], counts.duplicates)
        faults.add_metric(["deferred"], counts.deferred)  # "retry later": the cache lagged
        yield faults
        refusals = CounterMetricFamily(
            "edl_restarter_intake_refusals",
            "Reports or faults the intake refused, by reason.",
            labels=["reason"],
        )
        for reason, count in sorted(counts.refused.items()):
            refusals.add_metric([reason], count)
        yield refusals
        trimmed = CounterMetricFamily(
            "edl_restarter_intake_trimmed",
            "Faults the intake brought within its bounds, by field: reason, detail and "
            "device_ids cut (with a mark); observed_at dated more than 10 s ahead of the "
            "restarter's clock, taken as observed now.",
            labels=["field"],
        )
        for name in ("reason", "detail", "device_ids", "observed_at"):
            trimmed.add_metric([name], counts.trimmed.get(name, 0))
        yield trimmed
        errors = CounterMetricFamily(
            "edl_restarter_intake_errors",
            "Reports the intake could not take: token review unavailable, or the queue failed.",
            labels=["kind"],
        )
        errors.add_metric(["review"], counts.review_errors)
        errors.add_metric(["sink"], counts.sink_errors)
        yield errors

    def describe(self) -> Iterator[Metric]:
        return iter(())
