"""The storm guard: when many nodes fail at once the cause is rarely the nodes (a network
partition, the control plane, a power domain), and replacing every pod on them would only move
the damage. While more than `max_share` of the nodes (and at least `min_nodes`) are NotReady,
node-failure restarts wait; they go ahead, for the nodes still failing, once the storm is over.
Pure."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StormGuard:
    max_share: float = 0.1
    min_nodes: int = 3

    def storming(self, failing: int, total: int) -> bool:
        """Whether `failing` of `total` nodes NotReady is a storm. A `max_share` of 1 or more
        turns the guard off."""
        if self.max_share >= 1 or total <= 0:
            return False
        return failing >= self.min_nodes and failing > self.max_share * total

    def describe(self, failing: int, total: int) -> str:
        return (
            f"{failing} of {total} nodes are NotReady (more than {self.max_share:.0%} and at "
            f"least {self.min_nodes})"
        )
