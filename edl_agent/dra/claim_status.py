"""Device health in the ResourceClaims this node prepared (`status.devices`, KEP-4817, GA in
Kubernetes 1.37): each prepared device of ours carries one `Ready` condition, True while the
device is healthy and False with the fault's reason while it is not, so whoever reads the claim
(a user, a job controller) sees what kubelet shows in the pod's `allocatedResourcesStatus`.

Written by server-side apply, one field manager per driver: the entries of other drivers are
never touched, and the API server drops an entry once its device is no longer allocated. The
apply names the claim's uid, so a claim deleted and made again under the same name is left
alone. Only a change is written; a failed write is tried again with backoff. Writing needs
`patch` on `resourceclaims/status` and, under Kubernetes' granular status authorization (1.36+),
`associated-node:patch` on `resourceclaims/driver` for the driver's name: an agent may write its
own drivers' entries on claims allocated on its own node, nothing else.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import structlog

from edl_agent.dra.api import DraApi
from edl_agent.dra.checkpoint import PreparedClaim, PreparedDevice
from edl_agent.kube import CONFLICT, NOT_FOUND
from edl_agent.kube_errors import ApiError
from edl_agent.kube_time import format_time
from edl_agent.runtime.backoff import Backoff

READY = "Ready"
HEALTHY = "DeviceHealthy"
UNHEALTHY = "DeviceUnhealthy"
GONE_MESSAGE = "the device is no longer on this node"
MAX_MESSAGE = 1024
FORBIDDEN = 403

# (driver, pool, device, share id or ""): what identifies an entry of status.devices.
EntryKey = tuple[str, str, str, str]
# A device name → (healthy, why not), as the driver's kubelet plugin streams it.
DeviceHealth = Mapping[str, tuple[bool, str]]
# An entry's last Ready status and when it last changed.
Since = Mapping[EntryKey, tuple[str, str]]


def entry_key(driver: str, device: PreparedDevice) -> EntryKey:
    return (driver, device.pool, device.device, device.share_id or "")


def desired_entries(
    claim: PreparedClaim, health: DeviceHealth, since: Since, now: str
) -> list[dict[str, Any]]:
    """The `status.devices` entries of `claim`'s devices: a Ready condition each, whose
    lastTransitionTime stays as in `since` while its status does not change. A device the node
    no longer has is not Ready. One entry per device (and share), in the claim's order."""
    entries: dict[EntryKey, dict[str, Any]] = {}
    for device in claim.devices:
        key = entry_key(claim.driver, device)
        if key in entries:
            continue
        healthy, why = health.get(device.device, (False, GONE_MESSAGE))
        status = "True" if healthy else "False"
        previous = since.get(key)
        changed_at = previous[1] if previous is not None and previous[0] == status else now
        condition = {
            "type": READY,
            "status": status,
            "reason": HEALTHY if healthy else UNHEALTHY,
            "message": "healthy" if healthy else (why or "unhealthy")[:MAX_MESSAGE],
            "lastTransitionTime": changed_at,
        }
        entry: dict[str, Any] = {
            "driver": claim.driver,
            "pool": device.pool,
            "device": device.device,
            "conditions": [condition],
        }
        if device.share_id:
            entry["shareID"] = device.share_id
        entries[key] = entry
    return list(entries.values())


def since_of(entries: Iterable[Mapping[str, Any]], driver: str) -> dict[EntryKey, tuple[str, str]]:
    """The Ready status and transition time of `driver`'s entries in a claim's `status.devices`
    (what an earlier run wrote)."""
    found: dict[EntryKey, tuple[str, str]] = {}
    for entry in entries:
        if entry.get("driver") != driver:
            continue
        key = (driver, str(entry.get("pool")), str(entry.get("device")), entry.get("shareID") or "")
        for condition in entry.get("conditions") or []:
            if condition.get("type") == READY and condition.get("lastTransitionTime"):
                found[key] = (str(condition.get("status")), str(condition["lastTransitionTime"]))
    return found


def field_manager(driver: str) -> str:
    return f"edl-agent/{driver}"[:128]


class ClaimStatusWriter:
    """A supervised part: writes the prepared claims' device conditions whenever a claim is
    prepared or unprepared (`poke`) or a device's health changes (`wake` set by the health hub),
    and tries failed writes again."""

    name = "dra-claim-status"

    def __init__(
        self,
        *,
        api: DraApi,
        claims: Callable[[], Sequence[PreparedClaim]],
        health: Callable[[str], DeviceHealth],
        wake: threading.Event,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._api = api
        self._claims = claims
        self._health = health
        self._wake = wake
        self._now = now
        self._written: dict[tuple[str, str], list[dict[str, Any]]] = {}  # (driver, uid) → entries
        self._done: set[tuple[str, str]] = set()  # claims gone or made again under their name
        self._backoff = Backoff(1.0, 60.0)
        self._told_forbidden = False
        self.failures = 0
        self._log = structlog.get_logger().bind(part=self.name)

    def poke(self) -> None:
        self._wake.set()

    def run(self, stop: threading.Event, ready: Callable[[], None]) -> None:
        ready()
        while not stop.is_set():
            retry = self.sync()
            self._wake.wait(retry)
            self._wake.clear()

    def sync(self) -> float | None:
        """Write the entries that changed; seconds until failed writes are tried again (None
        when nothing failed)."""
        claims = self._claims()
        present = {(c.driver, c.uid) for c in claims}
        for key in set(self._written) - present:
            del self._written[key]
        self._done &= present
        failed = False
        for claim in claims:
            key = (claim.driver, claim.uid)
            if key in self._done:
                continue
            try:
                self._sync_one(claim)
            except ApiError as exc:
                failed = True
                self._failed(claim, exc)
        if not failed:
            self._backoff.reset()
            return None
        return self._backoff.next_delay()

    def _sync_one(self, claim: PreparedClaim) -> None:
        key = (claim.driver, claim.uid)
        written = self._written.get(key)
        since = self._since(claim) if written is None else since_of(written, claim.driver)
        now = format_time(self._now())
        entries = desired_entries(claim, self._health(claim.driver), since, now)
        if entries == written:
            return
        try:
            self._api.apply_claim_device_status(
                claim.namespace,
                claim.name,
                claim.uid,
                entries,
                manager=field_manager(claim.driver),
            )
        except ApiError as exc:
            if exc.status in {NOT_FOUND, CONFLICT}:  # gone, or another claim by that name now
                self._done.add(key)
                return
            raise
        self._written[key] = entries
        turned = [e["device"] for e in entries if e["conditions"][0]["status"] != "True"]
        self._log.info(
            "claim device status written",
            claim=f"{claim.namespace}/{claim.name}",
            devices=len(entries),
            not_ready=turned,
        )

    def _since(self, claim: PreparedClaim) -> Since:
        """What an earlier run wrote in the claim, so that a restart keeps transition times."""
        try:
            found = self._api.read_resource_claim(claim.namespace, claim.name)
        except ApiError as exc:
            if exc.status in {NOT_FOUND, CONFLICT}:
                return {}
            raise
        if (found.get("metadata") or {}).get("uid") != claim.uid:
            return {}
        return since_of((found.get("status") or {}).get("devices") or [], claim.driver)

    def _failed(self, claim: PreparedClaim, exc: ApiError) -> None:
        self.failures += 1
        # A driver permission refused comes back as an invalid status (422) naming it.
        if exc.status == FORBIDDEN or "resourceclaims/driver" in str(exc):
            if not self._told_forbidden:
                self._told_forbidden = True
                self._log.error(
                    "not allowed to write the claims' device status: the agent's role needs "
                    "patch on resourceclaims/status and associated-node:patch on "
                    "resourceclaims/driver for its drivers (deploy/daemonset/agent-rbac.yaml)",
                    claim=f"{claim.namespace}/{claim.name}",
                    error=str(exc),
                )
            return
        self._log.warning(
            "writing a claim's device status failed; trying again",
            claim=f"{claim.namespace}/{claim.name}",
            error=str(exc),
        )
