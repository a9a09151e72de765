"""One lock per run: a waiting run marks its task id, a copy meets the mark or the run.

In-process runs (``apply``: Celery's tracer, as eagerly as a worker would run them) on
``memory://`` and Redis: a run that gets its lock at once holds nothing else; one that
has to wait holds ``<key>#task:<id>`` only while it waits, so a copy delivered meanwhile
(same task id) is refused at once instead of waiting behind it and running again.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from deployments import build_deployment

from task_locks import Lock, get_backend
from task_locks.celery import singleton_task
from task_locks.celery.task import task_id_lock_name


@pytest.fixture(params=["memory", "redis"])
def lock_url(request: pytest.FixtureRequest) -> str:
    return build_deployment(request, request.param).url


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("run-check-marks", set_as_current=False)
    app.conf.update(task_always_eager=False, task_ignore_result=True)
    yield app
    app.close()


def wait_for(predicate: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_waiting_run_marks_its_task_id_and_a_copy_is_refused_at_once(
    app: Celery, lock_url: str, is_async: bool
) -> None:
    key = f"marks-{uuid.uuid4().hex[:8]}"
    ran: list[str] = []

    # A unique name: Celery warns (an error here) when a later app is given a task of the
    # same name as one before it (tasks are shared with every app), this test's other run.
    options: dict[str, Any] = {"name": f"t.{uuid.uuid4().hex}", "wait_timeout": 20}
    if is_async:

        @singleton_task(app=app, key=key, backend=lock_url, on_conflict="wait", **options)
        async def task() -> None:
            ran.append("run")

    else:

        @singleton_task(app=app, key=key, backend=lock_url, on_conflict="wait", **options)
        def task() -> None:
            ran.append("run")

    backend = get_backend(lock_url)
    task_id = str(uuid.uuid4())
    mark = task_id_lock_name(key, task_id)
    other = Lock(key, ttl=30, backend=lock_url).acquire(timeout=0)
    first = threading.Thread(target=lambda: task.apply(task_id=task_id))
    first.start()
    wait_for(lambda: backend.holder(mark) is not None, 10, "the waiting run's mark")
    started = time.monotonic()
    copy = task.apply(task_id=task_id)  # the same message again: refused, not queued
    assert copy.state == "IGNORED"
    assert time.monotonic() - started < 5
    other.release()
    first.join(timeout=20)
    assert ran == ["run"]
    assert backend.holder(mark) is None and backend.holder(key) is None


def test_a_run_that_gets_its_lock_at_once_holds_one_lock(app: Celery, lock_url: str) -> None:
    key = f"marks-{uuid.uuid4().hex[:8]}"
    seen: list[list[str]] = []
    backend = get_backend(lock_url)

    @singleton_task(
        app=app,
        name=f"t.{uuid.uuid4().hex}",
        key=key,
        backend=lock_url,
        on_conflict="wait",
        lock_on="run",
    )
    def task() -> None:
        seen.append(sorted(h.name for h in backend.holders() if key in h.name))

    task.apply(task_id=str(uuid.uuid4()))
    assert seen == [[key]]
