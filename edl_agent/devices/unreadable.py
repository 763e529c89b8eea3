"""Tool cells that could not be read: each vendor's parser lists them, discovery warns once per
discovery with the first few, and the fields they held stay unknown."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MAX_LOGGED = 8


def warn_unreadable(log: Any, tool: str, problems: Sequence[str]) -> None:
    """One warning naming the cells of `tool`'s output that could not be read (none: silent).
    `log` is a structlog logger (bound loggers are typed Any by structlog)."""
    if problems:
        log.warning(
            f"{tool}: some cells could not be read; those fields are unknown",
            count=len(problems),
            cells=list(problems[:MAX_LOGGED]),
        )
