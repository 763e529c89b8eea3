"""The storm guard's eyes: each dispatcher round tells the `Dispatch` how many nodes are
NotReady, and when a storm starts or ends it is logged, counted and announced (an Event on the
storm object), and the node faults held through it are handed back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from edl_agent.faults.model import Fault
from edl_agent.restarter.core.dispatch import Dispatch
from edl_agent.restarter.core.metrics import RestarterMetrics
from edl_agent.restarter.core.port import PodView

log = structlog.get_logger(__name__)


class StormWatch:
    def __init__(
        self,
        pods: PodView,
        metrics: RestarterMetrics,
        announce: Callable[[str, str, str], None],
    ) -> None:
        self._pods = pods
        self._metrics = metrics
        self._announce = announce

    def check(self, dispatch: Dispatch[Any]) -> list[Fault]:
        """Tell `dispatch` the nodes' state (under the lock that guards it); the held faults
        released, to be dispatched again."""
        failing, total = self._pods.node_counts()
        self._metrics.nodes_not_ready.set(failing)
        change = dispatch.nodes_seen(failing, total, self._pods.node_not_ready)
        if change is None:
            return []
        self._metrics.storm_paused.set(1 if change.storming else 0)
        self._metrics.held_faults.set(len(dispatch.held))
        if change.storming:
            log.warning("storm guard: node-failure restarts paused", nodes=change.description)
            self._announce(
                "Warning",
                "RestartStormPaused",
                f"node-failure restarts paused: {change.description}",
            )
            return []
        held = len(change.released) + change.dropped
        log.warning(
            "storm guard: node-failure restarts resume",
            held=held,
            still_failing=len(change.released),
            nodes=f"{failing} of {total} NotReady",
        )
        self._announce(
            "Normal",
            "RestartStormOver",
            f"node-failure restarts resume ({failing} of {total} nodes NotReady); "
            f"{len(change.released)} of {held} held faults are on nodes still failing",
        )
        return list(change.released)
