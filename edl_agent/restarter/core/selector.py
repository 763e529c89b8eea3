"""Kubernetes label selectors (matchLabels + matchExpressions): matching and the query string."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


class Operator(enum.StrEnum):
    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: Operator
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        match self.operator:
            case Operator.IN:
                return labels.get(self.key) in self.values
            case Operator.NOT_IN:
                return labels.get(self.key) not in self.values
            case Operator.EXISTS:
                return self.key in labels
            case Operator.DOES_NOT_EXIST:
                return self.key not in labels

    def __str__(self) -> str:
        values = ",".join(self.values)
        match self.operator:
            case Operator.IN:
                return f"{self.key} in ({values})"
            case Operator.NOT_IN:
                return f"{self.key} notin ({values})"
            case Operator.EXISTS:
                return self.key
            case Operator.DOES_NOT_EXIST:
                return f"!{self.key}"


@dataclass(frozen=True)
class LabelSelector:
    match_labels: Mapping[str, str] = field(default_factory=dict)
    match_expressions: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Every matchLabels pair and every expression holds (as the API server selects)."""
        return all(labels.get(k) == v for k, v in self.match_labels.items()) and all(
            r.matches(labels) for r in self.match_expressions
        )

    def __str__(self) -> str:
        """The `labelSelector` query parameter for list and watch calls."""
        parts = [f"{k}={v}" for k, v in sorted(self.match_labels.items())]
        return ",".join(parts + [str(r) for r in self.match_expressions])
