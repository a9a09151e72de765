"""Fixtures for the core tests: a sync-or-async driver, and holder processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from lease_fixtures import no_leftover_renewals  # noqa: F401  (autouse here)

from .support import AsyncDriver, Child, SyncDriver


@pytest.fixture(params=["sync", "async"])
def driver(request: pytest.FixtureRequest) -> Iterator[SyncDriver]:
    """The same test body against ``Lock`` and against ``AsyncLock``."""
    instance = SyncDriver() if request.param == "sync" else AsyncDriver()
    yield instance
    instance.close()


@pytest.fixture
def children() -> Iterator[Callable[..., Child]]:
    """Start holder processes (``mode``: "sync" or "async"); all closed at the end."""
    started: list[Child] = []

    def start(url: str, name: str, ttl: float, mode: str) -> Child:
        child = Child(url, name, ttl, mode)
        started.append(child)
        return child

    yield start
    for child in started:
        child.close()
