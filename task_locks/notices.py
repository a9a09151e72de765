"""Release notices: a holder's process hears of a force release at once, not at its next
renewal.

Why: renewal finds a lock freed by someone else only a third of the TTL later at worst
(10 s of a 30 s TTL), and all that while the holder (a task, a command, ``run``'s
program) works without the lock. A backend that declares
:attr:`~task_locks.backends.base.Capability.RELEASE_NOTICE` announces every release of
another holder's lock (Redis: a PUBLISH inside the force-release script, on one channel
per prefix and database; PostgreSQL: a ``NOTIFY`` in the same statement; etcd: the
delete events of a watch on the prefix, which also covers an etcd lease that expired).
One :class:`Listener` per backend and process reads them and marks the matching lease
lost through the lease's own loss path, so ``lease.lost``, ``on_lost``, the ``lost``
event and metrics, ``run``'s exit 79, ``LockedCommand`` and a Celery task's interrupt
all follow within a round trip.

What it must never do, and how it does not:

- **A false loss.** A notice names the lock and the fence it was freed under, and
  matches only the lease holding that very fence (fences never repeat for a name): a
  notice about an earlier lease of the name, or a later one, matches nothing. A lease
  being released by its own holder ignores notices (etcd's watch also sees our own
  deletes).
- **Cost the uncontended cycle.** Nothing is sent per acquire or release: a lease is
  entered in a dict when handed to its renewal lane and leaves it when released or
  lost. The listener subscribes once per process and backend, on its own connection and
  thread, started with the first renewed lease and stopped :data:`IDLE_EXIT` seconds
  after the last one went (as the renewal lanes are, so an acquire/release loop does not
  reconnect every time).
- **Be the only line of defence.** Renewal still runs on its schedule. A notice lost
  (the listener's connection down, a Redis restart, a lease acquired in the instant
  before the first SUBSCRIBE was confirmed) is found by the next renewal; and after a
  reconnect the listener has every lease renewed at once, since notices sent while it was
  away are gone (pub/sub keeps nothing).

Under gevent or eventlet the listener's thread is a greenlet like the renewal lanes', its
socket reads cooperative once ``socket`` is patched (Redis, etcd); the PostgreSQL backend
does not declare the capability there (psycopg's wait would block the hub), and renewal
finds the loss.

A lost key (the server expired it) is announced only by etcd (its lease expiry deletes
the key: a delete event). Redis expiry events need ``notify-keyspace-events`` set on the
server and carry no fence, so a late event could not be told from a fresh acquire: they
are not used; the local deadline watch marks the lease lost first anyway, since the
server's TTL ends after the local deadline.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from .backends.base import Capability
from .backends.notices import Notice, NoticeStream, retired
from .errors import BackendMisconfigured
from .leasing import Renewable, mark_driver

if TYPE_CHECKING:
    from .backends.base import Backend

__all__ = [
    "IDLE_EXIT",
    "READ_SLICE",
    "Listener",
    "forget",
    "listen",
    "listener",
]

log = logging.getLogger("task_locks.notices")

#: A listener with no lease to listen for stops after this long (the lanes' idle exit).
IDLE_EXIT = 5.0
#: A read waits at most this long before the listener looks at its leases again.
READ_SLICE = 1.0
#: Reconnects wait this long after a failure, doubling up to :data:`RETRY_MAX`.
RETRY_FIRST = 0.1
RETRY_MAX = 2.0

_LeaseKey = tuple[str, int]


class Listener:
    """The release notices of one backend in this process: its leases by (name, fence),
    and the thread (its own connection) that reads the notices and marks leases lost."""

    def __init__(self, backend: Backend) -> None:
        self._backend = weakref.ref(backend)
        self.server = backend.server
        self._leases: dict[_LeaseKey, weakref.ref[Any]] = {}
        self._guard = threading.Lock()
        self._thread: threading.Thread | None = None
        #: Set while subscribed: a release announced from then on is heard.
        self.ready = threading.Event()
        #: Times the connection was (re)opened after a failure (diagnostics, tests).
        self.reconnects = 0
        #: The backend refused the subscription (an ACL): renewal alone, no retries.
        self.refused: str | None = None

    def __len__(self) -> int:
        with self._guard:
            return len(self._leases)

    @property
    def running(self) -> bool:
        return self._thread is not None

    def add(self, lease: Renewable) -> None:
        key = (lease.name, int(getattr(lease, "fence", 0)))
        with self._guard:
            self._leases[key] = weakref.ref(lease)
            if self._thread is None and self.refused is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"task-locks-notices {self.server}", daemon=True
                )
                self._thread.start()

    def remove(self, lease: Renewable) -> None:
        key = (lease.name, int(getattr(lease, "fence", 0)))
        with self._guard:
            ref = self._leases.get(key)
            if ref is not None and ref() in (lease, None):
                del self._leases[key]

    def deliver(self, notice: Notice) -> bool:
        """Mark the lease ``notice`` is about lost; ``False`` if it is none of ours."""
        with self._guard:
            ref = self._leases.get((notice.name, notice.fence))
        lease = None if ref is None else ref()
        if lease is None:
            return False
        return bool(lease._release_noticed(notice.why))

    # -- the thread -----------------------------------------------------------------

    def _live(self) -> list[Any]:
        """The leases still listened for (dropping the collected ones); under the guard."""
        live, dead = [], []
        for key, ref in self._leases.items():
            lease = ref()
            if lease is None:
                dead.append(key)
            else:
                live.append(lease)
        for key in dead:
            del self._leases[key]
        return live

    def _run(self) -> None:
        mark_driver()  # on_lost callbacks go to the callback thread (or the lease's loop)
        stream: NoticeStream | None = None
        try:
            backend = self._backend()
            if backend is not None:  # (collected: its leases are gone with it)
                stream = backend.release_notices()
                del backend  # the leases keep it alive while it matters
                self._loop(stream)
        except BaseException:
            log.exception("the release-notice listener of %s failed; renewal goes on", self.server)
        finally:
            self.ready.clear()
            with self._guard:
                if self._thread is threading.current_thread():
                    self._thread = None
            if stream is not None:
                stream.close()

    def _loop(self, stream: NoticeStream) -> None:
        """Connect, read, deliver; reconnect after a failure; return once idle."""
        idle_since: float | None = None
        delay, connected, failed, opened = RETRY_FIRST, False, False, False
        live: list[Any] = []
        looked = -math.inf
        while True:
            now = time.monotonic()
            # Its leases at most once a read slice: an etcd watch streams every delete
            # under the prefix, and a busy prefix must not cost a pass over them each.
            if not connected or now - looked >= READ_SLICE:
                looked = now
                with self._guard:
                    live = self._live()
                    if live:
                        idle_since = None
                    else:
                        idle_since = idle_since or now
                        if now - idle_since >= IDLE_EXIT:
                            self._thread = None
                            return
            if retired(stream):  # its backend was closed: renewal alone from now on
                with self._guard:
                    self._leases.clear()
                    self._thread = None
                return
            if not connected:
                fences = [int(getattr(lease, "fence", 0)) for lease in live]
                try:
                    stream.open(min(fences) if fences else None)
                except BackendMisconfigured as exc:
                    # Not an outage: retrying would log this every few seconds, forever.
                    log.warning(
                        "release notices from %s are refused (%s); a force release is found "
                        "at the next renewal instead",
                        self.server,
                        exc,
                    )
                    with self._guard:
                        self.refused = str(exc)
                        self._thread = None
                    return
                except Exception as exc:
                    if not failed:
                        log.info(
                            "release notices from %s unavailable (%s); retrying", self.server, exc
                        )
                    failed = True
                    time.sleep(delay)
                    delay = min(RETRY_MAX, delay * 2)
                    continue
                if opened or failed:  # notices sent while away are gone: renew now instead
                    self.reconnects += 1
                    for lease in live:
                        _renew_soon(lease)
                delay, connected, failed, opened = RETRY_FIRST, True, False, True
                self.ready.set()
            live = []  # no strong reference across a read: a dropped lease stays collectable
            try:
                notices = stream.read(READ_SLICE)
            except Exception as exc:
                self.ready.clear()
                stream.close()
                connected = False
                with self._guard:
                    if not self._live() or retired(stream):  # no reconnect for nobody
                        self._leases.clear()
                        self._thread = None
                        return
                log.info("release notices from %s interrupted (%s); reconnecting", self.server, exc)
                continue
            for notice in notices:
                try:
                    self.deliver(notice)
                except Exception:
                    log.exception("a release notice for %r could not be applied", notice.name)


def _renew_soon(lease: Any) -> None:
    """Have ``lease`` renewed now (a renewal finds a loss no notice told us of)."""
    loop = getattr(lease, "_loop", None)
    if loop is None:
        lease._renew_soon()
        return
    try:  # an asyncio lane belongs to its loop
        loop.call_soon_threadsafe(lease._renew_soon)
    except RuntimeError:  # the loop is closed: its leases are not renewed any more
        pass


_listeners: dict[int, tuple[weakref.ref[Any], Listener]] = {}
#: Reentrant: a backend's weakref callback (:func:`_drop`) takes it, and may run in the
#: thread that holds it already (a garbage collection while a listener is being made).
#: With a plain lock that thread waited for itself for ever (seen: a 300 s hang).
_guard = threading.RLock()


def listener(backend: Backend, create: bool = True) -> Listener | None:
    """The listener of ``backend`` in this process (made if ``create``)."""
    key = id(backend)
    entry = _listeners.get(key)
    if entry is not None and entry[0]() is backend:
        return entry[1]
    if not create:
        return None
    with _guard:
        entry = _listeners.get(key)
        if entry is not None and entry[0]() is backend:
            return entry[1]
        made = Listener(backend)
        _listeners[key] = (weakref.ref(backend, functools.partial(_drop, key)), made)
        return made


def _drop(key: int, ref: weakref.ref[Any]) -> None:
    with _guard:
        entry = _listeners.get(key)
        if entry is not None and entry[0] is ref:
            del _listeners[key]


def listen(lease: Renewable) -> None:
    """Have ``lease`` marked lost as soon as its backend announces it freed by another."""
    backend = lease.backend
    if Capability.RELEASE_NOTICE in backend.capabilities:
        found = listener(backend)
        if found is not None:
            found.add(lease)


def forget(lease: Renewable) -> None:
    """``lease`` was released or lost: no notice is about it any more."""
    found = listener(lease.backend, create=False)
    if found is not None:
        found.remove(lease)


def _after_fork_in_child() -> None:
    """A forked child holds none of its parent's leases, and has none of its threads."""
    global _guard
    _listeners.clear()
    _guard = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)
