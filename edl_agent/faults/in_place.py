"""Whether kubelet itself starts a container again, in place, after it exited: pure.

The pod's `spec.restartPolicy` decides (Always: every exit; OnFailure: a non-zero exit; Never:
none), unless the container says otherwise:

- An init container with `restartPolicy: Always` is a sidecar: started again after every exit.
  Any other init container runs to completion: an exit 0 is never restarted, a failure is
  under the pod's policy (Never: the pod fails).
- Container restart rules (KEP-5307, ContainerRestartRules, alpha 1.34, beta 1.35): a container
  may set its own `restartPolicy` (Always, OnFailure, Never) and `restartPolicyRules`, a list
  of `{action, exitCodes: {operator: In|NotIn, values: [...]}}` evaluated in order; the first
  rule whose exit codes match decides (action `Restart`, or `RestartAllContainers` of KEP-5532,
  which restarts every container of the pod in place: both are "in place"); when none matches,
  the container's `restartPolicy` decides, and without one, the pod's. A rule without
  `exitCodes` (which validation does not allow) or with an action we do not know matches
  nothing.

Kubelet starts nothing again in a pod that has finished (phase Succeeded or Failed) or is being
deleted (`metadata.deletionTimestamp`), nor a container the pod's spec does not name (an
ephemeral container, a status without a spec).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

IN_PLACE_ACTIONS = frozenset({"Restart", "RestartAllContainers"})


def restarts_in_place(pod: Mapping[str, Any], container: str, exit_code: int) -> bool:
    """Whether kubelet restarts `container` of `pod` in place after it exited with `exit_code`."""
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return False
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    spec = pod.get("spec") or {}
    pod_policy = str(spec.get("restartPolicy") or "Always")  # the API's default
    for key, init in (("initContainers", True), ("containers", False)):
        for found in spec.get(key) or ():
            if found.get("name") == container:
                return _container_restarts(found, pod_policy, exit_code, init=init)
    return False


def _container_restarts(
    container: Mapping[str, Any], pod_policy: str, exit_code: int, *, init: bool
) -> bool:
    own_policy = container.get("restartPolicy")
    if init and own_policy == "Always":
        return True  # a sidecar
    if init and exit_code == 0:
        return False  # an init container that completed
    for rule in container.get("restartPolicyRules") or ():
        if _rule_matches(rule, exit_code):
            return True  # Restart or RestartAllContainers: both in place
    return _policy_restarts(str(own_policy or pod_policy), exit_code)


def _rule_matches(rule: Mapping[str, Any], exit_code: int) -> bool:
    if rule.get("action") not in IN_PLACE_ACTIONS:
        return False
    codes = rule.get("exitCodes")
    if not codes:
        return False
    values: Sequence[int] = codes.get("values") or ()
    operator = codes.get("operator")
    if operator == "In":
        return exit_code in values
    if operator == "NotIn":
        return exit_code not in values
    return False


def _policy_restarts(policy: str, exit_code: int) -> bool:
    if policy == "Always":
        return True
    if policy == "OnFailure":
        return exit_code != 0
    return False  # Never, or a policy we do not know
