"""``wait_replicas``: a lock counts only once a replica has it, so a failover keeps it.

Real replicas (``redis-server --replicaof``) and a real Sentinel; the replica is made
to miss the lock by stopping it (SIGSTOP) and cutting its replication link, exactly as
the chaos suite's failover fault does.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis
import redis.sentinel
from chaoskit.clusters import FAST_SYNC, SentinelRedis
from servers import RedisServer, wait_until

from task_locks import BackendUnavailable, Lock, LockLost, StaleFence
from task_locks.backends.redis_scripts import record_fields
from task_locks.fencing import FencedStore

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(120)]
WAIT = {"wait_replicas": 1, "wait_timeout": 100}


@pytest.fixture
def master_and_replica():
    master = RedisServer(extra=list(FAST_SYNC)).start()
    replica = RedisServer(extra=[*FAST_SYNC, "--replicaof", "127.0.0.1", str(master.port)]).start()
    wait_until(
        lambda: redis.Redis(port=replica.port).info("replication")["master_link_status"] == "up",
        10,
        "the replica to sync",
    )
    yield master, replica
    replica.cleanup()
    master.cleanup()


def _replica_fence(replica: RedisServer, name: str) -> int | None:
    record = record_fields(redis.Redis(port=replica.port).get(f"task_locks:{{{name}}}"))
    return None if record is None else int(record["fence"])


def test_an_acquire_returns_only_once_the_replica_has_the_lock(master_and_replica) -> None:
    master, replica = master_and_replica
    patient = {"wait_replicas": 1, "wait_timeout": 2000}  # a just-synced replica may lag
    with Lock("report", ttl=5, backend=master.url(**patient)).acquire(timeout=1) as lease:
        assert _replica_fence(replica, "report") == lease.fence  # no need to wait: WAIT did


def test_an_acquire_no_replica_acknowledged_fails_instead_of_counting(master_and_replica) -> None:
    master, replica = master_and_replica
    replica.pause()
    try:
        started = time.monotonic()
        with pytest.raises(BackendUnavailable) as failed:
            Lock("report", ttl=1, backend=master.url(**WAIT)).acquire(timeout=0)
        assert time.monotonic() - started < 2
        assert "replicas acknowledged" in str(failed.value)
        assert failed.value.name == "report"
        # The unacknowledged grant was given back: nobody waits for its TTL.
        assert Lock("report", backend=master.url()).holder() is None
    finally:
        replica.resume()

    def acquire_once_acknowledged():
        try:
            return Lock("report", ttl=5, backend=master.url(**WAIT)).acquire(timeout=0)
        except BackendUnavailable:  # the resumed replica is still catching up
            return None

    with wait_until(acquire_once_acknowledged, 10, "the resumed replica to acknowledge") as lease:
        assert lease.fence > 0


@pytest.fixture
def sentinel_cluster():
    service = SentinelRedis()
    service.start()
    yield service
    service.cleanup()


def _lose_the_replica(service: SentinelRedis) -> None:
    """Stop the replica and cut its link: what the master does next, it never sees."""
    service.replica.pause()
    redis.Redis(port=service.master.port).client_kill_filter(_type="replica")


def _fail_over(service: SentinelRedis) -> None:
    old_master, replica = service.master, service.replica
    old_master.kill()
    replica.resume()
    wait_until(lambda: service.master_port() == replica.port, 20, "Sentinel to promote the replica")
    sentinel = redis.sentinel.Sentinel([("127.0.0.1", service.sentinel.port)], socket_timeout=0.5)

    def master_serves() -> bool:  # what redis-py's Sentinel client checks before using it
        try:
            return sentinel.discover_master(service.sentinel.service)[1] == replica.port
        except redis.sentinel.MasterNotFoundError:
            return False

    wait_until(master_serves, 20, "Sentinel to report the new master as up")
    service.master, service.replica = replica, old_master


def test_failover_drops_a_granted_lock_unless_wait_replicas_refused_it(sentinel_cluster) -> None:
    """Without ``wait_replicas`` two clients end up holding the same lock after the
    failover (the promoted replica never had it); the fence still tells them apart.
    With it, the first client is told its acquire failed, so it never acts."""
    plain_url = sentinel_cluster.url([])
    careful_url = plain_url + "&wait_replicas=1&wait_timeout=100"
    _lose_the_replica(sentinel_cluster)

    first = Lock("invoice:7", ttl=30, backend=plain_url).acquire(timeout=0)
    with pytest.raises(BackendUnavailable):
        Lock("invoice:8", ttl=30, backend=careful_url).acquire(timeout=0)

    _fail_over(sentinel_cluster)
    second = Lock("invoice:7", ttl=30, backend=plain_url).acquire(timeout=5)
    assert first.held and second.held  # both believe they hold "invoice:7"
    assert second.fence > first.fence
    store = FencedStore(redis.Redis(port=sentinel_cluster.master.port))
    store.write("invoice:7", "second", second)
    with pytest.raises(StaleFence):
        store.write("invoice:7", "first", first)
    # "invoice:8" was never counted as held by anyone, and is free on the new master.
    Lock("invoice:8", ttl=30, backend=plain_url).acquire(timeout=0).release()
    with pytest.raises(LockLost):  # the first holder finds out at its next renewal
        first.renew()
    second.release()


def test_a_timed_out_sentinel_connection_is_not_reused(sentinel_cluster) -> None:
    from task_locks import get_backend
    from task_locks.types import Owner

    backend = get_backend(sentinel_cluster.url([]))
    backend.acquire("warm-up", "t0", 5000, Owner())
    master = sentinel_cluster.master
    master.pause()
    resume = threading.Timer(0.6, master.resume)
    resume.start()
    with pytest.raises(BackendUnavailable):
        backend.acquire("a", "token-a", 5000, Owner())  # its reply arrives after the timeout
    resume.join()
    direct = redis.Redis(port=master.port)
    wait_until(lambda: direct.exists("task_locks:{a}"), 5, "the late acquire to be applied")
    answer = backend.acquire("b", "token-b", 5000, Owner())
    holder = backend.holder("b")
    assert holder is not None and holder.fence == answer.fence  # not "a"'s stale reply
