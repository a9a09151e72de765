"""Chain, group, chord and chunks of a singleton task whose key is held.

``run(policy, key, locks_url)`` holds each canvas's key (``Lock`` in this process), sends
the four canvases of ``celery_tasks.canvas_<policy>``, releases the keys after
``HELD_FOR`` seconds (for ``wait``/``retry``, which must then run) or at the end, and
returns what each canvas's ``.get()`` gave, described as JSON (a chord's errback records
itself in the Redis list ``log:<key>``). Used in the test process
(Redis results) and by ``canvas_client.py`` (Django database results), so both result
backends see the very same canvases.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

import celery_tasks
from celery import chain, chord, group

from task_locks import Lock
from task_locks.celery import Skipped

#: Seconds the keys stay held after the canvases are sent (``wait``/``retry`` policies).
HELD_FOR = 1.0
#: Seconds each ``.get()`` may take.
GET_TIMEOUT = 45.0


def describe(value: Any) -> Any:
    """A result as JSON: a :class:`Skipped` marker becomes ``"Skipped"``."""
    if isinstance(value, Skipped):
        return "Skipped"
    if isinstance(value, list | tuple):
        return [describe(item) for item in value]
    return value


def outcome(result: Any) -> dict[str, Any]:
    try:
        return {"value": describe(result.get(timeout=GET_TIMEOUT, propagate=True))}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)[:200]}


def run(policy: str, key: str, locks_url: str) -> dict[str, Any]:
    task = getattr(celery_tasks, f"canvas_{policy}")
    keys = {name: f"{key}-{name}" for name in ("chain", "group", "chord", "chunks")}
    holds = [Lock(f"t:{k}", ttl=30, backend=locks_url).acquire(timeout=0) for k in keys.values()]
    log = f"log:{key}"
    free = f"{key}-free"  # a chord member whose key nobody holds
    canvases = {
        "chain": chain(task.si(keys["chain"], 1), celery_tasks.echo.s()),
        "group": group(task.si(keys["group"], n) for n in range(3)),
        "chord": chord(
            [task.si(keys["chord"], 0), task.si(free, 1)],
            celery_tasks.collect.s().on_error(celery_tasks.chord_failed.s(log)),
        ),
        "chunks": task.chunks([(keys["chunks"], n) for n in range(4)], 2).group(),
    }
    results = {name: canvas.apply_async() for name, canvas in canvases.items()}

    def release() -> None:
        for lease in holds:
            lease.release()

    timer = threading.Timer(HELD_FOR, release) if policy in ("wait", "retry") else None
    if timer is not None:
        timer.start()
    try:
        found = {name: outcome(result) for name, result in results.items()}
    finally:
        if timer is not None:
            timer.join()
        else:
            release()
    return found


if __name__ == "__main__":  # python canvases.py POLICY KEY LOCKS_URL: prints the outcome
    backend = type(celery_tasks.app.backend).__name__
    print(json.dumps({"backend": backend, **run(*sys.argv[1:])}))
