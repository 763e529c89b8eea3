"""Facts read off Kubernetes objects as the API returns them (plain JSON dicts); no client."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def version_number(version: object) -> int:
    """A resourceVersion as a number (etcd's revision: a later write has a greater one); 0 when
    it is not one. Kubernetes calls them opaque; the restarter compares its own API server's."""
    try:
        return int(str(version))
    except ValueError:
        return 0


def object_version(obj: Mapping[str, Any]) -> int:
    """`version_number` of an object's (as the API returned it) metadata.resourceVersion."""
    return version_number((obj.get("metadata") or {}).get("resourceVersion"))
