"""What the restarter keeps of a pod it watches: the fields it decides with, nothing else.

A pod as the API sends it is mostly spec (images, commands, env, volumes, probes),
managedFields and status it never reads; kept whole, ten thousand pods cost a quarter of a
gigabyte. A pod being replaced is read afresh before its replacement is made, so only a pod
deleted by someone else (force-deleted, evicted: no fresh copy to read) is kept whole, among the
few recently deleted ones. Pure.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from edl_agent.faults.pod_faults import pod_controller

OUR_ANNOTATIONS = "edl.io/"
MAX_MESSAGE = 512
_META = (
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "labels",
)
_CONTAINER = ("name", "restartPolicy", "restartPolicyRules")
_TERMINATED = ("exitCode", "reason", "finishedAt", "message", "signal")


def slim_pod(pod: Mapping[str, Any]) -> dict[str, Any]:
    """`pod` with only what the restarter reads: names and uid, labels, our annotations, the
    owner's controller flag, times; the node, restart policies; phase, reason, disruption
    conditions and each container's terminations."""
    return {
        "metadata": _metadata(pod),
        "spec": _spec(pod.get("spec") or {}),
        "status": _status(pod.get("status") or {}),
    }


def _metadata(pod: Mapping[str, Any]) -> dict[str, Any]:
    meta = pod.get("metadata") or {}
    kept: dict[str, Any] = {k: meta[k] for k in _META if meta.get(k) is not None}
    if "namespace" in kept:
        kept["namespace"] = _shared(kept["namespace"])
    if "labels" in kept:
        kept["labels"] = {_shared(k): _shared(v) for k, v in kept["labels"].items()}
    annotations = {
        k: v for k, v in (meta.get("annotations") or {}).items() if k.startswith(OUR_ANNOTATIONS)
    }
    if annotations:
        kept["annotations"] = annotations
    owner = pod_controller(pod)
    if owner is not None:
        kind, name = owner
        kept["ownerReferences"] = [{"controller": True, "kind": kind, "name": _shared(name)}]
    return kept


def _spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    kept: dict[str, Any] = {
        key: _shared(spec[key]) for key in ("nodeName", "restartPolicy") if spec.get(key)
    }
    for key in ("initContainers", "containers", "ephemeralContainers"):
        if spec.get(key):
            kept[key] = [
                {k: _shared(c[k]) for k in _CONTAINER if c.get(k) is not None} for c in spec[key]
            ]
    return kept


def _status(status: Mapping[str, Any]) -> dict[str, Any]:
    kept: dict[str, Any] = {
        key: _shared(status[key]) for key in ("phase", "reason") if status.get(key)
    }
    if status.get("message"):
        kept["message"] = str(status["message"])[:MAX_MESSAGE]
    disruptions = [c for c in status.get("conditions") or [] if c.get("type") == "DisruptionTarget"]
    if disruptions:
        kept["conditions"] = disruptions
    for key in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
        if status.get(key):
            kept[key] = [_container_status(c) for c in status[key]]
    return kept


def _container_status(status: Mapping[str, Any]) -> dict[str, Any]:
    """Its name, restart count and terminations: a running or waiting state says nothing the
    restarter asks, and ten thousand of them are worth leaving out."""
    kept: dict[str, Any] = {
        "name": _shared(status.get("name", "")),
        "restartCount": status.get("restartCount") or 0,
    }
    for which in ("state", "lastState"):
        terminated = (status.get(which) or {}).get("terminated")
        if terminated:
            kept[which] = {"terminated": _terminated(terminated)}
    return kept


def _shared(value: Any) -> Any:
    """One copy of a string many pods repeat (label keys and values, names of namespaces,
    nodes and containers, phases)."""
    return sys.intern(value) if isinstance(value, str) else value


def _terminated(terminated: Mapping[str, Any]) -> dict[str, Any]:
    kept = {k: terminated[k] for k in _TERMINATED if terminated.get(k) is not None}
    if "message" in kept:
        kept["message"] = str(kept["message"])[:MAX_MESSAGE]
    return kept


def is_whole(pod: Mapping[str, Any]) -> bool:
    """Whether `pod` is as the API sent it, not slimmed (a replacement can be made of it)."""
    containers = (pod.get("spec") or {}).get("containers") or []
    return bool(containers) and all("image" in c for c in containers)
