"""A lease's bookkeeping as plain logic: a clock and a scheduler are passed in.

Everything a lease decides after it was granted (its local deadline, when it is renewed
next, what a renewal's reply or failure means when other calls of the same lease are in
flight, when it is lost, which callbacks run) is here or in :class:`~task_locks.lock.
LeaseBase`, and none of it reads a clock, sleeps, starts a thread or calls a server. The
threads and asyncio tasks of :mod:`task_locks.watchdog` are thin drivers around it; the
deterministic simulator (``tests/sim``) drives the very same objects under virtual time.

The interface
-------------

- :class:`Clock`: ``monotonic()`` and ``time()``. :data:`SYSTEM_CLOCK` in production.
- :class:`LeaseRuntime`: where a lease lives: ``clock``, ``schedule(lease)`` (hand it to
  a renewal lane, return the lane), ``watch(lease)``/``unwatch(lease)`` (the deadline
  watch), ``run_callback(lease, fn)`` (a user callback, never on a lane or the watch:
  the drivers call :func:`mark_driver`, and a callback from there is deferred).
  :func:`use_runtime` installs one for the current context; every lock acquired in it
  (``Lock``, ``AsyncLock``, ``Semaphore``, ``Election``...) counts with its clock and is
  renewed, watched and called back by it. Without one, the process's threads do it
  (``watchdog.process_runtime()``).
- :class:`LeaseBook`: one lease's calls and deadline (owned by the lease, ``lease._book``).
- :class:`RenewalQueue`: one renewal lane's schedule, sans I/O. A driver loops:
  ``due = q.next_due()``; at ``due``: ``for backend, leases in q.take_due(now).items():``
  ``batch = q.start(backend, leases)``; send ``batch.items`` (timeout ``batch.timeout``);
  ``q.complete(batch, results)`` with the list of booleans or the exception.
- :class:`DeadlineHeap`: the deadline watch's heap, sans I/O: at ``next_deadline()``,
  ``for lease in heap.expired(now): lease._deadline_passed()``.

Both queues take ``wake``: called with a time whenever their earliest time moves earlier
(a driver sleeping until a later time must wake). A simulator runs a lease under a fake
clock like this (``FakeRuntime`` in tests/core/test_leasing.py is a complete one)::

    class SimRuntime:                    # a LeaseRuntime
        def __init__(self, clock):
            self.clock = clock           # monotonic(), time(): virtual
            self.queue = RenewalQueue(clock, wake=...)   # one lane (or one per backend)
            self.heap = DeadlineHeap(wake=...)
        def schedule(self, lease, asynchronous): self.queue.add(lease); return self
        def add(self, lease, due=None, earlier_only=False): self.queue.add(lease, due, earlier_only)
        def remove(self, lease): self.queue.remove(lease)
        def watch(self, lease): self.heap.add(lease)
        def unwatch(self, lease): self.heap.remove(lease)
        def run_callback(self, lease, fn): ...   # queue it; run it when the schedule says

    with use_runtime(SimRuntime(clock)):
        lease = Lock("a", ttl=3, backend=sim_backend).acquire(0)   # or step lock._plan()

The acquire's send time is read from the same clock (``LockBase._attempt``), so the lease
counts from virtual time. ``lease.renew(ttl)`` is, without its I/O:
``call = lease._begin_renew(ttl)``, then ``lease._finish_renew(call, ok, ttl is not None)``
or ``lease._renew_call_failed(call)``. A lane's batch: ``take_due``/``start``/``complete``
above. The watch: ``heap.expired(now)`` then ``lease._deadline_passed()`` for each.

Why the local deadline is never later than the server's expiry
---------------------------------------------------------------

Every call that sets the TTL (the acquire, each renewal: the watchdog's, or
``lease.renew(ttl=...)``) is a :class:`RenewCall` with its send time ``s`` and the TTL
``t`` it carries (``v = t - clock margin``). The server's expiry is ``a + t`` for the
call that *arrived last*, ``a`` its arrival, and ``a >= s``: so if call ``c`` arrived
last, the expiry is at least ``s_c + v_c``. The book keeps the calls that may still be
the last to arrive ("open" calls) and sets the deadline to the minimum of ``s + v`` over
them: whichever of them the server saw last, it keeps the lock at least that long.

A call is open from its send on (so a call in flight with a shorter TTL shortens the
deadline at once: it may reach the server any moment), and stays open until a *later*
call is granted: one whose send came after this call's reply or failure was seen. That
later call reached the server after this one did (this one's reply had left the server
before the later one was sent), so this one can no more be the last to arrive, and
dropping it is safe. Calls whose arrival order is unknown (two in flight together, in
either reply order) all stay, and the minimum takes the shortest. Which came "after" is
decided by the order of events in the book (a counter), not by clock readings, so equal
times under a coarse or virtual clock never let a call be dropped early.

So: ``renew(ttl=LONGER)`` raced by a watchdog renewal with the old TTL leaves the
deadline at the old TTL's, whichever reply comes first, until a renewal sent after both
replies is granted (it carries the new TTL). A failed call stays open (it may have
reached the server) until a later call is granted; and since its request may still
reach the server after any later call (a request the client gave up on, delayed on its
way), the lease counts every later call with the shortest TTL of a failed call from then
on: after a renewal of the old TTL timed out, ``renew(ttl=LONGER)`` extends the server's
expiry but not the local deadline (the late request would cut the expiry back to the
old TTL from its arrival). A failed call that carried the lease's TTL costs nothing.

The next renewal is due a third of the TTL after the send of the open call that gives
the soonest (``min(s + t/3)``), so a lease is renewed on the schedule of the TTL it counts
with (a failed ``renew(ttl=SHORTER)`` moves the next renewal earlier too). Only a call
answered (or failed) after the latest send counts from its own send; the others count
from the latest send: one still unanswered cannot be dropped by any renewal before its
answer, and one answered before the latest send is dropped by that call once granted.
Counted from their own sends, they kept the next renewal in the past, and the lane
renewed back to back (behind a ``renew()`` whose reply was lost, for its socket timeout;
or while a renewal sent after them was on its way).
"""

from __future__ import annotations

import contextlib
import contextvars
import heapq
import itertools
import math
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from . import events
from .errors import RenewalUndecided
from .types import RenewItem

if TYPE_CHECKING:
    from .backends.base import Backend

__all__ = [
    "SYSTEM_CLOCK",
    "Clock",
    "DeadlineHeap",
    "LeaseBook",
    "LeaseRuntime",
    "RenewBatch",
    "RenewCall",
    "Renewable",
    "RenewalQueue",
    "SystemClock",
    "current_runtime",
    "in_driver",
    "mark_driver",
    "report_dropped",
    "retry_delay",
    "use_runtime",
]

#: Leases due within this window are renewed together with the first due one.
BATCH_WINDOW = 0.25
#: The shortest timeout a renewal call is given (a lease with less left is as good as lost).
MIN_CALL_TIMEOUT = 0.01
#: A renewal granted after a round trip longer than this share of the lease's TTL is
#: reported ``renewal_late``: renewals go out a third of the TTL in, so such a reply
#: came with less than 5/12 of the TTL left, and a little more delay costs the lease.
RENEWAL_LATE_FRACTION = 0.25
#: A renewed lease that was garbage-collected while held is reported lost with this.
GC_REASON = "garbage-collected while held: renewal stopped, and it ends within its TTL"


class Clock(Protocol):
    """Where a lease reads the time: ``monotonic()`` for deadlines, ``time()`` for epochs."""

    def monotonic(self) -> float: ...
    def time(self) -> float: ...


class SystemClock:
    """The real clocks (``time.monotonic``, ``time.time``, looked up at each call)."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


SYSTEM_CLOCK: Clock = SystemClock()


def retry_delay(ttl: float) -> float:
    """How soon a renewal that could not reach the server is tried again."""
    return min(ttl / 10, 1.0)


# -- one lease -----------------------------------------------------------------------

#: Guards every book (their operations are a few list updates; one lock for all keeps
#: a lease as small as it was).
_book_guard = threading.Lock()
_events = itertools.count()


@dataclass(eq=False, slots=True)
class RenewCall:
    """One call that sets the lease's TTL on the server (the acquire, or a renewal)."""

    sent_at: float
    ttl: float
    #: ``ttl`` minus the backend's clock margin: what this call guarantees from its send.
    valid: float
    #: Order of the send among the book's events (see the module docstring).
    sent_seq: int = 0
    #: Order of the reply or failure, once seen (``None``: in flight).
    resolved_seq: int | None = None
    granted: bool = False

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl * 1000))


class LeaseBook:
    """The calls of one lease that may have set the server's expiry, and what follows.

    ``deadline``: the local deadline (monotonic), ``min(sent_at + valid)`` over the open
    calls; ``ttl``/``valid``: what the next call carries. No clock reads: the caller
    passes ``now``. Thread-safe.
    """

    __slots__ = (
        "_failed_ttl",
        "_failed_valid",
        "_open",
        "deadline",
        "hold_deadline",
        "ttl",
        "valid",
    )

    def __init__(
        self, ttl: float, valid: float, sent_at: float, hold_deadline: float | None = None
    ) -> None:
        self.ttl = ttl
        self.valid = valid
        self.hold_deadline = hold_deadline
        granted = RenewCall(sent_at, ttl, valid, next(_events), next(_events), True)
        self._open = [granted]
        self.deadline = sent_at + valid
        #: The shortest TTL (and validity) of a call that failed: its request may still
        #: land after any later call, so every later call counts with at most this.
        self._failed_ttl = self._failed_valid = math.inf

    def begin(self, now: float, ttl: float | None = None, valid: float | None = None) -> RenewCall:
        """A call is being sent at ``now`` (with a new ``ttl``/``valid`` if given, which
        every later call carries too). The deadline may move earlier, never later."""
        with _book_guard:
            if ttl is not None and valid is not None:
                self.ttl, self.valid = ttl, valid
            call = RenewCall(now, self.ttl, self.valid, next(_events))
            self._open.append(call)
            self.deadline = min(self.deadline, now + min(call.valid, self._failed_valid))
            return call

    def granted(self, call: RenewCall) -> float:
        """The server applied ``call``: drop the calls it supersedes; the new deadline."""
        with _book_guard:
            call.resolved_seq = next(_events)
            call.granted = True
            self._open = [
                c
                for c in self._open
                if c is call or c.resolved_seq is None or c.resolved_seq > call.sent_seq
            ]
            floor = self._failed_valid
            self.deadline = min(c.sent_at + min(c.valid, floor) for c in self._open)
            return self.deadline

    def failed(self, call: RenewCall) -> None:
        """No answer for ``call``: it may or may not have reached the server, now or later
        (it stays open; its TTL bounds every later call's)."""
        with _book_guard:
            call.resolved_seq = next(_events)
            self._failed_ttl = min(self._failed_ttl, call.ttl)
            self._failed_valid = min(self._failed_valid, call.valid)

    def next_renewal(self) -> float:
        """A third of the TTL after the send of the open call that gives the soonest,
        counted from the latest send for a call not answered since (see the module
        docstring), or the ``max_hold`` deadline if sooner."""
        with _book_guard:
            calls, ttl = self._open, self._failed_ttl
            if len(calls) == 1:  # the acquire alone (every lease at first): no search
                due = calls[0].sent_at + min(calls[0].ttl, ttl) / 3
                return due if self.hold_deadline is None else min(due, self.hold_deadline)
            latest = max(calls, key=_sent_seq)
            due = min(
                (c.sent_at if _answered_after(c, latest) else latest.sent_at) + min(c.ttl, ttl) / 3
                for c in calls
            )
        return due if self.hold_deadline is None else min(due, self.hold_deadline)

    def in_flight(self) -> int:
        with _book_guard:
            return sum(1 for c in self._open if c.resolved_seq is None)


def _sent_seq(call: RenewCall) -> int:
    return call.sent_seq


def _answered_after(call: RenewCall, latest: RenewCall) -> bool:
    return call.resolved_seq is not None and call.resolved_seq > latest.sent_seq


class Renewable(Protocol):
    """What the renewal queue and the deadline heap need from a lease (``LeaseBase``)."""

    name: str
    token: str
    backend: Backend
    _book: LeaseBook
    _released: bool
    #: ``False`` for the library's own records (``Owner.internal``): no events.
    _reported: bool

    @property
    def ttl(self) -> float: ...
    @property
    def lost(self) -> Any: ...
    @property
    def _expires_mono(self) -> float: ...
    @property
    def _hold_deadline(self) -> float | None: ...
    def _begin_call(self, now: float) -> RenewCall: ...
    def _renewed(self, call: RenewCall) -> bool: ...
    def _deadline_passed(self) -> None: ...
    def _renew_failed(self, call: RenewCall, error: BaseException, now: float) -> bool: ...
    def _mark_lost(self, reason: events.LostReason, message: str) -> None: ...
    def _renewal_refused(self) -> None: ...
    def _hold_expired(self, now: float) -> bool: ...


# -- one renewal lane ------------------------------------------------------------------


@dataclass(order=True, slots=True)
class _Entry:
    due: float
    seq: int
    #: A weak reference: a lease nobody can release any more must not be renewed forever
    #: (the "no TTL" mistake by another door). Its name and fence outlive it, for the warning.
    ref: weakref.ref[Renewable] = field(compare=False)
    key: int = field(compare=False)
    name: str = field(compare=False)
    fence: int | None = field(compare=False)
    cancelled: bool = field(default=False, compare=False)


@dataclass(slots=True)
class RenewBatch:
    """One renewal call of a lane: the leases, the call each is, what to send."""

    backend: Backend
    leases: list[Renewable]
    calls: list[RenewCall]
    items: list[RenewItem]
    sent_at: float
    #: The validity left to the first lease to expire: an answer after that is useless.
    timeout: float


def report_dropped(name: str, fence: int | None) -> None:
    """A renewed lease was garbage-collected while held: a `lost` this process will not
    see otherwise (logged once, by the events' logging subscriber)."""
    events.emit(
        events.Lost(
            name=name,
            fence=fence,
            reason=events.LostReason.DROPPED,
            message=f"{GC_REASON}; keep the lease and release() it (or use `with`)",
        )
    )


class RenewalQueue:
    """A lane's leases by next renewal time, and what a batch's answers mean. No I/O.

    ``clock`` gives ``now`` where the queue needs it; ``wake(when)`` is called when the
    earliest due time moved earlier (the driver must wake by then). Thread-safe.
    """

    def __init__(self, clock: Clock = SYSTEM_CLOCK, wake: Callable[[float], None] | None = None):
        self.clock = clock
        self.wake = wake
        self._heap: list[_Entry] = []
        self._entries: dict[int, _Entry] = {}
        self._seq = itertools.count()
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, lease: Renewable, due: float | None = None, earlier_only: bool = False) -> bool:
        """Schedule ``lease`` at ``due`` (default: its book's next renewal); ``True`` if it
        is now the earliest. ``earlier_only``: keep an earlier time it already has."""
        if due is None:
            due = lease._book.next_renewal()
        with self.lock:
            old = self._entries.get(id(lease))
            if old is not None:
                if earlier_only and old.due <= due:
                    return False
                old.cancelled = True
            entry = _Entry(
                due,
                next(self._seq),
                weakref.ref(lease),
                id(lease),
                lease.name,
                getattr(lease, "fence", None),
            )
            self._entries[id(lease)] = entry
            heapq.heappush(self._heap, entry)
            earliest = self._heap[0] is entry
        if earliest and self.wake is not None:
            self.wake(due)
        return earliest

    def remove(self, lease: Renewable) -> None:
        with self.lock:
            entry = self._entries.pop(id(lease), None)
            if entry is not None:
                entry.cancelled = True
                # Released leases stay in the heap until popped; compact when they
                # outnumber the live ones, so fast acquire/release loops stay small.
                if len(self._heap) > 64 and len(self._heap) > 2 * len(self._entries):
                    self._heap = [e for e in self._heap if not e.cancelled]
                    heapq.heapify(self._heap)

    def next_due(self) -> float | None:
        """When the earliest lease is due (``None``: nothing scheduled).

        From then on :meth:`take_due` returns at least that lease, so a driver that
        waits until this time never loops without work.
        """
        with self.lock:
            while self._heap and self._heap[0].cancelled:
                heapq.heappop(self._heap)
            return self._heap[0].due if self._heap else None

    def take_due(self, now: float) -> dict[Backend, list[Renewable]]:
        """Pop every lease due now (or within the batch window), grouped by backend.

        A lease that was garbage-collected while held is dropped here, with a warning: its
        lock ends within its TTL, as a dead holder's would.
        """
        batches: dict[Backend, list[Renewable]] = {}
        dropped: list[_Entry] = []
        with self.lock:
            while self._heap:
                top = self._heap[0]
                if top.cancelled:
                    heapq.heappop(self._heap)
                    continue
                if _ready_at(top) > now:
                    break
                heapq.heappop(self._heap)
                del self._entries[top.key]
                lease = top.ref()
                if lease is None:
                    dropped.append(top)
                else:
                    batches.setdefault(lease.backend, []).append(lease)
        for entry in dropped:
            report_dropped(entry.name, entry.fence)
        return batches

    def start(self, backend: Backend, leases: list[Renewable]) -> RenewBatch | None:
        """The call renewing ``leases`` now (``None``: none left to renew).

        Leases past their ``max_hold`` are marked lost (and released), lost ones dropped;
        each remaining lease records its call (:meth:`LeaseBook.begin`).
        """
        sent_at = self.clock.monotonic()
        keep = [x for x in leases if not x._hold_expired(sent_at) and not x.lost.is_set()]
        if not keep:
            return None
        calls = [lease._begin_call(sent_at) for lease in keep]
        items = [RenewItem(x.name, x.token, c.ttl_ms) for x, c in zip(keep, calls, strict=True)]
        timeout = max(MIN_CALL_TIMEOUT, min(x._expires_mono for x in keep) - sent_at)
        return RenewBatch(backend, keep, calls, items, sent_at, timeout)

    def complete(self, batch: RenewBatch, results: list[bool] | BaseException) -> list[Renewable]:
        """Record one batch's answers: reschedule the renewed, mark the lost, retry the
        rest. Returns the leases renewed."""
        now = self.clock.monotonic()
        took = now - batch.sent_at
        if batch.leases and not isinstance(results, BaseException):
            events.emit(
                events.Renewed(
                    name=batch.leases[0].name, backend=batch.backend.server, duration=took
                )
            )
        renewed: list[Renewable] = []
        for index, (lease, call) in enumerate(zip(batch.leases, batch.calls, strict=True)):
            outcome: bool | BaseException
            if isinstance(results, RenewalUndecided):  # decided lease by lease (Redlock)
                decided = results.outcomes[index]
                outcome = results if decided is None else decided
            elif isinstance(results, BaseException):
                outcome = results
            else:
                outcome = results[index]
            if outcome is True:
                if lease._renewed(call):
                    renewed.append(lease)
                    self.add(lease)
                    if lease._reported and took > RENEWAL_LATE_FRACTION * lease.ttl:
                        events.emit(
                            events.RenewalLate(
                                name=lease.name,
                                backend=batch.backend.server,
                                duration=took,
                                detail=f"{RENEWAL_LATE_FRACTION:.0%} of its {lease.ttl:g}s TTL",
                            )
                        )
            elif outcome is False:
                lease._renewal_refused()
            elif lease._renew_failed(call, outcome, now):
                self.add(lease, now + retry_delay(lease.ttl))
        return renewed

    def clear(self) -> None:
        with self.lock:
            self._heap.clear()
            self._entries.clear()


def _ready_at(entry: _Entry) -> float:
    # Leases due a little later ride along with an earlier batch (renewed a bit early);
    # a max_hold deadline is kept to the letter (taken early, it would be renewed again).
    lease = entry.ref()
    if lease is None:  # garbage-collected: take it out now
        return -math.inf
    hold = lease._hold_deadline
    if hold is not None and entry.due >= hold:
        return entry.due
    return entry.due - min(BATCH_WINDOW, lease.ttl / 10)


# -- the deadline watch -----------------------------------------------------------------


def _watched(lease: Renewable | None) -> bool:
    """Whether the deadline watch still has work with ``lease`` (alive, held, not lost)."""
    return lease is not None and not (lease._released or lease.lost._set)


class DeadlineHeap:
    """Leases by local deadline, for the watch that marks them lost there. No I/O.

    Each watched lease has one entry, at the deadline it had when pushed; when the entry
    comes up and the lease was renewed meanwhile, it is pushed again at its new deadline
    (renewals do not touch the heap). Released and lost leases leave at their turn. The
    heap holds weak references: it must not keep alive a lease its holder dropped.
    ``wake(when)``: called when the earliest deadline moved earlier. Thread-safe.
    """

    def __init__(self, wake: Callable[[float], None] | None = None) -> None:
        self.wake = wake
        self._heap: list[tuple[float, int, weakref.ref[Renewable]]] = []
        self._seq = itertools.count()
        self.lock = threading.Lock()
        self._done = 0  # entries of released or lost leases still in the heap

    def __len__(self) -> int:
        with self.lock:
            return len(self._heap)

    def add(self, lease: Renewable) -> None:
        with self.lock:
            ref = weakref.ref(lease)
            deadline = lease._expires_mono
            heapq.heappush(self._heap, (deadline, next(self._seq), ref))
            earliest = self._heap[0][2] is ref
        if earliest and self.wake is not None:
            self.wake(deadline)

    def remove(self, lease: Renewable) -> None:
        """``lease`` was released or lost: its entry is dropped at its turn, or sooner.

        Released leases would otherwise stay until their old deadline, so a fast
        acquire/release loop compacts the heap once they outnumber the live ones.
        """
        with self.lock:
            self._done += 1
            if len(self._heap) > 64 and 2 * self._done > len(self._heap):
                self._heap = [entry for entry in self._heap if _watched(entry[2]())]
                heapq.heapify(self._heap)
                self._done = 0

    def next_deadline(self) -> float | None:
        with self.lock:
            return self._heap[0][0] if self._heap else None

    def expired(self, now: float) -> list[Renewable]:
        """Pop the leases whose deadline has passed (the caller marks them lost)."""
        expired: list[Renewable] = []
        with self.lock:
            while self._heap and self._heap[0][0] <= now:
                _, _, ref = heapq.heappop(self._heap)
                lease = ref()
                if lease is None or not _watched(lease):
                    self._done = max(0, self._done - 1)
                    continue
                deadline = lease._expires_mono
                if deadline > now:  # renewed since: watch its new deadline
                    heapq.heappush(self._heap, (deadline, next(self._seq), ref))
                else:
                    expired.append(lease)
        return expired

    def clear(self) -> None:
        with self.lock:
            self._heap.clear()
            self._done = 0


# -- the runtime ------------------------------------------------------------------------


class LeaseRuntime(Protocol):
    """The clock and the scheduler leases run under (see the module docstring)."""

    clock: Clock

    def schedule(self, lease: Renewable, asynchronous: bool) -> Lane:
        """Hand ``lease`` to its renewal lane (and return the lane)."""

    def watch(self, lease: Renewable) -> None:
        """Have ``lease`` marked lost at its local deadline (again, if it moved earlier)."""

    def unwatch(self, lease: Renewable) -> None: ...

    def run_callback(self, lease: Renewable, callback: Callable[[], object]) -> None:
        """Run a user callback of ``lease``: never on a renewal lane or the watch
        (:func:`in_driver`), where a slow one would hold up every other lease."""


class Lane(Protocol):
    """Where a lease is renewed (``watchdog.ThreadLane``/``AsyncLane``, a simulated one)."""

    key: Hashable

    def add(self, lease: Renewable, due: float | None = None, earlier_only: bool = False) -> None:
        """(Re)schedule ``lease`` (default: its book's next renewal)."""

    def remove(self, lease: Renewable) -> None: ...
    def idle(self) -> bool: ...


_runtime: contextvars.ContextVar[LeaseRuntime | None] = contextvars.ContextVar(
    "task_locks_lease_runtime", default=None
)
_driving: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "task_locks_lease_driver", default=False
)


def mark_driver() -> None:
    """Say that the current thread (or task) is a driver: a renewal lane, the watch.

    A callback a lease runs from a driver is deferred (:meth:`LeaseRuntime.run_callback`
    must not run it there); one it runs from its holder's own call (``renew()``,
    ``check()``, ``release()``) may run right there, as it did before.
    """
    _driving.set(True)


def in_driver() -> bool:
    return _driving.get()


def current_runtime() -> LeaseRuntime | None:
    """The runtime installed by :func:`use_runtime` here (``None``: the process's)."""
    return _runtime.get()


@contextlib.contextmanager
def use_runtime(runtime: LeaseRuntime) -> Iterator[LeaseRuntime]:
    """Locks acquired inside count with ``runtime``'s clock and are renewed by it."""
    reset = _runtime.set(runtime)
    try:
        yield runtime
    finally:
        _runtime.reset(reset)
