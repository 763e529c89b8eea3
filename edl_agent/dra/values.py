"""Values as ResourceSlices carry them: quantities in the API server's canonical form, driver
versions as semantic versions, typed attribute values cut to the API's limits. Pure."""

from __future__ import annotations

import re
from typing import Any

MAX_ATTRIBUTE_LENGTH = 64
_BINARY_SUFFIXES = ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_VERSION_NUMBERS = re.compile(r"^v?(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:\.(\d+))?")
_VERSION_WORD = re.compile(r"[^0-9A-Za-z-]+")


def mib_quantity(mib: int) -> str:
    """MiB as the API server writes the quantity back (its canonical form): `81920` → `80Gi`,
    `81559` → `81559Mi`."""
    if mib <= 0:
        return "0"
    amount, suffix = mib, "Mi"
    for larger in _BINARY_SUFFIXES[2:]:
        if amount % 1024:
            break
        amount, suffix = amount // 1024, larger
    return f"{amount}{suffix}"


def semver(version: str) -> str | None:
    """A driver's version as the semantic version a `version` attribute needs: leading zeros
    dropped, missing parts 0, a fourth number as build metadata, the rest a pre-release:
    `535.183.01` → `535.183.1`, `24.1.rc2` → `24.1.0-rc2`, `5.0.21.21` → `5.0.21+21`."""
    match = _VERSION_NUMBERS.match(version.strip())
    if match is None:
        return None
    major, minor, patch, fourth = (str(int(part)) if part else None for part in match.groups())
    core = f"{major}.{minor or 0}.{patch or 0}"
    rest = _VERSION_WORD.sub(".", version.strip()[match.end() :]).strip(".-")
    if rest:
        parts = [(p.lstrip("0") or "0") if p.isdigit() else p for p in rest.split(".")]
        core += "-" + ".".join(parts)
    if fourth is not None:
        core += f"+{fourth}"
    return core if len(core) <= MAX_ATTRIBUTE_LENGTH else None


def string_value(value: str) -> dict[str, Any]:
    return {"string": value[:MAX_ATTRIBUTE_LENGTH]}


def optional_string_value(value: str | None) -> dict[str, Any] | None:
    return string_value(value) if value else None


def version_value(value: str | None) -> dict[str, Any] | None:
    return {"version": value} if value else None


def int_value(value: str | None) -> dict[str, Any] | None:
    try:
        return {"int": int(value)} if value is not None else None
    except ValueError:
        return None
