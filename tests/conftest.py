"""Fixtures shared by every test: real Redis servers, and a clean task-locks state."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis
from chaoskit.proxy import Proxy, ProxyHub

# The conformance deployments' servers, for every directory (one set per session).
from deployments import (  # noqa: F401
    etcd_cluster,
    etcd_node,
    redis_cluster,
    redis_masters,
    redis_sentinel,
)
from hypothesis import settings as hypothesis_settings

# The secured servers (TLS, etcd RBAC, Redis ACL users), for every directory.
from secure_fixtures import acl_redis, certs, rbac_etcd, tls_etcd, tls_redis  # noqa: F401
from servers import RedisServer

import task_locks
from task_locks import config, events
from task_locks.backends.redis_scripts import SCRIPTS

#: Fixtures of the event stream and metrics (seen, metric, only_logging_stays).
pytest_plugins = ["event_fixtures"]

# CI runs in a fresh clone: keep no example database there, and print the seed to replay.
hypothesis_settings.register_profile("ci", database=None, print_blob=True)
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    hypothesis_settings.load_profile("ci")


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
    """Each test starts with no configured default, no cached backends and no earlier
    test's events still on their way (a subscription made now would get them: the
    dispatcher thread lagged that far once, under load)."""
    events.flush(2.0)
    config.reset()
    yield
    task_locks.close_all()
    config.reset()


def pytest_report_header() -> list[str]:
    return [f"task-locks tests, pid {os.getpid()}"]


#: A skip whose reason starts with this is by design (the test does not apply to that
#: parameter), not a missing server; every other skip fails the run under ``CI=true``.
NOT_APPLICABLE = "not applicable: "


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Under ``CI=true`` a missing server is a failure: a skipped backend is untested."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI", "").lower() not in ("1", "true", "yes") or not report.skipped:
        return
    if hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if reason.removeprefix("Skipped: ").startswith(NOT_APPLICABLE):
        return
    report.outcome = "failed"
    report.longrepr = f"skipped under CI=true, where every server must be there: {reason}"


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
