"""Run-lock releases sent after the run, off the worker's critical path.

A run whose outcome nobody waits for (its result is not stored, no callback or chain
follows it) does not need its lock's release round trip before the worker moves on.
The run defers the lease's release here, and the release rides ahead of the next acquire the
process sends to that backend, in the acquire's own pipelined round trip
(:meth:`~task_locks.backends.base.Backend.defer_release`): back-to-back runs pay one
round trip each, and no thread runs beside the worker's. If no acquire comes within
:data:`RELEASE_DELAY` (the queue went quiet, or the backend cannot carry releases), the
process's releaser thread sends it itself. While runs keep coming, that thread wakes
about once per :data:`RELEASE_DELAY`, not once per run. Token-checked, as ever.

That thread needs the GIL, which the next task may keep for seconds in one C call (a
``sorted()`` of a big list): so no task body starts in this process while a release is
unsent. The next task's ``task_prerun`` sends, in its own thread, every pending release
its acquire will not carry (all of them before a task that takes no run lock on that
backend, :func:`task_locks.celery.signals._before_task`). A finished run's key is thus
taken for at most :data:`RELEASE_DELAY` and a round trip past its run, or until the
next task starts, whichever is first (a next task inside one long C call would
otherwise keep the finished run's key taken for as long).

What keeps it safe:

- a new run of the same key in this process, and a publish of it, first sends that
  key's pending release (:meth:`Releaser.flush_key`), so it is never refused by its own
  process's leftover; a pending release riding an acquire is sent before it, in order,
  on the same connection;
- worker shutdown, a pool child's exit and the interpreter's exit flush the queue
  (bounded by :data:`FLUSH_TIMEOUT`); a release still unsent after that is left to the
  lock's TTL, like any lock of a process that died;
- only leases still held as far as this process knows are deferred, and their
  renewal stops at once: a lease lost while the body ran is released in the run, which
  fails loudly as before. A release the server refuses later (the lock was
  force-released meanwhile) marks the lease lost (the ``lost`` event) and is logged at
  WARNING; the run has already ended.

A child killed while a run holds its lock never got to defer its release: the worker's main
process recovers that lock as before (:mod:`task_locks.celery.request`). A child killed
in the few milliseconds between a run's end and the release going out leaves that lock
to its TTL (renewal stopped when the run ended).

The same thread frees publish-time locks that no message carries
(:meth:`Releaser.free_later`): a publish whose acquire got no answer may have taken the
key with nothing published. That lock would keep the key for ``enqueue_ttl`` (an hour by
default), dropping every publish of it as a duplicate of a message that was never sent.
The free is token-checked, under a token no message carries (so it can never free a
run's lock), and tried again, backing off: while the server does not answer (until the
lock's TTL is over), and for :data:`LATE_WINDOW` whatever it answers, as the acquire it
undoes may still be on its way and land after a free (a request held up in the network,
a copy redis-py resent). One that lands later still holds the key until the TTL.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Final

from ..backends.base import Backend, DeferredRelease, ServerHandoff
from ..errors import BackendUnavailable, LockError
from ..lock import Lease

log = logging.getLogger("task_locks.celery")

#: Seconds a flush waits for the releases in flight (a release is one round trip).
FLUSH_TIMEOUT: Final = 5.0
#: Seconds a deferred release waits for an acquire to carry it before the releaser
#: thread sends it: the longest a finished run's key stays taken, plus the release's
#: round trip (and the thread's wait for a CPU).
RELEASE_DELAY: Final = 0.005
#: Seconds before the second try of a :meth:`Releaser.free_later`; each later try waits
#: twice as long as the one before, up to :data:`RETRY_MAX`.
RETRY_FIRST: Final = 0.1
RETRY_MAX: Final = 10.0
#: Seconds a :meth:`Releaser.free_later` keeps freeing after the server answered: the
#: acquire it undoes may still be on its way (a request held up in the network, or a
#: copy that redis-py resent), and land after the first free.
LATE_WINDOW: Final = 60.0

OnError = Callable[[Lease, LockError], None]


class _Pending(DeferredRelease):
    """One deferred release: the lease, who hears of its failure, when it is due."""

    __slots__ = ("backend", "due", "key", "lease", "on_error", "owner")

    #: A flush waits for its answer (see :attr:`_Orphan.holds_flush`).
    holds_flush = True

    def __init__(self, owner: Releaser, key: str, lease: Lease, on_error: OnError) -> None:
        super().__init__(lease.name, lease.token)
        self.owner = owner
        self.key = key
        self.lease = lease
        self.backend = lease.backend
        self.on_error = on_error
        self.due = time.monotonic() + RELEASE_DELAY

    def send(self) -> bool:
        return self.backend.release(self.name, self.token)

    def answer(self, outcome: bool | LockError) -> None:
        self.owner._answered(self, outcome)


class _Orphan(DeferredRelease):
    """One try of a :meth:`Releaser.free_later`: a lock no lease here holds."""

    __slots__ = ("backend", "delay", "due", "holds_flush", "key", "owner", "until", "watch")

    def __init__(
        self,
        owner: Releaser,
        backend: Backend,
        key: str,
        token: str,
        until: float,
        delay: float = 0.0,
        watch: float | None = None,
    ) -> None:
        super().__init__(key, token)
        self.owner = owner
        self.backend = backend
        self.key = key
        self.until = until  # the lock's TTL is over: nothing left to free
        #: Until then, tries go on whatever the answer (:data:`LATE_WINDOW`).
        self.watch = min(until, time.monotonic() + LATE_WINDOW) if watch is None else watch
        self.delay = delay  # how long this try waited after the one before
        self.due = time.monotonic() + delay
        #: Only the first try holds a flush up (and is sent by any flush): a flush
        #: before a publish of the key waits for its answer, so the publish is not
        #: refused by this process's leftover. Later tries are the thread's, with their
        #: backoff; only a flush of their own key sends them sooner.
        self.holds_flush = True

    def send(self) -> bool:
        """Under the server hand-off the acquire (``on_conflict="wait"``) may have left a
        queue entry: leave the queue, which gives back a grant too."""
        if isinstance(self.backend, ServerHandoff):
            return self.backend.dequeue(self.name, self.token)
        return self.backend.release(self.name, self.token)

    def answer(self, outcome: bool | LockError) -> None:
        self.owner._orphan_answered(self, outcome)


class Releaser:
    """The process's pending releases, and the daemon thread that sends those no acquire
    carried within :data:`RELEASE_DELAY`."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        """Empty, threadless state: at start, and in a forked child (whose copy of the
        parent's lock may be held, and whose parent sends the parent's releases)."""
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._done = threading.Condition(self._lock)
        #: Deferred and not yet claimed by a sender (claimed ones leave lazily).
        self._queue: list[_Pending | _Orphan] = []
        #: key -> releases of it not yet answered (queued or in flight).
        self._pending: dict[str, int] = {}
        #: Every release not yet answered (queued or in flight).
        self._open: set[_Pending | _Orphan] = set()
        #: backend -> how many of ``_open`` hold a flush up (none: no entry), so that the
        #: check before every task (:meth:`idle_but`) costs the same however many are open.
        self._holders: dict[Backend, int] = {}
        self._thread: threading.Thread | None = None
        #: When the thread wakes on its own (``inf``: it waits for work).
        self._wake_at = math.inf
        #: Releases deferred so far (the thread sleeps for good only when none came).
        self._submitted = 0

    def submit(self, key: str, lease: Lease, on_error: OnError) -> None:
        """Release ``lease`` soon; ``on_error`` gets what the release raised, if anything.

        Its renewal stops now; it stays counted as held until the release is answered.
        """
        if not lease.begin_release():
            return  # already released, or a forked child's copy: nothing to send
        item = _Pending(self, key, lease, on_error)
        with self._lock:
            self._queue.append(item)
            self._opened(item)
            self._pending[key] = self._pending.get(key, 0) + 1
            self._submitted += 1
            self._start()
        try:
            rides = lease.backend.defer_release(item)
        except Exception:  # a backend's hook must not lose the release
            log.exception("deferring the release of %r failed; sending it now", lease.name)
            rides = False
        with self._lock:
            if not rides:
                item.due = time.monotonic()
            if item.due < self._wake_at:
                self._work.notify()

    def free_later(self, backend: Backend, name: str, token: str, ttl: float) -> None:
        """Free ``name`` if ``token`` holds it, from the releaser's thread, trying again
        (backing off) while the server does not answer, for at most ``ttl`` seconds (the
        lock's TTL: it is free by then anyway), and for :data:`LATE_WINDOW` whatever it
        answers. For a lock that no lease and no message carries; its outcome is logged.
        :meth:`pending` says ``True`` for ``name`` meanwhile."""
        item = _Orphan(self, backend, name, token, time.monotonic() + ttl)
        with self._lock:
            self._queue.append(item)
            self._opened(item)
            self._pending[name] = self._pending.get(name, 0) + 1
            self._start()
            self._work.notify()

    def _start(self) -> None:
        """Start the thread if it is not running (``_lock`` held)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="task-locks-releaser", daemon=True
            )
            self._thread.start()

    def pending(self, key: str) -> bool:
        """Whether a release of ``key`` deferred in this process is not answered yet."""
        return key in self._pending

    def flush_key(self, key: str, timeout: float = FLUSH_TIMEOUT) -> bool:
        """Send ``key``'s pending releases now; wait (up to ``timeout``) for their answers."""

        def which(item: _Pending | _Orphan) -> bool:
            return item.key == key

        return self._flush(which, lambda: not self._holding(which), timeout)

    def flush(self, timeout: float = FLUSH_TIMEOUT, *, keep: Backend | None = None) -> bool:
        """Send every pending release now; wait (up to ``timeout``) for their answers.

        ``keep``: a backend whose acquire comes next in this thread; its releases are left
        to ride it.
        """

        def which(item: _Pending | _Orphan) -> bool:
            return item.holds_flush and item.backend is not keep

        return self._flush(which, lambda: not self._holding(which), timeout)

    def _holding(self, which: Callable[[_Pending | _Orphan], bool]) -> bool:
        """Whether an unanswered release that ``which`` picks holds a flush up."""
        return any(item.holds_flush and which(item) for item in self._open)

    def idle(self) -> bool:
        """Whether every release deferred in this process has been answered (a
        :meth:`free_later` still trying again, in the thread, does not count)."""
        return self.idle_but(None)

    def idle_but(self, keep: Backend | None) -> bool:
        """:meth:`idle`, but for the releases on ``keep``, left to ride its next acquire:
        whether a :meth:`flush` with ``keep`` would have nothing to send or wait for."""
        if not self._holders:
            return True
        with self._lock:  # the releaser thread changes the counts
            return all(backend is keep for backend in self._holders)

    def _opened(self, item: _Pending | _Orphan) -> None:
        """``item`` is not answered yet (``_lock`` held)."""
        self._open.add(item)
        if item.holds_flush:
            self._holders[item.backend] = self._holders.get(item.backend, 0) + 1

    def _closed(self, item: _Pending | _Orphan) -> None:
        """``item`` was answered (``_lock`` held)."""
        if item not in self._open:
            return
        self._open.discard(item)
        if item.holds_flush:
            left = self._holders[item.backend] - 1
            if left:
                self._holders[item.backend] = left
            else:
                del self._holders[item.backend]

    def _flush(
        self,
        which: Callable[[_Pending | _Orphan], bool],
        done: Callable[[], bool],
        timeout: float,
    ) -> bool:
        with self._lock:
            mine = [item for item in self._queue if which(item) and item.claim()]
        for item in mine:  # in this thread: no wait for the releaser's turn
            _send(item)
        deadline = time.monotonic() + timeout
        with self._lock:
            while not done():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.warning("releases still pending after %.1fs: %s", timeout, self._pending)
                    return False
                self._done.wait(remaining)
        return True

    def _answered(self, item: _Pending, outcome: bool | LockError) -> None:
        """Settle ``item``'s lease with what its release did, then count it answered."""
        lease = item.lease
        try:
            if isinstance(outcome, LockError):
                if isinstance(outcome, BackendUnavailable):
                    lease.release_unknown(outcome)
                raise outcome
            lease.finish_release(outcome)  # False: marks it lost, raises NotOwned
        except LockError as exc:
            try:
                item.on_error(lease, exc)
            except Exception:
                log.exception("reporting the failed release of %r failed", lease.name)
        except Exception:
            log.exception("settling the release of lock %r failed", lease.name)
        finally:
            self._settled(item)

    def _orphan_answered(self, item: _Orphan, outcome: bool | LockError) -> None:
        """Settle one try of a :meth:`free_later`, or queue the next: while the server
        does not answer (until the lock's TTL is over), and whatever it answers during
        :data:`LATE_WINDOW` (the acquire being undone may land after a free)."""
        unanswered = isinstance(outcome, BackendUnavailable)
        delay = min(RETRY_MAX, item.delay * 2 or RETRY_FIRST)
        if time.monotonic() + delay < (item.until if unanswered else item.watch):
            if unanswered:
                log.info("freeing lock %r got no answer (%s); trying again", item.name, outcome)
            else:
                log.debug(
                    "freeing lock %r: %s; again, should the acquire land late",
                    item.name,
                    "freed" if outcome else "not held",
                )
            again = _Orphan(self, item.backend, item.key, item.token, item.until, delay, item.watch)
            again.holds_flush = False
            with self._lock:
                self._closed(item)
                self._opened(again)
                self._queue.append(again)
                if again.due < self._wake_at:
                    self._work.notify()
                self._done.notify_all()  # a flush no longer waits for this one
            return
        if isinstance(outcome, LockError):
            log.warning("freeing lock %r: %s; it expires by its TTL", item.name, outcome)
        else:
            log.debug("freeing lock %r: %s", item.name, "freed" if outcome else "already free")
        self._settled(item)

    def _settled(self, item: _Pending | _Orphan) -> None:
        with self._lock:
            self._closed(item)
            left = self._pending.get(item.key, 1) - 1
            if left > 0:
                self._pending[item.key] = left
            else:
                self._pending.pop(item.key, None)
            self._done.notify_all()

    def _run(self) -> None:
        seen = -1
        while True:
            with self._lock:
                while True:
                    if self._queue:  # drop those an acquire carried
                        self._queue = [item for item in self._queue if not item.claimed]
                    now = time.monotonic()
                    due = [item for item in self._queue if item.due <= now and item.claim()]
                    if due:
                        self._queue = [item for item in self._queue if not item.claimed]
                        self._wake_at = -math.inf  # busy: looks again before sleeping
                        break
                    if self._queue:  # sleep until the first is due, unless it is carried
                        self._wake_at = min(item.due for item in self._queue)
                        self._work.wait(self._wake_at - now)
                        continue
                    if self._submitted == seen:
                        self._wake_at = math.inf  # nothing came since the last look
                        self._work.wait()
                        continue
                    # Runs keep deferring releases (and acquires keep carrying them):
                    # look again a delay on rather than be woken by the next deferral,
                    # whose due time is later still. A wake-up per run would cost the
                    # run's thread the GIL each time.
                    seen = self._submitted
                    self._wake_at = now + RELEASE_DELAY
                    self._work.wait(RELEASE_DELAY)
            for item in sorted(due, key=lambda item: isinstance(item, _Orphan)):
                _send(item)  # runs' releases first: an orphan's server may not answer


def _send(item: _Pending | _Orphan) -> None:
    """Send one claimed release with its own round trip and settle it."""
    outcome: bool | LockError
    try:
        outcome = item.send()
    except LockError as exc:
        outcome = exc
    except Exception as exc:  # the thread must outlive any one release
        log.exception("releasing lock %r in the background failed", item.name)
        outcome = BackendUnavailable(f"lock {item.name!r}: release failed: {exc}", name=item.name)
    except BaseException as exc:  # interrupted (Ctrl-C in a flush): settled, then re-raised
        item.answer(BackendUnavailable(f"lock {item.name!r}: release interrupted", name=item.name))
        raise exc
    item.answer(outcome)


#: This process's releaser.
releaser: Final = Releaser()
atexit.register(releaser.flush)

__all__ = [
    "FLUSH_TIMEOUT",
    "LATE_WINDOW",
    "RELEASE_DELAY",
    "RETRY_FIRST",
    "RETRY_MAX",
    "Releaser",
    "releaser",
]
