"""How a singleton task's run ends when its lock is lost mid-run (``on_lost``, with and
without a stored result), and a ``lock_on="both"`` run refused by an old library's key,
in real ``celery worker`` processes.

The lock is force-released (as an operator would) while the body runs; the next renewal
(ttl 1.5 s: every 0.5 s) finds its token gone. How each run ended is recorded by the
worker's own ``task_success``/``task_failure`` signals (``<log>:end``), so runs whose
result is not stored are checked the same way as the others.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from servers import wait_until

from task_locks import LockLost, get_backend
from task_locks.celery import Skipped

QUEUES = {
    "prefork": "tl_default",
    "threads": "tl_threads",
    "solo": "tl_solo",
    "gevent": "tl_gevent",
    "eventlet": "tl_eventlet",
}


def start_and_lose(
    cluster: Any, request: pytest.FixtureRequest, task: Any, pool: str, key: str,
    seconds: float, step: float,
) -> tuple[Any, float]:  # fmt: skip
    """Send ``task``, force-release its lock once its body runs: (result, when released)."""
    request.getfixturevalue("prefork_workers" if pool == "prefork" else f"{pool}_worker")
    log = f"log:{key}"
    result = task.apply_async((key, log, seconds, step), queue=QUEUES[pool])
    wait_until(lambda: events(cluster, log), 20, "the body to start")
    assert get_backend(cluster.locks_url).force_release(f"t:{key}")
    return result, time.monotonic()


def events(cluster: Any, log: str) -> list[str]:
    import json

    return [json.loads(item)["event"] for item in cluster.store.lrange(log, 0, -1)]


def ended(cluster: Any, key: str) -> dict[str, Any]:
    import json

    found = wait_until(lambda: cluster.store.lrange(f"log:{key}:end", 0, -1), 30, "the run to end")
    assert len(found) == 1, found
    return dict(json.loads(found[0]))


@pytest.mark.parametrize(
    ("pool", "stored"),
    [(pool, stored) for pool in QUEUES for stored in (True, False)],
)
def test_interrupt_raises_lock_lost_in_the_body_as_soon_as_the_loss_is_known(
    cluster: Any, request: pytest.FixtureRequest, key: str, pool: str, stored: bool
) -> None:
    task = cluster.tasks.lost_interrupt if stored else cluster.tasks.lost_interrupt_unstored
    # prefork/solo: one 30 s sleep, cut short by the signal; gevent/eventlet: the hub throws
    # it into the sleeping greenlet; threads: the async exception lands between two Python
    # bytecodes, so the body sleeps in short steps.
    step = 0.05 if pool == "threads" else 30.0
    result, released = start_and_lose(cluster, request, task, pool, key, 30.0, step)
    end = ended(cluster, key)
    assert time.monotonic() - released < 3.0  # renewal at ttl/3 = 0.5 s finds it gone
    assert end["state"] == "FAILURE" and end["error"] == "LockLost", end
    assert "was lost while the task ran" in end["message"] and "interrupted" in end["message"]
    assert "\n" not in end["message"]
    assert events(cluster, f"log:{key}") == ["started", "interrupted"]
    if stored:
        with pytest.raises(LockLost, match="was lost while the task ran"):
            result.get(timeout=10)
        assert result.state == "FAILURE"


@pytest.mark.parametrize("pool", ["prefork", "gevent"])
def test_a_force_release_interrupts_the_body_at_once_not_at_the_next_renewal(
    cluster: Any, request: pytest.FixtureRequest, key: str, pool: str
) -> None:
    """TTL 30 s (renewals every 10 s): the worker's release-notice listener hears the
    force release and the body is interrupted within a second or so; under gevent the
    listener is a greenlet on the patched socket."""
    task = cluster.tasks.lost_interrupt_noticed
    _result, released = start_and_lose(cluster, request, task, pool, key, 30.0, 30.0)
    end = ended(cluster, key)
    assert time.monotonic() - released < 3.0, "interrupted long before the 10 s renewal"
    assert end["state"] == "FAILURE" and end["error"] == "LockLost", end
    assert "release notice" in end["message"], end
    assert events(cluster, f"log:{key}") == ["started", "interrupted"]


@pytest.mark.parametrize(
    ("pool", "stored"),
    [
        *((pool, stored) for pool in ("prefork", "threads") for stored in (True, False)),
        ("solo", False),
        ("gevent", True),
        ("eventlet", False),
    ],
)
def test_fail_lets_the_body_finish_then_fails_with_one_line(
    cluster: Any, request: pytest.FixtureRequest, key: str, pool: str, stored: bool
) -> None:
    task = cluster.tasks.lost_fail if stored else cluster.tasks.lost_fail_unstored
    result, _released = start_and_lose(cluster, request, task, pool, key, 2.0, 0.05)
    end = ended(cluster, key)
    assert end["state"] == "FAILURE" and end["error"] == "LockLost", end
    assert "finished without exclusivity" in end["message"] and "\n" not in end["message"]
    assert events(cluster, f"log:{key}") == ["started", "finished"]
    if stored:
        with pytest.raises(LockLost, match="finished without exclusivity"):
            result.get(timeout=10)
    # The worker logs it as one line (an expected error), not a traceback.
    lines = wait_until(
        lambda: [
            line
            for worker in cluster.workers.values()
            for line in worker.tail(400).splitlines()
            if result.id in line and "LockLost" in line
        ],
        10,
        "the worker to log the failure",
    )
    assert all("raised expected" in line for line in lines), lines


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo", "gevent", "eventlet"])
def test_ignore_keeps_the_result(
    cluster: Any, request: pytest.FixtureRequest, key: str, pool: str
) -> None:
    task = cluster.tasks.lost_ignore
    result, _released = start_and_lose(cluster, request, task, pool, key, 1.5, 0.05)
    assert result.get(timeout=20) == "finished"
    assert ended(cluster, key)["state"] == "SUCCESS"


def test_a_both_run_refused_by_a_peer_key_frees_its_publish_lock(
    cluster: Any, prefork_workers: Any, key: str
) -> None:
    """The run is skipped (an old library holds the key); its publish-time
    lock must not stay for the whole enqueue_ttl and drop every later publish."""
    name, log = f"t:{key}", f"log:{key}"
    cluster.store.set(f"peer:{name}", "old-task-id", ex=60)
    try:
        first = cluster.tasks.peer_both_task.delay(key, log)
        assert isinstance(first.get(timeout=20), Skipped)
    finally:
        cluster.store.delete(f"peer:{name}")  # the old worker's run ends
    backend = get_backend(cluster.locks_url)
    wait_until(lambda: backend.holder(name) is None, 5, "the publish-time lock to be freed")
    second = cluster.tasks.peer_both_task.delay(key, log)
    assert second.id != first.id  # not dropped as a duplicate of the skipped message
    assert second.get(timeout=20) == "ran"


# -- in this process: a direct call on a thread that is not the main one, and async def -----


@pytest.fixture
def local_app() -> Any:
    from celery import Celery

    app = Celery(f"outcomes-{time.monotonic_ns()}", set_as_current=False)
    try:
        yield app
    finally:
        app.close()


def test_interrupt_reaches_a_body_on_another_thread(local_app: Any, redis_url: str) -> None:
    import threading

    from task_locks.celery import current_lease, singleton_task

    @singleton_task(app=local_app, shared=False, key="lost:{n}", ttl=1.5, backend=redis_url)
    def work(n: int) -> str:
        assert get_backend(redis_url).force_release(f"lost:{n}")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # Python bytecodes: the async exception lands
            time.sleep(0.02)
        return "finished"

    outcome: list[BaseException | str] = []

    def call() -> None:
        try:
            outcome.append(work(1))
        except BaseException as exc:
            outcome.append(exc)

    began = time.monotonic()
    thread = threading.Thread(target=call)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - began < 5
    assert isinstance(outcome[0], LockLost) and "interrupted" in str(outcome[0]), outcome
    assert current_lease() is None


def test_interrupt_cancels_an_async_body(local_app: Any, redis_url: str) -> None:
    import asyncio

    from task_locks.celery import singleton_task

    seen: list[str] = []

    @singleton_task(app=local_app, shared=False, key="alost:{n}", ttl=1.5, backend=redis_url)
    async def work(n: int) -> str:
        assert get_backend(redis_url).force_release(f"alost:{n}")
        try:
            await asyncio.sleep(20)
        except asyncio.CancelledError:
            seen.append("cancelled")  # the body may roll back here
            raise
        return "finished"

    began = time.monotonic()
    with pytest.raises(LockLost, match="'alost:1' was lost while the task ran"):
        work(1)
    assert time.monotonic() - began < 5 and seen == ["cancelled"]
