"""The direct command path (``redis_clients.send_commands``) answers as redis-py's own.

Every lock operation on a plain or Sentinel URL goes down this path instead of
redis-py's pipeline object: hiredis packs the commands, redis-py's connection reads the
replies. What a user relies on is that nothing changed but the CPU: the same bytes on
the wire, the same replies and error classes, redis-py's single quick retry on a
dropped connection (which the scripts are built to survive), and no retry on a
timeout, after which the connection is never handed out with a late reply unread.
Faults are real: a server-side ``CLIENT KILL`` and the chaoskit TCP proxy.

The asyncio twin (``asend_commands``, for ``AsyncLock`` and ``async def`` tasks) is held
to the same, and to one more: a call cancelled while it waits for its replies drops its
connection, so a late reply is never read as the next call's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
import redis
import redis.asyncio
from chaoskit.proxy import Proxy
from hypothesis import given
from hypothesis import strategies as st
from redis.connection import Connection
from redis.exceptions import DataError, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from servers import RedisClusterNodes, RedisServer

from task_locks import AsyncLock, Lock, get_backend
from task_locks.backends import redis as redis_backend
from task_locks.backends.redis_clients import (
    _pack,
    asend_commands,
    can_send_direct,
    can_send_direct_async,
    send_commands,
)

T = TypeVar("T")

ARGUMENTS = st.one_of(
    st.text(alphabet=st.characters(blacklist_categories=("Cs",))),
    st.binary(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
)
COMMANDS = st.lists(
    st.tuples(st.sampled_from(["EVALSHA", "GET", "PTTL"]), st.lists(ARGUMENTS, max_size=12)),
    min_size=1,
    max_size=4,
)


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, retry=get_backend(redis_url).client.get_retry())
    yield client
    client.close()


@given(COMMANDS)
def test_hiredis_packs_the_bytes_redis_py_would(commands: list[tuple[str, list[object]]]) -> None:
    connection = Connection()  # never connected: packing only
    shaped = [(name, *arguments) for name, arguments in commands]
    assert b"".join(_pack(connection, shaped)) == b"".join(connection.pack_commands(shaped))


def test_what_hiredis_might_pack_differently_goes_through_redis_py() -> None:
    connection = Connection()
    for command in [("SET", "k", 1.5), ("SET", "k", 2**70), ("SCRIPT LOAD", "return 1")]:
        assert _pack(connection, [command]) == connection.pack_commands([command])
    with pytest.raises(DataError, match="bool"):  # refused as redis-py refuses it
        _pack(connection, [("SET", "k", True)])


#: A script's reply, a NOSCRIPT error, replies with callbacks (INCR, SET), an error reply.
SCRIPT = "return ARGV[1]"


def mixed(sha: str, key: str) -> list[tuple[object, ...]]:
    return [
        ("EVALSHA", sha, 0, "caf\u00e9"),
        ("EVALSHA", "0" * 40, 0),
        ("INCR", key),
        ("SET", key, "x"),
        ("INCR", key),
    ]


def check_mixed(replies: list[object]) -> None:
    assert replies[0] == "caf\u00e9".encode()
    assert isinstance(replies[1], NoScriptError)
    assert replies[2:4] == [1, True]
    assert isinstance(replies[4], ResponseError)


def test_replies_and_error_replies_come_back_in_order(client: redis.Redis) -> None:
    check_mixed(send_commands(client, mixed(client.script_load(SCRIPT), "not-a-number-key")))
    assert client.ping()  # the connection stayed in step


def test_a_dropped_connection_is_retried_once(client: redis.Redis) -> None:
    assert send_commands(client, [("SET", "k", "1")]) == [True]
    (mine,) = [c["id"] for c in client.client_list() if c["cmd"] == "client|list"]
    killer = redis.Redis(connection_pool=redis.ConnectionPool(**client.get_connection_kwargs()))
    try:
        assert killer.client_kill_filter(_id=mine) == 1
    finally:
        killer.close()
    # The pooled connection is dead: the first write or read fails, the retry reconnects.
    assert send_commands(client, [("INCR", "k")]) == [2]
    assert client.get("k") == b"2"


def test_a_timeout_is_not_retried_and_the_late_reply_is_never_read(
    scripted_link: Proxy,
) -> None:
    # The backend's own client: its retry policy is the product's (connection drops only).
    client = get_backend(f"redis://127.0.0.1:{scripted_link.port}/0?socket_timeout=0.3").client
    assert can_send_direct(client)
    client.set("k", "0")
    scripted_link.hold_next_reply(1.0)
    with pytest.raises(RedisTimeoutError):
        send_commands(client, [("INCR", "k")])
    # Sent once (no retry on a timeout), and its late reply (1) is not the next call's:
    # the connection that timed out was dropped.
    assert send_commands(client, [("GET", "k")]) == [b"1"]


def test_cluster_and_single_connection_clients_keep_redis_pys_own_path(
    redis_server: RedisServer, redis_cluster: RedisClusterNodes
) -> None:
    single = redis.Redis(port=redis_server.port, single_connection_client=True)
    try:
        assert not can_send_direct(single)
    finally:
        single.close()
    cluster_backend = get_backend(redis_cluster.url())
    assert not can_send_direct(cluster_backend.client)  # its commands route by slot
    with Lock("wire-cluster", backend=redis_cluster.url(), ttl=5) as lease:
        assert cluster_backend.holder("wire-cluster") is not None
        assert lease.fence >= 1


def test_a_lock_cycle_goes_down_the_direct_path(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[str] = []

    def spy(client: redis.Redis, commands: list[tuple[object, ...]]) -> list[object]:
        sent.extend(str(command[0]) for command in commands)
        return send_commands(client, commands)  # a spy: the real path, to the real server

    monkeypatch.setattr(redis_backend, "send_commands", spy)
    backend = get_backend(redis_url)
    with Lock("wire", backend=redis_url, ttl=5) as lease:
        assert backend.holder("wire") is not None
        assert lease.fence >= 1
    assert backend.holder("wire") is None
    # The acquire's and the release's scripts (EVAL again after a fresh server's NOSCRIPT).
    assert [name for name in sent if name in ("EVALSHA", "EVAL")].count("EVALSHA") >= 2


# -- asyncio ------------------------------------------------------------------------------


def on_backend_client(url: str, test: Callable[[Any], Awaitable[T]]) -> T:
    """``test(client)`` in a fresh event loop, on the backend's own asyncio client of that
    loop (its retry policy is the product's), closed after."""
    backend = get_backend(url)

    async def main() -> T:
        try:
            return await test(backend._async_client())
        finally:
            await backend.aclose()

    return asyncio.run(main())


def test_async_replies_and_error_replies_come_back_in_order(redis_url: str) -> None:
    async def test(client: Any) -> None:
        assert can_send_direct_async(client)
        sha = await client.script_load(SCRIPT)
        check_mixed(await asend_commands(client, mixed(sha, "async-not-a-number")))
        assert await client.ping()  # the connection stayed in step

    on_backend_client(redis_url, test)


def test_async_a_dropped_connection_is_retried_once(redis_url: str) -> None:
    async def test(client: Any) -> None:
        assert await asend_commands(client, [("SET", "async-k", "1")]) == [True]
        # The pool's one connection (calls so far took turns on it) names itself.
        (mine,) = await asend_commands(client, [("CLIENT", "ID")])
        killer = redis.Redis.from_url(redis_url)
        try:
            assert killer.client_kill_filter(_id=mine) == 1
        finally:
            killer.close()
        assert await asend_commands(client, [("INCR", "async-k")]) == [2]
        assert await client.get("async-k") == b"2"
        assert await asend_commands(client, [("CLIENT", "ID")]) != [mine]  # a new one

    on_backend_client(redis_url, test)


def test_async_a_timeout_is_not_retried_and_the_late_reply_is_never_read(
    scripted_link: Proxy,
) -> None:
    async def test(client: Any) -> None:
        await client.set("k", "0")
        scripted_link.hold_next_reply(1.0)
        with pytest.raises(RedisTimeoutError):
            await asend_commands(client, [("INCR", "k")])
        # Sent once, and its late reply (1, an integer) is not the next call's.
        assert await asend_commands(client, [("GET", "k")]) == [b"1"]

    on_backend_client(f"redis://127.0.0.1:{scripted_link.port}/0?socket_timeout=0.3", test)


def test_async_a_cancelled_call_drops_its_connection(scripted_link: Proxy) -> None:
    async def test(client: Any) -> None:
        await client.set("k", "0")
        scripted_link.hold_next_reply(1.0)
        with pytest.raises(TimeoutError):  # asyncio's: the caller gave up, not the socket
            async with asyncio.timeout(0.2):
                await asend_commands(client, [("INCR", "k")])
        pool = client.connection_pool
        assert not pool._in_use_connections  # handed back...
        assert not any(c.is_connected for c in pool._available_connections)  # ...closed
        # The INCR was sent once; its reply, still on its way, is nobody's.
        assert await asend_commands(client, [("GET", "k")]) == [b"1"]

    on_backend_client(f"redis://127.0.0.1:{scripted_link.port}/0?socket_timeout=5", test)


def test_async_cluster_and_single_connection_clients_keep_redis_pys_own_path(
    redis_server: RedisServer, redis_cluster: RedisClusterNodes
) -> None:
    async def main() -> None:
        single = redis.asyncio.Redis(port=redis_server.port, single_connection_client=True)
        try:
            assert not can_send_direct_async(single)  # before it takes its one connection
            await single.ping()
            assert not can_send_direct_async(single)
        finally:
            await single.aclose()
        cluster_backend = get_backend(redis_cluster.url())
        try:
            assert not can_send_direct_async(cluster_backend._async_client())
            async with AsyncLock("wire-cluster-async", backend=redis_cluster.url(), ttl=5) as lease:
                assert await cluster_backend.aholder("wire-cluster-async") is not None
                assert lease.fence >= 1
        finally:
            await cluster_backend.aclose()

    asyncio.run(main())


def test_an_async_lock_cycle_goes_down_the_direct_path(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[str] = []

    async def spy(client: Any, commands: list[tuple[object, ...]]) -> list[object]:
        sent.extend(str(command[0]) for command in commands)
        return await asend_commands(client, commands)  # the real path, to the real server

    monkeypatch.setattr(redis_backend, "asend_commands", spy)
    backend = get_backend(redis_url)

    async def main() -> None:
        try:
            async with AsyncLock("wire-async", backend=redis_url, ttl=5) as lease:
                assert await backend.aholder("wire-async") is not None
                assert lease.fence >= 1
            assert await backend.aholder("wire-async") is None
        finally:
            await backend.aclose()

    asyncio.run(main())
    assert [name for name in sent if name in ("EVALSHA", "EVAL")].count("EVALSHA") >= 2
