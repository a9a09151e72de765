"""Owner metadata for the current thread or task.

The Celery and Django layers say what is running with :func:`owner_context`; the core
reads it with :func:`current_owner` when it acquires. Kept in a ``ContextVar`` so asyncio
tasks and threads each see their own.
"""

from __future__ import annotations

import os
import socket
import threading
from contextlib import ContextDecorator
from contextvars import ContextVar, Token
from typing import Any

from .types import Owner

_context: ContextVar[dict[str, Any] | None] = ContextVar("task_locks_owner", default=None)
_host = socket.gethostname()


#: The fields :func:`owner_context` takes (an owner's own, but where it runs).
_FIELDS: frozenset[str] = frozenset(Owner.__dataclass_fields__)


class owner_context(ContextDecorator):
    """Describe the running job (``task_id=``, ``task_name=``, ``command=``, ``worker=``).

    A context manager (or decorator) over a ``ContextVar``: asyncio tasks and threads
    each see their own. A class, not ``@contextmanager``: a Celery run enters one per
    run, and a generator-based one cost it more client CPU than its fields' checks.
    """

    __slots__ = ("_fields", "_token")

    def __init__(self, **fields: Any) -> None:
        if not _FIELDS.issuperset(fields):
            unknown = set(fields) - _FIELDS
            raise TypeError(f"owner_context() got unknown fields: {sorted(unknown)}")
        self._fields = fields
        self._token: Token[dict[str, Any] | None] | None = None

    def _recreate_cm(self) -> owner_context:
        """Used as a decorator: a fresh one per call (re-entrant, thread-safe)."""
        return owner_context(**self._fields)

    def __enter__(self) -> None:
        if self._token is not None:  # its token would be lost: the outer one never reset
            raise RuntimeError("this owner_context is already entered: make one per block")
        outer = _context.get()
        self._token = _context.set({**outer, **self._fields} if outer else dict(self._fields))

    def __exit__(self, *exc: object) -> None:
        token, self._token = self._token, None
        if token is not None:
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
