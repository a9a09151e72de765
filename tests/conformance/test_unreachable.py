"""An unreachable lock service is reported within the URL's documented timeout.

Two outages, against real servers: nothing listens on the port (refused at once), and the
server is frozen with SIGSTOP (connections open, nothing answers: the socket timeout). The
bound is the timeout the README documents for each scheme, plus scheduling slack; before
this test an unreachable ``redis+sentinel://`` took 8 s with ``connect_timeout=2`` (redis-py
retried each sentinel three times with backoff), a frozen Redis Cluster primary 11 s with
``socket_timeout=1`` (the same retries), and a frozen database twice its ``timeout`` (an
acquire retried a connect that had sent nothing).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from servers import EtcdServer, RedisClusterNodes, RedisSentinel, RedisServer, free_port

from task_locks import Backend, BackendUnavailable, Lock

#: Scheduling slack on a busy 2-core machine.
SLACK = 1.0
#: The per-call timeout every URL below asks for (seconds).
TIMEOUT = 1.0
NAME = "unreachable"

Setup = Callable[[list[Callable[[], None]]], tuple[str, float]]


def _nothing_listens(scheme: str) -> tuple[str, float]:
    port = free_port()
    urls = {
        "redis": f"redis://127.0.0.1:{port}/0?connect_timeout={TIMEOUT}&socket_timeout={TIMEOUT}",
        "sentinel": f"redis+sentinel://127.0.0.1:{port}/mymaster?connect_timeout={TIMEOUT}"
        f"&socket_timeout={TIMEOUT}",
        "cluster": f"redis+cluster://127.0.0.1:{port}?connect_timeout={TIMEOUT}"
        f"&socket_timeout={TIMEOUT}",
        "redlock": f"redlock://127.0.0.1:{port},127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
        f"?node_timeout={TIMEOUT}",
        "etcd": f"etcd://127.0.0.1:{port}?timeout={TIMEOUT}",
    }
    # A refused connection needs no timeout at all: it must fail well inside one.
    return urls[scheme], TIMEOUT


@pytest.fixture
def cleanups() -> Iterator[list[Callable[[], None]]]:
    done: list[Callable[[], None]] = []
    yield done
    for cleanup in reversed(done):
        cleanup()


def _paused(scheme: str, cleanups: list[Callable[[], None]]) -> tuple[str, float]:
    """The server is up, then frozen: every call must end by the socket timeout."""
    if scheme == "etcd":
        node = EtcdServer().start()
        cleanups.append(node.cleanup)
        cleanups.append(node.resume)
        node.pause()
        return node.url(timeout=TIMEOUT), TIMEOUT
    master = RedisServer().start()
    cleanups.append(master.cleanup)
    cleanups.append(master.resume)
    options = f"connect_timeout={TIMEOUT}&socket_timeout={TIMEOUT}"
    if scheme == "redis":
        url = f"redis://127.0.0.1:{master.port}/0?{options}"
    elif scheme == "sentinel":
        sentinel = RedisSentinel(master).start()
        cleanups.append(sentinel.cleanup)
        url = sentinel.url(connect_timeout=TIMEOUT, socket_timeout=TIMEOUT)
    elif scheme == "redlock":
        others = [RedisServer().start() for _ in range(2)]
        for other in others:
            cleanups.append(other.cleanup)
            cleanups.append(other.resume)
        ports = [master.port, *(o.port for o in others)]
        url = "redlock://" + ",".join(f"127.0.0.1:{p}" for p in ports)
        url += f"?node_timeout={TIMEOUT}"
        for other in others:
            other.pause()
        master.pause()
        # The vote times out, then the clean-up release of any partial grant does too.
        return url, 2 * TIMEOUT
    else:
        raise AssertionError(scheme)
    master.pause()
    return url, TIMEOUT


def _paused_cluster_primary(cleanups: list[Callable[[], None]]) -> tuple[str, float]:
    """A 3-primary cluster whose client knows the slot map; then the primary serving the
    lock freezes. The client refreshes its slot map (redis-py 8 may ask the frozen
    primary first) and tries once more (a failover would have moved the slot): the
    documented bound is three socket timeouts."""
    import redis

    nodes = RedisClusterNodes(3).start()
    cleanups.append(nodes.cleanup)
    url = nodes.url(connect_timeout=TIMEOUT, socket_timeout=TIMEOUT)
    Lock(NAME, ttl=5, backend=url).acquire(timeout=0).release()  # the slot map is known
    probe = redis.Redis(port=nodes.nodes[0].port)
    slot = probe.cluster("keyslot", f"task_locks:{{{NAME}}}")
    port = next(
        int(primary[1])
        for first, last, primary, *_ in probe.execute_command("CLUSTER SLOTS")
        if first <= slot <= last
    )
    probe.close()
    frozen = next(n for n in nodes.nodes if n.port == port)
    cleanups.append(frozen.resume)
    frozen.pause()
    return url, 3 * TIMEOUT


SCHEMES = ["redis", "sentinel", "cluster", "redlock", "etcd"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_nothing_listening_is_reported_within_the_timeout(scheme: str) -> None:
    url, bound = _nothing_listens(scheme)
    _assert_reported_within(url, bound)


@pytest.mark.parametrize("scheme", ["redis", "sentinel", "cluster", "redlock", "etcd"])
def test_a_frozen_server_is_reported_within_the_timeout(
    scheme: str, cleanups: list[Callable[[], None]]
) -> None:
    if scheme == "cluster":
        url, bound = _paused_cluster_primary(cleanups)
    else:
        url, bound = _paused(scheme, cleanups)
    _assert_reported_within(url, bound)


def _assert_reported_within(url: str | Backend, bound: float) -> None:
    lock = Lock(NAME, ttl=5, backend=url)
    start = time.monotonic()
    with pytest.raises(BackendUnavailable) as caught:
        lock.acquire(timeout=0)
    took = time.monotonic() - start
    assert caught.value.name == NAME
    assert took < bound + SLACK, f"{url}: reported after {took:.2f}s (documented: {bound}s)"


# -- django:// (PostgreSQL, MariaDB) ---------------------------------------------------


def _django_networked() -> list[str]:
    from django.conf import settings

    return [alias for alias in ("pg", "mysql") if alias in settings.DATABASES]


@pytest.fixture
def blackhole() -> Iterator[int]:
    """A port that accepts connections (the kernel completes the handshake) and never
    answers: a frozen database server, without stopping the shared one."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


@pytest.mark.parametrize("alias", _django_networked())
@pytest.mark.parametrize("outage", ["nothing-listening", "frozen"])
def test_an_unreachable_database_is_reported_within_the_timeout(
    alias: str,
    outage: str,
    request: pytest.FixtureRequest,
    django_db_blocker: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """django:// on a database host that refuses, or accepts and never answers.

    The backend's connections go to another port (the way the fault-injection tests
    point them at a proxy); nothing else changes. PostgreSQL's driver waits at least 2 s
    for a connection (libpq rounds ``connect_timeout`` up to 2), so the URL's timeout is
    2 s for both databases.
    """
    from django_app.backend import DjangoBackend

    port = request.getfixturevalue("blackhole") if outage == "frozen" else free_port()
    timeout = 2.0
    backend = DjangoBackend(f"django://{alias}?timeout={timeout:g}")
    real_settings = backend._pool._settings
    monkeypatch.setattr(
        backend._pool, "_settings", lambda: {**real_settings(), "HOST": "127.0.0.1", "PORT": port}
    )
    try:
        with django_db_blocker.unblock():
            _assert_reported_within(backend, timeout)
    finally:
        backend.close()
