"""structlog setup: JSON lines for machines, readable lines for people, always on stderr.

Logs go to stderr so that command output on stdout (`discover --format json`) stays clean; the
format follows whether stderr is a terminal unless `log_format` says otherwise.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure(
    level: str = "info",
    fmt: Literal["auto", "json", "console"] = "auto",
    *,
    stream: object | None = None,
) -> None:
    out = stream if stream is not None else sys.stderr
    use_console = fmt == "console" or (fmt == "auto" and _is_tty(out))
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer(colors=_is_tty(out))
        if use_console
        else structlog.processors.JSONRenderer(sort_keys=False)
    )
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if not use_console:  # the console renderer formats exceptions itself
        processors.append(structlog.processors.format_exc_info)
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=out),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )


def _is_tty(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty()) if callable(isatty) else False
