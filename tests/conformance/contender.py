"""A lock contender in its own process: ``python contender.py URL NAME ROUNDS LOG``.

Each round takes the lock, appends ``enter <fence> <pid>`` and then ``leave <fence>
<pid>`` to the shared LOG file (O_APPEND: one write is one line, in the order the
writes happened), sleeping a little inside. The test then reads the file: with mutual
exclusion every ``enter`` is followed by its own ``leave``, and fences only grow.
"""

from __future__ import annotations

import os
import sys
import time

from task_locks import Lock


def main(url: str, name: str, rounds: int, log_path: str) -> None:
    if os.environ.get("DJANGO_SETTINGS_MODULE"):  # django:// runs inside a Django project
        import django

        django.setup()
    lock = Lock(name, ttl=10, backend=url, timeout=60)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pid = os.getpid()
    try:
        for _ in range(rounds):
            with lock as lease:
                os.write(log, f"enter {lease.fence} {pid}\n".encode())
                time.sleep(0.003)
                os.write(log, f"leave {lease.fence} {pid}\n".encode())
    finally:
        os.close(log)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
