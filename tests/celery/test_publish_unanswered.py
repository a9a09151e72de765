"""A publish whose acquire got no answer leaves no lock behind (seed 32867 of the simulation).

The fault is real: the chaoskit TCP proxy lets the publish's acquire reach a real
redis-server, which takes the key under the publish's token, then drops the reply, and
redis-py times out. Nothing is published (the publish raises ``BackendUnavailable``), yet
the server holds the key for ``enqueue_ttl`` (here a minute; an hour by default), and every
publish of it would be dropped as a duplicate of a message that was never sent. The
publisher's releaser frees it (token-checked), trying again while its own tries get no
answer either.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from chaoskit.proxy import Proxy
from servers import RedisServer, wait_until

from task_locks import BackendUnavailable, Lock, get_backend
from task_locks.celery import releaser as releaser_module
from task_locks.celery import singleton_task

ENQUEUE_TTL = 60.0


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("publish-unanswered", broker="memory://", set_as_current=False)
    yield app
    app.close()


def publishing_task(app: Celery, key: str, url: str, *, lock_on: str, on_conflict: str) -> Any:
    """A task that locks ``key`` when published, through ``url``; its body does nothing."""

    @singleton_task(
        app=app,
        name=f"t.{uuid.uuid4().hex}",
        key=key,
        backend=url,
        lock_on=lock_on,
        enqueue_ttl=ENQUEUE_TTL,
        on_conflict=on_conflict,
        wait_timeout=1,
    )
    def task() -> None:
        pass

    return task


def answers(url: str) -> bool:
    try:
        get_backend(url).holder("warm-up")
    except BackendUnavailable:
        return False
    return True


@pytest.mark.parametrize(
    ("lock_on", "on_conflict"), [("enqueue", "raise"), ("both", "raise"), ("both", "wait")]
)
def test_a_publish_whose_acquire_got_no_answer_frees_the_key(
    app: Celery,
    scripted_link: Proxy,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    lock_on: str,
    on_conflict: str,
) -> None:
    monkeypatch.setattr(releaser_module, "RETRY_FIRST", 0.05)
    key = f"unanswered-{uuid.uuid4().hex[:8]}"
    url = f"redis://127.0.0.1:{scripted_link.port}/0?socket_timeout=0.3"
    direct = get_backend(f"redis://127.0.0.1:{redis_server.port}/0")

    task = publishing_task(app, key, url, lock_on=lock_on, on_conflict=on_conflict)

    # The pooled connection is open: the fault is the publish's (a loaded machine may miss
    # the 0.3 s timeout once).
    wait_until(lambda: answers(url), timeout=10, what="a warm-up call through the proxy")
    scripted_link.fault("drop_reply")
    try:
        with pytest.raises(BackendUnavailable):
            task.apply_async(task_id="lost-reply")
    finally:
        scripted_link.heal()
    wait_until(lambda: direct.holder(key) is None, timeout=10, what="the orphan's free")
    assert task.apply_async(task_id="next").id == "next"  # published, not a duplicate
    holder = direct.holder(key)
    assert holder is not None and holder.owner.task_id == "next"


def test_a_free_the_server_does_not_answer_is_retried_by_the_thread_not_by_flushes(
    scripted_link: Proxy, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker flushes the releaser before every task: a free still trying against a
    silent server must not cost each of them a socket timeout (only its first try holds
    a flush up), and it lands once the server answers."""
    monkeypatch.setattr(releaser_module, "RETRY_FIRST", 0.05)
    monkeypatch.setattr(releaser_module, "LATE_WINDOW", 1.0)
    key = f"silent-{uuid.uuid4().hex[:8]}"
    url = f"redis://127.0.0.1:{scripted_link.port}/0?socket_timeout=1.5"
    direct = get_backend(f"redis://127.0.0.1:{redis_server.port}/0")
    lease = Lock(key, ttl=60, backend=direct.url, renew=False).acquire(timeout=0)
    releaser = releaser_module.Releaser()
    scripted_link.blackhole()
    try:
        releaser.free_later(get_backend(url), key, lease.token, 60)
        wait_until(releaser.idle, 10, "the first try to get no answer")
        began = time.monotonic()
        assert releaser.flush(timeout=5)
        assert time.monotonic() - began < 0.75  # a retry (1.5 s here) is the thread's
        assert releaser.pending(key)  # still trying
        assert direct.holder(key) is not None
    finally:
        scripted_link.heal()
    wait_until(lambda: direct.holder(key) is None, 10, "the free to land")
    wait_until(lambda: not releaser.pending(key), 5, "the free to be settled")


def test_an_acquire_that_lands_after_the_first_free_is_freed_too(
    app: Celery, scripted_link: Proxy, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The publish's acquire is held up in the network past its socket timeout: the
    first free finds nothing, then the acquire lands and takes the key (seed 542975 of
    the simulation). The free goes on for ``LATE_WINDOW`` whatever it is told."""
    monkeypatch.setattr(releaser_module, "RETRY_FIRST", 0.05)
    key = f"late-{uuid.uuid4().hex[:8]}"
    url = f"redis://127.0.0.1:{scripted_link.port}/0?socket_timeout=0.3"
    direct = get_backend(f"redis://127.0.0.1:{redis_server.port}/0")

    task = publishing_task(app, key, url, lock_on="enqueue", on_conflict="raise")

    wait_until(lambda: answers(url), timeout=10, what="a warm-up call through the proxy")
    scripted_link.hold_next_request(1.0)
    with pytest.raises(BackendUnavailable):
        task.apply_async(task_id="late")
    wait_until(lambda: direct.holder(key) is not None, 5, "the held-up acquire to land")
    wait_until(lambda: direct.holder(key) is None, 10, "the free after it")
