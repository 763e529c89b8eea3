"""How often the agent starts vendor tools and how long they run, per tool: the cost of reading
vendors that send no events (`edl_vendor_tool_runs_total`, `edl_vendor_tool_seconds_total`).
One count for the process, as its CPU time is: every tool run goes through `HostRoot.run_tool`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCost:
    runs: int = 0
    seconds: float = 0.0


class ToolRuns:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._costs: dict[str, ToolCost] = {}

    def record(self, tool: str, seconds: float) -> None:
        with self._lock:
            cost = self._costs.get(tool, ToolCost())
            self._costs[tool] = ToolCost(cost.runs + 1, cost.seconds + seconds)

    def snapshot(self) -> Mapping[str, ToolCost]:
        with self._lock:
            return dict(self._costs)


TOOL_RUNS = ToolRuns()
