"""Labels as a Node Feature Discovery feature file, for clusters where NFD owns node labels.

NFD reads `key=value` lines from files in `/etc/kubernetes/node-feature-discovery/features.d/`
and tracks the keys it set itself, so this mode writes no owned-labels annotation. nfd-master
must allow our namespaces (`-extra-label-ns=nvidia.com,edl.io`), or it drops the labels.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from edl_agent.runtime.durable import write_atomically


def features_text(labels: Mapping[str, str]) -> str:
    return "".join(f"{key}={value}\n" for key, value in sorted(labels.items()))


def write_features_file(path: str | os.PathLike[str], labels: Mapping[str, str]) -> bool:
    """Replace the file atomically (a dot-file in the same directory, then rename, so that NFD
    never reads half a file); False when it already said exactly this."""
    target = Path(path)
    text = features_text(labels)
    try:
        if target.read_text(encoding="utf-8") == text:
            return False
    except FileNotFoundError:
        pass
    write_atomically(target, text, temporary=target.with_name(f".{target.name}.tmp"))
    return True
