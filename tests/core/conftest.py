"""Fixtures for the core tests: a sync-or-async driver, and holder processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis
from chaoskit.proxy import Proxy, ProxyHub
from lease_fixtures import no_leftover_renewals  # noqa: F401  (autouse here)
from servers import RedisServer

from task_locks.backends.redis import SCRIPTS

from .support import AsyncDriver, Child, SyncDriver


@pytest.fixture(params=["sync", "async"])
def driver(request: pytest.FixtureRequest) -> Iterator[SyncDriver]:
    """The same test body against ``Lock`` and against ``AsyncLock``."""
    instance = SyncDriver() if request.param == "sync" else AsyncDriver()
    yield instance
    instance.close()


@pytest.fixture
def scripted_link(redis_server: RedisServer, redis_url: str) -> Iterator[Proxy]:
    """A proxy in front of the shared (flushed) Redis, with our scripts already loaded: a
    first EVALSHA refused with NOSCRIPT would take the fault instead of the call."""
    client = redis.Redis(port=redis_server.port)
    for source in SCRIPTS.source.values():
        client.script_load(source)
    client.close()
    hub = ProxyHub()
    yield hub.proxy(redis_server.port)
    hub.close()


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
