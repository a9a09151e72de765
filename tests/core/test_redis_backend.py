"""The Redis backend for operators and odd set-ups: holders, force_release, NOSCRIPT, URLs."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis
import redis.connection
from servers import wait_until

from task_locks import AsyncLock, AsyncSemaphore, NotOwned, get_backend, owner_context
from task_locks.types import Owner, RenewItem

from .support import SyncDriver, holder_token


def listing(driver: SyncDriver, url: str, prefix: str) -> list:
    backend = get_backend(url)
    lister = backend.aholders if driver.mode == "async" else backend.holders
    return list(driver.call(lister, prefix))


def test_holders_lists_live_locks_by_prefix_with_owner(driver: SyncDriver, redis_url: str) -> None:
    with redis.Redis.from_url(redis_url) as client:
        client.config_resetstat()  # the server is shared: other tests may have sent KEYS
    with owner_context(task_id="t-42", task_name="reports.build", worker="w1@host"):
        reports = [driver.acquire(f"report:{i}", backend=redis_url, ttl=5) for i in range(3)]
    other = driver.acquire("sync:1", backend=redis_url, ttl=5)
    glob = driver.acquire("odd[*]?name", backend=redis_url, ttl=5)

    listed = listing(driver, redis_url, "report:")
    assert [h.name for h in listed] == ["report:0", "report:1", "report:2"]
    first = listed[0]
    assert first.fence == reports[0].fence
    assert first.owner.task_id == "t-42" and first.owner.task_name == "reports.build"
    assert first.owner.worker == "w1@host"
    assert first.owner.pid == os.getpid() and first.owner.host == socket.gethostname()
    assert first.acquired_at is not None and abs(first.acquired_at - time.time()) < 5
    assert first.expires_at is not None and 0 < first.expires_at - time.time() <= 5
    assert "reports.build" in first.describe()
    # Glob characters in names and prefixes are literal.
    assert [h.name for h in listing(driver, redis_url, "odd[*]")] == ["odd[*]?name"]
    assert listing(driver, redis_url, "report:*") == []
    assert len(listing(driver, redis_url, "")) == 5
    # The one-name lookup agrees with the listing.
    assert driver.call(driver.lock("report:1", backend=redis_url).holder).fence == reports[1].fence
    # Operators' listing scans; it never blocks the server with KEYS.
    with redis.Redis.from_url(redis_url) as client:
        stats = client.info("commandstats")
    assert "cmdstat_scan" in stats and "cmdstat_keys" not in stats
    for handle in [*reports, other, glob]:
        handle.release()
    assert listing(driver, redis_url, "") == []


def test_force_release_frees_the_lock_and_the_holder_finds_out(
    driver: SyncDriver, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend = get_backend(redis_url)
    force = backend.aforce_release if driver.mode == "async" else backend.force_release
    handle = driver.acquire("stuck", backend=redis_url, ttl=0.6)
    assert driver.call(force, "stuck") is True
    assert driver.call(force, "stuck") is False  # nothing held any more
    assert any(
        r.levelno == logging.WARNING and "'stuck' was force-released" in r.getMessage()
        for r in caplog.records
    )
    other = driver.acquire("stuck", timeout=0, backend=redis_url, ttl=5)  # free at once
    with pytest.raises(NotOwned):
        handle.release()
    assert holder_token(redis_url, "stuck") == other.token
    other.release()


def test_noscript_is_handled_after_script_flush(driver: SyncDriver, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.script_flush()
    handle = driver.acquire("noscript", backend=redis_url, ttl=0.6)
    client.script_flush()
    handle.renew()
    client.script_flush()
    renewals = handle.renewals
    wait_until(lambda: handle.renewals > renewals, 1, "a watchdog renewal (batched script)")
    client.script_flush()
    waiter = driver.start_acquire("noscript", timeout=5, backend=redis_url, ttl=5)
    handle.release()
    second, _ = waiter.result(timeout=5)
    client.script_flush()
    assert get_backend(redis_url).renew_many([RenewItem("noscript", second.token, 5000)]) == [True]
    second.release()
    assert holder_token(redis_url, "noscript") is None
    client.close()


def test_rediss_url_builds_a_tls_client_without_connecting() -> None:
    backend = get_backend("rediss://:s3cret@127.0.0.1:6390/2?socket_timeout=1.5&prefix=app:")
    pool = backend.client.connection_pool
    assert issubclass(pool.connection_class, redis.connection.SSLConnection)
    assert pool.connection_kwargs["db"] == 2
    assert pool.connection_kwargs["socket_timeout"] == 1.5
    assert backend.prefix == "app:"
    assert "s3cret" not in backend.server and "s3cret" not in repr(backend)


def test_unix_socket_url(driver: SyncDriver, redis_factory, tmp_path) -> None:
    path = tmp_path / "redis.sock"
    redis_factory(extra=["--unixsocket", str(path), "--unixsocketperm", "700"])
    url = f"unix://{path}?db=3&socket_timeout=2"
    handle = driver.acquire("over-unix", backend=url, ttl=5)
    with redis.Redis(unix_socket_path=str(path), db=3) as client:
        assert client.exists("task_locks:{over-unix}")
    assert holder_token(url, "over-unix") == handle.token
    handle.release()


def test_prefix_option_namespaces_locks(redis_url: str) -> None:
    one = get_backend(redis_url + "?prefix=one:")
    two = get_backend(redis_url + "?prefix=two:")
    from task_locks import Lock

    first = Lock("shared", ttl=5, backend=one).acquire(timeout=0)
    second = Lock("shared", ttl=5, backend=two).acquire(timeout=0)  # another namespace
    assert [h.name for h in one.holders()] == ["shared"]
    first.release()
    second.release()


def test_a_wall_clock_step_during_a_holder_read_keeps_the_holder(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wall clock jumps 30 s ahead while ``holder()`` waits for its reply (patched:
    a real step needs root and moves every process's clock). The lock is live on the
    server; it used to be reported gone ("expired by the time the reply came", judged on
    the wall clock), and a redelivered Celery copy took its run for finished and was
    refused: the message lost (simulation seed 157943)."""
    backend = get_backend(redis_url)
    name = f"wall-step-{os.getpid()}-{time.monotonic_ns()}"
    assert backend.acquire(name, "tok", 5_000, Owner()).acquired
    real, reads = time.time, [0]

    def stepping() -> float:  # the first read is the send; every later one is after the step
        reads[0] += 1
        return real() + (30.0 if reads[0] > 1 else 0.0)

    monkeypatch.setattr(time, "time", stepping)
    found = backend.holder(name)
    monkeypatch.undo()
    assert found is not None and found.token == "tok"
    assert backend.release(name, "tok")


def loops_close_their_connections(redis_url: str, main: Callable[[], Awaitable[None]]) -> None:
    """Run ``main`` in four event loops: the server counts no more connections after the
    last three than after the first. The notices' listener, which stays open for good, is
    left out: its thread subscribes when it gets there, which under load was after the
    first loop's count."""
    admin = redis.Redis.from_url(redis_url)

    def connected() -> int:
        subscribed = ("sub", "psub", "ssub")
        return sum(
            not any(int(client.get(kind, 0)) for kind in subscribed)
            for client in admin.client_list()
        )

    try:
        asyncio.run(main())
        settled = connected()
        for _ in range(3):
            asyncio.run(main())
        wait_until(lambda: connected() <= settled, 5, "each loop's connections to close")
    finally:
        admin.close()


def test_a_lock_released_as_its_loop_ends_leaves_no_connection_open(redis_url: str) -> None:
    """A generator still inside ``async with`` when ``asyncio.run`` ends is closed beside
    the client's closer (``shutdown_asyncgens`` closes them together): the closer waits
    for the release's connection to come back, then closes it too."""
    url = f"{redis_url}?prefix=loop-release:"  # a backend of its own: no other test's clients
    kept: list[AsyncIterator[int]] = []

    async def rows() -> AsyncIterator[int]:
        async with AsyncLock("loop-release", ttl=30, backend=url):
            yield 1

    async def main() -> None:
        kept.append(rows())
        assert await anext(kept[-1]) == 1

    loops_close_their_connections(redis_url, main)
    assert get_backend(url).holder("loop-release") is None  # and the lock was released


def test_a_loop_that_asyncio_run_ends_leaves_no_connection_open(redis_url: str) -> None:
    """Each event loop has its own client; ``asyncio.run`` ending the loop closes it too,
    with no ``backend.aclose()`` from the user. Before, every loop's connections stayed
    open (the server counted them) until a garbage collection found the sockets:
    ``ResourceWarning: unclosed <socket ...>``."""
    url = f"{redis_url}?prefix=loop-sockets:"  # a backend of its own: no other test's clients

    async def main() -> None:
        semaphore = AsyncSemaphore("loop-sockets", limit=2, ttl=5, backend=url, timeout=10)

        async def work() -> None:
            async with semaphore:
                await asyncio.sleep(0.01)

        await asyncio.gather(*(work() for _ in range(6)))  # several pooled connections

    loops_close_their_connections(redis_url, main)
