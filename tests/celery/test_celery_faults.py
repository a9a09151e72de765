"""The Celery fault matrix (broker, lock server and worker faults), short form: real workers, real Redis broker.

- **limit x redelivery**: ``limit`` 1 and 3, ``on_conflict`` skip and wait, with copies of
  one message (same task id) delivered at once and while the first copy runs. Whatever
  the cell: a task id never runs twice, never more than ``limit`` runs of the key at once,
  and (``wait``) every task id runs.
- **lock_on x concurrent publishers**: ``"enqueue"`` and ``"both"``, three processes
  publishing one key as fast as they can while a worker consumes it. Exactly one message
  is accepted while one is queued (or, with ``"both"``, running), and every accepted
  message runs: none is skipped at the hand-over from queued lock to run lock.

A copy of a message is a second publish with the same task id: what a broker's
at-least-once delivery, an ``acks_late`` redelivery or a visibility timeout produce
(the visibility-timeout path itself is in ``test_celery_coordination``).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from servers import wait_until

from task_locks import get_backend
from task_locks.celery import Skipped
from task_locks.celery.task import TASK_ID_SEPARATOR
from task_locks.semaphore import slot_name

pytestmark = pytest.mark.slow

# Not imported from conftest: with several test directories, "conftest" may be another's.
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

#: States of a message that has not finished.
UNFINISHED = ("PENDING", "RECEIVED", "STARTED", "RETRY")


def most_inside_at_once(runs: list[dict[str, Any]]) -> int:
    events = sorted([(r["start"], 1) for r in runs] + [(r["end"], -1) for r in runs])
    inside = most = 0
    for _when, step in events:
        inside += step
        most = max(most, inside)
    return most


def key_is_free(cluster: Any, key: str, limit: int) -> bool:
    """No run of ``key`` holds anything: its lock (or permits) and its run guards
    (``t:<key>#task:<id>``, held from the start of a run, while it waits, to its end,
    where the backend cannot check the task id itself; on Redis a waiting copy holds
    nothing)."""
    backend = get_backend(cluster.locks_url)
    names = [f"t:{key}"] if limit == 1 else [slot_name(f"t:{key}", i) for i in range(limit)]
    return not any(backend.holder(name) for name in names) and not backend.holders(
        f"t:{key}{TASK_ID_SEPARATOR}"
    )


def assert_runs_hold(runs: list[dict[str, Any]], limit: int) -> None:
    twice = [task_id for task_id, n in Counter(r["task_id"] for r in runs).items() if n > 1]
    assert not twice, f"task ids that ran more than once: {twice}"
    assert most_inside_at_once(runs) <= limit


# -- limit x redelivery ------------------------------------------------------------------------


CELLS = [(on_conflict, limit) for on_conflict in ("skip", "wait") for limit in (1, 3)]


@pytest.mark.parametrize(("on_conflict", "limit"), CELLS)
def test_copies_delivered_at_once_run_once(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any, on_conflict: str, limit: int
) -> None:
    """Four task ids of one key, each published three times back to back (six worker
    processes take the copies at the same moment)."""
    task = getattr(cluster.tasks, f"dup_{on_conflict}_{limit}")
    log = f"log:{key}"
    ids = [str(uuid.uuid4()) for _ in range(4)]
    for task_id in ids:
        for _copy in range(3):
            task.apply_async((key, log, 1.0), task_id=task_id)
    wait_until(lambda: len(intervals(log + ":deliveries")) == 12, 30, "all 12 deliveries")
    wait_until(lambda: key_is_free(cluster, key, limit), 30, "every run to end")
    if on_conflict == "wait":
        # Free is not done: between one run's release and the next waiting copy's take
        # the key is free for a moment (a run the server checks holds nothing while it
        # waits; one CI run read the log there, before the last id's run began).
        # Every id's run, then: a lost one fails here, after the bound.
        wait_until(
            lambda: {r["task_id"] for r in intervals(log)} >= set(ids), 30, "every task id to run"
        )
        wait_until(lambda: key_is_free(cluster, key, limit), 30, "every run to end")
    runs = intervals(log)
    assert_runs_hold(runs, limit)
    if on_conflict == "wait":
        assert sorted(r["task_id"] for r in runs) == sorted(ids)  # none lost
    else:
        assert runs, "no copy ran at all"
        ran = {r["task_id"] for r in runs}
        # A run's result is stored just after it released its lock: wait for the states.
        states = wait_until(
            lambda: (
                (found := {i: task.AsyncResult(i).state for i in ids})
                and all(state not in UNFINISHED for state in found.values())
                and found
            ),
            10,
            "every task id's final state",
        )
        assert all(state == "SUCCESS" for state in states.values()), states
        # An id none of whose copies ran was skipped; one that ran may still show a copy
        # skipped after the run ended (both are ready SUCCESS results).
        skipped = {i for i in ids if isinstance(task.AsyncResult(i).result, Skipped)}
        assert set(ids) - ran <= skipped, (skipped, ran)


@pytest.mark.parametrize(("on_conflict", "limit"), CELLS)
def test_copies_delivered_while_the_first_runs_are_refused(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any, on_conflict: str, limit: int
) -> None:
    task = getattr(cluster.tasks, f"dup_{on_conflict}_{limit}")
    log, task_id = f"log:{key}", str(uuid.uuid4())
    first = task.apply_async((key, log, 1.5), task_id=task_id)
    wait_until(lambda: not key_is_free(cluster, key, limit), 10, "the first copy to run")
    for _copy in range(2):
        task.apply_async((key, log, 1.5), task_id=task_id)
    assert first.get(timeout=20)["task_id"] == task_id
    wait_until(lambda: len(intervals(log + ":deliveries")) == 3, 20, "all 3 deliveries")
    wait_until(lambda: key_is_free(cluster, key, limit), 20, "every run to end")
    runs = intervals(log)
    assert [r["task_id"] for r in runs] == [task_id]  # the copies were refused, not run
    assert first.state == "SUCCESS"


# -- lock_on x concurrent publishers -----------------------------------------------------------


def publish_concurrently(
    cluster: Any, task_name: str, key: str, seconds: float, publishers: int, duration: float
) -> list[dict[str, Any]]:
    """Run ``publishers`` processes publishing ``key`` for ``duration`` s; the accepted ones."""
    log, stop, accepted = f"log:{key}", f"stop:{key}", f"accepted:{key}"
    env = {**os.environ, **cluster.env, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])}
    command = [sys.executable, str(HERE / "publisher.py"), task_name, key, log, str(seconds)]
    errors = [cluster.tmp / f"publisher-{key}-{n}.stderr" for n in range(publishers)]
    procs = []
    for error in errors:
        with open(error, "wb") as stderr:
            procs.append(
                subprocess.Popen([*command, stop, accepted, "30"], cwd=HERE, env=env, stderr=stderr)
            )

    def started() -> bool:
        for proc, error in zip(procs, errors, strict=True):
            if proc.poll() is not None:
                raise AssertionError(f"a publisher exited:\n{error.read_text()}")
        return cluster.store.llen(accepted + ":ready") == publishers

    try:
        wait_until(started, 30, "the publishers to start")
        time.sleep(duration)  # the length of the burst itself, not a synchronisation
    finally:
        cluster.store.set(stop, 1)
        for proc in procs:
            proc.wait(timeout=30)
    assert all(proc.returncode == 0 for proc in procs)
    return [json.loads(item) for item in cluster.store.lrange(accepted, 0, -1)]


@pytest.mark.parametrize("lock_on", ["enqueue", "both"])
def test_concurrent_publishers_one_accepted_at_a_time_and_every_accepted_runs(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any, lock_on: str
) -> None:
    task = getattr(cluster.tasks, f"{lock_on}_burst_task")
    app, consumer = cluster.app, prefork_workers[1].hostname
    app.control.add_consumer("tl_pending", destination=[consumer], reply=True)
    try:
        accepted = publish_concurrently(cluster, task.__name__, key, 0.05, 3, 3.0)
        assert len(accepted) >= 3, f"too few runs to prove anything: {accepted}"
        wait_until(
            lambda: all(task.AsyncResult(a["id"]).state not in UNFINISHED for a in accepted),
            30,
            "every accepted message to finish",
        )
    finally:
        app.control.cancel_consumer("tl_pending", destination=[consumer], reply=True)
    states = Counter(task.AsyncResult(a["id"]).state for a in accepted)
    assert states == {"SUCCESS": len(accepted)}, states  # none skipped at the hand-over
    runs = {r["task_id"]: r for r in intervals(f"log:{key}")}
    assert set(runs) == {a["id"] for a in accepted}
    delivered = {d["task_id"]: d["at"] for d in intervals(f"log:{key}:deliveries")}
    # The key is taken from the accepting publish until the message is delivered
    # ("enqueue": dropped as the task starts, after task_prerun) or its run ends ("both"):
    # the next accepted publish cannot have returned before that.
    ordered = sorted(accepted, key=lambda a: runs[a["id"]]["start"])
    for before, after in itertools.pairwise(ordered):
        freed = delivered[before["id"]] if lock_on == "enqueue" else runs[before["id"]]["end"]
        assert after["returned"] > freed, (
            f"{after['id']} was accepted at {after['returned']:.4f}, while {before['id']} "
            f"still held the key (until {freed:.4f})"
        )


def test_a_killed_both_run_frees_the_lock_it_took_over(
    cluster: Any, prefork_workers: Any, key: str, intervals: Any
) -> None:
    """``"both"``: the run holds the publish-time lock (same token, now its own): when its
    child is SIGKILLed the worker's main process frees the key and the run guard within
    seconds (ttl=60, and the queued lock's enqueue TTL is an hour)."""
    task, name, log = cluster.tasks.both_hold_task, f"t:{key}", f"log:{key}"
    result = task.delay(key, log, 30)
    backend = get_backend(cluster.locks_url)
    running = wait_until(
        lambda: (h := backend.holder(name)) and h.owner.worker and h, 10, "the run to hold it"
    )
    assert running.owner.task_id == result.id
    assert running.owner.pid == wait_until(lambda: intervals(log), 10, "a start")[0]["pid"]
    result.revoke(terminate=True, signal="SIGKILL")
    wait_until(lambda: key_is_free(cluster, key, 1), 3.0, "the key and guard to be free")
    wait_until(lambda: result.state == "REVOKED", 10, "the result to say REVOKED")
