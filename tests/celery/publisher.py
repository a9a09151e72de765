"""A publisher process for the Celery fault matrix: publish one key as fast as it can.

``python publisher.py TASK KEY LOG SECONDS STOP ACCEPTED DEADLINE``: calls
``TASK.apply_async((KEY, LOG, SECONDS), task_id=<new id>)`` in a loop until the Redis key
``STOP`` exists (or DEADLINE seconds pass), and for every publish that was accepted (the
returned handle has the id it was given, not the queued task's) pushes
``{"id", "called", "returned"}`` (wall clock, this host) onto the Redis list ``ACCEPTED``.
Several of these at once are the "concurrent publishers" of the matrix.
"""

from __future__ import annotations

import json
import sys
import time
import uuid

import celery_tasks


def main(task_name: str, key: str, log: str, seconds: str, stop: str, accepted: str,
         deadline: str) -> None:  # fmt: skip
    task = getattr(celery_tasks, task_name)
    store = celery_tasks.store
    store.rpush(accepted + ":ready", "1")
    ends = time.monotonic() + float(deadline)
    while time.monotonic() < ends and not store.exists(stop):
        task_id = str(uuid.uuid4())
        called = time.time()
        result = task.apply_async((key, log, float(seconds)), task_id=task_id)
        returned = time.time()
        if result.id == task_id:
            record = {"id": task_id, "called": called, "returned": returned}
            store.rpush(accepted, json.dumps(record))


if __name__ == "__main__":
    main(*sys.argv[1:])
