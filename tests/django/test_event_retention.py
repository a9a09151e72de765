"""Lock events an operator can read: repeats of one conflict fold into one counted row,
each row keeps its policy, and old rows are pruned by ``EVENT_RETENTION_DAYS`` from the
command or the Celery task a beat schedule runs (the schedule docs/operations.md shows).
"""

from __future__ import annotations

import datetime as dt
import time
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.utils import timezone

from django_app import audit
from django_app.models import LockEvent
from task_locks import Owner, events

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
TASK = Owner(task_name="shop.sync_account", task_id="abc-1", host="worker-2", pid=4242)


#: Only rows of this module's names are counted: a lease an earlier test left behind in
#: this process can be found lost (a force release's notice, its deadline) while one of
#: these tests records events, and its row would count too.
SYNC = "sync:42"


@pytest.fixture
def audited(settings: Any) -> None:
    settings.TASK_LOCKS = {"BACKEND": "memory://retention", "AUDIT": True}


def _conflict(name: str = SYNC, fence: int = 17, policy: str = "skip", **fields: Any) -> None:
    events.emit(events.Conflict(name=name, fence=fence, owner=TASK, policy=policy, **fields))


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("audited")
def test_repeated_conflicts_fold_into_one_counted_row() -> None:
    for _ in range(4):
        _conflict()
    assert audit.flush(10)
    for _ in range(3):  # a later batch: counted on the row already written
        _conflict()
    _conflict(policy="wait")  # another policy: a row of its own
    _conflict(fence=18)  # the next holder: a row of its own
    events.emit(events.Lost(name=SYNC, fence=17, owner=TASK, reason=events.LostReason.DEADLINE))
    events.emit(
        events.Lost(name=SYNC, fence=17, owner=TASK, reason=events.LostReason.DEADLINE)
    )  # not folded
    assert audit.flush(10)
    mine = LockEvent.objects.filter(name=SYNC)
    rows = {(r.kind, r.policy, r.fence): r for r in mine.filter(kind="conflict")}
    assert {k: r.count for k, r in rows.items()} == {
        ("conflict", "skip", 17): 7,
        ("conflict", "wait", 17): 1,
        ("conflict", "skip", 18): 1,
    }
    skips = rows[("conflict", "skip", 17)]
    assert skips.last_at is not None and skips.last_at >= skips.created_at
    assert mine.filter(kind="lost").count() == 2


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("audited")
def test_a_repeat_after_the_window_starts_a_new_row() -> None:
    window = audit.REPEAT_WINDOW.total_seconds()
    _conflict(at=time.time() - window - 60)
    _conflict()
    assert audit.flush(10)
    assert sorted(LockEvent.objects.filter(name=SYNC).values_list("count", flat=True)) == [1, 1]


def _aged(days: float, *, last_days: float | None = None) -> LockEvent:
    now = timezone.now()
    return LockEvent.objects.create(
        kind="conflict",
        name=f"aged:{days}:{last_days}",
        policy="skip",
        created_at=now - dt.timedelta(days=days),
        last_at=None if last_days is None else now - dt.timedelta(days=last_days),
        count=1 if last_days is None else 2,
    )


@pytest.mark.django_db
def test_prune_keeps_the_retention_and_a_row_by_its_last_repeat(settings: Any) -> None:
    settings.TASK_LOCKS = {"BACKEND": "memory://retention", "EVENT_RETENTION_DAYS": 30}
    old = _aged(40)
    repeated_lately = _aged(40, last_days=2)
    recent = _aged(3)
    out = StringIO()
    call_command("locks", "prune", stdout=out)
    assert "deleted 1 lock event(s) older than 30 day(s)" in out.getvalue()
    kept = set(LockEvent.objects.filter(name__startswith="aged:").values_list("pk", flat=True))
    assert kept == {repeated_lately.pk, recent.pk} and old.pk not in kept


@pytest.mark.django_db
def test_the_celery_task_the_docs_schedule_prunes(settings: Any) -> None:
    from celery import Celery

    from django_app.tasks import PRUNE_TASK
    from tests.test_readme import readme_blocks

    settings.TASK_LOCKS = {"BACKEND": "memory://retention", "EVENT_RETENTION_DAYS": 7}
    # The beat entry as docs/operations.md writes it names this task.
    block = next(b for b in readme_blocks(path=OPERATIONS) if "CELERY_BEAT_SCHEDULE" in b.code)
    namespace: dict[str, Any] = {}
    exec(block.code, namespace)
    entry = namespace["CELERY_BEAT_SCHEDULE"]["prune-lock-events"]
    assert entry["task"] == PRUNE_TASK and entry["schedule"].remaining_estimate(timezone.now())
    # A shared task: every Celery app has it once the module is imported. A fresh app, not
    # ``current_app``: which app is current depends on the tests run before in this process.
    app = Celery("retention", set_as_current=False)
    try:
        assert PRUNE_TASK in app.tasks
        _aged(8), _aged(1)
        assert app.tasks[PRUNE_TASK].apply().get() == 1
    finally:
        app.close()
    assert LockEvent.objects.filter(name__startswith="aged:").count() == 1


@pytest.mark.parametrize("days", [0, -3, "thirty", float("nan"), float("inf")])
def test_a_bad_retention_is_a_system_check_error(settings: Any, days: object) -> None:
    from django_app import checks

    settings.TASK_LOCKS = {"BACKEND": "memory://retention", "EVENT_RETENTION_DAYS": days}
    with checks.without_backend_probe():
        problems = checks.check_settings()
    errors = [p for p in problems if p.is_serious()]  # memory:// outside DEBUG also warns
    assert [p.id for p in errors] == ["task_locks.E004"], problems
    assert f"EVENT_RETENTION_DAYS'] must be a number of days > 0, got {days!r}" in errors[0].msg
