"""What makes a kubeconfig unusable, found without the kubernetes client package.

The agent registers with kubelet before it loads the (slow) Kubernetes client, so a kubeconfig
that cannot work has to be refused before that, as one line: this reads the files with YAML only
and checks what every client needs: a current context that exists and names a cluster with a
server. Files are merged as kubectl merges $KUBECONFIG: the first file to set `current-context`
wins, and so does the first to define a context or cluster of a name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def kubeconfig_problem(documents: Sequence[object]) -> str | None:
    """Why these kubeconfig documents (in merge order) cannot be used, or None. Pure."""
    for document in documents:
        if document is not None and not isinstance(document, Mapping):
            return "not a kubeconfig (a YAML mapping)"
    merged = [d for d in documents if isinstance(d, Mapping)]
    current = next((d["current-context"] for d in merged if d.get("current-context")), None)
    if not isinstance(current, str):
        return "no current-context"
    return _context_problem(merged, current)


def _context_problem(merged: Sequence[Mapping[object, object]], current: str) -> str | None:
    context = named_entry(merged, "contexts", current)
    if context is None:
        return f"current-context {current!r} names no context"
    cluster_name = context.get("cluster")
    if not isinstance(cluster_name, str) or not cluster_name:
        return f"context {current!r} names no cluster"
    cluster = named_entry(merged, "clusters", cluster_name)
    if cluster is None:
        return f"context {current!r}: cluster {cluster_name!r} is not defined"
    if not cluster.get("server"):
        return f"cluster {cluster_name!r} has no server"
    return None


def named_entry(
    documents: Sequence[Mapping[object, object]], kind: str, name: str
) -> Mapping[str, object] | None:
    """The first `kind` entry called `name` (its inner `context`/`cluster` mapping)."""
    inner = kind.removesuffix("s")
    for document in documents:
        entries = document.get(kind)
        if not isinstance(entries, list):
            continue
        for entry in entries:
            if isinstance(entry, Mapping) and entry.get("name") == name:
                body = entry.get(inner)
                return body if isinstance(body, Mapping) else {}
    return None


def read_documents(paths: Sequence[Path]) -> list[object]:
    """The YAML of each file that exists; ValueError (the reason) when one cannot be read."""
    import yaml  # not at start-up: only when there is a kubeconfig to read

    documents = []
    for path in paths:
        if not path.is_file():
            continue
        try:
            documents.append(yaml.safe_load(path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError) as exc:
            raise ValueError(" ".join(str(exc).split())[:300] or type(exc).__name__) from None
    return documents
