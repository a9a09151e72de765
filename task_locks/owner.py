"""Owner metadata for the current thread or task.

The Celery and Django layers say what is running with :func:`owner_context`; the core
reads it with :func:`current_owner` when it acquires. Kept in a ``ContextVar`` so asyncio
tasks and threads each see their own.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from .types import Owner

_context: ContextVar[dict[str, Any] | None] = ContextVar("task_locks_owner", default=None)
_host = socket.gethostname()


@contextmanager
def owner_context(**fields: Any) -> Iterator[None]:
    """Describe the running job (``task_id=``, ``task_name=``, ``command=``, ``worker=``)."""
    unknown = set(fields) - set(Owner.__dataclass_fields__)
    if unknown:
        raise TypeError(f"owner_context() got unknown fields: {sorted(unknown)}")
    merged = {**(_context.get() or {}), **fields}
    token = _context.set(merged)
    try:
        yield
    finally:
        _context.reset(token)


def internal() -> bool:
    """Whether locks taken here and now are the library's own records (``internal=True``
    in :func:`owner_context`): their leases report no events."""
    return bool((_context.get() or {}).get("internal"))


_local = threading.local()


def current_owner() -> Owner:
    """The owner to record for an acquire made here and now."""
    pid, thread = os.getpid(), threading.current_thread().name
    base: Owner | None = getattr(_local, "owner", None)
    if base is None or base.pid != pid or base.thread != thread:
        base = _local.owner = Owner(host=_host, pid=pid, thread=thread)
    extra = _context.get()
    if not extra:
        return base
    # Not dataclasses.replace (a Python loop over the fields): owner_context checked the keys.
    return Owner(**{"host": base.host, "pid": base.pid, "thread": base.thread, **extra})
