"""A separate process that takes a lock N times and logs its critical sections.

``python lock_worker.py URL NAME ROUNDS LOG`` appends ``start end fence pid`` per round
(``time.monotonic()`` is one clock for all processes on Linux), so the test can check that
no two critical sections overlap and that fences grow in time order.
"""

import os
import sys
import time

import django

django.setup()

from task_locks import Lock  # noqa: E402

url, name, rounds, log_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
with open(log_path, "a", buffering=1) as log:
    print("ready", flush=True)
    sys.stdin.readline()  # the test says go, so both workers start together
    for _ in range(rounds):
        with Lock(name, ttl=10, backend=url, timeout=30) as lease:
            start = time.monotonic()
            time.sleep(0.02)
            end = time.monotonic()
            log.write(f"{start} {end} {lease.fence} {os.getpid()}\n")
