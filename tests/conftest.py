"""Shared test hygiene."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import structlog


@pytest.fixture(autouse=True, scope="session")
def _no_ambient_kubeconfig() -> Iterator[None]:
    """$KUBECONFIG is a credential source for the agents and restarters tests start; tests name
    their kubeconfig explicitly and must never reach the cluster of the shell running them."""
    saved = os.environ.pop("KUBECONFIG", None)
    yield
    if saved is not None:
        os.environ["KUBECONFIG"] = saved


@pytest.fixture(autouse=True, scope="session")
def _state_in_scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Agents tests start without naming a state directory keep their quarantine and outbox in
    the session's scratch folder, never in /var/lib/edl-agent (nor each other's, across runs)."""
    key = "EDL_FAULTS__STATE_DIR"
    saved = os.environ.get(key)
    os.environ[key] = str(tmp_path_factory.mktemp("agent-state"))
    yield
    if saved is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = saved


@pytest.fixture(autouse=True)
def _fresh_logging() -> Iterator[None]:
    """Commands configure structlog globally; give every test the library defaults back."""
    yield
    structlog.reset_defaults()
