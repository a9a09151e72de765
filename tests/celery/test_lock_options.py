"""Per-call lock options (celery-once's ``once={...}``) and ``AlreadyQueued``.

``apply_async(..., lock_options={...})`` is validated at the call and applies to that run
only: in eager mode (the run in this process, through the same ``__call__`` a worker
uses), on every backend, and in a real ``celery worker``. The peer check (Redis keys of
an old library) runs on Redis, Sentinel and Cluster.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from deployments import REDIS_TOPOLOGIES, build_deployment, deployment_params

from task_locks import InvalidArgument, Lock, LockHeld, get_backend
from task_locks.celery import (
    AlreadyQueued,
    DuplicateTask,
    Skipped,
    current_lease,
    singleton_task,
)


@contextlib.contextmanager
def eager_app(url: str) -> Iterator[tuple[Celery, Any]]:
    """An eager Celery app and a singleton task (key ``opt:{n}``) locking on ``url``."""
    app = Celery(f"opts-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True

    # Unique task names: these apps outlive the test, and Celery warns (an error here)
    # when a later shared task is registered beside a same-named one.
    name = f"opt_job_{uuid.uuid4().hex[:8]}"

    @singleton_task(app=app, name=name, key="opt:{n}", ttl=10, backend=url, on_conflict="skip")
    def job(n: int) -> dict[str, Any]:
        lease = current_lease()
        assert lease is not None
        return {"ttl": lease.ttl, "max_hold": lease._hold_deadline is not None}

    try:
        yield app, job
    finally:
        app.close()


@pytest.fixture(params=deployment_params(*REDIS_TOPOLOGIES))
def lock_url(request: pytest.FixtureRequest) -> str:
    """The lock backend: every conformance deployment, Redis Sentinel and Cluster too."""
    return build_deployment(request, request.param).url


@pytest.fixture
def eager(lock_url: str) -> Iterator[tuple[Celery, Any]]:
    with eager_app(lock_url) as made:
        yield made


@pytest.fixture
def eager_on_redis(redis_url: str) -> Iterator[tuple[Celery, Any]]:
    """For what does not depend on the backend (validation)."""
    with eager_app(redis_url) as made:
        yield made


def test_lock_options_apply_to_one_call(eager: tuple[Celery, Any]) -> None:
    _app, job = eager
    assert job.apply_async((1,), lock_options={"ttl": 7}).get() == {"ttl": 7.0, "max_hold": False}
    assert job.apply_async((1,)).get() == {"ttl": 10.0, "max_hold": False}  # one call only
    assert job.lock_ttl == 10
    both = job.apply_async((1,), lock_options={"ttl": 3, "max_hold": 60}).get()
    assert both == {"ttl": 3.0, "max_hold": True}
    # A signature carries them too.
    assert job.s(2).set(lock_options={"ttl": 5}).apply_async().get()["ttl"] == 5.0


def test_on_conflict_and_timeout_per_call(eager: tuple[Celery, Any], lock_url: str) -> None:
    _app, job = eager
    with Lock("opt:1", ttl=10, backend=lock_url):
        skipped = job.apply_async((1,))  # the task's own choice: skip, a ready result
        assert isinstance(skipped.get(), Skipped) and skipped.get().lock == "opt:1"
        with pytest.raises(LockHeld):
            job.apply_async((1,), lock_options={"on_conflict": "raise"})
        started = time.monotonic()
        with pytest.raises(LockHeld):
            job.apply_async((1,), lock_options={"on_conflict": "wait", "timeout": 0.3})
        assert 0.25 <= time.monotonic() - started < 3
    assert job.apply_async((1,), lock_options={"on_conflict": "raise"}).get()["ttl"] == 10.0
    assert get_backend(lock_url).holder("opt:1") is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"tll": 5},
            r"unknown lock_options \['tll'\]; known: \['enqueue_ttl', 'max_hold', 'on_conflict'",
        ),
        ({"graceful": True}, "unknown lock_options"),
        ({"ttl": 0}, "lock_options: ttl must be"),
        ({"ttl": "long"}, "lock_options: ttl must be a number"),
        ({"max_hold": -1}, "lock_options: max_hold"),
        ({"enqueue_ttl": 0}, "lock_options: enqueue_ttl must be"),
        ({"enqueue_ttl": "1h"}, "lock_options: enqueue_ttl must be a number"),
        ({"on_conflict": "sometimes"}, "on_conflict must be one of"),
        ({"timeout": -2}, "lock_options: timeout must be >= 0"),
        ("ttl=5", "lock_options must be a dict"),
    ],
)
def test_bad_lock_options_raise_at_apply_async(
    eager_on_redis: tuple[Celery, Any], options: object, message: str, redis_url: str
) -> None:
    _app, job = eager_on_redis
    with pytest.raises(InvalidArgument, match=message) as refused:
        job.apply_async((1,), lock_options=options)
    assert job.name in str(refused.value)
    assert get_backend(redis_url).holder("opt:1") is None  # nothing ran


def test_already_queued_is_duplicate_task() -> None:
    assert AlreadyQueued is DuplicateTask
    assert issubclass(AlreadyQueued, LockHeld)
    with pytest.raises(AlreadyQueued):
        raise DuplicateTask("not queued", name="k")


def test_already_queued_is_caught_at_a_real_publish(cluster: Any, key: str) -> None:
    """lock_on="enqueue" + per-call on_conflict="raise": the second publish raises, and
    ``except AlreadyQueued`` (celery-once's spelling) catches it. Nothing consumes the
    queue here, so the first message stays queued."""
    tasks = cluster.tasks
    first = tasks.enqueue_task.apply_async((key, f"log:{key}"), queue=f"tl_none_{key}")
    try:
        with pytest.raises(AlreadyQueued) as caught:
            tasks.enqueue_task.apply_async(
                (key, f"log:{key}"), queue=f"tl_none_{key}", lock_options={"on_conflict": "raise"}
            )
        assert caught.value.existing.id == first.id
        # Without the per-call choice the task's own ("skip") returns the queued handle.
        again = tasks.enqueue_task.apply_async((key, f"log:{key}"), queue=f"tl_none_{key}")
        assert again.id == first.id
    finally:
        get_backend(cluster.locks_url).force_release(f"t:{key}")


def test_enqueue_ttl_per_call_sets_the_queued_locks_server_ttl(cluster: Any, key: str) -> None:
    """celery-once's ``once={"timeout": N}``: the lock a real publish takes lasts N s on
    the server (counted from the ETA), for that call only. Nothing consumes the queue."""
    import redis

    tasks, queue, name = cluster.tasks, f"tl_none_{key}", f"t:{key}"
    backend = get_backend(cluster.locks_url)

    def server_ttl() -> float:
        holder = backend.holder(name)
        assert holder is not None and holder.expires_in is not None
        pttl = cluster.store.pttl(f"task_locks:{{{name}}}")  # the lock's hash
        assert abs(pttl / 1000 - holder.expires_in) < 1, (pttl, holder.expires_in)
        return holder.expires_in

    try:
        tasks.enqueue_task.apply_async((key, "log"), queue=queue, lock_options={"enqueue_ttl": 60})
        assert 58 <= server_ttl() <= 60
        backend.force_release(name)
        eta = {"countdown": 30}
        tasks.enqueue_task.apply_async(
            (key, "log"), queue=queue, lock_options={"enqueue_ttl": 45}, **eta
        )
        assert 73 <= server_ttl() <= 75  # from the ETA: 30 + 45
        backend.force_release(name)
        tasks.enqueue_task.apply_async((key, "log"), queue=queue)  # the task's own: 1 h
        assert 3598 <= server_ttl() <= 3600
        backend.force_release(name)
        with pytest.raises(InvalidArgument, match="enqueue_ttl"):
            tasks.enqueue_task.apply_async(
                (key, "log"), queue=queue, lock_options={"enqueue_ttl": -5}
            )
        assert backend.holder(name) is None  # refused before any publish
    finally:
        backend.force_release(name)
        redis.Redis(port=cluster.server.port).delete(queue)


def test_lock_options_reach_a_real_worker(
    cluster: Any, solo_worker: Any, key: str, intervals: Any
) -> None:
    tasks = cluster.tasks
    log = f"log:{key}"
    result = tasks.options_task.apply_async(
        (key, log), queue="tl_solo", lock_options={"ttl": 7, "timeout": 2.5}
    )
    assert result.get(timeout=30) == {"ttl": 7.0, "on_conflict": "skip", "wait_timeout": 2.5}
    plain = tasks.options_task.apply_async((key, log), queue="tl_solo")
    assert plain.get(timeout=30) == {"ttl": 10.0, "on_conflict": "skip", "wait_timeout": None}

    # The task's own retries carry the call's options.
    retried = tasks.options_task.apply_async(
        (key, f"{log}:retried", 2), queue="tl_solo", lock_options={"ttl": 6}
    )
    assert retried.get(timeout=30)["ttl"] == 6.0
    attempts = intervals(f"{log}:retried")
    assert [(a["attempt"], a["ttl"]) for a in attempts] == [(0, 6.0), (1, 6.0), (2, 6.0)]

    with Lock(f"t:{key}", ttl=30, backend=cluster.locks_url):
        raised = tasks.options_task.apply_async(
            (key, log), queue="tl_solo", lock_options={"on_conflict": "raise"}
        )
        with pytest.raises(LockHeld):
            raised.get(timeout=30)


@pytest.fixture(params=["redis", *REDIS_TOPOLOGIES])
def peer_redis(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    """Peer keys are Redis keys: a lock URL on plain Redis, Sentinel or Cluster, and a
    redis-py client on the same servers (where the old library keeps its keys)."""
    import redis

    url = build_deployment(request, request.param).url
    client: Any
    if request.param == "redis":
        client = redis.Redis(port=request.getfixturevalue("redis_server").port)
    elif request.param == "sentinel":
        client = redis.Redis(port=request.getfixturevalue("redis_sentinel").master.port)
    else:
        port = request.getfixturevalue("redis_cluster").nodes[0].port
        client = redis.RedisCluster(host="127.0.0.1", port=port)
    yield url, client
    client.close()


def test_peer_checked_task_meets_an_old_celery_singleton_key(peer_redis: tuple[str, Any]) -> None:
    """Rolling deploy: the new task's run waits out celery-singleton's key (its real
    layout, SETNX'd by hand) for the same call."""
    from task_locks.celery.peers import PeerCheckedTask
    from task_locks.peers import PeerKeys, celery_singleton_key

    url, old = peer_redis
    task_name = f"tasks.sync_account_{uuid.uuid4().hex[:8]}"  # the old keys are unprefixed

    def old_key(name: str) -> str:
        return celery_singleton_key(task_name, [int(name.split(":")[1])])

    with eager_app(url) as (app, _job):

        @singleton_task(
            app=app,
            name=f"sync_account_{uuid.uuid4().hex[:8]}",
            key="sync:{account_id}",
            backend=url,
            on_conflict="raise",
            base=PeerCheckedTask,
            lock_peers=PeerKeys(old, old_key),
        )
        def sync_account(account_id: int) -> str:
            return f"synced {account_id}"

        assert old.setnx(old_key("sync:42"), "old-task-id")
        try:
            with pytest.raises(LockHeld, match="SINGLETONLOCK_"):
                sync_account.apply_async((42,))
            assert sync_account.apply_async((7,)).get() == "synced 7"  # another account
        finally:
            old.delete(old_key("sync:42"))  # the old worker's on_success
        assert sync_account.apply_async((42,)).get() == "synced 42"
        assert get_backend(url).holder("sync:42") is None
