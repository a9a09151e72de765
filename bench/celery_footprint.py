"""What each Celery mode leaves in Redis: keys and bytes after N runs, each of a key of its own.

A run is driven through Celery's own tracer in one process (``build_tracer``: what a solo
worker calls per message), not through a broker and a worker, so that 100,000 runs per
mode take seconds, not hours; the lock steps are the production ones. For
``lock_on="enqueue"``/``"both"`` each run's message is first put through the publish
guard (``guarded_publish``, the step every publish passes), with a sender that keeps the
headers it stamps instead of sending them, and the run gets them as a worker would.
celery-singleton and celery-once run in the peers' venv the same way: ``apply_async``
(their lock) to an in-memory broker, then the tracer (their unlock, on success or
``after_return``). Every mode is alone on a flushed database; a key whose expiry is more
than 60 s away (or none) counts as "beyond 60 s".

    .venv/bin/python bench/celery_footprint.py --n 100000
    .venv/bin/python bench/celery_footprint.py --peers-python bench/.peers/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Final

from workers import lasting_keys

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

#: Our modes: label -> singleton_task options (every run gets its lock at once).
OURS: Final = {
    'run lock (default: lock_on="run", skip)': {},
    'lock_on="both"': {"lock_on": "both"},
    'lock_on="enqueue"': {"lock_on": "enqueue"},
    "limit=3": {"limit": 3},
    'on_conflict="wait"': {"on_conflict": "wait", "wait_timeout": 5},
    'on_conflict="retry"': {"on_conflict": "retry"},
}
PEERS: Final = ("celery-singleton", "celery-once")


def measure(url: str, run: Any, n: int) -> dict[str, Any]:
    """Flush, run ``run(i)`` for ``i < n``, then count what the database holds."""
    import redis

    admin = redis.Redis.from_url(url)
    admin.flushdb()
    base = int(admin.info("memory")["used_memory"])
    commands = int(admin.info("stats")["total_commands_processed"])
    started = time.perf_counter()
    for i in range(n):
        run(i)
    seconds = time.perf_counter() - started
    settle()
    # Less the two INFO calls of this count itself; the server's own work, all clients.
    commands = int(admin.info("stats")["total_commands_processed"]) - commands - 2
    keys = admin.dbsize()
    left_bytes = int(admin.info("memory")["used_memory"]) - base
    lasting = lasting_keys(admin)
    admin.flushdb()
    return {
        "cycles": n,
        "left_keys": keys,
        "left_bytes": left_bytes,
        "left_keys_beyond_60s": lasting,
        "commands_per_run": commands / n,
        "us_per_run": 1e6 * seconds / n,
    }


def settle() -> None:
    """Let our background releaser send the last runs' releases (peers: nothing)."""
    try:
        from task_locks.celery.releaser import releaser
    except ImportError:
        return
    releaser.flush()


def tracer(app: Any, task: Any) -> Any:
    from celery.app.trace import build_tracer

    return build_tracer(task.name, task, app=app, hostname="footprint@host", eager=False)


def ours(url: str, label: str, n: int) -> dict[str, Any]:
    """One of our modes (:data:`OURS`), ``n`` runs of distinct keys."""
    sys.path.insert(0, str(ROOT))  # this checkout's task_locks
    from celery import Celery

    from task_locks.celery import singleton_task
    from task_locks.celery.publish import guarded_publish

    options = OURS[label]
    app = Celery("footprint", broker="memory://", set_as_current=True)
    app.conf.update(task_ignore_result=True)

    @singleton_task(app=app, name="footprint.ours", key="fp:{i}", backend=url, **options)
    def task(i: str) -> None:
        pass

    trace = tracer(app, task)
    publish = options.get("lock_on", "run") != "run"

    def kept(_producer: Any, _name: str, _message: Any, **sent: Any) -> dict[str, Any]:
        return dict(sent.get("headers") or {})

    def cycle(i: int) -> None:
        task_id = str(uuid.uuid4())
        args = (str(i),)
        request: dict[str, Any] = {"id": task_id, "delivery_info": {}}
        if publish:  # the publish guard's lock step, as apply_async runs it
            message = ({"id": task_id, "task": task.name}, {}, (args, {}, {}), None)
            request.update(guarded_publish(task, kept, None, task.name, message, {}))
        trace(task_id, args, {}, request)

    return measure(url, cycle, n)


def peer(url: str, label: str, n: int) -> dict[str, Any]:
    """celery-singleton or celery-once (run by the peers' python), ``n`` runs."""
    from celery import Celery

    app = Celery("footprint", broker="memory://", set_as_current=True)
    app.conf.update(task_ignore_result=True)
    if label == "celery-singleton":
        from celery_singleton import Singleton

        app.conf.singleton_backend_url = url

        @app.task(name="footprint.peer", base=Singleton)
        def task(i: str) -> None:
            pass

    else:
        from celery_once import QueueOnce

        app.conf.ONCE = {
            "backend": "celery_once.backends.Redis",
            "settings": {"url": url, "default_timeout": 3600},
        }

        @app.task(name="footprint.peer", base=QueueOnce, once={"graceful": True})
        def task(i: str) -> None:
            pass

    trace = tracer(app, task)
    with app.connection_for_write() as connection:
        queue = connection.SimpleQueue("celery")

        def cycle(i: int) -> None:
            task_id = str(uuid.uuid4())
            args = (str(i),)
            task.apply_async(args, task_id=task_id)  # the peer's lock
            trace(task_id, args, {}, {"id": task_id, "delivery_info": {}})
            queue.clear()  # the in-memory broker keeps nothing across runs

        return measure(url, cycle, n)


def run(url: str, n: int, peers_python: str | None = None) -> dict[str, Any]:
    """Every mode, each in a process of its own on database 13 of ``url``'s server: ours
    with this interpreter, the peers with ``peers_python`` (skipped without one)."""
    db_url = url.rsplit("/", 1)[0] + "/13"
    results: dict[str, Any] = {}
    jobs = [(sys.executable, "ours", label) for label in OURS]
    if peers_python:
        jobs += [(peers_python, "peer", label) for label in PEERS]
    for python, kind, label in jobs:
        done = subprocess.run(
            [python, __file__, "--one", kind, label, "--url", db_url, "--n", str(n)],
            capture_output=True,
            text=True,
            check=False,
            timeout=120 + n * 0.02,
        )
        if done.returncode != 0:
            results[label] = {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
        else:
            results[label] = json.loads(done.stdout.strip().splitlines()[-1])
    return {"n": n, "modes": results, "markdown": markdown(results, n)}


def markdown(results: dict[str, Any], n: int) -> str:
    lines = [
        f"| Celery mode ({n:,} runs, a key of its own each) | keys left | bytes left "
        "| keys left beyond 60 s | Redis commands / run | us / run (tracer, one process) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, r in results.items():
        if "error" in r:
            lines.append(f"| {label} | failed: {r['error'][:200]} | | | | |")
            continue
        lines.append(
            f"| {label} | {r['left_keys']:,} | {r['left_bytes']:,} "
            f"| {r['left_keys_beyond_60s']:,} | {r.get('commands_per_run', 0):.1f} "
            f"| {r['us_per_run']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000, help="runs per mode")
    parser.add_argument("--url", help="an existing Redis (default: start one)")
    parser.add_argument("--peers-python", help="the peers' venv python (bench/.peers)")
    parser.add_argument("--one", nargs=2, metavar=("KIND", "LABEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        kind, label = args.one
        measured = (ours if kind == "ours" else peer)(args.url, label, args.n)
        print(json.dumps(measured))
        return
    peers_python = args.peers_python
    if peers_python is None and (BENCH / ".peers" / "bin" / "python").exists():
        peers_python = str(BENCH / ".peers" / "bin" / "python")
    sys.path.insert(0, str(ROOT / "tests"))
    from common import redis_at

    with redis_at(args.url) as url:
        print(run(url, args.n, peers_python)["markdown"])


if __name__ == "__main__":
    main()
