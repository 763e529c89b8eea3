"""One resource's list-then-watch (pods, nodes, policies), kept alive: a 410 Gone (too old a
resourceVersion) lists again, any other failure retries after a backoff (1 s doubling to 30 s).
A list comes in pages, each object passed through `shrink` as it comes; the watch goes on from
the list's resourceVersion (or from an earlier one, to replay what happened meanwhile)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import structlog

from edl_agent.kube import call_json, watch_events
from edl_agent.kube_objects import version_number
from edl_agent.kube_watch import WatchLoop

log = structlog.get_logger(__name__)

WATCH_TIMEOUT = 300
MAX_RETRY_DELAY = 30.0
LIST_PAGE = 500

Lister = Callable[..., Any]


class ListWatch(WatchLoop):
    """List, then watch from the list's resourceVersion, forever (until `stop`): a `WatchLoop`
    whose retries back off from 1 s, doubling, to 30 s, and which lists again after a 410.

    `list_call(**kwargs)` is a kubernetes client list method bound to its namespace (or cluster
    wide); `on_list(items)` gets every full list, `on_event(type, object)` each watch event."""

    def __init__(
        self,
        name: str,
        list_call: Lister,
        *,
        on_list: Callable[[list[dict[str, Any]]], None],
        on_event: Callable[[str, dict[str, Any]], None],
        shrink: Callable[[dict[str, Any]], dict[str, Any]] = lambda item: item,
    ) -> None:
        self.name = f"watch-{name}"
        super().__init__(log_context={})
        self._shrink = shrink
        self.version: str | None = None
        """The resourceVersion of the last list or event handled."""
        self.replay_from: str | None = None
        """Set before it runs: after the first list, watch from this older version instead
        of the list's, so that what happened meanwhile (a deletion, say) is seen as events."""
        self._list_call = list_call
        self._on_list = on_list
        self._on_event = on_event
        self.synced = threading.Event()

    def _list(self) -> str | None:
        """List in pages, each item passed through `shrink` as it comes, so that a list of
        many big objects never sits in memory whole."""
        items: list[dict[str, Any]] = []
        version: str | None = None
        token: str | None = None
        while True:
            page = call_json(
                self._list_call, limit=LIST_PAGE, **({"_continue": token} if token else {})
            )
            meta = page.get("metadata") or {}
            version = version or str(meta.get("resourceVersion") or "") or None
            items.extend(self._shrink(item) for item in page.get("items") or [])
            del page
            token = meta.get("continue") or None
            if token is None:
                break
        self._on_list(items)
        replay, self.replay_from = self.replay_from, None
        if replay and version and version_number(replay) < version_number(version):
            log.info("replaying events since an earlier version", watch=self.name, since=replay)
            version = replay  # handled from here on, as the replayed events come
        self.version = version
        self.synced.set()
        return version

    def _watch(self, version: str | None) -> str | None:
        for kind, obj in watch_events(
            self._list_call,
            resource_version=version,
            timeout_seconds=WATCH_TIMEOUT,
            opened=self._opened,
        ):
            version = (obj.get("metadata") or {}).get("resourceVersion") or version
            if kind != "BOOKMARK":
                self._on_event(kind, obj)
            self.version = version
        return version

    def _retry_delay(self, failures_in_row: int) -> float:
        return min(2.0 ** (failures_in_row - 1), MAX_RETRY_DELAY)
