"""The Redis paths (sync and asyncio) keep their connection checked out between exchanges.

redis-py's pool checkout and check-in cost as much client CPU as the rest of a lock's
request, so :func:`~task_locks.backends.redis_clients.checkout` keeps the connection an
exchange used for the next one. What must stay true, on a real server: a cycle opens no
new connection and takes none from the pool; a connection the server closed while it was kept
is replaced without the caller seeing an error; a forked child never writes to its
parent's socket; an exchange that fails is never kept with its reply unread.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import weakref
from typing import Any

import pytest
import redis
from servers import wait_until

from task_locks import AsyncLock, BackendUnavailable, Lock, get_backend
from task_locks.backends import redis_clients
from task_locks.backends.redis import RedisBackend


def _client_id(client: Any) -> int:
    (reply,) = redis_clients.send_commands(client, [("CLIENT", "ID")])
    return int(reply)


def test_lock_cycles_reuse_one_connection_and_leave_the_pool_alone(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = get_backend(redis_url)
    assert isinstance(backend, RedisBackend)
    lock = Lock("kept", ttl=30, backend=backend)
    lock.acquire().release()
    pool = backend.client.connection_pool
    made = pool._created_connections
    checkouts = []
    real_get = pool.get_connection
    monkeypatch.setattr(pool, "get_connection", lambda *a: checkouts.append(1) or real_get(*a))
    for _ in range(50):
        lock.acquire().release()
    assert not checkouts, "a cycle took a connection from the pool"
    assert pool._created_connections == made, "a cycle opened a connection"


def test_a_connection_the_server_closed_while_kept_is_replaced(redis_url: str) -> None:
    backend = get_backend(redis_url)
    assert isinstance(backend, RedisBackend)
    lock = Lock("killed-while-kept", ttl=30, backend=backend)
    lock.acquire().release()
    kept = _client_id(backend.client)
    redis.Redis.from_url(redis_url).client_kill_filter(_id=kept)
    lease = lock.acquire(timeout=0)  # no error: the connection's one retry reconnects
    lease.release()
    assert _client_id(backend.client) != kept


def test_a_forked_child_opens_its_own_connection(redis_url: str) -> None:
    backend = get_backend(redis_url)
    assert isinstance(backend, RedisBackend)
    parent = _client_id(backend.client)

    def child(queue: Any) -> None:
        # The child's copy of the backend (forked with the parent's kept connection).
        queue.put(_client_id(backend.client))

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    process = context.Process(target=child, args=(queue,))
    process.start()
    child_id = queue.get(timeout=10)
    process.join(10)
    assert process.exitcode == 0
    assert child_id != parent, "the child wrote to its parent's socket"
    assert _client_id(backend.client) == parent  # the parent's connection is undisturbed


def test_a_failed_exchange_is_not_kept(redis_factory: Any) -> None:
    """A call that timed out leaves its reply on the way: its connection is closed, and
    the next call, on a fresh one, reads its own reply, not the late one."""
    server = redis_factory()
    backend = get_backend(server.url(socket_timeout=0.3))
    assert isinstance(backend, RedisBackend)
    first = _client_id(backend.client)
    server.pause()
    try:
        with pytest.raises(redis.exceptions.TimeoutError):
            redis_clients.send_commands(backend.client, [("ECHO", "late")])
    finally:
        server.resume()
    assert not redis_clients.kept_count(backend.client.connection_pool)
    (reply,) = redis_clients.send_commands(backend.client, [("ECHO", "mine")])
    assert reply in (b"mine", "mine")
    assert _client_id(backend.client) != first
    # And through a lock: an acquire that timed out (it may still run once the server
    # resumes), then another lock's acquire, which reads its own answer.
    server.pause()
    try:
        with pytest.raises(BackendUnavailable):
            Lock("paused", ttl=5, backend=backend).acquire(timeout=0)
    finally:
        server.resume()
    lease = Lock("after", ttl=5, backend=backend).acquire(timeout=0)
    assert lease.name == "after"
    lease.release()


def test_a_bounded_call_on_a_kept_connection_closed_meanwhile_is_still_bounded(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal's call is bounded by the validity left; a kept connection that the
    pool's ``disconnect()`` closed meanwhile is connected first, so that its exchange
    reads with that bound, not the connection's own socket timeout."""
    backend = get_backend(redis_url)
    assert isinstance(backend, RedisBackend)
    pool = backend.client.connection_pool
    _client_id(backend.client)  # one connection kept
    pool.disconnect()
    timeouts: list[float | None] = []
    real_exchange = redis_clients._exchange

    def exchange(connection: Any, commands: Any) -> Any:
        timeouts.append(connection._sock.gettimeout())
        return real_exchange(connection, commands)

    monkeypatch.setattr(redis_clients, "_exchange", exchange)
    (reply,) = redis_clients.send_bounded(pool, 0.3, [("PING",)])
    assert reply in (b"PONG", "PONG", True)
    assert timeouts == [0.3]


# -- the asyncio path: the same keeping, one event loop's client at a time ---------------


async def _aclient_id(client: Any) -> int:
    (reply,) = await redis_clients.asend_commands(client, [("CLIENT", "ID")])
    return int(reply)


def test_async_lock_cycles_reuse_one_connection_and_leave_the_pool_alone(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = get_backend(redis_url)
    assert isinstance(backend, RedisBackend)

    async def main() -> None:
        lock = AsyncLock("kept-async", ttl=30, backend=backend)
        await (await lock.acquire()).release()
        client = backend._async_client()
        kept = await _aclient_id(client)
        pool = client.connection_pool
        calls = []
        real_get, real_release = pool.get_connection, pool.release
        monkeypatch.setattr(pool, "get_connection", lambda *a: calls.append(1) or real_get(*a))
        monkeypatch.setattr(pool, "release", lambda *a: calls.append(1) or real_release(*a))
        for _ in range(50):
            await (await lock.acquire()).release()
        assert not calls, "a cycle took a connection from the pool or gave one back"
        assert await _aclient_id(client) == kept, "a cycle used another connection"

    asyncio.run(main())


def test_an_async_connection_the_server_closed_while_kept_is_replaced(redis_url: str) -> None:
    backend = get_backend(redis_url)
    assert isinstance(backend, RedisBackend)

    async def main() -> None:
        lock = AsyncLock("killed-while-kept-async", ttl=30, backend=backend)
        await (await lock.acquire()).release()
        kept = await _aclient_id(backend._async_client())
        redis.Redis.from_url(redis_url).client_kill_filter(_id=kept)
        lease = await lock.acquire(timeout=0)  # no error: the connection's retry reconnects
        await lease.release()
        assert await _aclient_id(backend._async_client()) != kept

    asyncio.run(main())


@pytest.mark.parametrize("how", ["timed out", "cancelled"])
def test_an_async_exchange_that_failed_is_not_kept(redis_factory: Any, how: str) -> None:
    """A call that timed out, or whose task was cancelled, leaves its reply on the way:
    its connection is closed, and the next call reads its own reply, not the late one."""
    server = redis_factory()
    backend = get_backend(server.url(socket_timeout=0.3))
    assert isinstance(backend, RedisBackend)

    async def main() -> None:
        client = backend._async_client()
        first = await _aclient_id(client)
        server.pause()
        try:
            call = redis_clients.asend_commands(client, [("ECHO", "late")])
            if how == "timed out":
                with pytest.raises(redis.exceptions.TimeoutError):
                    await call
            else:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.1):
                        await call
        finally:
            server.resume()
        assert not redis_clients.kept_count(client.connection_pool)
        (reply,) = await redis_clients.asend_commands(client, [("ECHO", "mine")])
        assert reply in (b"mine", "mine")
        assert await _aclient_id(client) != first

    asyncio.run(main())


@pytest.mark.parametrize("how", ["timed out", "cancelled"])
def test_an_async_write_the_server_does_not_read_is_bounded(redis_factory: Any, how: str) -> None:
    """A write the transport cannot take at once (a paused server stops reading) waits
    at most the socket timeout, then fails as redis-py's own send does; cancelled while
    it waits, it stops then. Either way its connection is closed at once, its unsent
    bytes dropped (not left for a close to flush), and not kept."""
    server = redis_factory()
    backend = get_backend(server.url(socket_timeout=0.3))
    assert isinstance(backend, RedisBackend)

    async def main() -> None:
        client = backend._async_client()
        await _aclient_id(client)
        [connection] = redis_clients._kept_for(client.connection_pool) or []
        transport = connection._writer.transport
        server.pause()
        try:
            started = asyncio.get_running_loop().time()
            call = redis_clients.asend_commands(client, [("ECHO", "x" * (16 << 20))])
            if how == "timed out":
                with pytest.raises(redis.exceptions.TimeoutError):  # beyond the buffers
                    await call
            else:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.1):
                        await call
            assert asyncio.get_running_loop().time() - started < 2
            await asyncio.sleep(0)  # the transport's own close runs on the next pass
            assert transport.is_closing() and transport.get_write_buffer_size() == 0
        finally:
            server.resume()
        assert not redis_clients.kept_count(client.connection_pool)
        (reply,) = await redis_clients.asend_commands(client, [("ECHO", "mine")])
        assert reply in (b"mine", "mine")

    asyncio.run(main())


def test_an_async_client_closed_keeps_no_connection_and_no_pool(redis_url: str) -> None:
    """``aclose()`` closes the kept connection with the others, and nothing of ours
    keeps the closed client's pool alive (a kept connection refers to its pool)."""
    backend = get_backend(f"{redis_url}?prefix=closed-kept:")  # a client of its own
    assert isinstance(backend, RedisBackend)
    admin = redis.Redis.from_url(redis_url)

    async def main() -> weakref.ref[Any]:
        lock = AsyncLock("closed-kept", ttl=30, backend=backend)
        await (await lock.acquire()).release()
        client = backend._async_client()
        kept = await _aclient_id(client)
        assert redis_clients.kept_count(client.connection_pool) == 1
        await backend.aclose()
        assert not redis_clients.kept_count(client.connection_pool)
        wait_until(
            lambda: kept not in {int(c["id"]) for c in admin.client_list()},
            5,
            "the kept connection to close",
        )
        return weakref.ref(client.connection_pool)

    try:
        pool = asyncio.run(main())
    finally:
        admin.close()
    gc.collect()
    assert pool() is None, "the closed client's pool is still alive"
