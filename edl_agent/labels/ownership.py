"""Which node labels are ours, and the patch that brings the Node to the labels we want. Pure.

The keys we set are recorded in the annotation `edl.io/owned-labels` (sorted, comma-joined, as
NFD does with `nfd.node.kubernetes.io/feature-labels`). A key we owned and no longer produce is
removed; a key we never owned is never touched — except one we now produce, which we take over
(a label left by an earlier GFD install is corrected rather than contradicting ours). Only keys
under our prefixes count as owned, whatever the annotation says: a hand-edited annotation must
not make the agent delete someone else's label (the admission policy would refuse it anyway).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

OWNED_LABELS = "edl.io/owned-labels"
OUR_PREFIXES = ("edl.io/", "nvidia.com/")


def owned_keys(annotations: Mapping[str, str]) -> frozenset[str]:
    keys = (key.strip() for key in (annotations.get(OWNED_LABELS) or "").split(","))
    return frozenset(key for key in keys if key.startswith(OUR_PREFIXES))


@dataclass(frozen=True)
class LabelPatch:
    """A JSON merge patch for the Node's metadata (None: nothing to change), and what it does."""

    body: dict[str, Any] | None
    set: Mapping[str, str] = field(default_factory=dict)
    removed: tuple[str, ...] = ()
    taken_over: tuple[str, ...] = ()


def label_patch(
    *, labels: Mapping[str, str], annotations: Mapping[str, str], desired: Mapping[str, str]
) -> LabelPatch:
    """From the Node's current labels and annotations to `desired` (all the labels we own)."""
    owned = owned_keys(annotations)
    changed = {key: value for key, value in sorted(desired.items()) if labels.get(key) != value}
    removed = tuple(sorted(key for key in owned - desired.keys() if key in labels))
    taken = tuple(sorted(key for key in changed if key in labels and key not in owned))
    record = ",".join(sorted(desired)) or None
    metadata: dict[str, Any] = {}
    if changed or removed:
        metadata["labels"] = {**changed, **dict.fromkeys(removed)}
    if annotations.get(OWNED_LABELS) != record:
        metadata["annotations"] = {OWNED_LABELS: record}
    body = {"metadata": metadata} if metadata else None
    return LabelPatch(body, changed, removed, taken)
