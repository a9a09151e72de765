"""``current_lease()``: the lease of the locked call running in this thread or asyncio task.

One context variable serves every way of running code under a lock that the caller does
not hold a lease object for: ``@singleton_task`` runs (:mod:`task_locks.celery`) and
``@locked`` functions (:mod:`task_locks.decorators`). A context variable, so each thread
and each asyncio task sees its own, and nested locked calls see the innermost.
"""

from __future__ import annotations

from contextvars import ContextVar

from .lock import AsyncLease, Lease

AnyLease = Lease | AsyncLease
_current: ContextVar[AnyLease | None] = ContextVar("task_locks_current_lease", default=None)


def current_lease() -> AnyLease | None:
    """The lease of the singleton task or ``@locked`` call running here, if any.

    Pass ``lease.fence`` to the resources the code writes; check ``lease.lost`` (or call
    ``lease.check()``) before acting when the work is long.
    """
    return _current.get()


__all__ = ["AnyLease", "current_lease"]
