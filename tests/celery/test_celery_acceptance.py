"""Singleton tasks in real ``celery worker`` processes: skips, kills, revokes,
time limits, enqueue locks and redeliveries.

Broker, result backend and locks are one real Redis (``conftest.Cluster``). Tasks record
their ``[start, end]`` intervals in Redis; the tests check, from outside, that no two
runs of a key overlapped and that the lock is where it should be.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from typing import Any

import pytest
from celery import group
from celery.exceptions import SoftTimeLimitExceeded
from servers import wait_until

from task_locks import Holder, LockLost, get_backend
from task_locks.celery import SKIPPED, DuplicateTask, Skipped

pytestmark = pytest.mark.slow


def assert_no_overlap(runs: list[dict[str, Any]]) -> None:
    """No two recorded ``[start, end]`` intervals overlap (one host, one clock)."""
    ordered = sorted(runs, key=lambda run: run["start"])
    for before, after in itertools.pairwise(ordered):
        assert after["start"] >= before["end"], (
            f"runs overlap: {before['task_id']} [{before['start']:.4f}, {before['end']:.4f}]"
            f" and {after['task_id']} [{after['start']:.4f}, {after['end']:.4f}]"
        )


def holder(cluster: Any, name: str) -> Holder | None:
    return get_backend(cluster.locks_url).holder(name)


def held_by(cluster: Any, name: str, task_id: str) -> Holder | None:
    found = holder(cluster, name)
    return found if found is not None and found.owner.task_id == task_id else None


def started_pid(read: Any, log: str) -> int:
    started = wait_until(lambda: read(log), 10, f"a start record in {log}")
    return int(started[0]["pid"])


# -- 1. wait / retry: all 40 run, one at a time, on 2 workers x 3 processes --------------------


@pytest.mark.parametrize("task_name", ["wait_task", "retry_task"])
def test_forty_calls_all_run_and_never_overlap(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any, task_name: str
) -> None:
    task = getattr(cluster.tasks, task_name)
    log = f"log:{key}"
    results = [task.delay(key, log, 0.05) for _ in range(40)]
    for result in results:
        assert result.get(timeout=90)["task_id"] == result.id
    runs = intervals(log)
    assert len(runs) == 40
    assert_no_overlap(runs)
    assert {run["worker"] for run in runs} == {w.hostname for w in prefork_workers}
    fences = [run["fence"] for run in sorted(runs, key=lambda run: run["start"])]
    assert fences == sorted(fences) and len(set(fences)) == 40
    assert holder(cluster, f"t:{key}") is None


# -- 2. skip: no overlap, skipped calls are ready, their result a Skipped marker -------------


def test_skip_never_overlaps_and_skips_are_visible(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any
) -> None:
    log = f"log:{key}"
    results = [cluster.tasks.skip_task.delay(key, log, 0.2) for _ in range(40)]
    values = {r.id: r.get(timeout=60) for r in results}  # a skipped call is ready too
    assert all(r.state == "SUCCESS" for r in results)
    ran = {i for i, value in values.items() if not isinstance(value, Skipped)}
    skipped = [value for value in values.values() if isinstance(value, Skipped)]
    runs = intervals(log)
    assert {run["task_id"] for run in runs} == ran
    assert len(ran) >= 1 and len(skipped) >= 1 and len(ran) + len(skipped) == 40
    assert_no_overlap(runs)
    for value in skipped:
        assert not value and value.state == SKIPPED
        assert value.lock == f"t:{key}"
        assert value.holder_task_id in ran
    assert holder(cluster, f"t:{key}") is None


# -- 3. revoke(terminate=True): the lock is free within 3 s (ttl=60) ---------------------------


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGKILL"])
def test_revoke_terminate_frees_the_lock_within_3s(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any, signum: str
) -> None:
    """SIGTERM (the default) and SIGKILL, which leaves the child no ``finally`` to run:
    then the worker's main process releases the lock."""
    name, log = f"t:{key}", f"log:{key}"
    result = cluster.tasks.hold_task.delay(key, log, 30)
    found = wait_until(lambda: held_by(cluster, name, result.id), 10, "the task to hold the key")
    assert found.owner.pid == started_pid(intervals, log) and found.owner.worker
    began = time.monotonic()
    result.revoke(terminate=True, signal=signum)
    wait_until(lambda: holder(cluster, name) is None, 3.0, "the key to be free after revoke")
    assert time.monotonic() - began < 3.0
    wait_until(lambda: result.state == "REVOKED", 10, "the result to say REVOKED")


# -- 4. SIGKILL of the prefork child: the lock is free within 5 s (ttl=60) ----------------------


def test_sigkill_of_the_child_frees_the_lock_within_5s(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any
) -> None:
    name, log = f"t:{key}", f"log:{key}"
    result = cluster.tasks.hold_task.delay(key, log, 30)
    wait_until(lambda: held_by(cluster, name, result.id), 10, "the task to hold the key")
    pid = started_pid(intervals, log)
    assert pid not in {w.proc.pid for w in prefork_workers}  # a child, not a main process
    began = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: holder(cluster, name) is None, 5.0, "the key to be free after SIGKILL")
    assert time.monotonic() - began < 5.0
    wait_until(lambda: result.state == "FAILURE", 10, "the result to say FAILURE")
    assert "WorkerLostError" in repr(result.result)


# -- 5. retries keep working; a raise frees the lock; a soft time limit frees the lock ----------


def test_a_task_that_retries_itself_reacquires_each_time(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any
) -> None:
    log = f"log:{key}"
    result = cluster.tasks.retrying_task.delay(key, log, 2)
    assert result.get(timeout=30) == "done"
    attempts = intervals(log)
    assert [a["attempt"] for a in attempts] == [0, 1, 2]
    assert all(a["holder_task_id"] == result.id for a in attempts)  # held it every time
    fences = [a["fence"] for a in attempts]
    assert fences == sorted(fences) and len(set(fences)) == 3  # released and re-taken
    assert holder(cluster, f"t:{key}") is None


def test_a_task_that_raises_frees_the_lock(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any
) -> None:
    result = cluster.tasks.failing_task.delay(key, f"log:{key}")
    with pytest.raises(ValueError, match="boom"):
        result.get(timeout=20)
    assert intervals(f"log:{key}")  # it did run
    assert holder(cluster, f"t:{key}") is None  # released before the result was stored


def test_soft_time_limit_frees_the_lock(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any
) -> None:
    began = time.monotonic()
    result = cluster.tasks.soft_limited_task.delay(key, f"log:{key}")
    with pytest.raises(SoftTimeLimitExceeded):
        result.get(timeout=20)
    assert time.monotonic() - began < 10  # the body sleeps 20 s: the limit cut it short
    assert holder(cluster, f"t:{key}") is None


# -- 6. lock_on="enqueue": duplicates are not queued while one is pending ------------------------


def test_enqueue_lock_queues_one_message_per_key(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any
) -> None:
    tasks, app, log = cluster.tasks, cluster.app, f"log:{key}"
    consumer = prefork_workers[0].hostname
    assert cluster.broker.llen("tl_pending") == 0
    first = tasks.enqueue_task.delay(key, log)
    queued = holder(cluster, f"t:{key}")
    assert queued is not None and queued.owner.task_id == first.id
    again = [tasks.enqueue_task.delay(key, log) for _ in range(19)]
    assert {result.id for result in again} == {first.id}  # the pending task's handle
    with pytest.raises(DuplicateTask) as dropped:
        app.send_task(tasks.enqueue_task.name, args=(key, log))
    assert dropped.value.existing.id == first.id
    group(tasks.enqueue_task.s(key, log) for _ in range(3)).apply_async()  # canvas too
    assert cluster.broker.llen("tl_pending") == 1  # exactly one message queued
    try:
        app.control.add_consumer("tl_pending", destination=[consumer], reply=True)
        assert first.get(timeout=20) == "ran"
        assert holder(cluster, f"t:{key}") is None
        second = tasks.enqueue_task.delay(key, log)  # after it ran, a new call queues again
        assert second.id != first.id
        assert second.get(timeout=20) == "ran"
        assert [run["task_id"] for run in intervals(log)] == [first.id, second.id]
    finally:
        app.control.cancel_consumer("tl_pending", destination=[consumer], reply=True)


def test_revoked_or_expired_queued_message_frees_its_enqueue_lock(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any
) -> None:
    """The worker that drops a revoked or expired message frees the lock taken when it
    was published (ttl=30), instead of leaving the key blocked until the TTL."""
    tasks, app, consumer = cluster.tasks, cluster.app, prefork_workers[0].hostname
    revoked = tasks.enqueue_task.delay(f"{key}r", f"log:{key}")
    expired = tasks.enqueue_task.apply_async((f"{key}e", f"log:{key}"), expires=0.5)
    revoked.revoke()
    assert holder(cluster, f"t:{key}r") is not None and holder(cluster, f"t:{key}e") is not None
    time.sleep(0.6)  # let the second message's expiry pass while it sits in the queue
    try:
        app.control.add_consumer("tl_pending", destination=[consumer], reply=True)
        wait_until(
            lambda: holder(cluster, f"t:{key}r") is None and holder(cluster, f"t:{key}e") is None,
            10,
            "both queued locks to be freed",
        )
        wait_until(lambda: revoked.state == expired.state == "REVOKED", 10, "REVOKED states")
    finally:
        app.control.cancel_consumer("tl_pending", destination=[consumer], reply=True)
    assert intervals(f"log:{key}") == []  # neither ran


def test_enqueue_lock_is_handed_over_to_the_run_with_both(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any
) -> None:
    """``lock_on="both"``: the queued lock becomes the run lock; duplicates are dropped
    while the task is queued *and* while it runs."""
    tasks, app, log, name = cluster.tasks, cluster.app, f"log:{key}", f"t:{key}"
    consumer = prefork_workers[1].hostname
    first = tasks.both_task.delay(key, log, 1.5)
    assert tasks.both_task.delay(key, log, 1.5).id == first.id  # while queued
    try:
        app.control.add_consumer("tl_pending", destination=[consumer], reply=True)
        running = wait_until(
            lambda: (h := held_by(cluster, name, first.id)) and h.owner.worker and h,
            10,
            "the run to hold the key",
        )
        assert running.owner.worker == consumer
        assert tasks.both_task.delay(key, log, 1.5).id == first.id  # while running
        first.get(timeout=20)
        assert holder(cluster, name) is None
        second = tasks.both_task.delay(key, log, 0)
        assert second.id != first.id
        second.get(timeout=20)
        assert [run["task_id"] for run in intervals(log)] == [first.id, second.id]
    finally:
        app.control.cancel_consumer("tl_pending", destination=[consumer], reply=True)


def test_both_keeps_the_key_taken_while_a_retry_waits(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any
) -> None:
    """A ``"both"`` task that retries itself hands its lease to the retry message: during
    the countdown the key stays taken and duplicates are still dropped."""
    task, log, name = cluster.tasks.both_retrying_task, f"log:{key}", f"t:{key}"
    first = task.delay(key, log, 1.5)
    wait_until(lambda: intervals(log), 10, "the first attempt")
    assert held_by(cluster, name, first.id) is not None  # parked for the retry
    assert task.delay(key, log, 1.5).id == first.id  # a duplicate is still dropped
    assert first.get(timeout=20) == "done"
    assert [a["attempt"] for a in intervals(log)] == [0, 1]
    assert holder(cluster, name) is None
    last = task.delay(key, log, 0)
    assert last.id != first.id  # free again once it is done
    assert last.get(timeout=20) == "done"


# -- 7. acks_late redelivery after visibility_timeout: the copy never runs alongside ---------


def test_redelivered_copy_does_not_run_concurrently(
    cluster: Any, redelivery_worker: Any, key: str, intervals: Any
) -> None:
    log = f"log:{key}"
    result = cluster.tasks.redelivered_task.delay(key, log, 15)
    assert result.get(timeout=40)["task_id"] == result.id
    deliveries = intervals(log + ":deliveries")
    assert len(deliveries) >= 2, "Redis did not redeliver the message: the test proved nothing"
    runs = intervals(log)
    assert len(runs) == 1  # exactly one copy did the work
    assert_no_overlap(runs)
    assert result.state == "SUCCESS"
    assert holder(cluster, f"t:{key}") is None


# -- 8. max_hold: a hung task's lease is lost after ~2 s and another worker takes the key --------


def test_max_hold_frees_a_hung_task_key(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any
) -> None:
    name, log = f"t:{key}", f"log:{key}"
    result = cluster.tasks.hung_task.delay(key, log, 10)
    wait_until(lambda: held_by(cluster, name, result.id), 10, "the hung task to hold the key")
    began = time.monotonic()
    wait_until(lambda: holder(cluster, name) is None, 5, "max_hold to free the key")
    assert time.monotonic() - began < 3.0
    lost = wait_until(
        lambda: [e for e in intervals(log) if e.get("event") in ("lost", "not lost")],
        5,
        "the task to see its lease lost",
    )
    assert lost[0]["event"] == "lost" and 1.5 <= lost[0]["after"] <= 3.5
    other = cluster.tasks.raise_task.delay(key, f"{log}:other", 0)  # raises if still held
    assert other.get(timeout=20)["task_id"] == other.id
    with pytest.raises(LockLost):  # the hung run ends loudly: its lease was lost
        result.get(timeout=20)


# -- 9. solo and threads pools; async def tasks ----------------------------------------------


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_solo_and_threads_pools_run_all_without_overlap(
    cluster: Any, key: str, intervals: Any, pool: str, request: pytest.FixtureRequest
) -> None:
    worker = request.getfixturevalue(f"{pool}_worker")
    log = f"log:{key}"
    queue = f"tl_{pool}"
    results = [
        cluster.tasks.wait_task.apply_async((key, log, 0.02), queue=queue) for _ in range(40)
    ]
    for result in results:
        result.get(timeout=60)
    runs = intervals(log)
    assert len(runs) == 40 and {run["worker"] for run in runs} == {worker.hostname}
    assert_no_overlap(runs)
    assert holder(cluster, f"t:{key}") is None


@pytest.mark.parametrize("queue", ["tl_default", "tl_threads"])
def test_async_task_runs_under_an_async_lease_and_releases(
    cluster: Any, prefork_workers: Any, threads_worker: Any, key: str, intervals: Any, queue: str
) -> None:
    log = f"log:{key}"
    results = [cluster.tasks.async_task.apply_async((key, log, 0.2), queue=queue) for _ in range(3)]
    for result in results:
        assert result.get(timeout=30)["lease_type"] == "AsyncLease"
    runs = intervals(log)
    assert len(runs) == 3
    assert_no_overlap(runs)
    assert holder(cluster, f"t:{key}") is None
