"""Celery integration: ``@singleton_task`` with the lock tied to the task's whole life.

    from task_locks.celery import singleton_task, current_lease

    @singleton_task(key="sync:{account_id}", ttl=60, on_conflict="skip")
    def sync_account(account_id): ...

- The lock name is the rendered key, so ``Lock("sync:42")`` anywhere is the same lock.
- ``on_conflict``: ``"skip"`` (log at INFO naming the holder; the run ends ``SUCCESS``
  with a :class:`Skipped` result, or with ``skip_as="failure"`` ``FAILURE`` with
  :class:`DuplicateTask`: ready either way, so ``.get()`` returns and canvases go on),
  ``"retry"`` (``self.retry`` with a jittered countdown, ``max_retries``
  applies, then fails with ``LockHeld``), ``"wait"`` (up to ``wait_timeout``, woken by
  the release), ``"raise"`` (fails with ``LockHeld`` naming the holder).
- ``on_lost``: a lock lost while the body runs: ``"interrupt"`` (default) raises
  ``LockLost`` in the body, ``"fail"`` lets it finish, and both end the run ``FAILURE``
  with ``LockLost``; ``"ignore"`` keeps its result (:mod:`task_locks.celery.interrupt`).
- ``limit=N`` (default 1): at most N runs of one key at once, through a
  :class:`~task_locks.Semaphore` named by the key (``current_lease()`` is the run's
  :class:`~task_locks.semaphore.Permit`); ``on_conflict`` applies when all N permits are
  taken. Run-time locking only (``lock_on="enqueue"``/``"both"`` with N > 1 is refused
  at definition time). A second delivery of a running message is not recognised under
  N > 1: it may take a second permit.
- Beat ticks sent by :class:`~task_locks.celery.beat.LeaderScheduler` carry the leader's
  term; a tick whose term is older than the current leader's (and whose claim is gone)
  is refused, logged at WARNING, and ends ready as a skip does: ``SUCCESS`` with a
  :class:`StaleTick` result, or ``FAILURE`` with :class:`DuplicateTask`
  (``skip_as="failure"``), at the cost of one read for beat messages only.
- ``lock_on``: ``"run"`` (default), ``"enqueue"`` (at most one *queued* message per key;
  the key is freed when it starts), ``"both"`` (at most one queued-or-running). See
  :mod:`task_locks.celery.publish`.
- Per call: ``apply_async(..., lock_options={"ttl": ..., "on_conflict": ..., "timeout":
  ..., "max_hold": ...})`` (:mod:`task_locks.celery.options`), validated at the call.
- ``AlreadyQueued`` is ``DuplicateTask`` (celery-once's name for it).
- A second delivery of a message that is still running (``acks_late`` redelivery)
  finds its own task id holding the key and is ignored (no state is written) under
  ``"skip"``/``"raise"``; under ``"wait"``/``"retry"`` it runs after the first, never
  alongside.
- Pools: prefork, threads, solo, gevent and eventlet, each tested on real workers. Under
  gevent and eventlet the renewal watchdog is a greenlet of the hub, so it runs only
  when a body yields: a body that blocks the hub past its TTL loses its lease, and the
  run ends ``FAILURE`` with ``LockLost`` (``on_lost="ignore"``: its result, the loss
  logged at WARNING).

Importing this package connects the signal receivers that release leftover locks.
"""

from __future__ import annotations

from . import signals as _signals
from .task import (
    LOCK_ON,
    ON_CONFLICT,
    ON_LOST,
    SKIP_AS,
    SKIPPED,
    STALE_TICK,
    TOKEN_HEADER,
    DuplicateTask,
    SingletonTask,
    Skipped,
    StaleTick,
    current_lease,
    singleton_task,
)

_signals.connect()

#: celery-once's name for a dropped duplicate: ``except AlreadyQueued`` catches
#: :class:`DuplicateTask` (the same class). It is not celery-once's own exception class:
#: code that imports ``celery_once.AlreadyQueued`` must import this one instead.
AlreadyQueued = DuplicateTask

__all__ = [
    "LOCK_ON",
    "ON_CONFLICT",
    "ON_LOST",
    "SKIPPED",
    "SKIP_AS",
    "STALE_TICK",
    "TOKEN_HEADER",
    "AlreadyQueued",
    "DuplicateTask",
    "SingletonTask",
    "Skipped",
    "StaleTick",
    "current_lease",
    "singleton_task",
]
