"""Every Redis operation works under exactly the README's least-privilege ACL.

The ``locker`` user of :func:`acl_redis` has the README's ACL block, verbatim, and
nothing else. Each test runs one family of operations as that user, then reads
``ACL LOG`` as ``admin``: any command or key the ACL refused (even one a client library
swallowed, such as ``CLIENT SETINFO``) fails the test.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator

import pytest
import redis
from secure_fixtures import SECRET, readme_acl
from servers import SecureRedisServer

from task_locks import AsyncLock, Election, Lock, Semaphore, get_backend
from task_locks.errors import InvalidArgument
from task_locks.fencing import FencedStore
from task_locks.types import RenewItem


def _admin(server: SecureRedisServer) -> redis.Redis:
    return server.redis_client("admin", SECRET + "-admin")  # type: ignore[return-value]


@pytest.fixture
def locker_url(acl_redis: SecureRedisServer) -> Iterator[str]:
    """The lock user's URL; after the test, nothing may have been refused by the ACL."""
    admin = _admin(acl_redis)
    admin.acl_log_reset()
    yield acl_redis.url()
    refused = [(e["reason"], e["object"], e["context"]) for e in admin.acl_log()]
    admin.close()
    assert refused == [], f"the README's ACL refused: {refused}"


def test_acquire_renew_holders_release(locker_url: str) -> None:
    backend = get_backend(locker_url)
    with Lock("acl-basic", ttl=5, backend=locker_url) as lease:
        assert backend.renew("acl-basic", lease.token, 5000)
        assert backend.renew_many([RenewItem("acl-basic", lease.token, 5000)]) == [True]
        (holder,) = backend.holders("acl-")
        assert holder.fence == lease.fence
        assert backend.holder("acl-basic") is not None
    assert backend.holders("acl-") == []


def test_wait_and_hand_off(locker_url: str) -> None:
    first = Lock("acl-handoff", ttl=5, backend=locker_url).acquire()
    fences: list[int] = []

    def wait_for_it() -> None:
        with Lock("acl-handoff", ttl=5, backend=locker_url, timeout=5) as lease:
            fences.append(lease.fence)

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    first.release()
    waiter.join(10)
    assert fences and fences[0] > first.fence


def test_force_release(locker_url: str) -> None:
    backend = get_backend(locker_url)
    Lock("acl-forced", ttl=5, backend=locker_url).acquire()
    assert backend.force_release("acl-forced")
    assert backend.holder("acl-forced") is None


def test_release_notices_under_the_acl(locker_url: str) -> None:
    """The ACL's channel pattern lets the holder's process subscribe and the force
    release publish: the holder hears of it at once (TTL 30 s: no renewal for 10 s)."""
    from task_locks import notices

    lease = Lock("acl-noticed", ttl=30, backend=locker_url).acquire()
    listener = notices.listener(lease.backend, create=False)
    assert listener is not None and listener.ready.wait(10), listener and listener.refused
    assert get_backend(locker_url).force_release("acl-noticed", lease.fence)
    assert lease.lost.wait(1.0) and "release notice" in (lease.lost_reason or "")


def test_fenced_store(locker_url: str) -> None:
    store = FencedStore(locker_url)
    with Lock("acl-store", ttl=5, backend=locker_url) as lease:
        assert store.write("report", "v1", lease) == 1
        assert store.read("report", fence=lease).value == b"v1"
        assert store.read("report").value == b"v1"
        store.delete("report", lease)


def test_election_and_semaphore(locker_url: str) -> None:
    election = Election("acl-leader", identity="me", ttl=5, backend=locker_url)
    with election.campaign(timeout=2):
        info = election.leader()
        assert info is not None and info.identity == "me"
    with Semaphore("acl-pool", 2, ttl=5, backend=locker_url) as first:
        with Semaphore("acl-pool", 2, ttl=5, backend=locker_url) as second:
            assert first.fence != second.fence


def test_asyncio_lock(locker_url: str) -> None:
    async def main() -> int:
        try:
            async with AsyncLock("acl-async", ttl=5, backend=locker_url) as lease:
                return lease.fence
        finally:
            await get_backend(locker_url).aclose()

    assert asyncio.run(main()) > 0


def test_celery_singleton_task(locker_url: str) -> None:
    celery = pytest.importorskip("celery")
    from task_locks.celery import current_lease, singleton_task

    app = celery.Celery("acl", set_as_current=False)
    app.conf.task_always_eager = True
    seen: list[int] = []

    @singleton_task(
        app=app, name=f"t.{uuid.uuid4().hex}", key="acl-report", ttl=5, backend=locker_url
    )
    def report() -> None:
        lease = current_lease()
        assert lease is not None
        seen.append(lease.fence)

    report.delay()
    assert seen and get_backend(locker_url).holder("acl-report") is None


def test_the_acl_refuses_everything_else(acl_redis: SecureRedisServer, locker_url: str) -> None:
    """Nothing more: other keys and other commands are refused (then the log is reset)."""
    client = acl_redis.redis_client()
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.set("someone-elses-key", "x")  # type: ignore[attr-defined]
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.flushall()  # type: ignore[attr-defined]
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.keys("*")  # type: ignore[attr-defined]
    _admin(acl_redis).acl_log_reset()


def test_a_key_outside_the_acl_is_a_clear_refusal(acl_redis: SecureRedisServer) -> None:
    """A prefix the ACL does not cover is a configuration error naming it, not an outage."""
    url = acl_redis.url(prefix="elsewhere:")
    with pytest.raises(InvalidArgument) as caught:
        Lock("outside", ttl=5, backend=url).acquire(timeout=0)
    message = str(caught.value)
    assert "'elsewhere:'" in message and "locker" in message, message
    assert SECRET not in message
    _admin(acl_redis).acl_log_reset()


def test_a_wrong_password_is_a_configuration_error(acl_redis: SecureRedisServer) -> None:
    url = f"redis://locker:wrong-{SECRET}@127.0.0.1:{acl_redis.port}/0"
    with pytest.raises(InvalidArgument) as caught:
        Lock("job", ttl=5, backend=url).acquire(timeout=0)
    assert "password" in str(caught.value) and SECRET not in str(caught.value)


@pytest.fixture(scope="module")
def acl_masters() -> Iterator[list[SecureRedisServer]]:
    """Three independent masters for ``redlock://``, each with the README's ACL."""
    acl = readme_acl() + f"user admin on >{SECRET}-admin ~* &* +@all\n"
    masters = [SecureRedisServer(acl=acl, client=("locker", SECRET)) for _ in range(3)]
    for master in masters:
        master.start()
    yield masters
    for master in masters:
        master.cleanup()


def test_redlock_under_the_acl(acl_masters: list[SecureRedisServer]) -> None:
    """Redlock's extra command (``INFO server`` on each new connection) is in the ACL."""
    for master in acl_masters:
        _admin(master).acl_log_reset()
    hosts = ",".join(f"127.0.0.1:{m.port}" for m in acl_masters)
    url = f"redlock://locker:{SECRET}@{hosts}?prefix=task_locks:redlock:"
    backend = get_backend(url)
    first = Lock("acl-redlock", ttl=5, backend=url).acquire()
    fences: list[int] = []

    def wait_for_it() -> None:
        with Lock("acl-redlock", ttl=5, backend=url, timeout=5) as lease:
            fences.append(lease.fence)
            assert backend.renew("acl-redlock", lease.token, 5000)
            assert [h.fence for h in backend.holders("acl-")] == [lease.fence]

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    first.release()
    waiter.join(10)
    assert fences and fences[0] > first.fence
    Lock("acl-redlock-forced", ttl=5, backend=url).acquire()
    assert backend.force_release("acl-redlock-forced")
    for master in acl_masters:
        refused = [(e["reason"], e["object"]) for e in _admin(master).acl_log()]
        assert refused == [], f"the README's ACL refused on a Redlock master: {refused}"
