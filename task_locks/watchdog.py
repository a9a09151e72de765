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
the leases it carries, and runs beside the lane, not on it: a call whose reply was lost
waits that long, and the lane meanwhile renews its other leases (a shorter TTL, one
acquired since) on time. At most :data:`MAX_CALLS_IN_FLIGHT` calls of a lane are out.

The :class:`DeadlineWatch` (one thread per process, a heap of deadlines) marks a lease
lost at its local deadline, whatever renewal call is still in flight: behind a
blackholed link the call only returns at its socket timeout, which may be long after the
server let the lock go. A reply that comes after the deadline does not bring the lease
back (``_renewed`` refuses it).

User callbacks (``on_lost``) run on the :class:`CallbackThread` (or, for an asyncio
lease, on its event loop), never on a lane or the watch: a slow one (an alert over HTTP,
a re-acquire) must not hold up the renewals of every other lease.

Everything here is a thin driver: the decisions (schedule, batches, deadlines, what an
answer means) are :mod:`task_locks.leasing`'s, with no I/O, which the simulator drives
under virtual time. :class:`ProcessRuntime` is the process's ``LeaseRuntime``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from . import notices
from .leasing import (
    GC_REASON as GC_REASON,
)
from .leasing import (
    RENEWAL_LATE_FRACTION as RENEWAL_LATE_FRACTION,
)
from .leasing import (
    SYSTEM_CLOCK,
    DeadlineHeap,
    Lane,
    Renewable,
    RenewalQueue,
    RenewBatch,
    in_driver,
    mark_driver,
    report_dropped,
)

if TYPE_CHECKING:
    from .backends.base import Backend

__all__ = [
    "AsyncLane",
    "AsyncRenewer",
    "CallbackThread",
    "DeadlineWatch",
    "Lane",
    "ProcessRuntime",
    "ThreadLane",
    "ThreadRenewer",
    "async_renewer",
    "callback_thread",
    "deadline_watch",
    "process_runtime",
    "thread_renewer",
]

log = logging.getLogger("task_locks.watchdog")

#: A lane's thread (and the deadline watch, and the callback thread) exits after this
#: long with nothing to do.
IDLE_EXIT = 5.0
#: The deadline watch looks at the leases offered to it (:class:`_Pending`) at least this
#: often while it watches any: a lease whose first renewal is due later (a TTL of 3 s or
#: more) costs no registration at acquire, and none at all if released before the look.
LOOK_EVERY = 1.0
#: User callbacks waiting for the callback thread, at most (more are dropped, logged).
CALLBACK_QUEUE = 10_000

#: Renewal calls one lane has in flight at once, at most (beyond: a server answering
#: nothing), after which the lane waits for one to end before it sends another.
MAX_CALLS_IN_FLIGHT = 8

#: Kept for callers of the old name: a lane's schedule is a :class:`RenewalQueue`.
Schedule = RenewalQueue


@functools.cache
def _takes_timeout(backend_class: type, method: str) -> bool:
    """Whether a backend's ``renew_many`` takes ``timeout`` (backends written before it
    was added do not: they are called without it)."""
    return "timeout" in inspect.signature(getattr(backend_class, method)).parameters


def _send(batch: RenewBatch) -> list[bool] | BaseException:
    """The I/O of one batch, on the calling thread; an error is the batch's answer."""
    backend = batch.backend
    try:
        if _takes_timeout(type(backend), "renew_many"):
            return backend.renew_many(batch.items, timeout=batch.timeout)
        return backend.renew_many(batch.items)
    except Exception as exc:  # a batch that failed as a whole is retried per lease
        return exc


async def _asend(batch: RenewBatch) -> list[bool] | BaseException:
    backend = batch.backend
    try:
        # wait_for bounds any backend's call; the backend may bound it too.
        call = (
            backend.arenew_many(batch.items, timeout=batch.timeout)
            if _takes_timeout(type(backend), "arenew_many")
            else backend.arenew_many(batch.items)
        )
        return await asyncio.wait_for(call, batch.timeout)
    except Exception as exc:
        return exc


class _IdleExitThread:
    """A daemon thread started on demand that exits once it had nothing to do for
    :data:`IDLE_EXIT`: the renewal lane's and the deadline watch's, written once so that
    both start, fail and exit by the same rules. It forgets itself under ``_cond`` as it
    exits, so an ``add()`` either finds it still running or starts a new one."""

    #: What the thread is, for its failure's log line.
    _what: str

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._thread_name = name
        self._idle_since: float | None = None
        # When the sleeping thread wakes on its own: a new entry wakes it only if due
        # before this, so a busy acquire/release loop never pays for a thread switch.
        self._wake_at = -math.inf
        #: How many times the thread woke from a sleep (its timer, or an entry due
        #: earlier): the benchmark counts them per acquire/release cycle.
        self.wakeups = 0

    def _start(self) -> bool:
        """Start the thread unless it runs; ``True`` if this call started it."""
        with self._cond:
            if self._thread is not None:
                return False
            self._idle_since = None
            self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
            self._thread.start()
            return True

    def _run(self) -> None:
        mark_driver()
        try:
            self._loop()
        except BaseException:
            log.exception("%s failed; the next acquire starts a new one", self._what)
            raise
        finally:
            with self._cond:
                if self._thread is threading.current_thread():
                    self._thread = None

    def _loop(self) -> None:
        raise NotImplementedError

    def _sleep(self, now: float, until: float) -> None:
        """Wait on ``_cond`` (held) until ``until``, or until woken (:meth:`_wake_for`)."""
        self._wake_at = until
        self._cond.wait(max(0.0, until - now))
        # Awake, it promises nothing until it sleeps again (see _Pending).
        self._wake_at = -math.inf
        self.wakeups += 1

    def _wake_for(self, due: float) -> None:
        """Something is due at ``due``: wake the sleeping thread only if it would sleep
        past it. A thread not asleep reads its queue (under ``_cond``) before it sleeps."""
        with self._cond:
            if self._thread is not None and due < self._wake_at:
                self._cond.notify()

    def _idle(self, now: float, busy: bool = False) -> bool:
        """Nothing is due (``_cond`` held): ``True`` once idle for :data:`IDLE_EXIT` and not
        ``busy``, the thread then forgotten (it must return); else it sleeps that long."""
        self._idle_since = self._idle_since or now
        if now - self._idle_since >= IDLE_EXIT and not busy:
            self._thread = None
            return True
        self._sleep(now, now + IDLE_EXIT)
        return False


class ThreadLane(_IdleExitThread):
    """The renewal thread (daemon) of one lane; started on demand, exits when idle."""

    _what = "a renewal thread"

    def __init__(self, key: Hashable = None, label: str = "") -> None:
        self.key = key
        self.label = label
        super().__init__(f"task-locks-renewer {label}")
        self.schedule = RenewalQueue(SYSTEM_CLOCK, wake=self._wake_for)
        #: Clear while a renewal call is in flight (see :meth:`quiet`).
        self._between_calls = threading.Event()
        self._between_calls.set()
        self._in_flight = 0  # calls out (under _cond)

    def add(self, lease: Renewable, due: float | None = None, earlier_only: bool = False) -> None:
        _pending.take(lease, renewal=True)  # scheduled here now, not by the watch's look
        self._add(lease, due, earlier_only)

    def _add(self, lease: Renewable, due: float | None = None, earlier_only: bool = False) -> None:
        self.schedule.add(lease, due, earlier_only)
        with self._cond:
            if self._start():
                self._wake_at = -math.inf

    def remove(self, lease: Renewable) -> None:
        if not _pending.take(lease, renewal=True):
            self.schedule.remove(lease)

    @property
    def thread(self) -> threading.Thread | None:
        """The lane's renewal thread while it runs (``None`` once idle): whose CPU time a
        benchmark reads."""
        return self._thread

    def idle(self) -> bool:
        """No lease, no thread: nothing is lost by forgetting this lane."""
        return self._thread is None and not len(self.schedule)

    def quiet(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) until no renewal call of this lane is in flight."""
        return self._between_calls.wait(timeout)

    def _loop(self) -> None:
        while True:
            # Reading the schedule and going to sleep happen under the condition, so an
            # add() in between cannot be missed.
            with self._cond:
                now = time.monotonic()
                due = self.schedule.next_due()
                if due is None:
                    if self._idle(now, busy=self._in_flight > 0):
                        return
                    continue
                self._idle_since = None
                if due > now:
                    self._sleep(now, due)
                    continue
                self._wake_at = -math.inf  # busy: the loop looks again before sleeping
            for backend, leases in self.schedule.take_due(now).items():
                batch = self.schedule.start(backend, leases)
                if batch is not None:
                    self._call(batch)

    def _renew(self, backend: Backend, leases: list[Renewable]) -> None:
        """One renewal call of ``leases`` (due now) on this thread, its answers applied."""
        batch = self.schedule.start(backend, leases)
        if batch is not None:
            self.schedule.complete(batch, _send(batch))

    def _call(self, batch: RenewBatch) -> None:
        """Send ``batch`` from a thread of its own: the lane does not wait for it."""
        with self._cond:
            while self._in_flight >= MAX_CALLS_IN_FLIGHT:
                self._cond.wait()
            self._in_flight += 1
            self._between_calls.clear()
        threading.Thread(
            target=self._answer, args=(batch,), name=f"task-locks-renewal {self.label}", daemon=True
        ).start()

    def _answer(self, batch: RenewBatch) -> None:
        mark_driver()
        try:
            self.schedule.complete(batch, _send(batch))
        except Exception:
            log.exception("applying a renewal's answer failed")
        finally:
            with self._cond:
                self._in_flight -= 1
                if not self._in_flight:
                    self._between_calls.set()
                self._cond.notify_all()


LaneT = TypeVar("LaneT", "ThreadLane", "AsyncLane")


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


class _Renewer(Generic[LaneT]):
    """What both renewers do with their lanes, written once: a lease goes to the lane of
    its backend and of the backend's lane for its name (sync and asyncio lanes apart)."""

    _asynchronous: bool

    def __init__(self, make: Callable[[Hashable, str], LaneT]) -> None:
        self.lanes = _Lanes(make)

    @property
    def schedule(self) -> _Lanes:
        return self.lanes

    def add(self, lease: Renewable) -> LaneT:
        lane: LaneT = self.lanes.get(lease, asynchronous=self._asynchronous)
        lane.add(lease)
        return lane


class ThreadRenewer(_Renewer[ThreadLane]):
    """The process's renewal lanes for :class:`~task_locks.Lock` leases."""

    _asynchronous = False

    def __init__(self) -> None:
        super().__init__(ThreadLane)

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
        self.schedule = RenewalQueue(SYSTEM_CLOCK, wake=self._woken)
        self._loop = loop
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._calls: set[asyncio.Task[None]] = set()  # renewal calls in flight
        self._pid = os.getpid()

    def add(self, lease: Renewable, due: float | None = None, earlier_only: bool = False) -> None:
        self.schedule.add(lease, due, earlier_only)
        self._start()

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = self._loop.create_task(
                self._run(), name=f"task-locks-renewer {self.label}"
            )

    def _woken(self, due: float) -> None:
        if self._task is not None and not self._task.done():
            self._wake.set()

    def remove(self, lease: Renewable) -> None:
        self.schedule.remove(lease)

    def idle(self) -> bool:
        return (
            (self._task is None or self._task.done()) and not len(self.schedule) and not self._calls
        )

    async def _run(self) -> None:
        mark_driver()  # this task's context only
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
                batch = self.schedule.start(backend, leases)
                if batch is not None:  # a task of its own: the lane does not wait for it
                    call = self._loop.create_task(self._answer(batch))
                    self._calls.add(call)
                    call.add_done_callback(self._calls.discard)

    async def _answer(self, batch: RenewBatch) -> None:
        try:
            self.schedule.complete(batch, await _asend(batch))
        except Exception:
            log.exception("applying a renewal's answer failed")
        if len(self.schedule) and os.getpid() == self._pid:
            self._start()  # the lane's task may have ended while this call was out


class AsyncRenewer(_Renewer[AsyncLane]):
    """The renewal lanes of one event loop, for :class:`~task_locks.AsyncLock` leases."""

    _asynchronous = True

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        super().__init__(lambda key, label: AsyncLane(loop, key, label))


class DeadlineWatch(_IdleExitThread):
    """Marks leases lost at their local deadline: one thread per process, around a
    :class:`~task_locks.leasing.DeadlineHeap`."""

    _what = "the deadline watch"

    def __init__(self) -> None:
        super().__init__("task-locks-deadlines")
        self.heap = DeadlineHeap(wake=self._wake_for)

    def __len__(self) -> int:
        return len(self.heap)

    def add(self, lease: Renewable) -> None:
        self.heap.add(lease)
        with self._cond:
            if self._start():
                self._wake_at = -math.inf

    def remove(self, lease: Renewable) -> None:
        self.heap.remove(lease)

    def _loop(self) -> None:
        while True:
            with self._cond:
                # Leases offered since the last look go to the heap and their lanes now,
                # before the thread decides how long to sleep (or to exit).
                _pending.hand_over(self.heap)
                now = time.monotonic()
                if self.heap.next_deadline() is None:
                    if self._idle(now):
                        return
                    continue
                self._idle_since = None
                expired = self.heap.expired(now)
                if not expired:
                    deadline = self.heap.next_deadline()
                    if deadline is not None:
                        # Looking at least every LOOK_EVERY while it watches anything, it
                        # can take offers of leases needed from then on (_Pending).
                        self._sleep(now, min(deadline, now + LOOK_EVERY))
                    continue
            for lease in expired:  # outside the lock: marking lost takes other locks
                try:
                    lease._deadline_passed()
                except Exception:
                    log.exception("marking lock %r lost at its deadline failed", lease.name)


class _Offer:
    """One lease :class:`_Pending` holds: what the watch's next look hands on for it."""

    __slots__ = ("fence", "lane", "name", "ref", "watched")

    def __init__(self, lease: Renewable) -> None:
        self.ref = weakref.ref(lease)
        self.name = lease.name
        self.fence: int | None = getattr(lease, "fence", None)
        #: The lane that renews it, until the look hands it there.
        self.lane: ThreadLane | None = None
        #: Whether the look puts it on the deadline heap.
        self.watched = False


class _Pending:
    """Leases offered to the deadline watch's next look instead of registered at once.

    Putting a lease on the watch's heap and in its renewal lane's schedule at acquire,
    and taking it off both at release, cost more client CPU than the rest of an
    uncontended acquire and release together, and most leases are released long before
    either is needed (their first renewal is due a third of the TTL in). So a lease is
    only *offered*: kept in a dict, handed to the heap and its lane at the watch
    thread's next look (:meth:`hand_over`), and simply forgotten if released first.

    The watch thread looks every time it wakes; asleep, it publishes when it will wake
    (``_wake_at``; awake, ``-inf``: no promise). An offer is taken only if that is no
    later than the lease is first needed (its first renewal, or its deadline); else the
    lease is registered at once as before. Since the offer is in the dict before the
    promise is read, and the thread withdraws its promise on waking before it looks,
    a look by the promised time always finds it. Offers, their withdrawal (:meth:`take`:
    a release, a lost lease, a lane's own scheduling) and the hand-over all hold
    ``lock``, so a lease is handed on exactly when nobody took it back first.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._offers: dict[int, _Offer] = {}

    def offer(self, lease: Renewable, needed_by: float, lane: ThreadLane | None = None) -> bool:
        """Offer ``lease`` to its ``lane`` (``None``: to the deadline heap), needed there
        by ``needed_by`` (monotonic); ``False``: register it now instead."""
        watch = deadline_watch()
        dropped: _Offer | None = None
        with self.lock:
            key = id(lease)
            offer = self._offers.get(key)
            if offer is None or offer.ref() is not lease:  # a collected lease's id, reused
                if offer is not None and offer.lane is not None:
                    dropped = offer
                offer = self._offers[key] = _Offer(lease)
            if lane is None:
                offer.watched = True
            else:
                offer.lane = lane
            # Read after the offer is in: see the class docstring. Awake (-inf), the
            # thread promises nothing: it may have looked already and be about to sleep.
            promise = watch._wake_at
            taken = watch._thread is not None and -math.inf < promise <= needed_by
            if not taken:
                if lane is None:
                    offer.watched = False
                else:
                    offer.lane = None
                if offer.lane is None and not offer.watched:
                    del self._offers[key]
        if dropped is not None:
            report_dropped(dropped.name, dropped.fence)
        return taken

    def take(self, lease: Renewable, renewal: bool) -> bool:
        """Take back ``lease``'s offer to its lane (``renewal``) or to the heap: ``True``
        if it was still offered, so nothing of it was registered there."""
        if not self._offers:  # nothing offered: no lock needed to know
            return False
        with self.lock:
            key = id(lease)
            offer = self._offers.get(key)
            if offer is None or offer.ref() is not lease:
                return False
            if renewal:
                if offer.lane is None:
                    return False
                offer.lane = None
            else:
                if not offer.watched:
                    return False
                offer.watched = False
            if offer.lane is None and not offer.watched:
                del self._offers[key]
            return True

    def hand_over(self, heap: DeadlineHeap) -> None:
        """The watch's look: every offer to ``heap`` and to its lane (the watch thread)."""
        if not self._offers:
            return
        dropped: list[_Offer] = []
        with self.lock:
            for offer in self._offers.values():
                lease = offer.ref()
                if lease is None:
                    if offer.lane is not None:
                        dropped.append(offer)
                    continue
                if offer.watched:
                    heap.add(lease)
                if offer.lane is not None:
                    # Earlier only: a renewal asked for sooner meanwhile keeps its time.
                    offer.lane._add(lease, earlier_only=True)
            # Emptied only now: a take() that found the dict empty without the lock
            # must not run before the leases it would take back are registered.
            self._offers.clear()
        for offer in dropped:
            report_dropped(offer.name, offer.fence)


_pending = _Pending()


class CallbackThread:
    """Runs user callbacks (``on_lost``) one after another, off every lane and the watch.

    One daemon thread, started on demand, exiting when idle; a bounded queue (a callback
    that never returns holds up only the callbacks behind it, never a renewal). When the
    queue is full a callback is dropped and logged: the loss it reports is still set on
    the lease and emitted as an event.
    """

    def __init__(self, limit: int = CALLBACK_QUEUE) -> None:
        self._queue: queue.Queue[Callable[[], object]] = queue.Queue(limit)
        self._guard = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, callback: Callable[[], object]) -> None:
        try:
            self._queue.put_nowait(callback)
        except queue.Full:
            log.error("%d callbacks are waiting; dropped %r", self._queue.maxsize, callback)
            return
        with self._guard:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="task-locks-callbacks", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                callback = self._queue.get(timeout=IDLE_EXIT)
            except queue.Empty:
                with self._guard:
                    if self._queue.empty():  # a submit() after this starts a new thread
                        self._thread = None
                        return
                continue
            try:
                callback()
            except Exception:
                log.exception("a lock callback (%r) failed", callback)


class ProcessRuntime:
    """The process's :class:`~task_locks.leasing.LeaseRuntime`: the real clock, renewal
    threads (tasks, per event loop), the deadline watch and the callback thread."""

    clock = SYSTEM_CLOCK

    def schedule(self, lease: Renewable, asynchronous: bool) -> Lane:
        lane: Lane
        if asynchronous:
            lane = async_renewer().add(lease)
        else:
            thread_lane: ThreadLane = thread_renewer().lanes.get(lease, asynchronous=False)
            if not _pending.offer(lease, lease._book.next_renewal(), thread_lane):
                thread_lane._add(lease)
            lane = thread_lane
        notices.listen(lease)  # a renewed lease also hears of a force release at once
        return lane

    def watch(self, lease: Renewable) -> None:
        if not _pending.offer(lease, lease._expires_mono):
            deadline_watch().add(lease)

    def unwatch(self, lease: Renewable) -> None:
        if not _pending.take(lease, renewal=False):
            deadline_watch().remove(lease)
        notices.forget(lease)

    def run_callback(self, lease: Renewable, callback: Callable[[], object]) -> None:
        if not in_driver():  # the holder's own call (renew, check, release): run it here
            callback()
            return
        # An asyncio lease's callbacks belong to its loop (an async on_lost is a task there).
        loop: asyncio.AbstractEventLoop | None = getattr(lease, "_loop", None)
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(callback)
                return
            except RuntimeError:  # the loop closed in between
                pass
        callback_thread().submit(callback)


T = TypeVar("T")


class _PerProcess(Generic[T]):
    """One ``make()`` per process, made on first use (a forked child makes its own)."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._value: T | None = None
        self._guard = threading.Lock()

    def get(self) -> T:
        value = self._value
        if value is None:
            with self._guard:
                if self._value is None:
                    self._value = self._make()
                value = self._value
        return value

    def forget(self) -> None:
        self._value = None
        self._guard = threading.Lock()  # it may have been held by a thread that is gone


_thread_renewer = _PerProcess(ThreadRenewer)
_deadline_watch = _PerProcess(DeadlineWatch)
_callback_thread = _PerProcess(CallbackThread)
_process_runtime = ProcessRuntime()
_async_renewers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncRenewer] = (
    weakref.WeakKeyDictionary()
)


def thread_renewer() -> ThreadRenewer:
    return _thread_renewer.get()


def deadline_watch() -> DeadlineWatch:
    return _deadline_watch.get()


def callback_thread() -> CallbackThread:
    return _callback_thread.get()


def process_runtime() -> ProcessRuntime:
    return _process_runtime


def async_renewer() -> AsyncRenewer:
    loop = asyncio.get_running_loop()
    renewer = _async_renewers.get(loop)
    if renewer is None:
        renewer = _async_renewers[loop] = AsyncRenewer(loop)
    return renewer


def _after_fork_in_child() -> None:
    """A forked child holds none of its parent's leases: forget them, never renew them.

    The parent's renewal threads, deadline watch and callback thread do not exist in the
    child. Renewal
    tasks do (when the fork happened inside a running event loop): they stop at their
    next wake-up (they check the pid), and their lanes are forgotten.
    """
    global _pending
    for singleton in (_thread_renewer, _deadline_watch, _callback_thread):
        singleton.forget()
    _pending = _Pending()
    for renewer in list(_async_renewers.values()):
        for lane in list(renewer.lanes._lanes.values()):
            # A fresh one: the old one's lock may be held by a dead thread.
            lane.schedule = RenewalQueue(SYSTEM_CLOCK, wake=lane._woken)
    _async_renewers.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)

OnLost = Callable[..., object]
