"""Workers of the previous release and of this one running copies of one message.

The previous release's worker took, for every run of a task with ``limit`` > 1,
``"wait"``, ``"retry"`` or ``lock_on="both"``, a second lock ``<key>#task:<task id>`` for
the whole run, then the run lock (under the publish-time token with ``"both"``). This
one takes the run lock with a run check (one server step refuses a run of the same task
id holding it), and the ``#task:`` name only while it waits. During a rolling upgrade
both meet on one key; these are the meetings, on a real Redis (CHANGELOG, "one lock per
run").
"""

from __future__ import annotations

import secrets
import time

import pytest

from task_locks import Lock, LockHeld
from task_locks._friends import acquire_as_run, acquire_under
from task_locks.celery.task import task_id_lock_name
from task_locks.lock import Lease
from task_locks.owner import owner_context


def old_run(url: str, key: str, task_id: str, handed: str | None = None) -> tuple[Lease, Lease]:
    """A run as the previous release's worker took it: the guard, then the run lock."""
    with owner_context(task_id=task_id, worker="old@host"):
        with owner_context(internal=True):
            guard = Lock(task_id_lock_name(key, task_id), ttl=10, backend=url).acquire(timeout=0)
        lease = acquire_under(Lock(key, ttl=10, backend=url), handed).acquire(timeout=0)
    return guard, lease


def new_run(url: str, key: str, task_id: str, handed: str | None) -> Lock:
    """The run lock as this release's worker takes it (task.py's ``_Acquire``)."""
    also = (task_id_lock_name(key, task_id),)
    return acquire_as_run(Lock(key, ttl=10, backend=url), handed, task_id, also=also)


def queued(url: str, key: str, task_id: str) -> str:
    """The lock a publish takes for a ``lock_on="both"`` message; its token."""
    with owner_context(task_id=task_id, worker=None):
        lease = Lock(key, ttl=10, backend=url, renew=False).acquire(timeout=0)
    return lease.token


@pytest.mark.parametrize("both", [False, True], ids=["run", "both"])
def test_a_new_copy_of_an_old_run_is_refused_at_once(redis_url: str, both: bool) -> None:
    key, task_id = f"upgrade:{secrets.token_hex(4)}", "task-old"
    handed = queued(redis_url, key, task_id) if both else None
    guard, lease = old_run(redis_url, key, task_id, handed)
    started = time.monotonic()
    with owner_context(task_id=task_id, worker="new@host"):
        copy = new_run(redis_url, key, task_id, handed)
        with pytest.raises(LockHeld) as held:
            copy.acquire(timeout=5)  # would wait; a copy gives up at once
    assert time.monotonic() - started < 2
    assert held.value.holder is not None and held.value.holder.owner.task_id == task_id
    if both:  # met the old run's guard, which it holds for the whole run
        assert held.value.holder.name == task_id_lock_name(key, task_id)
    lease.release()
    guard.release()


@pytest.mark.parametrize("both", [False, True], ids=["run", "both"])
def test_an_old_copy_of_a_new_run_finds_its_own_task_id(redis_url: str, both: bool) -> None:
    key, task_id = f"upgrade:{secrets.token_hex(4)}", "task-new"
    handed = queued(redis_url, key, task_id) if both else None
    with owner_context(task_id=task_id, worker="new@host"):
        lease = new_run(redis_url, key, task_id, handed).acquire(timeout=0)
    # The old copy's guard is free (the new run took none), and with "both" it carries
    # the publish-time token the new run took over; the run lock still names the task
    # id, which the old worker refuses as a copy of the running message.
    with pytest.raises(LockHeld) as held:
        old_run(redis_url, key, task_id, handed)
    assert held.value.holder is not None and held.value.holder.owner.task_id == task_id
    assert held.value.name == key
    lease.release()
