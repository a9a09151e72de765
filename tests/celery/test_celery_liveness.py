"""Liveness in real ``celery worker`` processes: nothing a user sends is lost.

- A past ETA on a ``lock_on="enqueue"``/``"both"`` task means "run now" (as in
  Celery), not a negative TTL.
- A queued lock outlasts a long queue by default (until the message's ``expires``,
  else :data:`~task_locks.celery.publish.DEFAULT_ENQUEUE_TTL`), and a queued lock that
  expired before its message ran is logged by the worker that runs it.

Each test publishes to a queue of its own, consumed only when the test says so.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any

import pytest
from servers import wait_until

from task_locks import get_backend

pytestmark = pytest.mark.slow


def queued_lock_left(cluster: Any, key: str) -> float:
    """Seconds the queued lock of ``key`` has left."""
    holder = get_backend(cluster.locks_url).holder(f"t:{key}")
    assert holder is not None and holder.expires_at is not None, "no queued lock"
    return holder.expires_at - time.time()


def consume(cluster: Any, worker: Any, queue: str, results: list[Any]) -> list[str]:
    """Let ``worker`` consume ``queue`` until every result has ended; their states."""
    app = cluster.app
    app.control.add_consumer(queue, destination=[worker.hostname], reply=True)
    try:
        wait_until(
            lambda: all(r.state not in ("PENDING", "STARTED") for r in results),
            20,
            f"the messages of {queue} to run",
        )
    finally:
        app.control.cancel_consumer(queue, destination=[worker.hostname], reply=True)
        cluster.broker.delete(queue)
    return [r.state for r in results]


@pytest.mark.parametrize("task_name", ["enqueue_burst_task", "both_burst_task"])
def test_a_past_eta_means_run_now(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any, task_name: str
) -> None:
    task, queue, log = getattr(cluster.tasks, task_name), f"tl_hold_{key}", f"log:{key}"
    an_hour_ago = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    result = task.apply_async((key, log, 0), eta=an_hour_ago, queue=queue)
    assert queued_lock_left(cluster, key) > 25  # the whole enqueue TTL (ttl=30), not less
    assert task.apply_async((key, log, 0), countdown=-5, queue=queue).id == result.id
    assert consume(cluster, prefork_workers[0], queue, [result]) == ["SUCCESS"]
    assert [run["task_id"] for run in intervals(log)] == [result.id]


def test_a_queued_lock_lasts_an_hour_by_default_or_until_the_message_expires(
    cluster: Any, key: str
) -> None:
    task, queue, log = cluster.tasks.default_queue_task, f"tl_hold_{key}", f"log:{key}"
    try:
        task.apply_async((key, log, 0), queue=queue)
        assert 3500 < queued_lock_left(cluster, key) <= 3600
        task.apply_async((f"{key}x", log, 0), queue=queue, expires=120)
        assert 110 < queued_lock_left(cluster, f"{key}x") <= 121
    finally:
        cluster.broker.delete(queue)


@pytest.mark.parametrize("task_name", ["short_queue_task", "short_both_task"])
def test_a_queued_lock_that_expired_before_its_message_ran_is_logged(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any, task_name: str
) -> None:
    task, queue, log = getattr(cluster.tasks, task_name), f"tl_hold_{key}", f"log:{key}"
    result = task.apply_async((key, log, 0), queue=queue)
    raw = cluster.broker.lindex(queue, 0)
    assert json.loads(raw)["headers"]["id"] == result.id
    backend = get_backend(cluster.locks_url)
    wait_until(lambda: backend.holder(f"t:{key}") is None, 5, "the queued lock to expire")
    worker = prefork_workers[0]
    assert consume(cluster, worker, queue, [result]) == ["SUCCESS"]  # it still runs
    wait_until(
        lambda: f"queued lock 't:{key}' of this message expired before it ran" in worker.tail(400),
        5,
        "the worker to log the expired queued lock",
    )
