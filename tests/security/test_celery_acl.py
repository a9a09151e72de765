"""Celery under the README's least-privilege Redis ACL: real publishes and an
in-process worker, not just an eager run.

The locks, semaphores, beat election and tick claims live on a Redis whose ``locker``
user has exactly the README's ACL block, with one replica (for ``wait_replicas``). The
broker is kombu's in-memory transport and the worker is Celery's own (``start_worker``,
solo pool, in a thread), so every message goes through the real publish path (the lock
taken at publish, its token in the headers) and the real worker path (the queued lock
taken over or dropped, the tick checked). After each test ``ACL LOG`` must be empty.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from beat_driver import drive_beat
from secure_fixtures import SECRET, readme_acl
from servers import SecureRedisServer, wait_until

from task_locks import Semaphore, get_backend
from task_locks.semaphore import slot_name

celery = pytest.importorskip("celery")
from celery.contrib.testing.worker import start_worker  # noqa: E402

from task_locks.celery import current_lease, singleton_task  # noqa: E402
from task_locks.celery.beat import CLAIM_PREFIX, LeaderScheduler, beat_tick  # noqa: E402

ADMIN = ("admin", SECRET + "-admin")


@pytest.fixture(scope="module")
def acl_primary() -> Iterator[SecureRedisServer]:
    """A primary whose ``locker`` user has the README's ACL, and one replica of it."""
    acl = readme_acl() + f"user admin on >{ADMIN[1]} ~* &* +@all\n"
    primary = SecureRedisServer(acl=acl, client=("locker", SECRET)).start()
    replica = SecureRedisServer(acl=acl, client=ADMIN)
    replica.extra = [
        "--replicaof", "127.0.0.1", str(primary.port),
        "--masteruser", ADMIN[0], "--masterauth", ADMIN[1],
    ]  # fmt: skip
    replica.start()
    admin = primary.redis_client(*ADMIN)

    def synced() -> bool:
        return int(admin.info("replication")["connected_slaves"]) == 1  # type: ignore[attr-defined]

    wait_until(synced, 15, "the replica to sync")
    admin.close()  # type: ignore[attr-defined]
    yield primary
    replica.cleanup()
    primary.cleanup()


@pytest.fixture
def locker_url(acl_primary: SecureRedisServer) -> Iterator[str]:
    admin: Any = acl_primary.redis_client(*ADMIN)
    admin.acl_log_reset()
    yield acl_primary.url()
    refused = [(e["reason"], e["object"], e["context"]) for e in admin.acl_log()]
    admin.close()
    assert refused == [], f"the README's ACL refused: {refused}"


@pytest.fixture
def app(locker_url: str) -> Iterator[Any]:
    app = celery.Celery(
        f"acl-{uuid.uuid4().hex[:6]}",
        broker="memory://",
        backend="cache+memory://",
        set_as_current=False,
    )
    app.conf.update(task_locks_beat_backend=locker_url, broker_connection_retry_on_startup=True)
    yield app


@contextlib.contextmanager
def _worker(app: Any) -> Iterator[Any]:
    """Celery's in-process worker; it sets the root logger's level and handlers for the
    whole process, which are put back after it, so later tests still see warnings."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10) as w:
            yield w
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers


@pytest.mark.parametrize("lock_on", ["enqueue", "both"])
@pytest.mark.parametrize("wait_replicas", [0, 1])
def test_a_published_task_under_the_acl(
    app: Any, locker_url: str, lock_on: str, wait_replicas: int
) -> None:
    """Publish (the lock taken at publish, WAIT with ``wait_replicas``), a duplicate
    publish refused, then a worker runs the message (``both``: the run takes the queued
    lock over with the same token) and the key is free again."""
    url = f"{locker_url}?wait_replicas={wait_replicas}&wait_timeout=2000"
    key = f"acl-pub-{uuid.uuid4().hex[:6]}"
    fences: list[int] = []

    @singleton_task(app=app, name=f"acl_pub_{key}", key=key, ttl=10, lock_on=lock_on, backend=url)
    def job() -> str:
        lease = current_lease()
        if lock_on == "both":
            assert lease is not None
            fences.append(lease.fence)
        return "ran"

    backend = get_backend(url)
    first = job.apply_async()
    queued = backend.holder(key)
    assert queued is not None and queued.owner.task_id == first.id
    assert job.apply_async().id == first.id  # the duplicate gets the queued task's handle
    with _worker(app):
        assert first.get(timeout=20) == "ran"
    if lock_on == "both":
        assert fences == [queued.fence]  # taken over: same fence, never free in between
    wait_until(lambda: backend.holder(key) is None, 5, "the key to be free")


def test_limit_two_under_the_acl(app: Any, locker_url: str) -> None:
    """``limit=2``: one permit is held elsewhere, the worker's run takes the other one."""
    key = f"acl-limit-{uuid.uuid4().hex[:6]}"
    slots: list[int] = []

    @singleton_task(app=app, name=f"acl_lim_{key}", key=key, ttl=10, limit=2, backend=locker_url)
    def job() -> None:
        lease = current_lease()
        assert lease is not None
        slots.append(lease.slot)  # type: ignore[union-attr]

    other = Semaphore(key, limit=2, ttl=10, backend=locker_url).acquire(timeout=0)
    try:
        results = [job.apply_async() for _ in range(3)]
        with _worker(app):
            for result in results:
                result.get(timeout=20)
    finally:
        other.release()
    assert slots == [1 - other.slot] * 3
    backend = get_backend(locker_url)
    assert [backend.holder(slot_name(key, i)) for i in range(2)] == [None, None]


def test_beat_tick_claims_under_the_acl(app: Any, locker_url: str, tmp_path: Path) -> None:
    """The HA beat scheduler leads, claims a tick and sends it, all as the lock user; the
    worker checks the tick (leader and claim) as the lock user and runs it."""
    key = f"acl-beat-{uuid.uuid4().hex[:6]}"
    ran: list[str] = []

    @singleton_task(app=app, name=f"acl_beat_{key}", key=key, ttl=10, backend=locker_url)
    def tick() -> None:
        sent = beat_tick(celery.current_task.request)
        assert sent is not None and sent.election == election  # checked by the worker
        ran.append(sent.tick)

    election = f"acl-beat-{uuid.uuid4().hex[:6]}"
    app.conf.update(
        beat_schedule={"tick": {"task": tick.name, "schedule": 1.0}},
        task_locks_beat_ttl=5,
        task_locks_beat_election=election,
    )
    scheduler = LeaderScheduler(app=app, schedule_filename=str(tmp_path / "schedule"))
    backend = get_backend(locker_url)
    try:
        drive_beat(
            scheduler,
            lambda: backend.holders(f"{CLAIM_PREFIX}{election}:"),
            10,
            "the leader claimed no tick",
        )
        with _worker(app):
            wait_until(lambda: ran, 20, "the tick to run")
    finally:
        scheduler.close()
    assert backend.holder(f"{CLAIM_PREFIX}{election}:{ran[0]}") is not None  # claimed once
