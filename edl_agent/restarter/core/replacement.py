"""What a replacement pod is made of, and the marks the restarter leaves on pods (pure: no API
client). A bare pod is created again under a new name, `<base>-r<count>`, with the same labels
(but those on the drop list), annotations and spec without the node binding, the restart count
in annotation `edl.io/restart-count` and env `EDL_RESTART_COUNT` of every container, and for
node and device faults a required node affinity away from the failed node. The name depends
only on the count, so a retried replacement finds its pod already there.

A replacement avoids one node at most: the last one a fault was found on (annotation
`edl.io/avoided-node`). Avoiding every node its predecessors failed on would, in a pool of a
few nodes, leave a job's replacement with nowhere to go after a fault on each; a node that
failed before and still is bad is kept out by the agent (its devices withdrawn) or by
Kubernetes (NotReady, tainted)."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from edl_agent.faults.model import FaultKind
from edl_agent.restarter.core.settings import DEFAULT_DROP_LABELS, label_dropped

DELETED_BY_ANNOTATION = "edl.io/deleted-by"
# The uid of the pod a replacement replaces: made before that pod is deleted, it tells every
# restarter (this one after a restart too) that the old pod's exit or deletion is ours.
REPLACES_UID_ANNOTATION = "edl.io/replaces-uid"
RESTARTER = "edl-restarter"
RESTART_COUNT_ANNOTATION = "edl.io/restart-count"
BASE_NAME_ANNOTATION = "edl.io/base-name"
REPLACES_ANNOTATION = "edl.io/replaces"
AVOIDED_NODE_ANNOTATION = "edl.io/avoided-node"
RESTART_COUNT_ENV = "EDL_RESTART_COUNT"
NODE_FAULTS = frozenset({FaultKind.NODE_NOT_READY, FaultKind.DEVICE_UNHEALTHY})
MAX_BASE = 240
_POD_META_KEPT = ("labels", "annotations")
_POD_SPEC_DROPPED = ("nodeName", "ephemeralContainers")


def replacement_pod(
    pod: Mapping[str, Any],
    *,
    avoid_node: str | None,
    drop_labels: Iterable[str] = DEFAULT_DROP_LABELS,
) -> dict[str, Any]:
    """The pod to create in place of `pod` (a dict as the API returned it), with its labels but
    those matching `drop_labels` (keys, or prefixes ending in `*`)."""
    meta = pod["metadata"]
    annotations = dict(meta.get("annotations") or {})
    annotations.pop(DELETED_BY_ANNOTATION, None)
    count = _int(annotations.get(RESTART_COUNT_ANNOTATION)) + 1
    base = annotations.get(BASE_NAME_ANNOTATION) or str(meta["name"])
    annotations.update(
        {
            RESTART_COUNT_ANNOTATION: str(count),
            BASE_NAME_ANNOTATION: base,
            REPLACES_ANNOTATION: str(meta["name"]),
            REPLACES_UID_ANNOTATION: str(meta.get("uid", "")),
        }
    )
    new_meta: dict[str, Any] = {k: copy.deepcopy(meta[k]) for k in _POD_META_KEPT if k in meta}
    new_meta["annotations"] = annotations
    if new_meta.get("labels"):
        drop = tuple(drop_labels)
        new_meta["labels"] = {
            k: v for k, v in new_meta["labels"].items() if not label_dropped(k, drop)
        }
    new_meta["name"] = f"{base[:MAX_BASE].rstrip('-.')}-r{count}"
    spec = copy.deepcopy(dict(pod.get("spec") or {}))
    for key in _POD_SPEC_DROPPED:
        spec.pop(key, None)
    for key in ("containers", "initContainers"):
        for container in spec.get(key) or []:
            env = [e for e in container.get("env") or [] if e.get("name") != RESTART_COUNT_ENV]
            container["env"] = [*env, {"name": RESTART_COUNT_ENV, "value": str(count)}]
    if avoid_node and avoid_node != annotations.get(AVOIDED_NODE_ANNOTATION):
        _forget(spec, annotations.pop(AVOIDED_NODE_ANNOTATION, ""))
        if _avoid(spec, avoid_node):
            annotations[AVOIDED_NODE_ANNOTATION] = avoid_node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": new_meta, "spec": spec}


def _avoid(spec: dict[str, Any], node: str) -> bool:
    """Add `metadata.name NotIn [node]` to every required node selector term (they are ORed);
    whether any term lacked it (the pod's own affinity may avoid that node already).

    The API server takes exactly one value in a `metadata.name` field requirement, so a pod's
    own requirements stay as they are and ours is one more (the requirements of a term are
    ANDed)."""
    affinity = spec.setdefault("affinity", {})
    node_affinity = affinity.setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    avoided = _requirement(node)
    added = False
    for term in terms:
        fields = term.setdefault("matchFields", [])
        if avoided not in fields:
            fields.append(dict(avoided))
            added = True
    return added


def _forget(spec: dict[str, Any], node: str) -> None:
    """Take out the requirement `_avoid(spec, node)` added, and what it made and left empty (an
    empty node selector term would match no node)."""
    if not node:
        return
    affinity = spec.get("affinity") or {}
    node_affinity = affinity.get("nodeAffinity") or {}
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    avoided = _requirement(node)
    terms = []
    for term in required.get("nodeSelectorTerms") or []:
        fields = [f for f in term.get("matchFields") or [] if f != avoided]
        kept = {k: v for k, v in term.items() if k != "matchFields"}
        if fields:
            kept["matchFields"] = fields
        if kept:
            terms.append(kept)
    for parent, key, value in (
        (required, "nodeSelectorTerms", terms),
        (node_affinity, "requiredDuringSchedulingIgnoredDuringExecution", required),
        (affinity, "nodeAffinity", node_affinity),
        (spec, "affinity", affinity),
    ):
        if value:
            parent[key] = value
        else:
            parent.pop(key, None)


def _requirement(node: str) -> dict[str, Any]:
    return {"key": "metadata.name", "operator": "NotIn", "values": [node]}


def _int(text: str | None) -> int:
    try:
        return max(0, int(text or 0))
    except ValueError:
        return 0


# The labels a Job's own selector matches its pods by (the current one and the older one Jobs
# still stamp): both hold the Job's uid.
JOB_UID_LABELS = ("batch.kubernetes.io/controller-uid", "controller-uid")


def release_patch(pod: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """A JSON patch that takes a Job's pod out of its Job's selector (None for a pod no Job
    owns, or one whose Job selects it by other labels: a manual selector).

    The Job controller then releases the pod (drops its owner reference and tracking finalizer)
    and creates the replacement at once. Left to the Job, a pod the restarter deleted becomes one
    more failed pod: the Job waits for it to end, then for its failure backoff (10 s after the
    first failure, doubling with each in a row, for ignored failures too) before it makes the
    next. The patch is conditional on the pod's uid."""
    meta = pod.get("metadata") or {}
    owner = next((r for r in meta.get("ownerReferences") or [] if r.get("controller")), None)
    if owner is None or owner.get("kind") != "Job" or owner.get("apiVersion") != "batch/v1":
        return None
    labels = meta.get("labels") or {}
    keys = [key for key in JOB_UID_LABELS if owner.get("uid") and labels.get(key) == owner["uid"]]
    if not keys or not meta.get("uid"):
        return None
    return [
        {"op": "test", "path": "/metadata/uid", "value": meta["uid"]},
        *(
            {
                "op": "remove",
                "path": "/metadata/labels/" + key.replace("~", "~0").replace("/", "~1"),
            }
            for key in keys
        ),
    ]
