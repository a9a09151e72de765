"""Run-lock releases sent after the run, off the worker's critical path (issue 15).

A run whose outcome nobody waits for (its result is not stored, no callback or chain
follows it) does not need its lock's release round trip before the worker moves on:
the run hands the lease to this process's releaser thread, which sends the release
(token-checked, as ever) while the worker acknowledges and fetches the next message.

What keeps it safe:

- a new run of the same key in this process first waits for that key's pending
  release (:meth:`Releaser.flush_key`), so it is never refused by its own process's
  leftover;
- worker shutdown, a pool child's exit and the interpreter's exit flush the queue
  (bounded by :data:`FLUSH_TIMEOUT`); a release still unsent after that is left to the
  lock's TTL, like any lock of a process that died;
- only leases still held as far as this process knows are handed over: a lease lost
  while the body ran is released in the run, which fails loudly as before. A release
  the server refuses later (the lock was force-released meanwhile) is logged at
  WARNING; the run has already ended.

A child killed while a run holds its lock never got to hand it over: the worker's main
process recovers that lock as before (:mod:`task_locks.celery.request`).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Final

from ..errors import LockError
from ..lock import Lease

log = logging.getLogger("task_locks.celery")

#: Seconds a flush waits for the releases in flight (a release is one round trip).
FLUSH_TIMEOUT: Final = 5.0

OnError = Callable[[Lease, LockError], None]


class Releaser:
    """One daemon thread per process that sends the releases runs handed over, in order."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        """Empty, threadless state: at start, and in a forked child (whose copy of the
        parent's lock may be held, and whose parent sends the parent's releases)."""
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._done = threading.Condition(self._lock)
        self._queue: deque[tuple[str, Lease, OnError]] = deque()
        #: key -> releases of it not yet answered (queued or in flight).
        self._pending: dict[str, int] = {}
        self._thread: threading.Thread | None = None

    def submit(self, key: str, lease: Lease, on_error: OnError) -> None:
        """Release ``lease`` soon; ``on_error`` gets what the release raised, if anything."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="task-locks-releaser", daemon=True
                )
                self._thread.start()
            self._queue.append((key, lease, on_error))
            self._pending[key] = self._pending.get(key, 0) + 1
            self._work.notify()

    def pending(self, key: str) -> bool:
        """Whether a release of ``key`` handed over in this process is not answered yet."""
        return key in self._pending

    def flush_key(self, key: str, timeout: float = FLUSH_TIMEOUT) -> bool:
        """Wait (up to ``timeout``) until no release of ``key`` is pending here."""
        return self._wait(lambda: key not in self._pending, timeout)

    def flush(self, timeout: float = FLUSH_TIMEOUT) -> bool:
        """Wait (up to ``timeout``) until every release handed over here was sent."""
        return self._wait(lambda: not self._pending, timeout)

    def _wait(self, done: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while not done():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.warning("releases still pending after %.1fs: %s", timeout, self._pending)
                    return False
                self._done.wait(remaining)
        return True

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._work.wait()
                key, lease, on_error = self._queue.popleft()
            try:
                lease.release()
            except LockError as exc:
                on_error(lease, exc)
            except Exception:  # the thread must outlive any one release
                log.exception("releasing lock %r in the background failed", lease.name)
            finally:
                with self._lock:
                    left = self._pending.get(key, 1) - 1
                    if left > 0:
                        self._pending[key] = left
                    else:
                        self._pending.pop(key, None)
                    self._done.notify_all()


#: This process's releaser.
releaser: Final = Releaser()
atexit.register(releaser.flush)

__all__ = ["FLUSH_TIMEOUT", "Releaser", "releaser"]
