"""Coordination in real ``celery worker`` processes: ``limit=N`` and stale beat ticks.

- ``@singleton_task(..., limit=2)``: at most two runs of one key at once (interval log),
  every call runs, and a killed holder's permit comes back within seconds.
- A message stamped by the HA beat scheduler (``task_locks_election``/``_term``/``_tick``
  headers) runs only if its term is still the current leader's; an older term whose claim
  is gone is refused, and ends ready as a skip does (``SUCCESS`` with a ``StaleTick``, or
  ``skip_as="failure"``: ``FAILURE`` with ``DuplicateTask``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
from beat_driver import drive_beat
from servers import wait_until

from task_locks import Election, get_backend
from task_locks.celery import STALE_TICK, DuplicateTask, StaleTick
from task_locks.celery.beat import ELECTION_HEADER, TERM_HEADER, TICK_HEADER
from task_locks.semaphore import slot_name

pytestmark = pytest.mark.slow


def most_inside_at_once(runs: list[dict[str, Any]]) -> int:
    """The largest number of recorded ``[start, end)`` intervals that overlap."""
    events = sorted(
        [(run["start"], 1) for run in runs] + [(run["end"], -1) for run in runs],
        key=lambda event: (event[0], event[1]),  # an end before a start at the same instant
    )
    inside = most = 0
    for _when, step in events:
        inside += step
        most = max(most, inside)
    return most


def permits_held(cluster: Any, key: str, limit: int) -> list[Any]:
    backend = get_backend(cluster.locks_url)
    found = (backend.holder(slot_name(key, index)) for index in range(limit))
    return [holder for holder in found if holder is not None]


# -- limit=N: at most N of a key at once ---------------------------------------------------------


def test_limit_two_runs_all_calls_never_more_than_two_inside(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any
) -> None:
    """8 calls with ``on_conflict="wait"`` on 6 worker processes: two at a time, all run."""
    log = f"log:{key}"
    results = [cluster.tasks.limited_task.delay(key, log, 0.3) for _ in range(8)]
    for result in results:
        assert result.get(timeout=60)["task_id"] == result.id
    runs = intervals(log)
    assert len(runs) == 8
    assert most_inside_at_once(runs) == 2  # the limit is reached, and never passed
    assert {run["lease_type"] for run in runs} == {"Permit"}  # current_lease() is the permit
    assert {run["slot"] for run in runs} == {0, 1}
    assert permits_held(cluster, f"t:{key}", 2) == []  # every permit came back


def test_a_killed_permit_holder_frees_its_permit_within_3s(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any
) -> None:
    """``revoke(terminate=True, signal="SIGKILL")``: the child never reaches its ``finally``;
    the worker's main process frees the permit (ttl=60) and the other one stays held."""
    log = f"log:{key}"
    tasks = cluster.tasks
    first = tasks.limited_hold_task.delay(key, log, 30)
    second = tasks.limited_hold_task.delay(key, log, 30)
    wait_until(
        lambda: len(permits_held(cluster, f"t:{key}", 2)) == 2, 10, "both permits to be held"
    )
    third = tasks.limited_hold_task.delay(key, log, 0)  # on_conflict="raise": no permit left
    with pytest.raises(Exception, match="all 2 permits"):
        third.get(timeout=20)
    began = time.monotonic()
    first.revoke(terminate=True, signal="SIGKILL")
    wait_until(
        lambda: {h.owner.task_id for h in permits_held(cluster, f"t:{key}", 2)} == {second.id},
        3.0,
        "the killed task's permit to come back",
    )
    assert time.monotonic() - began < 3.0
    second.revoke(terminate=True, signal="SIGKILL")
    wait_until(lambda: not permits_held(cluster, f"t:{key}", 2), 3.0, "all permits free")


def test_limit_three_redelivered_copy_of_a_running_message_is_refused(
    cluster: Any, redelivery_worker: Any, key: str, intervals: Any
) -> None:
    """``acks_late`` past the 5 s visibility timeout, ``limit=3``: Redis hands
    the running message to the worker's other process, where two permits are free. The
    copy must be refused as with ``limit=1``, not run the same task id a second time."""
    log = f"log:{key}"
    result = cluster.tasks.limited_redelivered_task.delay(key, log, 12)
    assert result.get(timeout=40)["task_id"] == result.id
    deliveries = intervals(log + ":deliveries")
    assert len(deliveries) >= 2, "Redis did not redeliver the message: the test proved nothing"
    assert [run["task_id"] for run in intervals(log)] == [result.id]  # one copy did the work
    assert result.state == "SUCCESS"
    assert permits_held(cluster, f"t:{key}", 3) == []


# -- stale beat ticks: a message sent under an old term is refused ------------------------------


def beat_headers(election: str, term: int) -> dict[str, Any]:
    return {ELECTION_HEADER: election, TERM_HEADER: term, TICK_HEADER: f"test@{term}"}


def test_a_tick_sent_under_an_old_term_is_refused_and_the_current_term_runs(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any
) -> None:
    """Two terms of one election: the deposed leader's tick is refused (not run; its
    ``.get()`` returns a ``StaleTick``, or raises ``DuplicateTask`` with
    ``skip_as="failure"``); the current leader's tick runs; with no leader nothing is
    refused."""
    name = f"beat-{uuid.uuid4().hex[:8]}"
    election = Election(name, ttl=10, backend=cluster.locks_url)
    old = election.campaign(timeout=5)
    old_term = old.term
    old.resign()
    current = election.campaign(timeout=5)
    assert current.term > old_term
    task, log = cluster.tasks.skip_task, f"log:{key}"
    try:
        stale = task.apply_async((key, log, 0), headers=beat_headers(name, old_term))
        fresh = task.apply_async((f"{key}b", log, 0), headers=beat_headers(name, current.term))
        assert fresh.get(timeout=20)["task_id"] == fresh.id
        # Ready, as a skip is: .get() returns the refusal (a custom state never would).
        refused = stale.get(timeout=20)
        assert refused == StaleTick(name, f"test@{old_term}", old_term, current.term)
        assert not refused and refused.state == STALE_TICK and stale.state == "SUCCESS"
        failing = cluster.tasks.canvas_skip_failure.apply_async(
            (f"{key}d", 0), headers=beat_headers(name, old_term)
        )
        with pytest.raises(DuplicateTask, match=f"leader's term is {current.term}: it may"):
            failing.get(timeout=20)
        assert failing.state == "FAILURE"
    finally:
        current.resign()
    # No leader now (the last one resigned): a tick from the last term is not refused.
    leaderless = task.apply_async((f"{key}c", log, 0), headers=beat_headers(name, current.term))
    assert leaderless.get(timeout=20)["task_id"] == leaderless.id
    assert sorted(run["task_id"] for run in intervals(log)) == sorted([fresh.id, leaderless.id])


def test_a_tick_queued_at_a_clean_hand_over_still_runs(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any, tmp_path: Any
) -> None:
    """The leader sends a tick, then resigns cleanly (a deploy restart) while
    the tick is still queued; the next leader's term is newer. That tick was sent once,
    by the real leader, and its claim is intact: it must run, not be refused as stale."""
    from celery import Celery

    from task_locks.celery.beat import LeaderScheduler

    election, log, queue = f"beat-{uuid.uuid4().hex[:8]}", f"log:{key}", f"tl_hold_{key}"
    beat_app = Celery("beat_handover", broker=cluster.env["TL_CELERY_BROKER"], set_as_current=False)
    beat_app.conf.update(
        beat_schedule={
            "tick": {
                "task": cluster.tasks.skip_task.name,
                "schedule": 1.0,
                "args": (key, log, 0),
                "options": {"queue": queue},
            }
        },
        task_locks_beat_ttl=5,
        task_locks_beat_backend=cluster.locks_url,
        task_locks_beat_election=election,
        broker_connection_retry_on_startup=True,
    )
    scheduler = LeaderScheduler(app=beat_app, schedule_filename=str(tmp_path / "schedule"))
    # A 1 s schedule: a tick within 2 s alone, but 10 s once ran out in a loaded CI run.
    drive_beat(scheduler, lambda: cluster.broker.llen(queue), 20, "the leader sent no tick")
    scheduler.close()  # resigns: the clean hand-over
    next_leader = Election(election, ttl=5, backend=cluster.locks_url).campaign(timeout=5)
    consumer = prefork_workers[0].hostname
    try:
        assert cluster.broker.llen(queue) == 1
        raw = cluster.broker.lindex(queue, 0)
        task_id = json.loads(raw)["headers"]["id"]
        assert json.loads(raw)["headers"][TERM_HEADER] < next_leader.term
        cluster.app.control.add_consumer(queue, destination=[consumer], reply=True)
        result = cluster.tasks.skip_task.AsyncResult(task_id)
        wait_until(lambda: result.state not in ("PENDING", "STARTED"), 20, "the tick to end")
        assert result.state == "SUCCESS", result.info
        assert [run["task_id"] for run in intervals(log)] == [task_id]
    finally:
        cluster.app.control.cancel_consumer(queue, destination=[consumer], reply=True)
        next_leader.resign()
