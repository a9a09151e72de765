"""Rolling deploys: a PeerCheckedLock waits while an older library's key is held.

The peers' keys are written here exactly as each library writes them (read from their
source: python-redis-lock's ``acquire`` is ``SET lock:<name> <id> NX EX <expire>`` and
its release ``DEL`` + ``LPUSH lock-signal:<name>``; celery-singleton's ``lock`` is
``SETNX SINGLETONLOCK_<md5(task + json args + json kwargs)> <task id>``), on a real Redis.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time

import pytest
import redis

from task_locks import InvalidArgument, Lock, LockHeld, get_backend
from task_locks.peers import (
    PYTHON_REDIS_LOCK,
    AsyncPeerCheckedLock,
    PeerCheckedLock,
    PeerKeys,
    celery_once_key,
    celery_singleton_key,
)


def python_redis_lock_acquire(client: redis.Redis, name: str, expire: int | None) -> bool:
    """What python-redis-lock 4.x's ``Lock(client, name, expire).acquire(blocking=False)``
    sends."""
    return bool(client.set("lock:" + name, "b64-random-id", nx=True, ex=expire))


def python_redis_lock_release(client: redis.Redis, name: str) -> None:
    """Its UNLOCK script's effect (id matched): wake its waiters, delete the key."""
    client.delete("lock-signal:" + name)
    client.lpush("lock-signal:" + name, 1)
    client.delete("lock:" + name)


def test_waits_while_python_redis_lock_holds_the_same_name(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    peers = PeerKeys(redis_url, PYTHON_REDIS_LOCK)
    lock = PeerCheckedLock("report", ttl=10, backend=redis_url, peers=peers)
    assert python_redis_lock_acquire(client, "report", expire=None)  # old code holds it

    # Without the check, the new code would take the lock beside the old holder.
    unguarded = Lock("report", ttl=10, backend=redis_url).try_acquire()
    assert unguarded is not None
    unguarded.release()

    assert lock.try_acquire() is None
    with pytest.raises(LockHeld, match=r"'lock:report' \(no TTL\)"):
        lock.acquire(timeout=0.2)
    assert get_backend(redis_url).holder("report") is None  # nothing of ours left behind

    released = threading.Timer(0.3, python_redis_lock_release, (client, "report"))
    started = time.monotonic()
    released.start()
    lease = lock.acquire(timeout=5)
    waited = time.monotonic() - started
    released.join()
    assert 0.25 <= waited < 1.0, waited
    assert get_backend(redis_url).holder("report").fence == lease.fence  # type: ignore[union-attr]
    lease.release()
    peers.close()


def test_a_peer_key_with_a_ttl_is_waited_out(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    assert client.set("lock:nightly", "id", nx=True, px=400)  # python-redis-lock, expire set
    lock = PeerCheckedLock(
        "nightly", ttl=10, backend=redis_url, peers=PeerKeys(client, PYTHON_REDIS_LOCK)
    )
    started = time.monotonic()
    lease = lock.acquire(timeout=5)
    assert 0.3 <= time.monotonic() - started < 1.0
    lease.release()


def test_celery_singleton_key_layout_and_check(redis_url: str) -> None:
    # celery_singleton.util.generate_lock: md5(task_name + json.dumps(args, sort_keys=True)
    # + json.dumps(kwargs, sort_keys=True)), prefixed with SINGLETONLOCK_.
    expected = "SINGLETONLOCK_" + hashlib.md5(b'tasks.sync_account[42]{"full": true}').hexdigest()
    assert celery_singleton_key("tasks.sync_account", (42,), {"full": True}) == expected
    assert celery_once_key("tasks.sync_account", {"full": True, "account_id": 42}) == (
        "qo_tasks.sync_account_account_id-42_full-True"
    )

    client = redis.Redis.from_url(redis_url)
    assert client.setnx(expected, "old-task-id")  # an old publisher queued sync_account(42)

    def singleton_key(name: str) -> str:  # "sync:42" -> the old task's key for 42
        return celery_singleton_key(
            "tasks.sync_account", (int(name.split(":")[1]),), {"full": True}
        )

    lock = PeerCheckedLock("sync:42", backend=redis_url, peers=PeerKeys(client, singleton_key))
    with pytest.raises(LockHeld, match="SINGLETONLOCK_"):
        lock.acquire(timeout=0)
    other = PeerCheckedLock("sync:7", backend=redis_url, peers=PeerKeys(client, singleton_key))
    other.acquire(timeout=0).release()  # another account is free
    client.delete(expected)  # the old worker's on_success
    lock.acquire(timeout=0).release()


class PeerSneaksIn(PeerKeys):
    """The real PeerKeys on the real Redis; on its second look the peer has just taken
    its key (between our first check and our acquire): a race made to happen on cue."""

    looks = 0

    def holding(self, name: str) -> dict[str, float | None]:
        self.looks += 1
        if self.looks == 2:
            self.client.set("lock:" + name, "peer", nx=True, px=300)
        return super().holding(name)


def test_a_peer_that_gets_in_between_is_given_way(redis_url: str) -> None:
    peers = PeerSneaksIn(redis_url, PYTHON_REDIS_LOCK)
    lock = PeerCheckedLock("raced", ttl=10, backend=redis_url, peers=peers)
    with pytest.raises(LockHeld, match="lock:raced"):
        lock.acquire(timeout=0)
    assert get_backend(redis_url).holder("raced") is None  # ours was given back
    lease = lock.acquire(timeout=5)  # the peer's key expires after 300 ms
    assert peers.looks >= 4
    lease.release()


def test_async_peer_checked_lock(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    assert python_redis_lock_acquire(client, "alock", expire=None)

    async def scenario() -> None:
        lock = AsyncPeerCheckedLock(
            "alock", ttl=10, backend=redis_url, peers=PeerKeys(client, PYTHON_REDIS_LOCK)
        )
        assert await lock.try_acquire() is None
        asyncio.get_running_loop().call_later(0.2, python_redis_lock_release, client, "alock")
        lease = await lock.acquire(timeout=5)
        assert lease.held
        await lease.release()
        await get_backend(redis_url).aclose()

    asyncio.run(scenario())


def test_bad_patterns_are_refused(redis_url: str) -> None:
    with pytest.raises(InvalidArgument):
        PeerKeys(redis_url)
    with pytest.raises(InvalidArgument, match="only use"):
        PeerKeys(redis_url, "lock:{task}")
    with pytest.raises(InvalidArgument):
        PeerKeys(redis_url, 42)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="PeerKeys"):
        PeerCheckedLock("x", peers="lock:{name}")  # type: ignore[arg-type]
