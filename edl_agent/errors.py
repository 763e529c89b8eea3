"""Errors that mean bad input from a person: commands print them as one line and exit 2."""


class UsageError(Exception):
    """Bad input from the person running the command."""


def shorten(text: str, limit: int = 60) -> str:
    """`text` cut to `limit` characters, so that a message quoting a person's input stays one
    readable line whatever that input's size."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


class Unavailable(Exception):
    """A command could not find out what it was asked (an API server that does not answer or
    refuses): printed as one line, exit 1."""
