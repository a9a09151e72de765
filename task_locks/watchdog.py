"""Renewal: one lane per backend (per primary on Redis Cluster), and a deadline watch.

Every live lease is renewed at about a third of its TTL. All leases of a lane that are
due together go to :meth:`Backend.renew_many` in one call (one pipelined round trip on
Redis), so 10,000 leases cost one thread and a few round trips per round, not 10,000
threads. A renewal that finds the token gone marks the lease lost; one that cannot reach
the server is retried until the lease would have expired, and then the lease is lost.
Renewal never re-acquires.

Lanes are independent: each has its own schedule, its own thread (or task, per event
loop) and its own call timeout, so a stalled server (or one stalled cluster primary)
delays only its own leases' renewals. A lane's thread starts with its first lease and
exits when idle. Each renewal call is given a timeout shorter than the validity left to
the leases it carries.

The :class:`DeadlineWatch` (one thread per process, a heap of deadlines) marks a lease
lost at its local deadline, whatever renewal call is still in flight: behind a
blackholed link the call only returns at its socket timeout, which may be long after the
server let the lock go. A reply that comes after the deadline does not bring the lease
back (``_renewed`` refuses it).

The bookkeeping (:class:`Schedule`) has no I/O; the thread and asyncio lanes only differ
in how they wait and how they call the backend.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import inspect
import itertools
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from . import events
from .errors import RenewalUndecided
from .types import RenewItem

if TYPE_CHECKING:
    from .backends.base import Backend

log = logging.getLogger("task_locks.watchdog")

#: Leases due within this window are renewed together with the first due one.
BATCH_WINDOW = 0.25
#: A lane's thread (and the deadline watch) exits after this long with nothing to do.
IDLE_EXIT = 5.0
#: A renewal granted after a round trip longer than this share of the lease's TTL is
#: reported ``renewal_late``: renewals go out a third of the TTL in, so such a reply
#: came with less than 5/12 of the TTL left, and a little more delay costs the lease.
RENEWAL_LATE_FRACTION = 0.25
#: A renewed lease that was garbage-collected while held is reported lost with this.
GC_REASON = "garbage-collected while held: renewal stopped, and it ends within its TTL"
#: The shortest timeout a renewal call is given (a lease with less left is as good as lost).
MIN_CALL_TIMEOUT = 0.01


class Renewable(Protocol):
    """What the schedule needs from a lease (implemented by ``LeaseBase``)."""

    name: str
    token: str
    ttl: float
    backend: Backend
    _hold_deadline: float | None
    _expires_mono: float
    _released: bool
    #: ``False`` for the library's own records (``Owner.internal``): no events.
    _reported: bool

    @property
    def lost(self) -> Any: ...
    def _renewed(self, sent_at: float) -> bool: ...
    def _deadline_passed(self) -> None: ...
    def _renew_failed(self, now: float, error: BaseException) -> bool: ...
    def _mark_lost(self, reason: events.LostReason, message: str) -> None: ...
    def _renewal_refused(self) -> None: ...
    def _hold_expired(self, now: float) -> bool: ...


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


class Schedule:
    """A heap of leases by next renewal time. Thread-safe; no I/O."""

    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._entries: dict[int, _Entry] = {}
        self._seq = itertools.count()
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, lease: Renewable, due: float) -> bool:
        """Schedule ``lease``; ``True`` if it is now the earliest (the driver must wake)."""
        with self.lock:
            old = self._entries.pop(id(lease), None)
            if old is not None:
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
            return self._heap[0] is entry

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
        for entry in dropped:  # a `lost` this process will not see otherwise (logged once)
            events.emit(
                events.Lost(
                    name=entry.name,
                    fence=entry.fence,
                    reason=events.LostReason.DROPPED,
                    message=f"{GC_REASON}; keep the lease and release() it (or use `with`)",
                )
            )
        return batches

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


def next_renewal(lease: Renewable, base: float) -> float:
    """When to look at ``lease`` next: a third of its TTL on, or its ``max_hold`` if sooner."""
    due = base + lease.ttl / 3
    hold = lease._hold_deadline
    return due if hold is None else min(due, hold)


def split_batch(leases: list[Renewable], now: float) -> tuple[list[Renewable], list[RenewItem]]:
    """Drop leases past their ``max_hold`` (marked lost) or their deadline; the rest become
    renew items."""
    keep = [lease for lease in leases if not lease._hold_expired(now) and not lease.lost.is_set()]
    return keep, [RenewItem(x.name, x.token, max(1, int(x.ttl * 1000))) for x in keep]


def call_timeout(leases: list[Renewable], sent_at: float) -> float:
    """The timeout of one renewal call: the validity left to the first lease to expire.

    An answer after that is useless (the deadline watch has marked the lease lost, and
    ``_renewed`` refuses late answers), and waiting longer only delays the lane's retry.
    """
    return max(MIN_CALL_TIMEOUT, min(lease._expires_mono for lease in leases) - sent_at)


@functools.cache
def _takes_timeout(backend_class: type, method: str) -> bool:
    """Whether a backend's ``renew_many`` takes ``timeout`` (backends written before it
    was added do not: they are called without it)."""
    return "timeout" in inspect.signature(getattr(backend_class, method)).parameters


def apply_results(
    schedule: Schedule,
    leases: list[Renewable],
    results: list[bool] | BaseException,
    sent_at: float,
) -> None:
    """Record one batch's answers: reschedule the renewed, mark the lost, retry the rest."""
    now = time.monotonic()
    if leases and not isinstance(results, BaseException):
        events.emit(
            events.Renewed(
                name=leases[0].name, backend=leases[0].backend.server, duration=now - sent_at
            )
        )
    for index, lease in enumerate(leases):
        outcome = results if isinstance(results, BaseException) else results[index]
        if isinstance(results, RenewalUndecided):  # decided lease by lease (Redlock)
            decided = results.outcomes[index]
            outcome = results if decided is None else decided
        if outcome is True:
            if lease._renewed(sent_at):
                schedule.add(lease, next_renewal(lease, sent_at))
                if lease._reported and now - sent_at > RENEWAL_LATE_FRACTION * lease.ttl:
                    events.emit(
                        events.RenewalLate(
                            name=lease.name,
                            backend=lease.backend.server,
                            duration=now - sent_at,
                            detail=f"{RENEWAL_LATE_FRACTION:.0%} of its {lease.ttl:g}s TTL",
                        )
                    )
        elif outcome is False:
            lease._renewal_refused()
        elif lease._renew_failed(now, outcome):
            schedule.add(lease, now + min(lease.ttl / 10, 1.0))


class Lane(Protocol):
    """Where a lease is renewed: :class:`ThreadLane` or :class:`AsyncLane`."""

    schedule: Schedule

    def add(self, lease: Renewable) -> None: ...
    def remove(self, lease: Renewable) -> None: ...
    def idle(self) -> bool: ...


class ThreadLane:
    """The renewal thread (daemon) of one lane; started on demand, exits when idle."""

    def __init__(self, key: Hashable = None, label: str = "") -> None:
        self.key = key
        self.label = label
        self.schedule = Schedule()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        # When the sleeping thread wakes on its own; add() wakes it only for an earlier
        # lease, so a busy acquire/release loop never pays for a thread switch.
        self._wake_at = -math.inf
        #: Clear while a renewal call is in flight (see :meth:`quiet`).
        self._between_calls = threading.Event()
        self._between_calls.set()

    def add(self, lease: Renewable) -> None:
        due = next_renewal(lease, time.monotonic())
        self.schedule.add(lease, due)
        with self._cond:
            if self._thread is None:  # _run() clears it, under this lock, as it exits
                self._thread = threading.Thread(
                    target=self._run, name=f"task-locks-renewer {self.label}", daemon=True
                )
                self._wake_at = -math.inf
                self._thread.start()
            elif due < self._wake_at:
                self._cond.notify()

    def remove(self, lease: Renewable) -> None:
        self.schedule.remove(lease)

    def idle(self) -> bool:
        """No lease, no thread: nothing is lost by forgetting this lane."""
        return self._thread is None and not len(self.schedule)

    def quiet(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) until no renewal call of this lane is in flight."""
        return self._between_calls.wait(timeout)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            log.exception("a renewal thread failed; the next acquire starts a new one")
            raise
        finally:
            with self._cond:
                if self._thread is threading.current_thread():
                    self._thread = None

    def _loop(self) -> None:
        idle_since: float | None = None
        while True:
            # Reading the schedule and going to sleep happen under the condition, so an
            # add() in between cannot be missed.
            with self._cond:
                now = time.monotonic()
                due = self.schedule.next_due()
                if due is None:
                    idle_since = idle_since or now
                    if now - idle_since >= IDLE_EXIT:
                        self._thread = None
                        return
                    self._wake_at = now + IDLE_EXIT
                    self._cond.wait(IDLE_EXIT)
                    continue
                idle_since = None
                if due > now:
                    self._wake_at = due
                    self._cond.wait(due - now)
                    continue
                self._wake_at = -math.inf  # busy: the loop looks again before sleeping
                self._between_calls.clear()
            try:
                for backend, leases in self.schedule.take_due(now).items():
                    self._renew(backend, leases)
            finally:
                self._between_calls.set()

    def _renew(self, backend: Backend, leases: list[Renewable]) -> None:
        sent_at = time.monotonic()
        leases, items = split_batch(leases, sent_at)
        if not items:
            return
        results: list[bool] | BaseException
        try:
            timeout = call_timeout(leases, sent_at)
            if _takes_timeout(type(backend), "renew_many"):
                results = backend.renew_many(items, timeout=timeout)
            else:
                results = backend.renew_many(items)
        except Exception as exc:  # a batch that failed as a whole is retried per lease
            results = exc
        apply_results(self.schedule, leases, results, sent_at)


class _Lanes:
    """The lanes of one renewer, keyed by backend and the backend's lane for the name."""

    def __init__(self, make: Callable[[Hashable, str], Any]) -> None:
        self._make = make
        self._lanes: dict[tuple[int, Hashable], Any] = {}
        self._guard = threading.Lock()

    def get(self, lease: Renewable, asynchronous: bool) -> Any:
        backend = lease.backend
        part = backend.renewal_lane(lease.name, asynchronous=asynchronous)
        key = (id(backend), part)
        lane = self._lanes.get(key)
        if lane is None:
            with self._guard:
                lane = self._lanes.get(key)
                if lane is None:
                    # Lanes of backends gone (closed, collected: ids get reused) must not
                    # pile up: idle ones are dropped as new ones come. A lane dropped
                    # while a lease is being added to it still works, only alone.
                    for old_key in [k for k, v in self._lanes.items() if v.idle()]:
                        del self._lanes[old_key]
                    label = f"{backend.server} #{id(backend):x}"
                    label += "" if part is None else f" {part}"
                    lane = self._lanes[key] = self._make(key, label)
        return lane

    def all(self) -> list[Any]:
        with self._guard:
            return list(self._lanes.values())

    # ``renewer.schedule`` reads as one schedule over every lane (tests, diagnostics).
    def __len__(self) -> int:
        return sum(len(lane.schedule) for lane in self.all())

    def clear(self) -> None:
        for lane in self.all():
            lane.schedule.clear()


class ThreadRenewer:
    """The process's renewal lanes for :class:`~task_locks.Lock` leases."""

    def __init__(self) -> None:
        self.lanes = _Lanes(ThreadLane)

    @property
    def schedule(self) -> _Lanes:
        return self.lanes

    def add(self, lease: Renewable) -> ThreadLane:
        lane: ThreadLane = self.lanes.get(lease, asynchronous=False)
        lane.add(lease)
        return lane

    def quiet(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` in all) until no lane has a renewal call in flight.

        For a process about to exit: at interpreter shutdown a daemon thread is frozen
        wherever it stands, and one frozen inside the client library (holding its
        connection pool's lock) deadlocks the shutdown's own cleanup of that client.
        """
        deadline = time.monotonic() + timeout
        return all(lane.quiet(max(0.0, deadline - time.monotonic())) for lane in self.lanes.all())


class AsyncLane:
    """The renewal task of one lane in one event loop."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, key: Hashable = None, label: str = ""
    ) -> None:
        self.key = key
        self.label = label
        self.schedule = Schedule()
        self._loop = loop
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._pid = os.getpid()

    def add(self, lease: Renewable) -> None:
        earliest = self.schedule.add(lease, next_renewal(lease, time.monotonic()))
        if self._task is None or self._task.done():
            self._task = self._loop.create_task(
                self._run(), name=f"task-locks-renewer {self.label}"
            )
        elif earliest:
            self._wake.set()

    def remove(self, lease: Renewable) -> None:
        self.schedule.remove(lease)

    def idle(self) -> bool:
        return (self._task is None or self._task.done()) and not len(self.schedule)

    async def _run(self) -> None:
        while True:
            due = self.schedule.next_due()
            if due is None or os.getpid() != self._pid:  # idle, or a forked child's copy
                return
            now = time.monotonic()
            if due > now:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), due - now)
                except TimeoutError:
                    pass
                continue
            for backend, leases in self.schedule.take_due(now).items():
                sent_at = time.monotonic()
                leases, items = split_batch(leases, sent_at)
                if not items:
                    continue
                timeout = call_timeout(leases, sent_at)
                results: list[bool] | BaseException
                try:
                    # wait_for bounds any backend's call; the backend may bound it too.
                    call = (
                        backend.arenew_many(items, timeout=timeout)
                        if _takes_timeout(type(backend), "arenew_many")
                        else backend.arenew_many(items)
                    )
                    results = await asyncio.wait_for(call, timeout)
                except Exception as exc:
                    results = exc
                apply_results(self.schedule, leases, results, sent_at)


class AsyncRenewer:
    """The renewal lanes of one event loop, for :class:`~task_locks.AsyncLock` leases."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.lanes = _Lanes(lambda key, label: AsyncLane(loop, key, label))

    @property
    def schedule(self) -> _Lanes:
        return self.lanes

    def add(self, lease: Renewable) -> AsyncLane:
        lane: AsyncLane = self.lanes.get(lease, asynchronous=True)
        lane.add(lease)
        return lane


def _watched(lease: Renewable | None) -> bool:
    """Whether the deadline watch still has work with ``lease`` (alive, held, not lost)."""
    return lease is not None and not (lease._released or lease.lost._set)


class DeadlineWatch:
    """Marks leases lost at their local deadline: one thread per process, a heap.

    Each watched lease has one entry, at the deadline it had when pushed; when the entry
    comes up and the lease was renewed meanwhile, it is pushed again at its new deadline
    (renewals do not touch the heap). Released and lost leases leave at their turn. The
    heap holds weak references: it must not keep alive a lease its holder dropped.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, weakref.ref[Renewable]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._done = 0  # entries of released or lost leases still in the heap

    def __len__(self) -> int:
        with self._cond:
            return len(self._heap)

    def add(self, lease: Renewable) -> None:
        with self._cond:
            ref = weakref.ref(lease)
            heapq.heappush(self._heap, (lease._expires_mono, next(self._seq), ref))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="task-locks-deadlines", daemon=True
                )
                self._thread.start()
            elif self._heap[0][2] is ref:
                self._cond.notify()

    def remove(self, lease: Renewable) -> None:
        """``lease`` was released or lost: its entry is dropped at its turn, or sooner.

        Released leases would otherwise stay until their old deadline, so a fast
        acquire/release loop compacts the heap once they outnumber the live ones.
        """
        with self._cond:
            self._done += 1
            if len(self._heap) > 64 and 2 * self._done > len(self._heap):
                self._heap = [entry for entry in self._heap if _watched(entry[2]())]
                heapq.heapify(self._heap)
                self._done = 0

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            log.exception("the deadline watch failed; the next acquire starts a new one")
            raise
        finally:
            with self._cond:
                if self._thread is threading.current_thread():
                    self._thread = None

    def _loop(self) -> None:
        idle_since: float | None = None
        while True:
            expired: list[Renewable] = []
            with self._cond:
                now = time.monotonic()
                if not self._heap:
                    idle_since = idle_since or now
                    if now - idle_since >= IDLE_EXIT:
                        self._thread = None
                        return
                    self._cond.wait(IDLE_EXIT)
                    continue
                idle_since = None
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
                if not expired:
                    if self._heap:
                        self._cond.wait(max(0.0, self._heap[0][0] - now))
                    continue
            for lease in expired:  # outside the lock: callbacks may acquire again
                try:
                    lease._deadline_passed()
                except Exception:
                    log.exception("marking lock %r lost at its deadline failed", lease.name)


_thread_renewer: ThreadRenewer | None = None
_deadline_watch: DeadlineWatch | None = None
_async_renewers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncRenewer] = (
    weakref.WeakKeyDictionary()
)
_guard = threading.Lock()


def thread_renewer() -> ThreadRenewer:
    global _thread_renewer
    renewer = _thread_renewer
    if renewer is None:
        with _guard:
            if _thread_renewer is None:
                _thread_renewer = ThreadRenewer()
            renewer = _thread_renewer
    return renewer


def deadline_watch() -> DeadlineWatch:
    global _deadline_watch
    watch = _deadline_watch
    if watch is None:
        with _guard:
            if _deadline_watch is None:
                _deadline_watch = DeadlineWatch()
            watch = _deadline_watch
    return watch


def async_renewer() -> AsyncRenewer:
    loop = asyncio.get_running_loop()
    renewer = _async_renewers.get(loop)
    if renewer is None:
        renewer = _async_renewers[loop] = AsyncRenewer(loop)
    return renewer


def _after_fork_in_child() -> None:
    """A forked child holds none of its parent's leases: forget them, never renew them.

    The parent's renewal threads and deadline watch do not exist in the child. Renewal
    tasks do (when the fork happened inside a running event loop): they stop at their
    next wake-up (they check the pid), and their lanes are forgotten.
    """
    global _thread_renewer, _deadline_watch, _guard
    _thread_renewer = None
    _deadline_watch = None
    for renewer in list(_async_renewers.values()):
        for lane in list(renewer.lanes._lanes.values()):
            lane.schedule = Schedule()  # a fresh one: the old lock may be held by a dead thread
    _async_renewers.clear()
    _guard = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)

OnLost = Callable[..., object]
