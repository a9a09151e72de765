"""``?wait_replicas=N`` counts replicas for *our* acquire, never for other clients' writes.

``WAIT`` only answers for the writes of the connection it runs on. It must therefore run
on the connection that ran the acquire script, right after it: on another pooled
connection it reports replicas for whatever that connection wrote before (or, for one
that wrote nothing, every connected replica), and an acquire no replica has counts.

Real servers: a master with a replica, and a Redis Cluster with one replica per primary.
The replica is stopped (SIGSTOP) so that our acquire cannot be acknowledged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.crc import key_slot
from servers import RedisClusterNodes, RedisServer, wait_until

from task_locks import BackendUnavailable, get_backend
from task_locks.backends import redis_clients
from task_locks.backends.redis import RedisBackend
from task_locks.backends.redis_scripts import SCRIPTS, record_fields
from task_locks.types import Owner

WAIT = {"wait_replicas": 1, "wait_timeout": 100}
FAST_SYNC = ["--repl-diskless-sync-delay", "0"]


@pytest.fixture(scope="module")
def master_and_replica() -> Iterator[tuple[RedisServer, RedisServer]]:
    master = RedisServer(extra=FAST_SYNC).start()
    replica = RedisServer(extra=[*FAST_SYNC, "--replicaof", "127.0.0.1", str(master.port)]).start()
    wait_until(
        lambda: redis.Redis(port=replica.port).info("replication")["master_link_status"] == "up",
        10,
        "the replica to sync",
    )
    yield master, replica
    replica.cleanup()
    master.cleanup()


@pytest.fixture(scope="module")
def cluster_with_replicas() -> Iterator[RedisClusterNodes]:
    nodes = RedisClusterNodes(3, replicas=1).start()
    yield nodes
    nodes.cleanup()


def _replica_acknowledges(master: RedisServer | int, key: str = "probe") -> bool:
    port = master if isinstance(master, int) else master.port
    client = redis.Redis(port=port, single_connection_client=True)
    client.set(key, "1")
    return int(client.wait(1, 200)) >= 1


def _until_acknowledged(master: RedisServer) -> None:
    """A just-synced (or resumed) replica is counted once it acknowledges: wait for that,
    so that a WAIT on any connection *without* writes of its own would count it."""
    wait_until(lambda: _replica_acknowledges(master), 10, "the replica to acknowledge")


class _Thief:
    """Another thread of the process, taking a connection the moment it is handed back.

    A client-side wrapper around the REAL pool (no server is faked): it reproduces, on
    every run, the interleaving that concurrent threads produce now and then: our
    acquire's connection goes back to the pool and another caller takes it before our
    next command, which then runs on a different connection.
    """

    def __init__(self, pool: Any, monkeypatch: pytest.MonkeyPatch, asynchronous: bool) -> None:
        self.pool = pool
        self.taken: list[Any] = []
        real_release = pool.release
        real_get = pool.get_connection
        if asynchronous:

            async def arelease(connection: Any) -> None:
                await real_release(connection)
                if not self.taken:
                    self.taken.append(await real_get())

            # As below: the next caller takes a kept connection (redis_clients.acheckout).
            real_acheckin = redis_clients.acheckin

            async def acheckin(pool: Any, connection: Any) -> None:
                await real_acheckin(pool, connection)
                if not self.taken:
                    self.taken.append(await redis_clients.acheckout(pool, "PING"))

            monkeypatch.setattr(pool, "release", arelease)
            monkeypatch.setattr(redis_clients, "acheckin", acheckin)
        else:

            def release(connection: Any) -> None:
                real_release(connection)
                if not self.taken:
                    self.taken.append(real_get())

            # Our own exchanges keep their connection checked out between them: the
            # next caller takes it from there (redis_clients.checkout), not the pool.
            real_checkin = redis_clients.checkin

            def checkin(pool: Any, connection: Any) -> None:
                real_checkin(pool, connection)
                if not self.taken:
                    self.taken.append(redis_clients.checkout(pool, "PING"))

            monkeypatch.setattr(pool, "release", release)
            monkeypatch.setattr(redis_clients, "checkin", checkin)


def _load_scripts(port: int) -> None:
    """A server that has run our scripts before (else NOSCRIPT adds a round trip)."""
    for source in SCRIPTS.source.values():
        redis.Redis(port=port).script_load(source)


def _warm(pool: Any) -> None:
    """Two connections in the pool, connected now (so they have nothing left to
    acknowledge once the replica has caught up)."""
    first, second = pool.get_connection(), pool.get_connection()
    pool.release(second)
    pool.release(first)


async def _awarm(pool: Any) -> None:
    first, second = await pool.get_connection(), await pool.get_connection()
    await pool.release(second)
    await pool.release(first)


def test_wait_runs_on_the_connection_that_ran_the_acquire(
    master_and_replica: tuple[RedisServer, RedisServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    master, replica = master_and_replica
    _load_scripts(master.port)
    backend = get_backend(master.url(**WAIT))
    assert isinstance(backend, RedisBackend)
    pool = backend.client.connection_pool
    _warm(pool)
    _until_acknowledged(master)  # the replica has acknowledged all there is, so far
    thief = _Thief(pool, monkeypatch, asynchronous=False)
    replica.pause()
    try:
        with pytest.raises(BackendUnavailable, match="replicas acknowledged"):
            backend.acquire("sync-report", "tok", 5000, Owner())
    finally:
        replica.resume()
    assert thief.taken, "the interleaving under test did not happen"
    pool.release(thief.taken[0])
    monkeypatch.undo()
    assert record_fields(redis.Redis(port=master.port).get("task_locks:{sync-report}")) is None
    _until_acknowledged(master)
    assert backend.acquire("sync-report", "tok", 5000, Owner()).acquired


def test_async_wait_runs_on_the_connection_that_ran_the_acquire(
    master_and_replica: tuple[RedisServer, RedisServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    master, replica = master_and_replica
    _load_scripts(master.port)
    backend = get_backend(master.url(**WAIT))
    assert isinstance(backend, RedisBackend)

    async def run() -> None:
        pool = backend._async_client().connection_pool
        await _awarm(pool)
        _until_acknowledged(master)  # the replica has acknowledged all there is, so far
        thief = _Thief(pool, monkeypatch, asynchronous=True)
        replica.pause()
        try:
            with pytest.raises(BackendUnavailable, match="replicas acknowledged"):
                await backend.aacquire("async-report", "tok", 5000, Owner())
        finally:
            replica.resume()
        assert thief.taken, "the interleaving under test did not happen"
        monkeypatch.undo()
        await pool.release(thief.taken[0])
        await backend.aclose()

    asyncio.run(run())
    assert record_fields(redis.Redis(port=master.port).get("task_locks:{async-report}")) is None


def _primaries(cluster: RedisClusterNodes) -> list[int]:
    return [
        n.port
        for n in cluster.nodes
        if redis.Redis(port=n.port).info("replication")["role"] == "master"
    ]


def _name_on(primary_port: int, cluster: RedisClusterNodes) -> str:
    """A lock name whose keys live on the primary at ``primary_port``."""
    slots = redis.Redis(port=primary_port).cluster("slots")
    mine = [(int(r[0]), int(r[1])) for r in slots if int(r[2][1]) == primary_port]
    for index in range(10_000):
        name = f"slot-probe-{index}"
        slot = key_slot(f"task_locks:{{{name}}}".encode())
        if any(start <= slot <= end for start, end in mine):
            return name
    raise LookupError(primary_port)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_cluster_wait_goes_to_the_locks_primary(
    cluster_with_replicas: RedisClusterNodes, mode: str
) -> None:
    """Each primary in turn has its replica stopped: an acquire of a lock on that primary
    must fail, whatever the other primaries' replicas would acknowledge."""
    cluster = cluster_with_replicas
    cluster.flushall()
    backend = get_backend(cluster.url(**WAIT))
    for primary in _primaries(cluster):
        name = _name_on(primary, cluster)
        replica = cluster.replica_of(primary)
        for port in _primaries(cluster):
            probe = _name_on(port, cluster)
            _load_scripts(port)
            wait_until(lambda p=port, k=probe: _replica_acknowledges(p, k), 10, "replicas to ack")
        replica.pause()
        try:
            if mode == "sync":
                with pytest.raises(BackendUnavailable, match="replicas acknowledged"):
                    backend.acquire(name, "tok", 5000, Owner())
            else:

                async def attempt(name: str = name) -> None:
                    try:
                        with pytest.raises(BackendUnavailable, match="replicas acknowledged"):
                            await backend.aacquire(name, "tok", 5000, Owner())
                    finally:
                        await backend.aclose()

                asyncio.run(attempt())
        finally:
            replica.resume()
        assert record_fields(redis.Redis(port=primary).get(f"task_locks:{{{name}}}")) is None

        def acquired(name: str = name) -> bool:
            try:
                return backend.acquire(name, "tok", 5000, Owner()).acquired
            except BackendUnavailable:  # the resumed replica is still catching up
                return False

        wait_until(acquired, 10, "the resumed replica to acknowledge")
        assert backend.release(name, "tok")
