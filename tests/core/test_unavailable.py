"""Redis down or paused -> BackendUnavailable within the socket timeout."""

from __future__ import annotations

import time

import pytest
from servers import RedisServer, wait_until

from task_locks import BackendUnavailable

from .support import SyncDriver, blocked_clients

SOCKET_TIMEOUT = 0.5
#: Scheduling slack on a busy 2-core machine; the point is "not the lock's timeout".
SLACK = 0.5


def hurt(server: RedisServer, outage: str) -> None:
    if outage == "stopped":
        server.stop()
    else:
        server.pause()  # SIGSTOP: connections open, nothing answers


def assert_names_lock_and_server(error: BackendUnavailable, name: str, port: int) -> None:
    assert error.name == name
    assert f"127.0.0.1:{port}" in (error.server or "")
    assert repr(name) in str(error) and f"127.0.0.1:{port}" in str(error)


@pytest.mark.parametrize("outage", ["stopped", "paused"])
def test_acquire_and_release_fail_fast(driver: SyncDriver, redis_factory, outage: str) -> None:
    server = redis_factory()
    url = server.url(socket_timeout=SOCKET_TIMEOUT)
    held = driver.acquire("outage:held", backend=url, ttl=30)
    hurt(server, outage)

    attempts = {
        "try once": lambda: driver.acquire("outage:new", timeout=0, backend=url, ttl=5),
        "wait 30 s": lambda: driver.acquire("outage:new", timeout=30, backend=url, ttl=5),
        "wait forever": lambda: driver.acquire("outage:new", timeout=None, backend=url, ttl=5),
    }
    for what, attempt in attempts.items():
        started = time.monotonic()
        with pytest.raises(BackendUnavailable) as caught:
            attempt()
        assert time.monotonic() - started < SOCKET_TIMEOUT + SLACK, what
        assert_names_lock_and_server(caught.value, "outage:new", server.port)

    started = time.monotonic()
    with pytest.raises(BackendUnavailable) as caught:
        held.release()
    assert time.monotonic() - started < SOCKET_TIMEOUT + SLACK
    assert_names_lock_and_server(caught.value, "outage:held", server.port)


def test_blocked_waiter_raises_when_redis_pauses(driver: SyncDriver, redis_factory) -> None:
    server = redis_factory()
    url = server.url(socket_timeout=SOCKET_TIMEOUT)
    holder = driver.acquire("outage:wait", backend=url, ttl=30)
    waiter = driver.start_acquire("outage:wait", timeout=None, backend=url, ttl=5)
    wait_until(lambda: blocked_clients(url) >= 1, 15, "the waiter to block")
    server.pause()
    paused_at = time.monotonic()
    with pytest.raises(BackendUnavailable) as caught:
        waiter.result(timeout=10)
    assert time.monotonic() - paused_at < SOCKET_TIMEOUT + SLACK
    assert_names_lock_and_server(caught.value, "outage:wait", server.port)
    server.resume()
    holder.release()


def test_service_resumes_after_the_outage(driver: SyncDriver, redis_factory) -> None:
    """Errors are not sticky: the next call after the server is back just works."""
    server = redis_factory()
    url = server.url(socket_timeout=SOCKET_TIMEOUT)
    driver.acquire("outage:before", timeout=0, backend=url, ttl=5).release()
    server.restart()
    handle = driver.acquire("outage:after", timeout=0, backend=url, ttl=5)
    handle.release()


def test_a_grant_that_arrives_after_its_ttl_is_given_back(redis_factory) -> None:
    """A reply slower than the TTL must not become a lease: the lock may be another's.

    Redis is paused while the acquire is in flight, so the grant (PX 300 ms) is sent only
    after the client has waited longer than the TTL.
    """
    import threading

    from task_locks import Lock

    server = redis_factory()
    url = server.url(socket_timeout=5)
    lock = Lock("slow-grant", ttl=0.3, backend=url)
    assert lock.holder() is None  # connection made before the pause

    def resume_later() -> None:
        time.sleep(0.6)  # the fault's length, not synchronisation
        server.resume()

    server.pause()
    threading.Thread(target=resume_later, daemon=True).start()
    with pytest.raises(BackendUnavailable, match="longer than the TTL"):
        lock.acquire(timeout=0)
    assert lock.holder() is None  # given back, nobody waits for its TTL

    server.pause()
    threading.Thread(target=resume_later, daemon=True).start()
    lease = lock.acquire(timeout=5)  # the retry after the late grant succeeds
    assert lease.held
    lease.release()
