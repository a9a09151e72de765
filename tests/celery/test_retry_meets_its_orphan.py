"""A retry after a lost acquire reply meets its own task id on a lock nobody renews.

The fault is real: the chaoskit TCP proxy lets the run's acquire reach a real
redis-server, which takes the lock for the run, then resets the connection instead of
passing the reply on, and resets redis-py's own retry too. The run reports
``BackendUnavailable`` (``lock_unavailable="retry"`` sends the message again) while
the server holds the lock under that run's token, with its task id in the owner, and
nobody renews it. The retry (same task id, ``retries`` = 1) meets that lock: it is no
running copy of the message, and refusing it as one would acknowledge the message with
its body never run. The retry watches it, as a redelivery does: expired unrenewed, it
takes the key and runs. Runs in-process (``apply``: Celery's tracer).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from celery import Celery
from chaoskit.proxy import Proxy

import task_locks.celery.task as celery_task
from task_locks import get_backend
from task_locks.celery import singleton_task

TTL = 2.0


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("retry-orphan", set_as_current=False)
    app.conf.update(task_always_eager=False, task_ignore_result=True)
    yield app
    app.close()


@pytest.mark.parametrize("options", [{}, {"limit": 2}, {"on_conflict": "wait"}])
def test_a_retry_runs_once_its_previous_attempts_orphan_lock_expires(
    app: Celery,
    scripted_link: Proxy,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    options: dict[str, object],
) -> None:
    # The retry's wait for its previous attempt, shorter than the TTL: the orphan must
    # be told from a running copy by watching it, not by outwaiting it.
    monkeypatch.setattr(celery_task, "RETRY_HANDOVER_WAIT", 0.2)
    key = f"orphan-{uuid.uuid4().hex[:8]}"
    url = f"redis://127.0.0.1:{scripted_link.port}/0?socket_timeout=0.5"
    ran: list[int] = []

    @singleton_task(app=app, name=f"t.{uuid.uuid4().hex}", key=key, backend=url, ttl=TTL, **options)
    def task() -> None:
        ran.append(1)

    get_backend(url).holder("warm-up")  # the pooled connection is open: the fault is the run's
    task_id = str(uuid.uuid4())
    scripted_link.fault("reset_mid_call")
    try:
        first = task.apply(task_id=task_id)
    finally:
        scripted_link.heal()
    assert first.state == "FAILURE" and ran == [], first.result
    direct = get_backend(redis_url)
    orphans = [h for h in direct.holders() if key in h.name]
    assert [h.owner.task_id for h in orphans] == [task_id], "the acquire was not applied"

    retry = task.apply(task_id=task_id, retries=1)
    assert retry.state == "SUCCESS", retry.result
    assert ran == [1], "the retry was refused as a copy of itself: the message is lost"
    assert not [h for h in direct.holders() if key in h.name]
