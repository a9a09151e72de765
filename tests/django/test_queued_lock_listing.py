"""A queued lock's expiry is visible to operators.

``lock_on="enqueue"`` takes the key's lock when the message is published; it lasts
``enqueue_ttl`` (else the message's ``expires``, else an hour) while the message waits.
``task-locks list`` and ``manage.py locks list`` (table and ``--json``) must show that
lock with its holder (the queued task) and when it expires, so an operator can see a
queue longer than the lock lasts. The message is published for real (kombu's in-memory
transport, nobody consumes it) and the lock is on a real Redis.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from django_helpers import cli, finish, manage

from task_locks.celery import singleton_task
from task_locks.celery.publish import DEFAULT_ENQUEUE_TTL


@pytest.mark.parametrize(
    ("front", "prefix"), [(manage, ("locks",)), (cli, ())], ids=["manage.py", "task-locks"]
)
@pytest.mark.parametrize("expires", [None, 600])
def test_list_shows_a_queued_locks_expiry(
    redis_url: str,
    front: Callable[..., Any],
    prefix: tuple[str, ...],
    expires: int | None,
) -> None:
    app = Celery(f"queued-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    key = f"queued-{uuid.uuid4().hex[:8]}"

    @singleton_task(
        app=app,
        name=f"queued_job_{uuid.uuid4().hex[:8]}",
        key=key,
        ttl=30,
        lock_on="enqueue",
        backend=redis_url,
    )
    def job() -> None:  # pragma: no cover - never consumed
        pass

    published = time.time()
    result = job.apply_async(expires=expires)
    lasts = DEFAULT_ENQUEUE_TTL if expires is None else expires

    status, out, err = finish(front(*prefix, "list", "--json", backend_url=redis_url))
    assert status == 0, err
    (row,) = [r for r in json.loads(out) if r["name"] == key]
    assert row["owner"]["task_id"] == result.id
    assert row["owner"]["task_name"] == job.name
    assert lasts - 60 < row["expires_in"] <= lasts + 2, row  # (+1 s: rounding up)
    assert abs(row["expires_at"] - (published + lasts)) < 60, row

    status, out, err = finish(front(*prefix, "list", backend_url=redis_url))
    assert status == 0, err
    (line,) = [ln for ln in out.splitlines() if ln.startswith(key)]
    assert result.id in line and "EXPIRES IN" in out
    assert lasts - 60 < _seconds(line.split()[-1]) <= lasts + 2, out


def _seconds(shown: str) -> float:
    """``59m59s``, ``1h00m``, ``10m00s`` (the table's EXPIRES IN) as seconds."""
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", shown)
    assert match and shown, shown
    hours, minutes, seconds = (int(part or 0) for part in match.groups())
    return hours * 3600 + minutes * 60 + seconds
