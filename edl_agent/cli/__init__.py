"""`edl-agent` command line: discover accelerators, and build simulated nodes to run on.

One module per command (`discover`, `run`, `config`, `simulate`; `restarter` and `hosts` are
their packages' own), `command` puts them under one parser, `parser` and `settings` are what
they share. Layered in pyproject.toml's import-linter contract `cli-layers`."""

from edl_agent.cli.command import main

__all__ = ["main"]
