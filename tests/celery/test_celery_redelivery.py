"""Redeliveries and recycled children: real prefork workers on the
Redis broker and on RabbitMQ (127.0.0.1:5672, guest/guest).

What is documented (docs/celery.md, "Redeliveries and copies"):

- ``acks_late=True`` + ``task_reject_on_worker_lost=True``, the child killed mid-run: the
  worker's main process releases the run's lock before the message goes back to the
  queue, so the redelivery takes the key and runs (it is not refused as a copy).
- the whole worker killed mid-run (no main process left), ``acks_late``: the broker
  redelivers the message (RabbitMQ as the connection drops, Redis after its visibility
  timeout) while the dead run's lock still names the message's task id. The copy waits
  for that lock (at most one TTL: nobody renews it) and runs: the message is never lost
  with the lock (refused as "already running" and acknowledged).
- ``worker_max_tasks_per_child`` / ``worker_max_memory_per_child``: a child that exits
  after a run sends that run's release first, so the next run of the key, in the next
  child, finds it free.
- a hard time limit: the child is killed by the main process, which releases the lock.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from celery.exceptions import TimeLimitExceeded
from servers import wait_until

from task_locks import get_backend

pytestmark = pytest.mark.slow

AMQP = os.environ.get("TL_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
#: One queue per session on the shared RabbitMQ, so runs never meet another's messages.
AMQP_QUEUE = f"tl_amqp_{uuid.uuid4().hex[:8]}"


def holder(cluster: Any, name: str) -> Any:
    return get_backend(cluster.locks_url).holder(name)


@pytest.fixture(scope="module")
def acks_worker(cluster: Any) -> Iterator[Any]:
    with cluster.running([("acks", ["-P", "prefork", "-c", "2", "-Q", "tl_acks"], {})]) as started:
        yield started[0]


@pytest.fixture(scope="module")
def amqp_workers(cluster: Any) -> Iterator[list[Any]]:
    """Two workers on RabbitMQ, one process each (one is killed whole by a test)."""
    options = ["-P", "prefork", "-c", "1", "-Q", AMQP_QUEUE]
    env = {"TL_CELERY_BROKER": AMQP}
    with cluster.running([("amqp-a", options, env), ("amqp-b", options, env)], AMQP) as started:
        yield started


@pytest.fixture(scope="module")
def redis_crash_workers(cluster: Any) -> Iterator[list[Any]]:
    """Two workers on the Redis broker, one process each, unacked messages restored after
    2 s (one is killed whole by a test)."""
    options = ["-P", "prefork", "-c", "1", "-Q", "tl_crash"]
    env = {"TL_VISIBILITY_TIMEOUT": "2"}
    with cluster.running([("crash-a", options, env), ("crash-b", options, env)]) as started:
        yield started


@contextmanager
def publishing(
    cluster: Any, broker: str, redis_queue: str = "tl_acks", amqp_queue: str = AMQP_QUEUE
) -> Iterator[dict[str, Any]]:
    """``apply_async`` options that publish to ``broker`` ("redis" or "amqp")."""
    if broker == "redis":
        yield {"queue": redis_queue}
        return
    with cluster.app.connection_for_write(AMQP) as connection:
        yield {"queue": amqp_queue, "connection": connection}


def started(intervals: Any, log: str, count: int) -> list[dict[str, Any]]:
    return wait_until(
        lambda: len(found := intervals(log)) >= count and found, 20, f"{count} deliveries"
    )


@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_reject_on_worker_lost_redelivers_and_the_copy_takes_the_key(
    cluster: Any, request: pytest.FixtureRequest, broker: str, key: str, intervals: Any
) -> None:
    request.getfixturevalue("acks_worker" if broker == "redis" else "amqp_workers")
    log, name = f"log:{key}", f"t:{key}"
    with publishing(cluster, broker) as options:
        result = cluster.tasks.reject_on_lost_task.apply_async((key, log, 30), **options)
    first = started(intervals, log, 1)[0]
    wait_until(lambda: holder(cluster, name), 10, "the first delivery to hold the key")
    os.kill(first["pid"], signal.SIGKILL)
    assert result.get(timeout=30) == "finished"  # the message came back and ran (ttl=60)
    runs = intervals(log)
    assert [r["task_id"] for r in runs] == [result.id] * 2 and runs[1]["pid"] != first["pid"]
    wait_until(lambda: holder(cluster, name) is None, 5, "the key to be free")


@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_a_whole_worker_killed_mid_run_loses_neither_the_message_nor_the_key(
    cluster: Any, request: pytest.FixtureRequest, broker: str, key: str, intervals: Any
) -> None:
    """RabbitMQ redelivers an unacknowledged message as soon as the dead worker's
    connection drops, Redis once its visibility timeout (2 s) has passed, to the other
    worker, while the dead run's lock (ttl=3, its renewals gone with it) still names the
    same task id.

    The worker is killed after the run's lock was renewed once: the refusal the copy
    meets reports no renewal count, and the renewals the dead run made must not count as
    a renewal at the copy's first look (found by the simulation: the copy was refused as
    "already running" and the message lost)."""
    workers = request.getfixturevalue("amqp_workers" if broker == "amqp" else "redis_crash_workers")
    log, name = f"log:{key}", f"t:{key}"
    with publishing(cluster, broker, "tl_crash") as options:
        result = cluster.tasks.crash_task.apply_async((key, log, 30), **options)
    first = started(intervals, log, 1)[0]
    wait_until(
        lambda: (found := holder(cluster, name)) is not None and found.renewals >= 1,
        10,
        "the first delivery to hold the key and renew it",
    )
    victim = next(w for w in workers if _in_group(first["pid"], w.proc.pid))
    killed = time.monotonic()
    victim.signal(signal.SIGKILL)
    victim.proc.wait(timeout=10)
    assert result.get(timeout=30) == "finished"
    ran_after = time.monotonic() - killed
    runs = intervals(log)
    # (On Redis the copy, which waits up to a TTL for the dead run's lock, may outlast the
    # 2 s visibility timeout itself: a later copy then runs again after it, as in Celery.)
    assert len(runs) >= 2 and {r["task_id"] for r in runs} == {result.id}, runs
    assert ran_after < 3 + 5, f"the copy ran {ran_after:.1f}s after the kill (ttl=3)"
    wait_until(lambda: holder(cluster, name) is None, 10, "the key to be free")


def _in_group(pid: int, leader: int) -> bool:
    try:
        return os.getpgid(pid) == os.getpgid(leader)
    except ProcessLookupError:
        return False


@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_a_hard_time_limit_frees_the_lock_within_seconds(
    cluster: Any, request: pytest.FixtureRequest, broker: str, key: str, intervals: Any
) -> None:
    """``time_limit=1``: the child is killed by its main process, so no ``finally`` runs;
    the main process releases the key (ttl=60) and the run ends ``TimeLimitExceeded``."""
    request.getfixturevalue("acks_worker" if broker == "redis" else "amqp_workers")
    log, name = f"log:{key}", f"t:{key}"
    began = time.monotonic()
    with publishing(cluster, broker) as options:
        result = cluster.tasks.hard_limited_task.apply_async((key, log), **options)
    started(intervals, log, 1)
    with pytest.raises(TimeLimitExceeded):
        result.get(timeout=20)
    wait_until(lambda: holder(cluster, name) is None, 3, "the key to be free")
    assert time.monotonic() - began < 8  # the body sleeps 20 s


@pytest.mark.parametrize(
    ("recycle", "broker"),
    [("--max-tasks-per-child=1", "redis"), ("--max-memory-per-child=1", "amqp")],
    ids=["tasks-redis", "memory-amqp"],  # each recycle and each broker once: 14 s a case
)
def test_a_recycled_child_sends_its_runs_release_before_it_exits(
    cluster: Any, recycle: str, broker: str, key: str, intervals: Any
) -> None:
    """Each run in a fresh child (the limit is one task, or 1 KiB of memory: every child
    is over it after its first task); results not stored, so each release follows its
    run. ``on_conflict="raise"`` refuses a run that finds the key taken: all three run."""
    queue = f"tl_recycle_{recycle.split('-')[3]}_{broker}"
    if broker == "amqp":
        queue = f"{AMQP_QUEUE}_{queue}"
    env, ready_on = ({"TL_CELERY_BROKER": AMQP}, AMQP) if broker == "amqp" else ({}, None)
    log = f"log:{key}"
    options = ["-P", "prefork", "-c", "1", recycle, "-Q", queue]
    with (
        cluster.running([(queue, options, env)], ready_on),
        publishing(cluster, broker, queue, queue) as publish,
    ):
        for _ in range(3):
            cluster.tasks.fire_and_forget_task.apply_async((key, log), **publish)
        wait_until(lambda: len(intervals(log)) >= 3, 30, "three runs")
        assert len({r["pid"] for r in intervals(log)}) == 3  # three children: one run each
        wait_until(lambda: holder(cluster, f"t:{key}") is None, 5, "the key to be free")
