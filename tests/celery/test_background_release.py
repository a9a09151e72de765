"""A run whose end nobody waits for releases its lock after the run, in the
process's releaser thread, and that never costs a run of the same key or a lock left
behind at shutdown.

The runs go through Celery's own tracer (``build_tracer``, what a worker calls per
message) in this process, against the shared real Redis.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, signals
from celery.app.trace import build_tracer
from servers import wait_until

from task_locks import events, get_backend, notices
from task_locks.backends.base import DeferredRelease
from task_locks.celery import releaser as releaser_module
from task_locks.celery import singleton_task
from task_locks.celery.releaser import releaser
from task_locks.errors import BackendUnavailable
from task_locks.types import Owner

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("background_release", broker="memory://", backend="cache+memory://")
    yield app
    releaser.flush()


def tracer(app: Celery, task: Any) -> Callable[[str, tuple[Any, ...]], Any]:
    trace = build_tracer(task.name, task, app=app, hostname="test@host", eager=False)

    def run(task_id: str, args: tuple[Any, ...]) -> Any:
        return trace(task_id, args, {}, {"id": task_id, "delivery_info": {}})

    return run


def define(app: Celery, url: str, ran: list[str], **options: Any) -> Any:
    @singleton_task(app=app, name=f"t.{uuid.uuid4().hex}", key="bg:{k}", backend=url, **options)
    def task(k: str) -> None:
        ran.append(k)

    return task


def test_the_release_follows_the_run_and_a_flush_frees_the_key(app: Celery, redis_url: str) -> None:
    ran: list[str] = []
    task = define(app, redis_url, ran, ignore_result=True, on_conflict="raise")
    run = tracer(app, task)
    run("id-1", ("a",))
    assert ran == ["a"]
    assert releaser.flush()
    assert not releaser.pending(task.lock_name("a"))
    assert get_backend(redis_url).holder(task.lock_name("a")) is None


@pytest.mark.parametrize(
    "options",
    [
        {"on_conflict": "raise"},
        {"on_conflict": "raise", "limit": 2},
        {"on_conflict": "wait", "wait_timeout": 0.0},
    ],
)
def test_the_next_run_of_the_key_here_waits_for_the_pending_release(
    app: Celery, redis_url: str, options: dict[str, Any]
) -> None:
    """Back to back, the next acquire is sent microseconds after the hand-over; without
    the flush it would meet its own process's lock (``raise``: the run fails)."""
    ran: list[str] = []
    task = define(app, redis_url, ran, ignore_result=True, **options)
    run = tracer(app, task)
    states = [run(f"id-{i}", ("same",)) for i in range(200)]
    assert len(ran) == 200, [s for s in states if s[1] is not None][:1]
    assert releaser.flush()
    assert get_backend(redis_url).holder(task.lock_name("same")) is None


def test_worker_shutdown_flushes_the_pending_releases(app: Celery, redis_url: str) -> None:
    ran: list[str] = []
    task = define(app, redis_url, ran, ignore_result=True)
    run = tracer(app, task)
    names = [task.lock_name(f"k{i}") for i in range(20)]
    for i in range(20):
        run(f"id-{i}", (f"k{i}",))
    signals.worker_shutdown.send(sender=None)
    assert not any(releaser.pending(name) for name in names)
    backend = get_backend(redis_url)
    assert [name for name in names if backend.holder(name) is not None] == []


def test_a_run_whose_result_is_stored_releases_before_it_ends(app: Celery, redis_url: str) -> None:
    """Whoever sees the result may send the key again at once: it must be free."""
    ran: list[str] = []
    task = define(app, redis_url, ran)  # ignore_result=False: the result is stored
    run = tracer(app, task)
    run("id-stored", ("s",))
    assert not releaser.pending(task.lock_name("s"))
    assert get_backend(redis_url).holder(task.lock_name("s")) is None
    assert app.AsyncResult("id-stored").state == "SUCCESS"


def test_process_exit_flushes_the_pending_releases(redis_url: str, tmp_path: Path) -> None:
    """A process that ends right after its runs (no worker signal) still sends them."""
    script = tmp_path / "runs.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from celery import Celery
            from celery.app.trace import build_tracer
            from task_locks.celery import singleton_task

            app = Celery("exit", broker="memory://")

            @singleton_task(app=app, name="exit.t", key="exit:{{k}}", backend={redis_url!r},
                            ignore_result=True)
            def t(k):
                pass

            trace = build_tracer(t.name, t, app=app, hostname="exit@host", eager=False)
            for i in range(50):
                trace(f"id-{{i}}", (f"k{{i}}",), {{}}, {{"id": f"id-{{i}}", "delivery_info": {{}}}})
            print("ran")
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0 and "ran" in done.stdout, done.stderr
    backend = get_backend(redis_url)
    held = [i for i in range(50) if backend.holder(f"exit:k{i}") is not None]
    assert held == []


def test_a_solo_worker_runs_every_message_of_one_key_back_to_back(
    cluster: Any, solo_worker: Any, key: str
) -> None:
    """A real worker: each run's release is sent after it, and the next message of the
    key (``on_conflict="raise"``: refused runs record nothing) still finds it free."""
    log = f"log:{key}"
    for _ in range(30):
        cluster.tasks.fire_and_forget_task.apply_async((key, log), queue="tl_solo")
    store = redis.Redis.from_url(cluster.locks_url)
    wait_until(lambda: store.llen(log) >= 30, 60, "30 runs")
    assert store.llen(log) == 30
    wait_until(lambda: get_backend(cluster.locks_url).holder(f"t:{key}") is None, 10, "release")


def test_a_publish_here_after_a_run_waits_for_its_pending_release(
    app: Celery, redis_url: str
) -> None:
    """The run is over when the worker publishes the same key again: the publish-time
    lock must not meet this process's own release still in flight (DuplicateTask)."""
    ran: list[str] = []
    task = define(app, redis_url, ran, ignore_result=True, lock_on="both")
    run = tracer(app, task)
    backend = get_backend(redis_url)
    for i in range(50):
        run(f"id-{i}", ("same",))
        task.apply_async(("same",))  # raises DuplicateTask if it met the run's lock
        queued = backend.holder(task.lock_name("same"))
        assert queued is not None
        assert backend.force_release(task.lock_name("same"), queued.fence)  # next round
    assert len(ran) == 50


# -- the release rides the next acquire (one round trip per run) -------------------------


class Rider(DeferredRelease):
    """A deferred release whose outcome the test reads."""

    def __init__(self, name: str, token: str) -> None:
        super().__init__(name, token)
        self.outcomes: list[object] = []

    def answer(self, outcome: object) -> None:  # type: ignore[override]
        self.outcomes.append(outcome)


def test_a_deferred_release_goes_out_before_the_acquire_that_carries_it(redis_url: str) -> None:
    """Same key: the release must reach the server first, or the acquire meets the lock."""
    backend = get_backend(redis_url)
    owner = Owner(task_id="t")
    assert backend.acquire("same", "first", 30_000, owner).acquired
    rider = Rider("same", "first")
    assert backend.defer_release(rider)
    result = backend.acquire("same", "second", 30_000, owner)
    assert rider.outcomes == [True]
    assert result.acquired
    holder = backend.holder("same")
    assert holder is not None and holder.token == "second"
    # Answered once: a later acquire carries nothing, and the claim is taken.
    assert not rider.claim()
    assert backend.acquire("other", "third", 30_000, owner).acquired
    assert rider.outcomes == [True]


def test_with_server_hand_off_the_release_rides_the_enqueue_and_grants_the_waiter(
    redis_server: Any, redis_url: str
) -> None:
    """``handoff=server``: the plan's try is an enqueue; the release goes out before it,
    and hands the lock to the first queued waiter, as a release sent alone would."""
    backend = get_backend(redis_server.url(handoff="server"))
    owner = Owner(task_id="t")
    assert backend.enqueue("k", "first", 30_000, owner, 0).acquired
    queued = backend.enqueue("k", "waiter", 30_000, owner, 5_000)
    assert not queued.acquired
    rider = Rider("k", "first")
    assert backend.defer_release(rider)
    assert not backend.enqueue("k", "late", 30_000, owner, 0).acquired  # the waiter has it
    assert rider.outcomes == [True]
    assert backend.await_grant("k", "waiter", 1.0, queued.holder_fence) is not None
    holder = backend.holder("k")
    assert holder is not None and holder.token == "waiter"


def test_a_deferred_release_is_token_checked(redis_url: str) -> None:
    backend = get_backend(redis_url)
    owner = Owner(task_id="t")
    assert backend.acquire("k", "theirs", 30_000, owner).acquired
    rider = Rider("k", "not-the-holder")
    assert backend.defer_release(rider)
    assert backend.acquire("other", "mine", 30_000, owner).acquired
    assert rider.outcomes == [False]
    holder = backend.holder("k")
    assert holder is not None and holder.token == "theirs"


def test_a_claimed_release_is_not_carried(redis_url: str) -> None:
    """Whoever claims it first sends it (the releaser's thread, a flush): never twice."""
    backend = get_backend(redis_url)
    owner = Owner(task_id="t")
    assert backend.acquire("k", "first", 30_000, owner).acquired
    rider = Rider("k", "first")
    assert backend.defer_release(rider)
    assert rider.claim()
    assert backend.acquire("other", "x", 30_000, owner).acquired
    assert rider.outcomes == []
    assert backend.holder("k") is not None  # the claimer's to send


def test_a_failed_carrying_acquire_reports_the_release_as_unknown(redis_factory: Any) -> None:
    server = redis_factory()
    backend = get_backend(server.url(socket_timeout=1, connect_timeout=0.5))
    owner = Owner(task_id="t")
    assert backend.acquire("k", "first", 30_000, owner).acquired
    rider = Rider("k", "first")
    assert backend.defer_release(rider)
    server.kill()
    with pytest.raises(BackendUnavailable):
        backend.acquire("other", "x", 30_000, owner)
    assert len(rider.outcomes) == 1 and isinstance(rider.outcomes[0], BackendUnavailable)


def test_a_forked_child_never_sends_its_parents_deferred_release(redis_url: str) -> None:
    backend = get_backend(redis_url)
    owner = Owner(task_id="t")
    assert backend.acquire("k", "parent", 30_000, owner).acquired
    rider = Rider("k", "parent")
    assert backend.defer_release(rider)
    pid = os.fork()
    if pid == 0:  # the child: an acquire of its own carries nothing of the parent's
        code = 1
        try:
            backend.acquire("child", "c", 30_000, owner)
            code = 0 if rider.outcomes == [] and backend.holder("k") is not None else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert backend.holder("k") is not None  # the child left it alone
    assert backend.acquire("parent-next", "p", 30_000, owner).acquired
    assert rider.outcomes == [True]
    assert backend.holder("k") is None


def test_back_to_back_runs_carry_each_release_in_the_next_acquire(
    app: Celery, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Distinct keys, no delay elapsing: every release but the last goes out with the next
    run's acquire (no round trip of its own), and the last is sent by a flush."""
    monkeypatch.setattr(releaser_module, "RELEASE_DELAY", 30.0)  # the thread never fires
    # The server's read count is the measure: the release-notice listener's own connection
    # (its handshake and SUBSCRIBE, started with the first lease) must not land in it.
    monkeypatch.setattr(notices, "listen", lambda lease: None)
    ran: list[str] = []
    task = define(app, redis_url, ran, ignore_result=True)
    run = tracer(app, task)
    backend = get_backend(redis_url)
    store = redis.Redis.from_url(redis_url)
    run("id-0", ("k0",))
    store.config_resetstat()
    before = store.info("stats")["total_reads_processed"]
    for i in range(1, 21):
        run(f"id-{i}", (f"k{i}",))
    after = store.info("stats")["total_reads_processed"]
    # 20 acquires and 20 releases in 20 round trips: each pipeline arrives as one read
    # (the INFO call adds one; sent on its own, the releases would add 20). The count is
    # the server's, over every client: an earlier test's background thread (a renewal,
    # a listener) added a few reads once, under load, so the bound sits between the two.
    assert store.info("commandstats")["cmdstat_evalsha"]["calls"] == 40
    assert after - before < 30
    assert [i for i in range(20) if backend.holder(task.lock_name(f"k{i}"))] == []
    assert releaser.pending(task.lock_name("k20"))  # nothing carried the last one yet
    store.close()
    assert releaser.flush()
    assert backend.holder(task.lock_name("k20")) is None
    assert ran == [f"k{i}" for i in range(21)]


def test_with_no_acquire_to_carry_it_the_thread_sends_the_release_soon(
    app: Celery, redis_url: str
) -> None:
    ran: list[str] = []
    task = define(app, redis_url, ran, ignore_result=True)
    run = tracer(app, task)
    run("id-alone", ("alone",))
    backend = get_backend(redis_url)
    wait_until(lambda: backend.holder(task.lock_name("alone")) is None, 2, "the thread's release")
    wait_until(lambda: not releaser.pending(task.lock_name("alone")), 2, "answered")


def test_a_lock_lost_before_its_deferred_release_is_reported(
    app: Celery, redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Force-released between the run's end and the release going out: the release finds
    the token gone, the lease is marked lost and the failure is logged."""
    monkeypatch.setattr(releaser_module, "RELEASE_DELAY", 30.0)
    ran: list[str] = []
    task = define(app, redis_url, ran, ignore_result=True)
    run = tracer(app, task)
    backend = get_backend(redis_url)
    seen: list[Any] = []
    subscription = events.subscribe(seen.append)
    try:
        run("id-lost", ("lost",))
        name = task.lock_name("lost")
        holder = backend.holder(name)
        assert holder is not None
        assert backend.force_release(name, holder.fence)
        with caplog.at_level(logging.WARNING, logger="task_locks.celery"):
            run("id-next", ("next",))  # carries the release, which finds the token gone
        assert not releaser.pending(name)
        assert any("releasing lock" in r.getMessage() and name in r.getMessage()
                   for r in caplog.records), caplog.text  # fmt: skip
        assert events.flush(5.0)
        assert [e.kind for e in seen if e.name == name and e.kind in ("lost", "released")] == [
            "lost"
        ]
    finally:
        subscription.close()


def test_a_task_after_the_run_starts_only_once_the_release_is_sent(
    app: Celery, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next task (no lock of its own) may keep the GIL from its first
    line, so the releaser thread could not send the finished run's release until it ends:
    its ``task_prerun`` sends it first."""
    monkeypatch.setattr(releaser_module, "RELEASE_DELAY", 30.0)  # the thread never fires
    ran: list[str] = []
    task = define(app, redis_url, ran, ignore_result=True)
    backend = get_backend(redis_url)
    seen: list[object] = []

    @app.task(name=f"t.{uuid.uuid4().hex}")
    def plain() -> None:
        seen.append(backend.holder(task.lock_name("gil")))

    tracer(app, task)("id-run", ("gil",))
    assert releaser.pending(task.lock_name("gil"))
    tracer(app, plain)("id-plain", ())
    assert seen == [None]
    assert not releaser.pending(task.lock_name("gil"))


def test_a_task_holding_the_gil_does_not_keep_the_finished_runs_key(
    cluster: Any, solo_worker: Any, key: str
) -> None:
    """A real worker: a run, then a task inside one C call for seconds. Another process
    takes the run's key within half a second of the run's end, while that call goes on."""
    log = f"log:{key}"
    store = redis.Redis.from_url(cluster.locks_url)
    backend = get_backend(cluster.locks_url)
    cluster.tasks.fire_and_forget_task.apply_async((key, log), queue="tl_solo")
    cluster.tasks.gil_task.apply_async((log, 150_000_000), queue="tl_solo")
    wait_until(lambda: store.llen(log) >= 1, 20, "the run")
    ran_seen = time.monotonic()
    owner = Owner(task_id="other-process")
    wait_until(lambda: backend.acquire(f"t:{key}", "other", 10_000, owner).acquired, 10, "the key")
    took = time.monotonic() - ran_seen
    calls_ended = store.llen(log) > 1  # the C call's end is recorded after it
    wait_until(lambda: store.llen(log) >= 2, 60, "the C call to end")
    backend.release(f"t:{key}", "other")
    assert took < 0.5 and not calls_ended, (
        f"the finished run's key stayed taken {took:.2f}s (the C call had ended: {calls_ended})"
    )


def test_a_pending_release_holds_up_only_a_task_that_would_not_carry_it(
    app: Celery, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``task_prerun`` flushes only what the next task's acquire will not carry: a run on
    the release's own backend leaves it to ride its acquire, any other task sends it."""
    monkeypatch.setattr(releaser_module, "RELEASE_DELAY", 30.0)  # the thread never fires
    ran: list[str] = []
    task = define(app, redis_url, ran, ignore_result=True)
    tracer(app, task)("id-ride", ("ride",))
    assert releaser.pending(task.lock_name("ride"))
    assert not releaser.idle()
    assert releaser.idle_but(get_backend(redis_url))
    assert not releaser.idle_but(get_backend("memory://"))
    assert not releaser.idle_but(None)
    # Celery's own signal, as a worker sends it before each task: a run of this task
    # (its acquire carries the release) leaves it pending; any other task sends it.
    signals.task_prerun.send(sender=task, task_id="id-next", task=task, args=(), kwargs={})
    assert releaser.pending(task.lock_name("ride")), "flushed before a run that carries it"

    @app.task(name="plain-next")
    def plain() -> None:
        pass

    signals.task_prerun.send(sender=plain, task_id="id-plain", task=plain, args=(), kwargs={})
    assert not releaser.pending(task.lock_name("ride")), "a plain task started before the send"
    assert releaser.idle() and releaser.idle_but(None)
