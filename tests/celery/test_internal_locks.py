"""Internal records are never shown or counted as the user's.

A run's task-id guard (``<key>#task:<id>``, taken for ``on_conflict="wait"``/``"retry"``,
``limit > 1`` and ``lock_on="both"``) is marked ``Owner.internal``: listings, the admin,
the event stream and the metrics see one run as one lock, one row, one count. Checked by
that marker, so it holds whatever internal records a backend keeps (or stops keeping).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from celery import Celery
from event_fixtures import Value

from task_locks import events, get_backend, verbs
from task_locks.celery import singleton_task
from task_locks.events import LockEvent
from task_locks.listing import group_holders

prometheus_client = pytest.importorskip("prometheus_client")
pytestmark = pytest.mark.usefixtures("only_logging_stays")


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery(f"internal-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.task_always_eager = True  # the run in this process, through a worker's path
    app.conf.task_eager_propagates = True
    yield app
    app.close()


def test_a_runs_guard_is_not_the_users_lock(
    app: Celery, redis_url: str, seen: list[LockEvent], metric: Value
) -> None:
    backend = get_backend(redis_url)
    during: dict[str, Any] = {}

    @singleton_task(app=app, shared=False, ttl=30, backend=redis_url, on_conflict="wait")
    def rebuild_index() -> None:  # unkeyed: its lock is the task's name
        during["raw"] = backend.holders()
        during["listing"] = group_holders(during["raw"])
        out = StringIO()
        verbs.cmd_list(backend, "", True, out)
        during["json"] = json.loads(out.getvalue())

    rebuild_index.apply()
    [name] = [h.name for h in during["raw"] if not h.owner.internal]  # the run's lock
    internal = [h for h in during["raw"] if h.owner.internal]
    assert all(h.name.startswith(f"{name}#") for h in internal)  # the guard, if one is kept
    assert [h.name for h in during["listing"].locks] == [name]  # one run, one row
    assert [lock["name"] for lock in during["json"]] == [name]
    assert events.flush(5.0)
    assert {e.name for e in seen} == {name}, {e.name for e in seen}
    family = name.split(":", 1)[0]
    assert metric("task_locks_acquisitions_total", lock=family, outcome="acquired") == 1
    assert metric("task_locks_hold_seconds_count", lock=family) == 1
    assert metric("task_locks_held", lock=family) == 0
    labels = {
        s.labels["lock"]
        for m in metric.registry.collect()  # type: ignore[attr-defined]
        for s in m.samples
        if "lock" in s.labels
    }
    assert labels == {family}, labels  # no `<name>#task` family
