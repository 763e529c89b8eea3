"""Keeps this node's ResourceSlices what `slices.desired_slices` says they should be.

`SlicePublisher.sync` lists the node's slices of our drivers, then per pool (driver):
- nothing changed (same slices, same content, one generation, owned by the Node): no write;
- else the pool's generation goes one past the highest stored (so it survives restarts of the
  agent), and every slice is created or replaced (with its resourceVersion as a precondition),
  then the slices the pool no longer has are deleted;
- a driver with no desired slices (a vendor gone, or no longer served by DRA) loses its slices.
A conflict (409: someone else wrote in between) starts the sync again from a fresh list, a few
times; any other failure raises `SlicePublishError`. Waiting and retrying later is the caller's.

Slice names are `slices.slice_name(node, driver, index)`, and each slice is owned by the Node
(its uid read at every sync), so that the garbage collector removes the slices of a deleted Node.
An API server that drops the fields of a feature that is off (consumable capacity, device
taints, counters) is noticed on the first write: a warning is logged once, and from then on the
pools are published without that feature (`slices.without_features`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import structlog

from edl_agent.devices import names
from edl_agent.dra.api import GROUP_VERSION, DraApi
from edl_agent.dra.slices import (
    CONSUMABLE_CAPACITY,
    DEVICE_TAINTS,
    PARTITIONABLE_DEVICES,
    Spec,
    carry_taint_times,
    dropped_features,
    same_content,
    slice_name,
    with_generation,
    without_features,
)
from edl_agent.kube import CONFLICT, NOT_FOUND, ApiError

CONFLICT_ATTEMPTS = 3
FALLBACKS = {
    CONSUMABLE_CAPACITY: "shared devices are published whole: one claim holds each",
    DEVICE_TAINTS: "unhealthy devices are left out of their pools instead of tainted",
    PARTITIONABLE_DEVICES: "MIG devices are published without their GPU's counters",
}


class SlicePublishError(ApiError):
    """The node's ResourceSlices could not be brought up to date; `status` is the HTTP status
    of the call that failed (None when no answer came)."""


class _Conflict(Exception):
    """Another writer changed a slice between our list and our write."""


@dataclass
class SyncResult:
    """What one sync did, and the generation of each pool it left in place."""

    created: int = 0
    updated: int = 0
    deleted: int = 0
    generations: dict[str, int] = field(default_factory=dict)

    @property
    def writes(self) -> int:
        return self.created + self.updated + self.deleted


class SlicePublisher:
    """Publishes the ResourceSlices of one node through `api` (one thread at a time)."""

    def __init__(self, api: DraApi, node: str, *, attempts: int = CONFLICT_ATTEMPTS) -> None:
        self._api = api
        self.node = node
        self._attempts = attempts
        self._unsupported: frozenset[str] = frozenset()
        self.conflicts = 0
        self._log = structlog.get_logger().bind(part="slice-publisher", node=node)

    @property
    def unsupported(self) -> frozenset[str]:
        """The features the API server was seen to drop (feature gate names)."""
        return self._unsupported

    def sync(self, desired: Mapping[str, Sequence[Spec]]) -> SyncResult:
        """Make the node's slices of our drivers those of `desired` (driver → specs)."""
        owner = self._owner()
        known = self._unsupported
        result = self._sync_with_retries(desired, owner)
        if self._unsupported != known:  # published with fields the server dropped: again
            result = self._merge(result, self._sync_with_retries(desired, owner))
        return result

    def remove_all(self, drivers: Collection[str] | None = None) -> SyncResult:
        """Delete the node's slices of `drivers` (all of ours when None): at shutdown, or when
        a vendor is no longer served by DRA."""
        result = SyncResult()
        for driver, stored in self._stored().items():
            if drivers is not None and driver not in drivers:
                continue
            try:
                for item in stored:
                    self._delete(item, result, precondition=False)
            except _Conflict as exc:  # not expected: these deletes carry no precondition
                raise SlicePublishError(CONFLICT, str(exc)) from None
            self._log.info("resource slices removed", driver=driver, deleted=len(stored))
        return result

    # --- one sync -----------------------------------------------------------------------------

    def _sync_with_retries(
        self, desired: Mapping[str, Sequence[Spec]], owner: dict[str, Any]
    ) -> SyncResult:
        attempt = 1
        while True:
            try:
                return self._sync_once(desired, owner)
            except _Conflict as exc:
                self.conflicts += 1
                if attempt == self._attempts:
                    raise SlicePublishError(CONFLICT, f"{exc} ({attempt} attempts)") from None
                self._log.info("resource slice conflict, listing again", attempt=attempt)
                attempt += 1

    def _sync_once(
        self, desired: Mapping[str, Sequence[Spec]], owner: dict[str, Any]
    ) -> SyncResult:
        result = SyncResult()
        stored = self._stored()
        for driver in sorted(set(desired) | set(stored)):
            pool = self._sync_pool(driver, desired.get(driver, ()), stored.get(driver, []), owner)
            result = self._merge(result, pool)
        return result

    def _sync_pool(
        self,
        driver: str,
        desired: Sequence[Spec],
        stored: list[dict[str, Any]],
        owner: dict[str, Any],
    ) -> SyncResult:
        specs = without_features(desired, self._unsupported)
        current = {item["metadata"]["name"]: item for item in stored}
        wanted = {slice_name(self.node, driver, i): spec for i, spec in enumerate(specs)}
        generation = max((_generation(item) for item in stored), default=0)
        result = SyncResult()
        if self._unchanged(wanted, current, owner):
            if wanted:
                result.generations[driver] = generation
            return result
        generation += 1
        stamped = with_generation(list(wanted.values()), generation)
        for name, spec in zip(wanted, stamped, strict=True):
            self._write(name, spec, current.get(name), owner, result)
        for name in sorted(current.keys() - wanted.keys()):
            self._delete(current[name], result, precondition=True)
        if wanted:
            result.generations[driver] = generation
        self._log.info(
            "resource slices written" if wanted else "resource slices removed",
            driver=driver,
            generation=generation if wanted else None,
            slices=len(wanted),
            created=result.created,
            updated=result.updated,
            deleted=result.deleted,
        )
        return result

    def _unchanged(
        self,
        wanted: Mapping[str, Spec],
        current: Mapping[str, dict[str, Any]],
        owner: dict[str, Any],
    ) -> bool:
        if wanted.keys() != current.keys():
            return False
        if len({_generation(item) for item in current.values()}) > 1:
            return False  # a write that stopped half way
        return all(
            current[name]["metadata"].get("ownerReferences") == [owner]
            and same_content(spec, current[name].get("spec") or {})
            for name, spec in wanted.items()
        )

    def _write(
        self,
        name: str,
        spec: Spec,
        stored: dict[str, Any] | None,
        owner: dict[str, Any],
        result: SyncResult,
    ) -> None:
        metadata: dict[str, Any] = {"name": name, "ownerReferences": [owner]}
        if stored is not None:
            metadata["resourceVersion"] = stored["metadata"]["resourceVersion"]
        body: dict[str, Any] = {
            "apiVersion": GROUP_VERSION,
            "kind": "ResourceSlice",
            "metadata": metadata,
            "spec": carry_taint_times(spec, stored.get("spec") if stored else None),
        }
        try:
            if stored is None:
                written = self._api.create_resource_slice(body)
                result.created += 1
            else:
                written = self._api.replace_resource_slice(name, body)
                result.updated += 1
        except ApiError as exc:
            self._raise(exc, f"{'create' if stored is None else 'replace'} {name}")
        self._notice_dropped(body["spec"], written.get("spec") or {})

    def _delete(self, item: dict[str, Any], result: SyncResult, *, precondition: bool) -> None:
        name = item["metadata"]["name"]
        version = item["metadata"].get("resourceVersion") if precondition else None
        try:
            if self._api.delete_resource_slice(name, resource_version=version):
                result.deleted += 1
        except ApiError as exc:
            self._raise(exc, f"delete {name}")

    def _notice_dropped(self, sent: Spec, stored: Spec) -> None:
        for feature in sorted(dropped_features(sent, stored) - self._unsupported):
            self._log.warning(
                "the API server drops a DRA feature's fields",
                feature=feature,
                fallback=FALLBACKS[feature],
            )
            self._unsupported |= {feature}

    # --- reads ------------------------------------------------------------------------------

    def _stored(self) -> dict[str, list[dict[str, Any]]]:
        """Our drivers' slices on this node, by driver."""
        try:
            items = self._api.list_resource_slices(node=self.node)
        except ApiError as exc:
            self._raise(exc, "list")
        stored: dict[str, list[dict[str, Any]]] = {}
        for item in items:
            driver = (item.get("spec") or {}).get("driver", "")
            if names.vendor_of_driver(driver) is not None:
                stored.setdefault(driver, []).append(item)
        return stored

    def _owner(self) -> dict[str, Any]:
        """The owner reference to this node's Node."""
        try:
            node = self._api.read_node(self.node)
        except ApiError as exc:
            if exc.status == NOT_FOUND:
                msg = f"node {self.node} not found: its ResourceSlices need it as their owner"
                raise SlicePublishError(NOT_FOUND, msg) from None
            self._raise(exc, f"read node {self.node}")
        uid = (node.get("metadata") or {}).get("uid")
        if not uid:
            raise SlicePublishError(None, f"node {self.node} has no uid")
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "name": self.node,
            "uid": uid,
            "controller": True,
        }

    def _raise(self, exc: ApiError, what: str) -> NoReturn:
        if exc.status == CONFLICT:
            raise _Conflict(f"resource slices of {self.node}: {what}: {exc}") from None
        raise SlicePublishError(
            exc.status, f"resource slices of {self.node}: {what}: {exc}"
        ) from None

    @staticmethod
    def _merge(first: SyncResult, second: SyncResult) -> SyncResult:
        return SyncResult(
            created=first.created + second.created,
            updated=first.updated + second.updated,
            deleted=first.deleted + second.deleted,
            generations={**first.generations, **second.generations},
        )


def _generation(item: Mapping[str, Any]) -> int:
    return int(((item.get("spec") or {}).get("pool") or {}).get("generation") or 0)


def remove_stale_slices(api: DraApi, node: str) -> None:
    """No vendor is served through DRA: remove the slices a former configuration published for
    `node` (a cluster without the DRA API, or an agent without its RBAC, has none of ours).
    Raises what another try may get past (a connection failure, a 5xx)."""
    log = structlog.get_logger().bind(part="dra", node=node)
    try:
        result = SlicePublisher(api, node).remove_all()
    except ApiError as exc:
        if exc.status in {403, 404}:
            return
        raise
    if result.deleted:
        log.info("stale ResourceSlices removed", deleted=result.deleted)
