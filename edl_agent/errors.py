"""Errors that mean bad input from a person: commands print them as one line and exit 2."""

import difflib
from collections.abc import Iterable


class UsageError(Exception):
    """Bad input from the person running the command."""


def shorten(text: str, limit: int = 60) -> str:
    """`text` cut to `limit` characters, so that a message quoting a person's input stays one
    readable line whatever that input's size."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def did_you_mean(word: str, known: Iterable[str], *, prefix: str = "") -> str:
    """`, did you mean X?` for the known word closest to a mistyped one, or `` when none is
    close; `prefix` goes before the suggestion (`health.` for a nested key)."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.75)
    return f", did you mean {prefix}{close[0]}?" if close else ""


class Unavailable(Exception):
    """A command could not find out what it was asked (an API server that does not answer or
    refuses): printed as one line, exit 1."""
