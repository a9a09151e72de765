"""Issue 15: a run whose end nobody waits for releases its lock after the run, in the
process's releaser thread, and that never costs a run of the same key or a lock left
behind at shutdown.

The runs go through Celery's own tracer (``build_tracer``, what a worker calls per
message) in this process, against the shared real Redis.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, signals
from celery.app.trace import build_tracer
from servers import wait_until

from task_locks import get_backend
from task_locks.celery import singleton_task
from task_locks.celery.releaser import releaser

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
