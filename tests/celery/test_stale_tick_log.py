"""A refused beat tick is logged at WARNING, in this process.

The worker-side refusal is tested in real workers by ``test_celery_coordination.py``;
their log goes to a file. Here the same ``__call__`` runs through ``apply()`` (the path
a worker takes, with the message's headers) so ``caplog`` sees the record: a tick that is
refused must never disappear silently.
"""

from __future__ import annotations

import logging
import uuid

import pytest
from celery import Celery

from task_locks import Election
from task_locks.celery import DuplicateTask, StaleTick, singleton_task
from task_locks.celery.beat import ELECTION_HEADER, TERM_HEADER, TICK_HEADER


@pytest.mark.parametrize("skip_as", ["success", "failure"])
def test_a_refused_stale_tick_is_logged_at_warning_and_ends_ready(
    redis_url: str, caplog: pytest.LogCaptureFixture, skip_as: str
) -> None:
    app = Celery(f"stale-{uuid.uuid4().hex[:6]}", backend="cache+memory://", set_as_current=False)
    app.conf.task_locks_beat_backend = redis_url
    ran: list[int] = []

    @singleton_task(
        app=app,
        name=f"stale_job_{uuid.uuid4().hex[:8]}",
        key="stale",
        ttl=5,
        backend=redis_url,
        skip_as=skip_as,
    )
    def job() -> None:
        ran.append(1)

    election = f"beat-{uuid.uuid4().hex[:8]}"
    old = Election(election, ttl=10, backend=redis_url).campaign(timeout=5)
    old_term = old.term
    old.resign()
    current = Election(election, ttl=10, backend=redis_url).campaign(timeout=5)
    headers = {ELECTION_HEADER: election, TERM_HEADER: old_term, TICK_HEADER: f"t@{old_term}"}
    try:
        with caplog.at_level(logging.DEBUG, logger="task_locks"):
            result = job.apply(headers=headers)
    finally:
        current.resign()
    assert ran == [], "a tick of an old term whose claim is gone must not run"
    if skip_as == "success":
        assert result.state == "SUCCESS"
        assert result.get() == StaleTick(election, f"t@{old_term}", old_term, current.term)
    else:
        assert result.state == "FAILURE" and isinstance(result.result, DuplicateTask)
    refusals = [
        r for r in caplog.records if r.name == "task_locks.celery" and "refused" in r.getMessage()
    ]
    assert len(refusals) == 1, [r.getMessage() for r in caplog.records]
    record = refusals[0]
    assert record.levelno == logging.WARNING and record.name == "task_locks.celery"
    message = record.getMessage()
    assert f"t@{old_term}" in message and repr(election) in message, message
    assert f"term {old_term}" in message and f"term is {current.term}" in message, message
