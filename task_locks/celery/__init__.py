"""Celery integration: ``@singleton_task`` with the lock tied to the task's whole life.

    from task_locks.celery import singleton_task, current_lease

    @singleton_task(key="sync:{account_id}", ttl=60, on_conflict="skip")
    def sync_account(account_id): ...

The lock name is the rendered key, so ``Lock("sync:42")`` anywhere is the same lock.
Importing this package connects the signal receivers that release leftover locks.
Pools: prefork, threads and solo are supported and tested; gevent and eventlet are not
tested (the renewal watchdog is a real OS thread, which monkey-patching turns into a
greenlet that only runs when the task yields).
"""

from __future__ import annotations

from . import signals as _signals
from .task import (
    LOCK_ON,
    ON_CONFLICT,
    SKIPPED,
    TOKEN_HEADER,
    DuplicateTask,
    SingletonTask,
    current_lease,
    singleton_task,
)

_signals.connect()

__all__ = [
    "LOCK_ON",
    "ON_CONFLICT",
    "SKIPPED",
    "TOKEN_HEADER",
    "DuplicateTask",
    "SingletonTask",
    "current_lease",
    "singleton_task",
]
