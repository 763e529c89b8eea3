"""Which policies may cover a pod, without trying every policy of its namespace. Pure.

A training operator makes a policy per job, so a namespace can hold thousands; the one that
covers a pod is found among the few whose selector shares one of the pod's labels. A policy is
filed under one pair of its selector's matchLabels (its job label's pair when the selector
names one: the most telling), or, without matchLabels, among the namespace's unfiled ones that
every lookup tries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from edl_agent.faults.model import PodRef
from edl_agent.restarter.core.policy import Policy

Key = tuple[str, str]  # (namespace, name)


@dataclass
class PolicyIndex:
    _filed: dict[tuple[str, str, str], dict[str, Policy]] = field(default_factory=dict)
    _unfiled: dict[str, dict[str, Policy]] = field(default_factory=dict)
    _where: dict[Key, tuple[str, str, str] | None] = field(default_factory=dict)

    def put(self, namespace: str, name: str, policy: Policy | None) -> None:
        """File `policy` (None: a policy that covers nothing, e.g. malformed)."""
        self.remove(namespace, name)
        if policy is None:
            return
        pair = _pair(policy)
        if pair is None:
            self._unfiled.setdefault(namespace, {})[name] = policy
            self._where[(namespace, name)] = None
            return
        slot = (namespace, *pair)
        self._filed.setdefault(slot, {})[name] = policy
        self._where[(namespace, name)] = slot

    def remove(self, namespace: str, name: str) -> None:
        if (namespace, name) not in self._where:
            return
        slot = self._where.pop((namespace, name))
        group = self._unfiled.get(namespace, {}) if slot is None else self._filed.get(slot, {})
        group.pop(name, None)

    def covering(
        self, namespace: str, ref: PodRef, labels: Mapping[str, str]
    ) -> list[tuple[str, Policy]]:
        """The policies that cover the pod, by name."""
        found = [
            (name, policy)
            for name, policy in self._unfiled.get(namespace, {}).items()
            if policy.identify(ref, labels)
        ]
        for key, value in labels.items():
            for name, policy in self._filed.get((namespace, key, value), {}).items():
                if policy.identify(ref, labels):
                    found.append((name, policy))
        return sorted(found, key=lambda item: item[0])


def _pair(policy: Policy) -> tuple[str, str] | None:
    match = policy.selector.match_labels
    if not match:
        return None
    if policy.job_label in match:
        return policy.job_label, match[policy.job_label]
    key = sorted(match)[0]
    return key, match[key]
