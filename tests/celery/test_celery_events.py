"""Singleton tasks and the publish guard feed the event stream and the metrics.

In-process: the tasks are called directly (the code path a worker runs) or published to
a real Redis broker with no worker: what matters is what this process reports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
from celery import Celery
from event_fixtures import Value

from task_locks import Lock, LockLost, Semaphore, events, get_backend
from task_locks.celery import DuplicateTask, current_lease, singleton_task
from task_locks.events import LockEvent

prometheus_client = pytest.importorskip("prometheus_client")
pytestmark = pytest.mark.usefixtures("only_logging_stays")


@pytest.fixture
def app(redis_url: str) -> Iterator[Celery]:
    app = Celery("events", broker=redis_url, backend="cache+memory://", set_as_current=False)
    yield app
    app.close()


def test_a_duplicate_publish_is_one_event_and_the_queued_lock_is_handed_over(
    app: Celery, redis_url: str, seen: list[LockEvent], metric: Value
) -> None:
    @singleton_task(
        app=app, shared=False, key="pub:{n}", ttl=30, backend=redis_url, lock_on="enqueue"
    )
    def job(n: int) -> int:
        return n

    job.apply_async((1,))
    with pytest.raises(DuplicateTask):  # (apply_async would return the pending handle)
        app.send_task(job.name, args=(1,))
    assert events.flush(5.0)
    kinds = [(e.kind, e.reason) for e in seen if e.kind != "renewed"]
    assert kinds == [("acquired", ""), ("released", events.HANDED_OVER), ("duplicate", "")]
    assert "worker of" in seen[1].detail
    assert Lock("pub:1", backend=redis_url).holder() is not None  # still queued
    value = metric
    assert value("task_locks_acquisitions_total", lock="pub", outcome="acquired") == 1
    assert value("task_locks_acquisitions_total", lock="pub", outcome="conflict") == 0
    assert value("task_locks_held", lock="pub") == 0
    assert value("task_locks_hold_seconds_count", lock="pub") == 0  # not a hold
    assert not [e for e in seen if e.kind == "lost"]


def test_a_limited_task_is_labelled_by_its_keys_family(
    app: Celery, redis_url: str, seen: list[LockEvent], metric: Value
) -> None:
    @singleton_task(
        app=app, shared=False, key="exports:{tenant}", ttl=5, backend=redis_url, limit=2
    )
    def export(tenant: str) -> int:
        lease = current_lease()
        assert lease is not None
        return lease.fence

    assert export("acme")
    others = Semaphore("exports:acme", limit=2, ttl=5, backend=redis_url)
    first, second = others.acquire(timeout=0), others.acquire(timeout=0)
    assert export("acme") is None  # skipped: both permits taken
    first.release()
    second.release()
    assert metric("task_locks_acquisitions_total", lock="exports", outcome="acquired") == 3
    assert metric("task_locks_acquisitions_total", lock="exports", outcome="conflict") == 1
    assert metric("task_locks_held", lock="exports") == 0
    conflict = next(e for e in seen if e.kind == "conflict")
    assert conflict.policy == "skip" and conflict.name == "exports:acme"


@pytest.mark.parametrize("on_lost", ["interrupt", "fail"])
def test_a_lost_lease_in_a_singleton_task_is_logged_once(
    app: Celery, redis_url: str, caplog: pytest.LogCaptureFixture, on_lost: str
) -> None:
    @singleton_task(
        app=app, shared=False, key="sync:{n}", ttl=1.5, backend=redis_url, on_lost=on_lost
    )
    def sync(n: int) -> str:
        lease = current_lease()
        assert lease is not None
        assert get_backend(redis_url).force_release(f"sync:{n}")
        assert lease.lost.wait(5)  # the next renewal (ttl/3) finds the token gone
        time.sleep(0.3)  # "interrupt" cuts this short
        return "finished"

    caplog.set_level(logging.WARNING, logger="task_locks")
    with pytest.raises(LockLost, match="'sync:1' was lost while the task ran"):
        sync(1)
    assert events.flush(5.0)
    losses = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("task_locks")
        and "'sync:1'" in r.getMessage()
        and "lost" in r.getMessage()
    ]
    assert len(losses) == 1, losses


def test_a_beat_tick_claim_is_handed_over_and_a_second_claim_is_no_conflict(
    redis_url: str, seen: list[LockEvent], metric: Value
) -> None:
    from types import SimpleNamespace

    from task_locks import Election
    from task_locks.celery.beat import LeaderMixin

    scheduler = SimpleNamespace(election=Election("beat", ttl=5, backend=redis_url))
    assert LeaderMixin._claim(scheduler, "nightly@1000", 5.0)  # type: ignore[arg-type]
    assert LeaderMixin._claim(scheduler, "nightly@1000", 5.0) is None  # already sent
    assert metric("task_locks_acquisitions_total", lock="beat-tick", outcome="acquired") == 1
    assert metric("task_locks_acquisitions_total", lock="beat-tick", outcome="conflict") == 0
    assert metric("task_locks_held", lock="beat-tick") == 0
    kinds = [(e.kind, e.reason) for e in seen if e.kind != "renewed"]
    assert kinds == [("acquired", ""), ("released", events.HANDED_OVER)]
