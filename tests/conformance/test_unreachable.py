"""An unreachable lock service is reported within the URL's documented timeout.

Two outages, against real servers: nothing listens on the port (refused at once), and the
server is frozen with SIGSTOP (connections open, nothing answers: the socket timeout). The
bound is the timeout the README documents for each scheme, plus scheduling slack; before
this test an unreachable ``redis+sentinel://`` took 8 s with ``connect_timeout=2`` (redis-py
retried each sentinel three times with backoff).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from servers import EtcdServer, RedisSentinel, RedisServer, free_port

from task_locks import BackendUnavailable, Lock

#: Scheduling slack on a busy 2-core machine.
SLACK = 1.0
#: The per-call timeout every URL below asks for (seconds).
TIMEOUT = 1.0

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


SCHEMES = ["redis", "sentinel", "cluster", "redlock", "etcd"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_nothing_listening_is_reported_within_the_timeout(scheme: str) -> None:
    url, bound = _nothing_listens(scheme)
    _assert_reported_within(url, bound)


@pytest.mark.parametrize("scheme", ["redis", "sentinel", "redlock", "etcd"])
def test_a_frozen_server_is_reported_within_the_timeout(
    scheme: str, cleanups: list[Callable[[], None]]
) -> None:
    url, bound = _paused(scheme, cleanups)
    _assert_reported_within(url, bound)


def _assert_reported_within(url: str, bound: float) -> None:
    lock = Lock("unreachable", ttl=5, backend=url)
    start = time.monotonic()
    with pytest.raises(BackendUnavailable) as caught:
        lock.acquire(timeout=0)
    took = time.monotonic() - start
    assert caught.value.name == "unreachable"
    assert took < bound + SLACK, f"{url}: reported after {took:.2f}s (documented: {bound}s)"
