"""What a prepared DRA claim gets on this node: the decision behind kubelet's NodePrepareResources
and NodeUnprepareResources for one driver, with the API server, the devices, the CDI specs and
the checkpoint injected.

A claim is prepared from the ResourceClaim the API server holds: its uid must be the one kubelet
names (a claim deleted and made again under the same name is another claim), it must be
allocated, and of its allocation only the results of this driver in this node's pool are ours.
Every one of those devices must be on the node, healthy and available, named once, and held by
no other prepared claim unless both allocations share it (consumable-capacity shares, admin
access); otherwise the claim is refused with a reason and nothing is written. A prepared claim
gets a claim CDI spec, is recorded in the checkpoint, and only then answered; asked again, it is
answered from the checkpoint without reading the API server, so a repeat after a restart changes
nothing.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol

import structlog

from edl_agent.devices import names
from edl_agent.devices.model import Device, Health, Vendor
from edl_agent.dra.checkpoint import PreparedClaim, PreparedClaims, PreparedDevice

MIB = 2**20
# Consumed capacities counted in bytes by Kubernetes and in MiB by us.
BYTE_CAPACITIES = frozenset({"memory"})

ReadClaim = Callable[[str, str], Mapping[str, Any]]
DeviceMap = Mapping[str, tuple[Vendor, Device]]


@dataclass(frozen=True)
class ClaimRef:
    """A ResourceClaim as kubelet names it."""

    namespace: str
    name: str
    uid: str


@dataclass(frozen=True)
class Grant:
    """One allocated device of a claim: `consumed_capacity` is its share (`memory` in MiB,
    others as plain numbers such as `cores` in percent); empty for a whole device."""

    device_name: str
    device: Device
    request_names: tuple[str, ...]
    consumed_capacity: Mapping[str, int] = field(default_factory=dict)
    share_id: str | None = None
    admin_access: bool = False


class ClaimCdi(Protocol):
    """The per-claim CDI spec: `write` makes (or replaces) it and returns its CDI device id;
    `remove` deletes it and succeeds when there is none."""

    def write(self, claim_uid: str, grants: list[Grant]) -> str: ...

    def remove(self, claim_uid: str) -> None: ...


@dataclass(frozen=True)
class PrepareResult:
    devices: tuple[PreparedDevice, ...] = ()
    error: str | None = None


class ClaimRefused(Exception):
    """A claim this node will not prepare; the message says why."""


def always_available(device_name: str) -> str | None:
    return None


class Preparer:
    """Prepares and unprepares the claims of one driver in one pool (the node); thread-safe."""

    def __init__(
        self,
        *,
        driver: str,
        pool: str,
        read_claim: ReadClaim,
        devices: Callable[[], DeviceMap],
        checkpoint: PreparedClaims,
        claim_cdi: ClaimCdi,
        is_available: Callable[[str], str | None] = always_available,
    ) -> None:
        """`read_claim(namespace, name)` returns the ResourceClaim as the API server's JSON and
        raises when it cannot; `devices()` maps the driver's device names to what is on the node
        now, with `Device.health` as currently known; `is_available(name)` returns why a device
        may not be given to a claim (held elsewhere), or None."""
        self.driver = driver
        self.pool = pool
        self._read_claim = read_claim
        self._devices = devices
        self._checkpoint = checkpoint
        self._claim_cdi = claim_cdi
        self._is_available = is_available
        # Serialises deciding and recording, so two prepares of one claim cannot both write it.
        self._lock = threading.Lock()
        self._log = structlog.get_logger().bind(part="dra-prepare", driver=driver)

    def prepare(self, claims: Iterable[ClaimRef]) -> dict[str, PrepareResult]:
        """Claim uid → its devices, or why it was not prepared; one claim never fails another."""
        results: dict[str, PrepareResult] = {}
        for claim in claims:
            try:
                _check_named(claim)
                results[claim.uid] = PrepareResult(devices=self._prepare_one(claim))
            except ClaimRefused as exc:
                self._log.warning("claim refused", **_fields(claim), reason=str(exc))
                results[claim.uid] = PrepareResult(error=str(exc))
            except Exception as exc:
                self._log.exception("claim preparation failed", **_fields(claim))
                results[claim.uid] = PrepareResult(error=f"{type(exc).__name__}: {exc}")
        return results

    def unprepare(self, claims: Iterable[ClaimRef]) -> dict[str, str | None]:
        """Claim uid → None once its CDI spec and record are gone (also for a claim never
        prepared here), else the error."""
        results: dict[str, str | None] = {}
        for claim in claims:
            try:
                _check_named(claim)
            except ClaimRefused as exc:
                self._log.warning("claim not unprepared", **_fields(claim), reason=str(exc))
                results[claim.uid] = str(exc)
                continue
            try:
                with self._lock:
                    self._claim_cdi.remove(claim.uid)
                    known = self._checkpoint.remove(self.driver, claim.uid)
            except Exception as exc:
                self._log.exception("claim unpreparation failed", **_fields(claim))
                results[claim.uid] = f"{type(exc).__name__}: {exc}"
                continue
            if known:
                self._log.info("claim unprepared", **_fields(claim))
            results[claim.uid] = None
        return results

    def held(self) -> dict[str, frozenset[str]]:
        """Device name → uids of the prepared claims that hold it."""
        holders: dict[str, set[str]] = {}
        for claim in self._checkpoint.claims(self.driver):
            for device in claim.devices:
                holders.setdefault(device.device, set()).add(claim.uid)
        return {name: frozenset(uids) for name, uids in holders.items()}

    def _prepare_one(self, claim: ClaimRef) -> tuple[PreparedDevice, ...]:
        recorded = self._checkpoint.get(self.driver, claim.uid)
        if recorded is not None:
            return recorded.devices
        try:
            resource_claim = self._read_claim(claim.namespace, claim.name)
        except Exception as exc:
            raise ClaimRefused(
                f"reading ResourceClaim {claim.namespace}/{claim.name}: {exc}"
            ) from exc
        try:
            results = self._our_results(claim, resource_claim)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ClaimRefused(f"malformed ResourceClaim: {type(exc).__name__}: {exc}") from exc
        with self._lock:
            recorded = self._checkpoint.get(self.driver, claim.uid)
            if recorded is not None:
                return recorded.devices
            grants = self._grants(claim.uid, results)
            claim_cdi_id = self._claim_cdi.write(claim.uid, [grant for _, grant in grants])
            record = PreparedClaim(
                uid=claim.uid,
                namespace=claim.namespace,
                name=claim.name,
                driver=self.driver,
                devices=tuple(
                    PreparedDevice(
                        requests=grant.request_names,
                        pool=self.pool,
                        device=grant.device_name,
                        # Kubelet passes every device's ids on to the runtime: the claim's
                        # own spec is named once, with the first device.
                        cdi_ids=(names.cdi_id(vendor, grant.device_name),)
                        + ((claim_cdi_id,) if i == 0 else ()),
                        share_id=grant.share_id,
                        consumed=grant.consumed_capacity,
                        admin_access=grant.admin_access,
                    )
                    for i, (vendor, grant) in enumerate(grants)
                ),
            )
            try:
                self._checkpoint.put(record)
            except OSError:
                self._claim_cdi.remove(claim.uid)
                raise
        self._log.info(
            "claim prepared", **_fields(claim), devices=[d.device for d in record.devices]
        )
        return record.devices

    def _our_results(self, claim: ClaimRef, resource_claim: Mapping[str, Any]) -> list[_Result]:
        """The allocation results of this driver in this pool; refuses a replaced, unallocated
        or foreign claim."""
        uid = resource_claim["metadata"].get("uid")
        if uid != claim.uid:
            raise ClaimRefused(
                f"ResourceClaim {claim.namespace}/{claim.name} has uid {uid}, not {claim.uid}: "
                "the claim kubelet means is gone"
            )
        allocation = (resource_claim.get("status") or {}).get("allocation")
        if not allocation:
            raise ClaimRefused("the claim is not allocated")
        results = [
            _Result.parse(r)
            for r in (allocation.get("devices") or {}).get("results") or []
            if r["driver"] == self.driver and r["pool"] == self.pool
        ]
        if not results:
            raise ClaimRefused(f"the claim has no device of {self.driver} in pool {self.pool}")
        return results

    def _grants(self, claim_uid: str, results: list[_Result]) -> list[tuple[Vendor, Grant]]:
        """The devices `results` name, each checked: on the node, healthy, available, and not
        held by another prepared claim unless both may share it (caller holds the lock, so the
        checkpoint read here is the one the claim is recorded against)."""
        present = self._devices()
        held = self._held_by_others(claim_uid)
        grants: list[tuple[Vendor, Grant]] = []
        problems: list[str] = []
        taken: dict[str, list[_Result]] = {}
        for result in results:
            entry = present.get(result.device)
            if entry is None:
                problems.append(f"device {result.device}: not on this node")
                continue
            vendor, device = entry
            reason = "unhealthy" if device.health is Health.UNHEALTHY else None
            reason = reason or _overlap(result, held.get(result.device, ()), taken)
            taken.setdefault(result.device, []).append(result)
            reason = reason or self._is_available(result.device)
            if reason is not None:
                problems.append(f"device {result.device}: {reason}")
                continue
            grant = Grant(
                device_name=result.device,
                device=device,
                request_names=(result.request,),
                consumed_capacity=result.consumed,
                share_id=result.share_id,
                admin_access=result.admin_access,
            )
            grants.append((vendor, grant))
        if problems:
            raise ClaimRefused("; ".join(problems))
        return grants

    def _held_by_others(self, claim_uid: str) -> dict[str, list[tuple[str, PreparedDevice]]]:
        """Device name → (claim uid, device) of every other prepared claim holding it."""
        holders: dict[str, list[tuple[str, PreparedDevice]]] = {}
        for claim in self._checkpoint.claims(self.driver):
            if claim.uid != claim_uid:
                for device in claim.devices:
                    holders.setdefault(device.device, []).append((claim.uid, device))
        return holders


def _check_named(claim: ClaimRef) -> None:
    missing = [what for what in ("namespace", "name", "uid") if not getattr(claim, what)]
    if missing:
        raise ClaimRefused(f"kubelet named a claim without its {', '.join(missing)}")


def _overlap(
    result: _Result,
    holders: Iterable[tuple[str, PreparedDevice]],
    taken: Mapping[str, list[_Result]],
) -> str | None:
    """Why `result` cannot have its device beside what already holds it, or None. A device is
    shared only where every allocation of it allows that: a share of consumable capacity (its
    own share id) or admin access; anything else holds it exclusively."""
    shared = result.share_id is not None or result.admin_access
    for uid, device in holders:
        if not (shared and (device.share_id is not None or device.admin_access)):
            return f"held by prepared claim {uid}"
    for earlier in taken.get(result.device, ()):
        distinct = result.share_id is not None and earlier.share_id not in (None, result.share_id)
        if not (distinct or (result.admin_access and earlier.admin_access)):
            return "named twice in the claim"
    return None


@dataclass(frozen=True)
class _Result:
    """One entry of `status.allocation.devices.results`, read."""

    request: str
    device: str
    share_id: str | None
    consumed: Mapping[str, int]
    admin_access: bool = False

    @classmethod
    def parse(cls, result: Mapping[str, Any]) -> _Result:
        share_id = result.get("shareID")
        return cls(
            request=base_request(_text(result["request"])),
            device=_text(result["device"]),
            share_id=None if share_id is None else _text(share_id),
            consumed=consumed_capacity(result.get("consumedCapacity") or {}),
            admin_access=result.get("adminAccess") is True,
        )


def base_request(request: str) -> str:
    """`gpu/large` (a subrequest of a prioritised list) → `gpu`: kubelet matches containers'
    claims against base request names."""
    return request.split("/", 1)[0]


def consumed_capacity(quantities: Mapping[str, Any]) -> dict[str, int]:
    """An allocation result's `consumedCapacity` in our units (bytes capacities in MiB, rounded
    up); raises ClaimRefused for a quantity that cannot be read."""
    consumed: dict[str, int] = {}
    for name, quantity in quantities.items():
        try:
            value = parse_quantity(str(quantity))
        except ValueError as exc:
            raise ClaimRefused(f"consumed capacity {name}: {exc}") from exc
        consumed[name] = math.ceil(value / MIB if name in BYTE_CAPACITIES else value)
    return consumed


_QUANTITY = re.compile(
    r"(?P<number>\+?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(?P<binary>Ki|Mi|Gi|Ti|Pi|Ei)|[eE](?P<exponent>[+-]?[0-9]+)|(?P<decimal>[numkMGTPE]?))"
)
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL_EXPONENT = {
    "n": -9,
    "u": -6,
    "m": -3,
    "": 0,
    "k": 3,
    "M": 6,
    "G": 9,
    "T": 12,
    "P": 15,
    "E": 18,
}
# Beyond this a quantity is not a device's capacity but a typo (and too big to compute with).
_MAX_EXPONENT = 30


def parse_quantity(text: str) -> Fraction:
    """A non-negative Kubernetes quantity (`4Gi`, `4096Mi`, `1.5G`, `250m`, `1e3`, `25`),
    exactly."""
    match = _QUANTITY.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a quantity")
    number = Fraction(match["number"])
    if match["binary"] is not None:
        return number * _BINARY[match["binary"]]
    exponent = (
        int(match["exponent"])
        if match["exponent"] is not None
        else _DECIMAL_EXPONENT[match["decimal"]]
    )
    if abs(exponent) > _MAX_EXPONENT:
        raise ValueError(f"{text!r} is out of range")
    return number * Fraction(10) ** exponent


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _fields(claim: ClaimRef) -> dict[str, str]:
    return {"claim": f"{claim.namespace}/{claim.name}", "uid": claim.uid}
