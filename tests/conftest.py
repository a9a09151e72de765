"""Fixtures shared by every test: real Redis servers, and a clean task-locks state."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import task_locks
from task_locks import config

sys.path.insert(0, str(Path(__file__).parent))

from servers import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One Redis for the whole run; tests that hurt it use ``redis_factory``."""
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """A URL on the shared server, flushed before each test."""
    redis.Redis(port=redis_server.port).flushall()
    yield redis_server.url()


@pytest.fixture
def redis_factory() -> Iterator:
    """Start private Redis servers a test may stop, pause, kill or restart."""
    started: list[RedisServer] = []

    def start(**kwargs: object) -> RedisServer:
        server = RedisServer(**kwargs).start()  # type: ignore[arg-type]
        started.append(server)
        return server

    yield start
    for server in started:
        server.cleanup()


@pytest.fixture(autouse=True)
def _fresh_task_locks() -> Iterator[None]:
    """Each test starts with no configured default and no cached backends."""
    config.reset()
    yield
    task_locks.close_all()
    config.reset()


def pytest_report_header() -> list[str]:
    return [f"task-locks tests, pid {os.getpid()}"]
