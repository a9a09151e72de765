"""The direct command path (``redis_clients.send_commands``) answers as redis-py's own.

Every lock operation on a plain or Sentinel URL goes down this path instead of
redis-py's pipeline object: hiredis packs the commands, redis-py's connection reads the
replies. What a user relies on is that nothing changed but the CPU: the same bytes on
the wire, the same replies and error classes, redis-py's single quick retry on a
dropped connection (which the scripts are built to survive), and no retry on a
timeout, after which the connection is never handed out with a late reply unread.
Faults are real: a server-side ``CLIENT KILL`` and the chaoskit TCP proxy.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from chaoskit.proxy import Proxy
from hypothesis import given
from hypothesis import strategies as st
from redis.connection import Connection
from redis.exceptions import DataError, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from servers import RedisClusterNodes, RedisServer

from task_locks import Lock, get_backend
from task_locks.backends import redis as redis_backend
from task_locks.backends.redis_clients import _pack, can_send_direct, send_commands

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


def test_replies_and_error_replies_come_back_in_order(client: redis.Redis) -> None:
    sha = client.script_load("return ARGV[1]")
    replies = send_commands(
        client,
        [
            ("EVALSHA", sha, 0, "caf\u00e9"),
            ("EVALSHA", "0" * 40, 0),
            ("INCR", "not-a-number-key"),
            ("SET", "not-a-number-key", "x"),
            ("INCR", "not-a-number-key"),
        ],
    )
    assert replies[0] == "caf\u00e9".encode()
    assert isinstance(replies[1], NoScriptError)
    assert replies[2:4] == [1, True]
    assert isinstance(replies[4], ResponseError)
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
