"""Tool output that could not be read as printed: each vendor's parser lists the cells it could not
read (their fields stay unknown) and what it had to repair; discovery warns once per discovery
with the first few."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MAX_LOGGED = 8


def warn_unreadable(log: Any, tool: str, problems: Sequence[str]) -> None:
    """One warning naming the problems in `tool`'s output (none: silent).
    `log` is a structlog logger (bound loggers are typed Any by structlog)."""
    if problems:
        log.warning(
            f"{tool}: output not read as printed; the fields named are unknown or repaired",
            count=len(problems),
            problems=list(problems[:MAX_LOGGED]),
        )
