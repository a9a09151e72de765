"""Fixtures for the core tests: a sync-or-async driver, and holder processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from task_locks import watchdog

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


@pytest.fixture(autouse=True)
def _no_leftover_renewals() -> Iterator[None]:
    """A failing test may leave leases behind: stop renewing them for the next test."""
    yield
    watchdog.thread_renewer().schedule.clear()
