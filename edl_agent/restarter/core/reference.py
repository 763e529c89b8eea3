"""How an Event names the object it is about (pure: no API client)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def reference(obj: Mapping[str, Any]) -> dict[str, str]:
    """The involvedObject for an object as the API returned it."""
    meta = obj.get("metadata") or {}
    ref = {
        "apiVersion": str(obj.get("apiVersion", "")),
        "kind": str(obj.get("kind", "")),
        "name": str(meta.get("name", "")),
        "namespace": str(meta.get("namespace", "")),
    }
    if meta.get("uid"):
        ref["uid"] = str(meta["uid"])
    return ref
