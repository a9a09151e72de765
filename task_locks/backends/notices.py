"""Release notices: what a backend tells a holder's process when its lock was freed by
someone else, and the stream a listener reads them from.

Why: a holder otherwise learns of a force release at its next renewal, up to a third of
the TTL later, all of it work done without the lock. A backend that declares
:attr:`~task_locks.backends.base.Capability.RELEASE_NOTICE` announces each such release
on a channel of its own (one per Redis database and prefix, PostgreSQL's ``NOTIFY``,
an etcd watch), and :mod:`task_locks.notices` marks the matching lease lost within a
round trip. A notice names the lock *and* the fence it was freed under: fences never
repeat for a name, so a notice can only ever match the one lease it is about, never a
later lease of the same name (a stale notice is simply unmatched).

A stream is sans policy: it connects, waits, and reports what it read or the error that
broke it; the listener (:class:`task_locks.notices.Listener`) decides about reconnects,
idling and which lease a notice means.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, NamedTuple, Protocol

__all__ = ["RETIRED", "Notice", "NoticeStream", "close_streams", "retired", "track"]


class Notice(NamedTuple):
    """Lock ``name`` (as the caller names it, without the backend's prefix) held under
    ``fence`` is gone; ``why`` says how, for ``lease.lost_reason``."""

    name: str
    fence: int
    why: str


class NoticeStream(Protocol):
    """One connection that hears release notices (used by one thread at a time)."""

    def open(self, since: int | None) -> None:
        """Connect and subscribe; return once notices sent from now on will be read.

        ``since``: the lowest fence of the leases to hear about (etcd replays its events
        from that revision, so a release between the acquire and the watch is heard).
        Raises on failure (the listener retries later).
        """

    def read(self, timeout: float) -> list[Notice]:
        """The notices that arrive within ``timeout`` seconds (``[]``: none). Raises
        when the connection broke: the listener closes it and opens again."""

    def close(self) -> None:
        """Drop the connection (never raises)."""


#: The streams each backend opened, so that its ``close()`` closes them too (a stream's
#: connection must not outlive a closed backend: a test database cannot be dropped while
#: a session is on it).
_streams: weakref.WeakKeyDictionary[object, weakref.WeakSet[Any]] = weakref.WeakKeyDictionary()
_streams_guard = threading.Lock()


def track(backend: object, stream: NoticeStream) -> NoticeStream:
    """Remember ``stream`` as ``backend``'s (see :func:`close_streams`); returns it."""
    with _streams_guard:
        _streams.setdefault(backend, weakref.WeakSet()).add(stream)
    return stream


def _forget_streams() -> None:
    """A forked child must never close its parent's streams: a shutdown or a PostgreSQL
    Terminate on the inherited socket would end the parent's subscription."""
    global _streams_guard
    _streams.clear()
    _streams_guard = threading.Lock()


os.register_at_fork(after_in_child=_forget_streams)


def close_streams(backend: object) -> None:
    """Close every stream ``backend`` opened (from its ``close()``), for good: the
    listener reading one stops (its leases fall back to renewal) rather than reconnect,
    and the next lease acquired on the backend starts a new one."""
    with _streams_guard:
        streams = list(_streams.pop(backend, ()))
    for stream in streams:
        setattr(stream, RETIRED, True)
        stream.close()


#: Set on a stream its backend's ``close()`` closed (see :func:`retired`).
RETIRED = "task_locks_retired"


def retired(stream: NoticeStream) -> bool:
    """Whether ``stream``'s backend closed it: its listener must not open it again."""
    return bool(getattr(stream, RETIRED, False))
