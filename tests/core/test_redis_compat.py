"""The redis-py compatibility shim (the support matrix runs the suite on 5.0.1 too)."""

from __future__ import annotations

import asyncio
import warnings

import redis
import redis.asyncio

from task_locks.backends._redis_compat import aget_connection, get_connection, set_socket_timeout


def test_a_connection_is_taken_without_a_deprecation_warning(redis_url: str) -> None:
    pool = redis.ConnectionPool.from_url(redis_url, socket_timeout=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        connection = get_connection(pool, "PING")
    try:
        set_socket_timeout(connection, 0.25)
        assert connection._sock.gettimeout() == 0.25
        set_socket_timeout(connection, None)
        assert connection._sock.gettimeout() == 5
        connection.send_command("PING")
        assert connection.read_response() in (b"PONG", "PONG")
    finally:
        pool.release(connection)
        pool.disconnect()


def test_an_async_connection_is_taken_without_a_deprecation_warning(redis_url: str) -> None:
    async def ping() -> object:
        pool = redis.asyncio.ConnectionPool.from_url(redis_url)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            connection = await aget_connection(pool, "PING")
        try:
            await connection.send_command("PING")
            return await connection.read_response()
        finally:
            await pool.release(connection)
            await pool.disconnect()

    assert asyncio.run(ping()) in (b"PONG", "PONG")
