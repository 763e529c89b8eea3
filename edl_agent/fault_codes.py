"""How vendor fault codes are spelled in settings and reasons: NVIDIA XIDs as decimal numbers,
Ascend fault codes as 8 hex digits (`0x80E01801`). Pure; the settings' checks
(`config.HealthSettings`) and the classification tables (`health.classify`) share it."""

from __future__ import annotations

import re
from collections.abc import Mapping

HEX_CODE = re.compile(r"^(?:0[xX])?([0-9a-fA-F]{1,8})$")


def parse_ascend_code(text: str) -> int:
    """`0x80E01801`, `80E01801` or `80e01801` to its number; ValueError for anything else."""
    match = HEX_CODE.match(text.strip())
    if match is None:
        msg = f"{text!r} is not an Ascend fault code (8 hex digits, e.g. 0x80E01801)"
        raise ValueError(msg)
    return int(match.group(1), 16)


def format_ascend_code(code: int) -> str:
    """The spelling used in reasons and settings: `0x80E01801`."""
    return f"0x{code:08X}"


def check_code_keys(setting: str, overrides: Mapping[str, str], *, ascend: bool) -> None:
    """Raise ValueError naming `setting` and the first key of `overrides` that is not an XID
    number (or, with `ascend`, not an Ascend fault code). The values' types check the values."""
    for key in overrides:
        if ascend:
            try:
                parse_ascend_code(key)
            except ValueError as exc:
                raise ValueError(f"{setting}: {exc}") from None
        elif not key.strip().isdigit():
            raise ValueError(f"{setting}: {key!r} is not an XID number")
