"""The watch a redelivered copy keeps on its own task id's holder:
renewed or released early means alive (refuse the copy), expired unrenewed means dead
(run it). On the in-process ``memory://`` backend, with a real clock and short TTLs."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import pytest
from celery import Celery
from celery.app.trace import build_tracer

from task_locks import get_backend
from task_locks._steps import drive
from task_locks.celery import singleton_task
from task_locks.celery.redelivery import watch
from task_locks.types import Owner

TTL_MS = 600


@pytest.mark.parametrize(
    ("meanwhile", "dead"),
    [
        (None, True),  # nobody renews it: it expires, its process is gone
        ("renew", False),  # its holder renews it: alive, still running
        ("release", False),  # released well before its expiry: the original finished
    ],
)
def test_a_holder_is_dead_only_if_it_expires_unrenewed(meanwhile: str | None, dead: bool) -> None:
    backend = get_backend(f"memory://watch-{uuid.uuid4().hex}")
    name, token = "t:k", "original"
    assert backend.acquire(name, token, TTL_MS, Owner(task_id="same-id")).acquired
    seen = backend.holder(name)
    assert seen is not None
    actions: dict[str, Callable[[], object]] = {
        "renew": lambda: backend.renew(name, token, TTL_MS),
        "release": lambda: backend.release(name, token),
    }
    timer = threading.Timer(0.15, actions[meanwhile]) if meanwhile else None
    if timer:
        timer.start()
    began = time.monotonic()
    try:
        assert drive(watch(backend, name, seen)) is dead
    finally:
        if timer:
            timer.join()
    assert time.monotonic() - began < TTL_MS / 1000 + 0.5  # never longer than one TTL


@pytest.mark.parametrize("clock", ["time", "monotonic"])
def test_a_clock_step_while_watching_is_not_a_renewal(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, clock: str
) -> None:
    """This host's wall clock (NTP) or monotonic clock (a VM migrated) jumps 1 s ahead
    while the copy watches an unrenewed holder. The clock is patched because a real step
    needs root and would move every process's clock; the server's expiry does not move,
    so the holder is still dead. Before, the step read as a renewal and the copy was
    refused, the message lost (simulation seeds 7187, wall clock, and 108010, monotonic).
    On a real Redis: its expiry is the server's, whatever this process's clocks say."""
    backend = get_backend(redis_url)
    name = f"watch-{uuid.uuid4().hex}"
    assert backend.acquire(name, "original", TTL_MS, Owner(task_id="same-id")).acquired
    seen = backend.holder(name)
    assert seen is not None
    real, step = getattr(time, clock), [0.0]
    monkeypatch.setattr(time, clock, lambda: real() + step[0])
    timer = threading.Timer(0.15, lambda: step.__setitem__(0, 1.0))
    timer.start()
    try:
        assert drive(watch(backend, name, seen)) is True
    finally:
        timer.join()


@pytest.mark.parametrize(
    ("meanwhile", "runs"),
    [(None, True), ("renew", False), ("release", False)],
    ids=["expires", "renewed", "released"],
)
def test_a_redelivered_copy_runs_only_if_its_own_ids_lock_expires_unrenewed(
    redis_url: str, meanwhile: str | None, runs: bool
) -> None:
    """Celery's tracer in this process, the message marked redelivered: the same task id
    holds the key (the original run, here a plain acquire). Released or renewed while the
    copy watches, the copy never runs (released: the original has finished, and a copy of
    it must not run again); expired unrenewed, it runs."""
    app = Celery("watch", broker="memory://", backend="cache+memory://")
    ran: list[str] = []

    @singleton_task(app=app, name=f"t.{uuid.uuid4().hex}", key="w:{k}", backend=redis_url, ttl=5)
    def task(k: str) -> None:
        ran.append(k)

    backend = get_backend(redis_url)
    task_id, name = str(uuid.uuid4()), task.lock_name("k")
    assert backend.acquire(name, "original", TTL_MS, Owner(task_id=task_id)).acquired
    actions: dict[str, Callable[[], object]] = {
        "renew": lambda: backend.renew(name, "original", TTL_MS),
        "release": lambda: backend.release(name, "original"),
    }
    timer = threading.Timer(0.15, actions[meanwhile]) if meanwhile else None
    if timer:
        timer.start()
    trace = build_tracer(task.name, task, app=app, hostname="copy@host", eager=False)
    try:
        trace(task_id, ("k",), {}, {"id": task_id, "delivery_info": {"redelivered": True}})
    finally:
        if timer:
            timer.join()
        backend.release(name, "original")
    assert ran == (["k"] if runs else [])
