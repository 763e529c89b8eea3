"""Errors that mean bad input from a person: commands print them as one line and exit 2."""


class UsageError(Exception):
    """Bad input from the person running the command."""
