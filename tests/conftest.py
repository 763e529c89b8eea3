"""Shared test hygiene."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog


@pytest.fixture(autouse=True)
def _fresh_logging() -> Iterator[None]:
    """Commands configure structlog globally; give every test the library defaults back."""
    yield
    structlog.reset_defaults()
