"""The templates of pods gone from the API whose restart or backoff is recorded
(`status.pod_template`): what their replacements are made of. Bounded: the policies' status
holds them too, and a new start reads them from there. Also answers whether a pod of a recorded
restart needs nothing more (`done`), which depends on them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from edl_agent.faults.model import PodRef
from edl_agent.faults.pod_faults import controller_owned, pod_ref
from edl_agent.kube_time import format_micro_time
from edl_agent.restarter.core.pod_cache import is_whole
from edl_agent.restarter.core.port import PodView
from edl_agent.restarter.core.status import pod_template
from edl_agent.runtime.bounded import BoundedMap


class GoneTemplates:
    def __init__(self, pods: PodView, *, clock: Callable[[], datetime], keep: int) -> None:
        self._pods = pods
        self._clock = clock
        self._lock = threading.Lock()
        self._templates: BoundedMap[str, Mapping[str, Any]] = BoundedMap(keep)

    def learn(self, templates: Mapping[str, Mapping[str, Any]]) -> None:
        """Templates (uid → template) read from a policy's status."""
        with self._lock:
            self._templates.update(templates)

    def get(self, uid: str) -> Mapping[str, Any] | None:
        with self._lock:
            return self._templates.get(uid)

    def done(self, ref: PodRef) -> bool:
        """Whether a pod of a recorded restart needs nothing more: it is gone or being deleted,
        and replaced (or owned by a controller, which replaces it, or no longer known)."""
        if self._pods.exists(ref):
            return False
        if self._pods.replaced(ref):
            with self._lock:
                self._templates.pop(ref.uid, None)
            return True
        with self._lock:
            if ref.uid in self._templates:
                return False  # gone, and its replacement is still to be made from the template
        pod = self._pods.find_pod(ref)
        return pod is None or pod_ref(pod).uid != ref.uid or controller_owned(pod)

    def as_deleted(self, ref: PodRef) -> dict[str, Any] | None:
        """A pod gone from the API as its recorded template shows it, marked as deleted (so
        that nothing takes it for a pod kubelet could still restart)."""
        template = self.get(ref.uid)
        if template is None:
            return None
        meta = dict(template.get("metadata") or {})
        meta["deletionTimestamp"] = format_micro_time(self._clock())
        return {**template, "metadata": meta, "status": {}}

    def gone(self, ref: PodRef) -> Mapping[str, Any] | None:
        """The template of a pod the API no longer has (or is deleting), to record with a
        decision about it; None for a live pod, or when no whole copy is at hand."""
        if self._pods.exists(ref):
            return None
        known = self.get(ref.uid)
        if known is not None:
            return known
        pod = self._pods.whole(ref) or self._pods.find_pod(ref)
        if pod is None or pod_ref(pod).uid != ref.uid or not is_whole(pod) or controller_owned(pod):
            return None
        template = pod_template(pod)
        with self._lock:
            self._templates[ref.uid] = template
        return template
