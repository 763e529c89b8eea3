"""The DRA claims this node has prepared, on disk: what survives an agent restart.

`<state_dir>/dra/prepared.json` holds, per driver, claim uid → the claim's namespace and name
and the devices kubelet was answered with (their requests, pool, name, CDI ids, share and
consumed capacity). A claim is recorded before kubelet hears that it is prepared and forgotten
once it is unprepared, so a restarted agent answers a repeated prepare with what it answered
before, and knows which claims hold which devices.

The file is rewritten atomically (a temporary file, fsync, rename, fsync of the directory) on
every change and read once, when the store is made. A file that cannot be read as this format is
set aside as `prepared.json.corrupt` with one log line and the store starts empty: kubelet keeps
its own record of prepared claims, and a later unprepare of a claim we forgot still succeeds.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from edl_agent.runtime.durable import read_state, write_atomically

FORMAT = 1
DIRECTORY = "dra"
FILE_NAME = "prepared.json"


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim, as kubelet was told: `requests` are the claim's (base)
    request names it answers, `cdi_ids` what the runtime injects for it."""

    requests: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    share_id: str | None = None
    consumed: Mapping[str, int] = field(default_factory=dict)
    admin_access: bool = False


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    driver: str
    devices: tuple[PreparedDevice, ...]


class PreparedClaims:
    """The prepared claims of every DRA driver of this node; thread-safe. `put` and `remove`
    raise OSError when the file cannot be written, and then change nothing."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / DIRECTORY / FILE_NAME
        self._lock = threading.Lock()
        self._log = structlog.get_logger().bind(part="dra-checkpoint", path=str(self.path))
        self._claims: dict[tuple[str, str], PreparedClaim] = self._load()

    def get(self, driver: str, uid: str) -> PreparedClaim | None:
        with self._lock:
            return self._claims.get((driver, uid))

    def claims(self, driver: str | None = None) -> tuple[PreparedClaim, ...]:
        """Every prepared claim, or those of `driver`, in (driver, uid) order."""
        with self._lock:
            return tuple(
                claim
                for key, claim in sorted(self._claims.items())
                if driver is None or key[0] == driver
            )

    def put(self, claim: PreparedClaim) -> None:
        with self._lock:
            claims = dict(self._claims)
            claims[(claim.driver, claim.uid)] = claim
            self._save(claims)

    def remove(self, driver: str, uid: str) -> bool:
        """Forget a claim; False when it was not recorded (nothing is written then)."""
        with self._lock:
            if (driver, uid) not in self._claims:
                return False
            claims = dict(self._claims)
            del claims[(driver, uid)]
            self._save(claims)
            return True

    def _save(self, claims: dict[tuple[str, str], PreparedClaim]) -> None:
        text = json.dumps(_encode(claims.values()), indent=1, sort_keys=True) + "\n"
        write_atomically(self.path, text)
        self._claims = claims

    def _load(self) -> dict[tuple[str, str], PreparedClaim]:
        # A warning only: kubelet keeps its own record, and unprepares what we forgot.
        read = read_state(
            self.path, _decode, what="prepared claims file", log=self._log, corrupt_level="warning"
        )
        if read is None:
            return {}
        claims, _ = read
        self._log.info("prepared claims loaded", claims=len(claims))
        return claims


def _encode(claims: Iterable[PreparedClaim]) -> dict[str, Any]:
    drivers: dict[str, dict[str, Any]] = {}
    for claim in claims:
        drivers.setdefault(claim.driver, {})[claim.uid] = {
            "namespace": claim.namespace,
            "name": claim.name,
            "devices": [_encode_device(device) for device in claim.devices],
        }
    return {"format": FORMAT, "drivers": drivers}


def _encode_device(device: PreparedDevice) -> dict[str, Any]:
    encoded: dict[str, Any] = {
        "requests": list(device.requests),
        "pool": device.pool,
        "device": device.device,
        "cdi_ids": list(device.cdi_ids),
    }
    if device.share_id is not None:
        encoded["share_id"] = device.share_id
    if device.consumed:
        encoded["consumed"] = dict(device.consumed)
    if device.admin_access:
        encoded["admin_access"] = True
    return encoded


def _decode(data: Any) -> dict[tuple[str, str], PreparedClaim]:
    if _mapping(data).get("format") != FORMAT:
        raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
    claims: dict[tuple[str, str], PreparedClaim] = {}
    for driver, by_uid in _mapping(data["drivers"]).items():
        for uid, entry in _mapping(by_uid).items():
            claims[(driver, uid)] = PreparedClaim(
                uid=uid,
                namespace=_text(entry["namespace"]),
                name=_text(entry["name"]),
                driver=driver,
                devices=tuple(_decode_device(_mapping(d)) for d in _list(entry["devices"])),
            )
    return claims


def _decode_device(data: Mapping[str, Any]) -> PreparedDevice:
    share_id = data.get("share_id")
    return PreparedDevice(
        requests=tuple(_text(r) for r in _list(data["requests"])),
        pool=_text(data["pool"]),
        device=_text(data["device"]),
        cdi_ids=tuple(_text(c) for c in _list(data["cdi_ids"])),
        share_id=None if share_id is None else _text(share_id),
        consumed={_text(k): _int(v) for k, v in _mapping(data.get("consumed", {})).items()},
        admin_access=data.get("admin_access") is True,
    )


def _mapping(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"expected an object, got {type(value).__name__}")
    return value


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {type(value).__name__}")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return value
