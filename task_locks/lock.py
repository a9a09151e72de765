"""``Lock`` / ``AsyncLock`` and the ``Lease`` they hand out.

The acquire loop (token, deadline, waiting for the holder) is written once, as a plan
(:mod:`task_locks._plan`, the internal engine) that yields the I/O it needs (``Acquire``,
``Release``, ``Wait``) and receives the answers; ``_plan.run_against`` runs it
against a backend's sync methods and ``_plan.arun_against`` against its async ones, so sync and async
share every decision and differ only in how they talk to the server. The semaphore's
loop (:mod:`task_locks.semaphore`) is driven by the same two functions. An acquire's
first try is sent by the front end itself (:class:`_FirstTry`): granted, it needs no plan.

:class:`LockBase` and :class:`LeaseBase` are internal too: the semaphore and the election
build on them; the package does not export them.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import os
import re
import secrets
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Collection
from types import TracebackType
from typing import Any, Final, Generic, TypeVar

from . import events
from ._plan import MIN_PAUSE as MIN_PAUSE
from ._plan import UNKNOWN_TTL_POLL as UNKNOWN_TTL_POLL
from ._plan import (
    UNSET,
    Acquire,
    AwaitGrant,
    Dequeue,
    Enqueue,
    Op,
    Plan,
    Release,
    Unset,
    Wait,
    aanswer,
    answer,
    arun_against,
    entry_ms,
    handoff_slice,
    pause,
    report_acquired,
    report_conflict,
    run_against,
)
from .backends.base import Backend, ServerHandoff, parse_capabilities
from .config import default_ttl, resolve_backend, validate_ttl
from .errors import (
    BackendUnavailable,
    InvalidArgument,
    LockError,
    LockHeld,
    LockLost,
    MissingCapability,
    NotOwned,
)
from .events import HANDED_OVER, LostReason, ReleaseReason
from .leasing import Clock, Lane, LeaseBook, LeaseRuntime, RenewCall, current_runtime, retry_delay
from .owner import current_owner
from .owner import internal as owner_internal
from .types import AcquireResult, Holder, RunCheck
from .watchdog import process_runtime

log = logging.getLogger("task_locks.lock")

MAX_NAME_LENGTH: Final = 512
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")
L = TypeVar("L", bound="LeaseBase")
SL = TypeVar("SL", bound="Lease")
AL = TypeVar("AL", bound="AsyncLease")
T = TypeVar("T")
#: (backend id, lock name, thread or task): see ``_held_by``.
_HolderKey = tuple[int, str, "weakref.ref[Any]"]
#: This process's id, kept current by a fork hook: ``held`` asks it on every look, and
#: ``os.getpid()`` is a system call (a few percent of a simulated schedule's time).
_this_process = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _this_process.__setitem__(0, os.getpid()))


def validate_name(name: object) -> str:
    if not isinstance(name, str):
        raise InvalidArgument(f"a lock name must be a string, got {type(name).__name__}")
    if not name.strip():
        raise InvalidArgument("a lock name must not be empty or blank", name=name)
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidArgument(
            f"a lock name must be at most {MAX_NAME_LENGTH} characters, got {len(name)}",
            name=name[:40] + "...",
        )
    # Every backend must store the name as given: no database text column holds NUL, no
    # server takes a lone surrogate, and control characters would garble listings and logs.
    control = _CONTROL.search(name)
    if control:
        raise InvalidArgument(
            f"a lock name must not contain control characters, got {control.group()!r} "
            f"at position {control.start()}",
            name=name.encode("unicode_escape").decode(),
        )
    try:
        name.encode()
    except UnicodeEncodeError as exc:
        raise InvalidArgument(
            f"a lock name must be valid unicode text (UTF-8 encodable): {exc.reason} at "
            f"position {exc.start}",
            name=name.encode("unicode_escape").decode(),
        ) from None
    return name


def validate_timeout(timeout: object, name: str | None = None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout != timeout:
        raise InvalidArgument(
            f"timeout must be seconds (a number) or None, got {timeout!r}", name=name
        )
    if timeout < 0:
        raise InvalidArgument(f"timeout must be >= 0 seconds, got {timeout!r}", name=name)
    return float(timeout)


def format_wait(seconds: float) -> str:
    """``<1ms``, ``155ms``, ``2.5s``: a wait as people read it, not ``0.000155s``."""
    if seconds < 0.001:
        return "<1ms"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    return f"{seconds:.1f}s"


def _held_message(name: str, result: AcquireResult, waited: float | None) -> LockHeld:
    holder = None
    if result.holder is not None:
        expires = None if result.retry_after is None else time.time() + result.retry_after
        holder = Holder(
            result.holder_name or name,
            result.holder_fence or 0,
            result.holder,
            result.holder_acquired_at,
            expires,
        )
    who = holder.describe() if holder else "another holder"
    after = f" after waiting {format_wait(waited)}" if waited else ""
    return LockHeld(f"lock {name!r} is held by {who}{after}", name=name, holder=holder)


_background: set[asyncio.Future[Any]] = set()


def _spawn(awaitable: Any) -> None:
    """Run ``awaitable`` on the running loop, keeping a reference until it is done."""
    future = asyncio.ensure_future(awaitable)
    _background.add(future)
    future.add_done_callback(_background.discard)


_flag_guard = threading.Lock()
#: Why a lease is lost when its local deadline passed with no renewal answered in time.
DEADLINE_REASON: Final = "its TTL ran out before it was renewed (no renewal answered in time)"
#: Why a lock's token is gone before its (clock-margin-safe) expiry.
FORCED_REASON: Final = (
    "it was force-released before its TTL ran out (an operator's release, or the server "
    "lost it: a restart or failover)"
)


def _unreachable(error: BaseException) -> str:
    return f"the backend was unreachable until the TTL ran out ({error})"


class LostFlag:
    """``lease.lost``: a ``threading.Event`` look-alike that builds the Event only if waited on.

    It is also set, with no one calling :meth:`set`, once the lease's local deadline
    (``_deadline``, monotonic) has passed: a renewal call still blocked on a dead link
    cannot keep the lease looking alive past the time the server may have expired it.

    Most leases are never waited on; a real Event per lease costs a lock, a condition and
    about a kilobyte, on every acquire.
    """

    __slots__ = ("_clock", "_deadline", "_event", "_set")

    def __init__(self, deadline: float = math.inf, clock: Clock | None = None) -> None:
        self._set = False
        self._event: threading.Event | None = None
        self._deadline = deadline
        self._clock = clock

    def _now(self) -> float:
        return time.monotonic() if self._clock is None else self._clock.monotonic()

    def is_set(self) -> bool:
        return self._set or self._now() >= self._deadline

    def set(self) -> None:
        self._claim()

    def _claim(self) -> bool:
        """Set the flag; ``True`` only for the one caller that set it (who reports the loss)."""
        with _flag_guard:
            if self._set:
                return False
            self._set = True
            event = self._event
        if event is not None:
            event.set()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        with _flag_guard:
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        end = None if timeout is None else self._now() + timeout
        while True:
            if self.is_set():
                return True
            now = self._now()
            # Wake at the deadline too: it may pass with nobody calling set().
            left = self._deadline - now
            if end is not None:
                if now >= end:
                    return False
                left = min(left, end - now)
            if event.wait(None if math.isinf(left) else max(0.0, left)):
                return True

    def __bool__(self) -> bool:
        return self.is_set()

    def __repr__(self) -> str:
        return f"<LostFlag {'set' if self.is_set() else 'clear'}>"


class LeaseBase:
    """State and non-I/O logic shared by :class:`Lease` and :class:`AsyncLease`.

    The deadline and the renewal schedule are its :class:`~task_locks.leasing.LeaseBook`'s
    (``_book``); the clock, the renewal lane, the deadline watch and where callbacks run
    are its runtime's (``_runtime``, :mod:`task_locks.leasing`).
    """

    #: The renewal lane this lease was handed to (``None``: not renewed in the background).
    _renewer: Lane | None = None
    #: Whether the deadline watch has this lease.
    _watched: bool = False
    #: A release was sent and got no answer (see ``release_unknown``).
    _release_failed: bool = False
    #: Its holder is releasing it: a release notice is about our own delete (etcd).
    _releasing: bool = False
    #: Its entry in the holders map (see ``LockBase._held_here``).
    _holder_key: _HolderKey | None = None

    def __init__(
        self,
        name: str,
        token: str,
        fence: int,
        ttl: float,
        backend: Backend,
        sent_at: float,
        *,
        on_lost: Callable[[Any], object] | None = None,
        max_hold: float | None = None,
        runtime: LeaseRuntime | None = None,
    ) -> None:
        self.name = name
        self.token = token
        self.fence = fence
        self.backend = backend
        self._runtime: LeaseRuntime = runtime or process_runtime()
        self._clock = self._runtime.clock
        self.acquired_at = self._clock.time()
        self._acquired_mono = sent_at
        # The server set the TTL after we sent the request, so counting from the send is
        # never late; the backend's clock margin (Redlock's drift) makes it early enough.
        self._book = LeaseBook(
            ttl,
            ttl - backend.clock_margin(ttl),
            sent_at,
            None if max_hold is None else sent_at + max_hold,
        )
        #: Set when the lease is known lost (expired, taken over, renewal refused), and
        #: by itself at the local deadline, whatever renewal call is still in flight.
        self.lost = LostFlag(self._book.deadline, self._clock)
        self._lost_reason: str | None = None
        #: The last renewal failure, to say why the lease ran out.
        self._renew_error: BaseException | None = None
        self._released = False
        #: Called with the lease when it is found lost (off the renewal lanes). A front end
        #: may chain its own hook in front of it (:class:`task_locks._friends.FriendLease`).
        self.on_lost = on_lost
        self.renewals = 0
        #: What the front end said when it took the lock (for the events it reports).
        self._detail = events.current_context().detail
        #: A user's lock (reported) or the library's own record (``Owner.internal``).
        self._reported = not owner_internal()
        # A forked child inherits this object but not the lock: see _foreign().
        self._pid = _this_process[0]

    # -- what users read --------------------------------------------------------

    @property
    def ttl(self) -> float:
        """The TTL (seconds) this lease's renewals set (``renew(ttl=...)`` changes it)."""
        return self._book.ttl

    @property
    def _expires_mono(self) -> float:
        """The local deadline (monotonic): see :class:`~task_locks.leasing.LeaseBook`."""
        return self._book.deadline

    @property
    def _hold_deadline(self) -> float | None:
        return self._book.hold_deadline

    @property
    def lost_reason(self) -> str | None:
        """Why the lease was lost (``None`` while it is not)."""
        if self._lost_reason is None and self.lost.is_set():
            return self._deadline_reason()[1]
        return self._lost_reason

    @property
    def held(self) -> bool:
        """Still ours, as far as this process knows (no round trip)."""
        return (
            not self._released
            and not self.lost.is_set()
            and not self._foreign()
            and self._clock.monotonic() < self._book.deadline
        )

    def _foreign(self) -> bool:
        """True in a forked child: the parent holds the lock, the child must not act on it."""
        return _this_process[0] != self._pid

    @property
    def expires_at(self) -> float:
        """Epoch seconds by which the lease ends unless renewed (a safe, early estimate)."""
        return self._clock.time() + (self._book.deadline - self._clock.monotonic())

    @property
    def remaining(self) -> float:
        """Seconds left before the lease's local deadline (0 once it passed); no round trip."""
        return max(0.0, self._book.deadline - self._clock.monotonic())

    def check(self) -> None:
        """Raise :class:`LockLost` unless the lease is still ours (local knowledge).

        Call it before acting on the protected resource; pass ``fence`` to the resource
        as well, since a pause can still happen between the check and the write.
        """
        if self.lost.is_set():  # released leases never turn lost by their deadline
            self._mark_lost(*self._deadline_reason())  # no-op if already marked
            raise LockLost(f"lock {self.name!r} was lost: {self.lost_reason}", name=self.name)
        if self._released:
            raise LockLost(f"lock {self.name!r} was already released", name=self.name)
        if self._foreign():
            raise LockLost(
                f"lock {self.name!r} is held by process {self._pid}; this forked child "
                "does not hold it",
                name=self.name,
            )

    # -- renewal bookkeeping (called by the renewal queue and by renew()) ------------

    def _begin_call(self, now: float) -> RenewCall:
        """A watchdog renewal of this lease is sent at ``now`` (with the current TTL)."""
        return self._book.begin(now)

    def _renewed(self, call: RenewCall) -> bool:
        """Record a renewal the server granted; ``False`` if its reply came too late.

        A reply that arrives after the local deadline must not bring the lease back: for
        a while the lease counted as lost, and its holder (``run``, a command, a task)
        may already have stopped or been stopped, or another process taken the lock.
        The deadline moves only as far as the calls still open allow (see the book).
        """
        if self.lost.is_set():
            self._book.failed(call)
            self._mark_lost(
                LostReason.DEADLINE,
                DEADLINE_REASON + "; the renewal's reply came after the deadline",
            )
            return False
        self.lost._deadline = self._book.granted(call)
        self.renewals += 1
        return True

    def _deadline_passed(self) -> None:
        """Called by the deadline watch once the local deadline has passed."""
        self._mark_lost(*self._deadline_reason())

    def _deadline_reason(self) -> tuple[LostReason, str]:
        """Why the local deadline passed: no renewal answered, or none got through."""
        if self._renew_error is None:
            return LostReason.DEADLINE, DEADLINE_REASON
        return LostReason.UNREACHABLE, _unreachable(self._renew_error)

    def _begin_renew(self, ttl: object) -> RenewCall:
        """Check the lease and send a renewal now (with ``ttl`` if given): the call.

        The new TTL is in force before the request leaves, so every later watchdog batch
        carries it too. A shorter TTL shortens the local deadline at once (the request
        may reach the server any moment), and the next watchdog renewal follows it: the
        lease is renewed on the schedule of the TTL it counts with, whether this call
        succeeds or not.
        """
        self.check()
        now = self._clock.monotonic()
        if ttl is None:
            return self._book.begin(now)
        new_ttl = validate_ttl(ttl, name=self.name)
        before = self._book.deadline
        call = self._book.begin(now, new_ttl, new_ttl - self.backend.clock_margin(new_ttl))
        if self._book.deadline < before:
            # The deadline moved earlier: the lost flag and the deadline watch follow.
            self.lost._deadline = self._book.deadline
            if self._watched:
                self._runtime.watch(self)
        if self._renewer is not None and not self._released and not self.lost.is_set():
            self._renewer.add(self, earlier_only=True)
        return call

    def _renew_call_failed(self, call: RenewCall) -> None:
        """``renew()`` got no answer: the call may or may not have reached the server."""
        self._book.failed(call)

    def _reschedule(self) -> None:
        """After renew(ttl=...) succeeded: the watchdog's next renewal follows the book."""
        if self._renewer is not None and not self._released and not self.lost.is_set():
            self._renewer.add(self)

    def _renew_failed(self, call: RenewCall, error: BaseException, now: float) -> bool:
        """A renewal could not reach the server: retry (``True``) while time remains."""
        self._book.failed(call)
        if now + retry_delay(self.ttl) >= self._book.deadline:
            self._mark_lost(LostReason.UNREACHABLE, _unreachable(error))
            return False
        self._renew_error = error
        self._report(events.RenewalFailed, reason=str(error))  # logged by its subscriber
        return True

    def _renewal_refused(self) -> None:
        """A renewal found the token gone. It was sent before the local deadline (a lost
        lease is not renewed), so the lock was removed before its TTL ran out."""
        self._mark_lost(LostReason.FORCED, f"renewal found the lock's token gone: {FORCED_REASON}")

    def _release_noticed(self, why: str) -> bool:
        """The backend announced that this lease's lock (its name and fence) was freed
        by someone else (:mod:`task_locks.notices`): lost now, not at the next renewal.
        ``False`` when it says nothing new (released, being released, lost already)."""
        if self._releasing or self._released or self._foreign() or self.lost.is_set():
            return False
        self._mark_lost(LostReason.FORCED, f"{why}; heard from the server's release notice")
        return True

    def _renew_soon(self) -> None:
        """Renew now, ahead of schedule: release notices may have been missed."""
        if self._renewer is not None and not (
            self._released or self._releasing or self.lost.is_set()
        ):
            self._renewer.add(self, self._clock.monotonic(), earlier_only=True)

    def _hold_expired(self, now: float) -> bool:
        if self._hold_deadline is None or now < self._hold_deadline:
            return False
        self._mark_lost(
            LostReason.MAX_HOLD, "max_hold exceeded: renewal stopped and the lock was released"
        )
        self._release_in_background()
        return True

    def _release_in_background(self) -> None:
        try:
            self.backend.release(self.name, self.token)
        except Exception as exc:
            log.warning("releasing lock %r after max_hold failed: %s", self.name, exc)

    def _held(self) -> float:
        """Seconds this lease has been held (from its acquire's send), for its events."""
        return self._clock.monotonic() - self._acquired_mono

    def _report(self, event: type[events.LockEvent], **fields: Any) -> None:
        """Emit ``event`` about this lease, named the same way in each (lock, server,
        fence): a user's lease only, never the library's own records (``_reported``)."""
        if self._reported and events.wanted(event.kind):
            events.emit(
                event(name=self.name, backend=self.backend.server, fence=self.fence, **fields)
            )

    def _mark_lost(self, reason: LostReason, message: str) -> None:
        """The lease is lost, for ``reason`` (what the metrics count), said as ``message``
        (``lost_reason``, the ``lost`` event's words); the first call wins."""
        if self._released:
            return
        with _flag_guard:
            if self._lost_reason is not None:
                return
            self._lost_reason = message
        if not self.lost._claim():
            return
        self.stop_renewal()
        self._unwatch()
        # Logged (once) by the events' logging subscriber.
        self._report(
            events.Lost, held=self._held(), reason=reason, message=message, detail=self._detail
        )
        if self.on_lost is not None:
            # Never here: this may be a renewal lane or the deadline watch, and a slow
            # callback would hold up every other lease's renewals.
            self._runtime.run_callback(self, self._call_on_lost)

    def _call_on_lost(self) -> None:
        assert self.on_lost is not None
        try:
            outcome = self.on_lost(self)
            if inspect.isawaitable(outcome):
                _spawn(outcome)
        except Exception:
            log.exception("on_lost callback for lock %r failed", self.name)

    def _schedule(self) -> None:
        """Hand the lease to the renewer of this thread's process or this event loop."""
        raise NotImplementedError

    def _watch(self) -> None:
        """Have the deadline watch mark the lease lost at its local deadline."""
        raise NotImplementedError

    def _unwatch(self) -> None:
        if self._watched:
            self._watched = False
            self._runtime.unwatch(self)

    def stop_renewal(self) -> None:
        """Friends only (:class:`task_locks._friends.FriendLease`): stop renewing the lease,
        which keeps its lock until the TTL runs out (a Celery run parking it for its retry)."""
        # The renewer it was given, not the current thread's or loop's: a lease may be
        # marked lost from another thread, and must still leave its schedule.
        if self._renewer is not None:
            self._renewer.remove(self)

    def begin_release(self) -> bool:
        """Friends only (:class:`task_locks._friends.FriendLease`), with
        :meth:`finish_release`: a release sent by someone else than :meth:`release` (the
        Celery releaser's thread). ``False`` when there is nothing to send (already
        released, or not ours to send).

        A forked child that unwinds a ``with`` block must not free its parent's lock, so
        there the release only forgets the lease locally.
        """
        if self._released:
            return False
        if self._foreign():
            self._released = True
            self.lost._deadline = math.inf
            log.debug("lock %r belongs to parent process %s; not released", self.name, self._pid)
            return False
        self._releasing = True
        self.stop_renewal()
        return True

    def release_unknown(self, error: BackendUnavailable) -> None:
        """Friends only: a release whose outcome is unknown (no reply): the lock may be
        free already.

        The lease stops counting as held (another process may hold the lock any moment);
        a later ``release()`` may still send it, and its "not ours" then means the first
        one got through.
        """
        self._release_failed = True
        self._mark_lost(
            LostReason.UNKNOWN,
            f"the release's outcome is unknown, so it may be free already ({error})",
        )

    def hand_over(self, to: str) -> None:
        """Friends only (:class:`task_locks._friends.FriendLease`): the lock goes on to
        another process (``to``: a queued task's worker...): this process stops holding
        it, with no request to the server, and reports it released (reason
        :data:`events.HANDED_OVER`), not lost at its deadline."""
        if self.begin_release():
            self.finish_release(True, to)

    def finish_release(self, ok: bool, handed_to: str | None = None) -> None:
        """Friends only: the answer to the release :meth:`begin_release` began (``ok``: the
        server freed it); a refused one marks the lease lost and raises :class:`NotOwned`."""
        if self._holder_key is not None:
            ref = _held_by.get(self._holder_key)
            if ref is not None and ref() is self:
                del _held_by[self._holder_key]
        if ok:
            self._released = True
            self.lost._deadline = math.inf  # released, not lost
            self._unwatch()
            if handed_to is None:
                log.debug("released lock %r (fence %s)", self.name, self.fence)
            else:
                log.debug("lock %r (fence %s) handed to %s", self.name, self.fence, handed_to)
            if events.wanted(events.Released.kind):  # its fields cost a little to build
                self._report(
                    events.Released,
                    held=self._held(),
                    reason=ReleaseReason.FREED if handed_to is None else HANDED_OVER,
                    detail=self._detail if handed_to is None else f"handed to {handed_to}",
                )
            return
        if self._release_failed:
            # An earlier release got no reply: it most likely freed the lock.
            self._released = True
            log.info("lock %r: an earlier release (reply lost) had freed it", self.name)
            return
        # Known without asking the server: before our (clock-margin-safe) expiry the TTL
        # cannot have run out, so someone removed the lock.
        forced = self._clock.monotonic() < self._expires_mono
        why = FORCED_REASON if forced else "it expired"
        self._mark_lost(
            LostReason.FORCED if forced else LostReason.DEADLINE,
            f"the lock's token was gone at release: {why}",
        )
        self._released = True
        raise NotOwned(
            f"lock {self.name!r} (fence {self.fence}) was no longer ours at release: "
            f"{why}, and may be held by someone else; nothing was released",
            name=self.name,
        )

    def _finish_renew(self, call: RenewCall, ok: bool, new_ttl: bool = False) -> None:
        """``renew()``'s answer (``new_ttl``: it set a TTL, the schedule follows it)."""
        if ok:
            if not self._renewed(call):
                raise LockLost(f"lock {self.name!r} was lost: {self.lost_reason}", name=self.name)
            if new_ttl:
                self._reschedule()
            return
        self._renewal_refused()
        raise NotOwned(
            f"lock {self.name!r} could not be renewed: it is no longer ours", name=self.name
        )

    def __repr__(self) -> str:
        state = "held" if self.held else ("lost" if self.lost.is_set() else "released")
        return f"<{type(self).__name__} {self.name!r} fence={self.fence} {state}>"


class Lease(LeaseBase):
    """Proof of holding a lock, renewed in the background until released."""

    def _schedule(self) -> None:
        self._renewer = self._runtime.schedule(self, asynchronous=False)

    def _watch(self) -> None:
        self._watched = True
        self._runtime.watch(self)

    def renew(self, ttl: float | None = None) -> None:
        """Extend the TTL now (the watchdog also does this on its own), token-checked.

        ``ttl`` (seconds) replaces the lease's TTL: the server's expiry becomes ``ttl``
        from now, and the watchdog renews to ``ttl`` (every ``ttl/3``) from then on.
        Raises :class:`NotOwned` if the lock is no longer ours.
        """
        call = self._begin_renew(ttl)
        try:
            ok = self.backend.renew(self.name, self.token, call.ttl_ms)
        except BaseException:
            self._renew_call_failed(call)
            raise
        self._finish_renew(call, ok, ttl is not None)

    def release(self) -> None:
        """Free the lock if it is still ours; raise :class:`NotOwned` if it was lost.

        Calling it again after a successful release does nothing.
        """
        if self.begin_release():
            try:
                ok = self.backend.release(self.name, self.token)
            except BackendUnavailable as exc:
                self.release_unknown(exc)
                raise
            self.finish_release(ok)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.release()
        except LockLost:
            if exc[0] is None:
                raise
            # The block's own exception goes on; the loss was logged when it happened.


class AsyncLease(LeaseBase):
    """The asyncio twin of :class:`Lease`; renewed by a task in its event loop."""

    _loop: asyncio.AbstractEventLoop | None = None

    def _schedule(self) -> None:
        self._renewer = self._runtime.schedule(self, asynchronous=True)

    def _watch(self) -> None:
        # The lease's callbacks run on this loop (the runtime sends them there).
        self._loop = asyncio.get_running_loop()
        self._watched = True
        self._runtime.watch(self)

    async def renew(self, ttl: float | None = None) -> None:
        """The asyncio twin of :meth:`Lease.renew` (same ``ttl``)."""
        call = self._begin_renew(ttl)
        try:
            ok = await self.backend.arenew(self.name, self.token, call.ttl_ms)
        except BaseException:
            self._renew_call_failed(call)
            raise
        self._finish_renew(call, ok, ttl is not None)

    def _release_in_background(self) -> None:
        # Called from the loop's renewal task: release without blocking the loop.
        async def release() -> None:
            try:
                await self.backend.arelease(self.name, self.token)
            except Exception as exc:
                log.warning("releasing lock %r after max_hold failed: %s", self.name, exc)

        _spawn(release())

    async def release(self) -> None:
        """The asyncio twin of :meth:`Lease.release`: free the lock if it is still ours;
        raise :class:`NotOwned` if it was lost."""
        if self.begin_release():
            try:
                ok = await self.backend.arelease(self.name, self.token)
            except BackendUnavailable as exc:
                self.release_unknown(exc)
                raise
            self.finish_release(ok)

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.release()
        except LockLost:
            if exc[0] is None:
                raise
            # The block's own exception goes on; the loss was logged when it happened.


#: Leases held now, by (backend, name, holder), the holder being (a weak reference to) the
#: thread (sync) or the task (asyncio) that acquired them: not its id, which a new thread or
#: task reuses once the old one is gone, and would then be taken for the holder. A second acquire of the same name by the same holder
#: would wait for itself (forever with ``timeout=None``: the first lease keeps being
#: renewed), so it fails at once instead. Weak: a dropped lease is not kept alive here.
_held_by: dict[_HolderKey, weakref.ref[Any]] = {}


def _forget_holder(key: _HolderKey, ref: weakref.ref[Any]) -> None:
    if _held_by.get(key) is ref:
        del _held_by[key]


def _give_back(name: str, token: str) -> Plan[None]:
    """Leave the queue, giving back a grant that may have raced in (best effort: the call
    that failed just before may mean this one fails too; the TTL then frees it)."""
    try:
        yield Dequeue(name, token)
    except LockError as exc:
        log.warning("lock %r: could not leave the wait queue (%s); its TTL frees it", name, exc)


#: What an acquire plan returns: the token, the fence, and the send time of the try
#: that took the lock (the lease counts from it).
Granted = tuple[str, int, float]


class _Attempt:
    """One acquire's inputs, and the rules both plans share: when a grant is taken
    (:meth:`accept`) and when a refused try ends the acquire (:meth:`refuse`).

    ``held_token``: acquire under this token instead of a fresh one. It may hold the lock
    already (Celery's publish-time lock, taken over by its run), so a try that failed
    with no reply may have found the lock ours: it is never given back
    (:attr:`may_give_back`). ``fresh_token``: a new token the caller chose (it frees the
    lock itself should the acquire's outcome be unknown); given back like any new one.
    """

    def __init__(
        self,
        name: str,
        ttl: float,
        backend: Backend,
        clock: Clock,
        timeout: float | None,
        mine: tuple[LeaseBase, str] | None,
        *,
        held_token: str | None,
        fresh_token: str | None = None,
        run: RunCheck | None = None,
    ) -> None:
        self.name, self.ttl, self.backend, self.clock = name, ttl, backend, clock
        self.timeout, self.mine, self.run = timeout, mine, run
        self.ttl_ms = max(1, int(ttl * 1000))
        self.token = held_token or fresh_token or secrets.token_hex(16)
        self.may_give_back = held_token is None and (run is None or run.take_over is None)
        self.owner = current_owner()
        self.start = clock.monotonic()
        self.deadline = None if timeout is None else self.start + timeout
        # The server hand-off's queue does not carry a run check: each try sends it.
        self.handoff = isinstance(backend, ServerHandoff) and run is None

    def expired(self, now: float) -> bool:
        """Whether the acquire's wait is over (never with ``timeout=None``)."""
        return self.deadline is not None and now >= self.deadline

    def try_op(self, sent_at: float, first: bool = False) -> Acquire | Enqueue:
        """One try, sent at ``sent_at``: a server hand-off's also queues the waiter,
        unless it cannot wait (timeout 0, or the deadline passed). The ``first`` may
        also wait for its grant in the same request (``Enqueue.pop``): one slice, as
        the wait after it would (the server cuts it short when the holder's record ends
        sooner). Not when the lease :attr:`mine` may hold the lock: a wait for itself is
        refused at once, not after a slice."""
        if not self.handoff:
            return Acquire(self.name, self.token, self.ttl_ms, self.owner, self.run)
        if self.expired(sent_at):
            return Enqueue(self.name, self.token, self.ttl_ms, self.owner, 0)
        pop = 0.0
        if first and self.mine is None:
            pop = handoff_slice(self.ttl)
            if self.deadline is not None:
                pop = min(pop, self.deadline - sent_at)
        return Enqueue(self.name, self.token, self.ttl_ms, self.owner, entry_ms(self.ttl), pop)

    def in_time(self, fence: int, sent_at: float) -> Granted | None:
        """The grant of the try sent at ``sent_at`` if its reply came within its TTL,
        the lease counting from that send (see :meth:`accept`)."""
        now = self.clock.monotonic()
        if now < sent_at + self.ttl - self.backend.clock_margin(self.ttl):
            log.debug("acquired lock %r (fence %s)", self.name, fence)
            report_acquired(self.name, self.backend, fence, self.owner, now - self.start)
            return self.token, fence, sent_at
        return None

    def accept(self, fence: int, sent_at: float) -> Plan[Granted | None]:
        """The grant of the try sent at ``sent_at``, the lease counting from that send;
        ``None`` (try again) if its reply came after its TTL: the lock may be someone
        else's by now, so it is given back (token-checked), not handed out as a dead lease.
        """
        granted = self.in_time(fence, sent_at)
        if granted is not None:
            return granted
        log.warning("lock %r: the acquire's reply came after the TTL; retrying", self.name)
        yield Release(self.name, self.token)
        if self.expired(self.clock.monotonic()):
            raise BackendUnavailable(
                f"lock {self.name!r}: the acquire's reply took longer than the TTL "
                f"({self.ttl}s) at {self.backend.server}",
                name=self.name,
                server=self.backend.server,
            )
        return None

    def refuse(self, result: AcquireResult, now: float, leave: Op | None = None) -> Plan[None]:
        """Raise :class:`LockHeld` if the try refused with ``result`` ends the acquire
        (``leave``: the op that takes this waiter out of the server's queue first).

        It ends at the deadline, and when the wait would be for itself: the server says
        the lease :attr:`mine` holds the lock, it is renewed, and there is no timeout, so
        the wait would never end. A bounded wait, or one for an unrenewed lease (its TTL
        frees it), waits as usual. And at once when a run check says a run of the same
        task id holds it (:class:`~task_locks.types.RunCheck`): a copy never waits.
        """
        run = self.run
        if self.expired(now) or (run is not None and run.give_up_on_copy and run.is_copy(result)):
            if leave is not None:
                yield leave
            held = _held_message(self.name, result, now - self.start)
            report_conflict(
                self.name, self.backend, held, now - self.start, self.timeout, self.owner,
                result.holder_fence,
            )  # fmt: skip
            raise held
        mine = self.mine
        if (
            mine is not None
            and self.deadline is None
            and result.holder_fence == mine[0].fence
            and mine[0].held
            and mine[0]._renewer is not None
        ):
            if leave is not None:
                yield leave
            raise LockHeld(
                f"lock {self.name!r} is already held by this same {mine[1]} (fence "
                f"{mine[0].fence}): a second acquire would wait for itself; release "
                "the first lease, or pass it along instead of acquiring again",
                name=self.name,
            )


class _FirstTry:
    """An acquire's first try, sent by the front end itself rather than by a plan.

    Most acquires are granted at their first try: that one is then answered with no
    plan, generator or op loop at all (they cost as much client CPU as the request's
    I/O). Only a try refused, failed or answered late goes on to the plan
    (:func:`_acquire_plan`), which takes its answer as its first try's and decides
    everything from there as it always does. The decisions are made here, once; the
    sync and asyncio front ends only send :attr:`op` (``answer`` / ``aanswer``).
    """

    __slots__ = ("attempt", "granted", "op", "outcome", "sent_at")

    def __init__(self, attempt: _Attempt) -> None:
        self.attempt = attempt
        self.sent_at = attempt.clock.monotonic()
        self.op = attempt.try_op(self.sent_at, first=True)
        #: The try's answer, or what its call raised.
        self.outcome: AcquireResult | BaseException | None = None
        #: Set when the try took the lock in time: the acquire is over.
        self.granted: Granted | None = None

    def answered(self, result: AcquireResult) -> None:
        self.outcome = result
        if result.fence is not None:
            self.granted = self.attempt.in_time(result.fence, self.sent_at)

    def failed(self, error: BaseException) -> None:
        self.outcome = error

    def rest(self) -> Plan[Granted]:
        """The plan that goes on from this try's answer."""
        return _acquire_plan(self.attempt, self)


def _acquire_plan(attempt: _Attempt, first: _FirstTry | None = None) -> Plan[Granted]:
    """The acquire loop of ``attempt``'s protocol; ``first``: its first try, already sent."""
    if attempt.handoff:
        return _handoff_plan(attempt, first)
    return _plain_plan(attempt, first)


def _plain_plan(attempt: _Attempt, first: _FirstTry | None = None) -> Plan[Granted]:
    """Try; while held, wait for a release's wake-up or the holder's TTL, and try again."""
    a = attempt
    while True:
        if first is None:
            sent_at = a.clock.monotonic()
            result: AcquireResult = yield a.try_op(sent_at)
        else:
            sent_at = first.sent_at
            result = yield from _answered(a, first.outcome, give_back=False)
            first = None
        if result.fence is None:
            now = a.clock.monotonic()
            yield from a.refuse(result, now)
            yield Wait(a.name, pause(result.retry_after, now, a.deadline))
            continue
        granted = yield from a.accept(result.fence, sent_at)
        if granted is not None:
            return granted


def _handoff_plan(attempt: _Attempt, first: _FirstTry | None = None) -> Plan[Granted]:
    """Each try also queues this waiter, and the wait is a short blocking pop of the grant
    a release makes inside the server.

    A grant can land any time after the try's request was sent, so the lease counts
    from that send, never from the pop that brought it. A waiter that gives up leaves the
    queue, and one whose call fails gives back a grant that raced in. A popped fence not
    above the holder's fence that try reported is a stale grant (made before the try,
    and taken back since by a force release): the backend drops it.
    """
    a = attempt
    grant_slice = handoff_slice(a.ttl)
    queued = False
    while True:
        if first is None:
            sent_at = a.clock.monotonic()
            op = a.try_op(sent_at)
            result: AcquireResult = yield from _leaving_if_failed(a, op, give_back=a.may_give_back)
        else:
            sent_at, op = first.sent_at, first.op
            result = yield from _answered(a, first.outcome, give_back=a.may_give_back)
            first = None
        # Not queued by a try that cannot wait (timeout 0, or the deadline passed).
        queued = queued or (isinstance(op, Enqueue) and op.wait_ms > 0)
        fence = result.fence
        if fence is None:
            now = a.clock.monotonic()
            yield from a.refuse(result, now, Dequeue(a.name, a.token) if queued else None)
            if result.grant_awaited:
                continue  # that try waited its slice for the grant already
            # A slice, and no longer than the holder's TTL: a dead holder makes no release.
            block = min(grant_slice, pause(result.retry_after, now, a.deadline))
            grant = AwaitGrant(a.name, a.token, block, result.holder_fence)
            fence = yield from _leaving_if_failed(a, grant, give_back=True)
            if fence is None:
                continue  # the next try refreshes the entry (or finds the lock ours by then)
        granted = yield from a.accept(fence, sent_at)
        if granted is not None:
            return granted


def _leaving_if_failed(
    attempt: _Attempt, op: Acquire | Enqueue | AwaitGrant, *, give_back: bool
) -> Plan[Any]:
    """``op``'s answer. If it fails (a lost reply, or the waiter interrupted: cancelled,
    Ctrl-C, a task time limit) with its entry still queued and maybe a grant taken, the
    waiter leaves the queue, giving the grant back (unless ``give_back`` is false), rather
    than have the lock held by no one until its TTL runs out.

    Not after a call the server did not answer in time: a paused or cut-off server would
    keep the give-back waiting a whole socket timeout more, doubling how long an outage
    takes to report; the entry then expires, and a grant with its TTL, as a plain
    acquire's lost reply does. Nor after one whose last try could not connect,
    or that the server refused (:func:`_may_have_queued`)."""
    try:
        return (yield op)
    except GeneratorExit:
        raise
    except BaseException as exc:
        return (yield from _answered(attempt, exc, give_back=give_back))


def _answered(
    attempt: _Attempt, outcome: AcquireResult | BaseException | None, *, give_back: bool
) -> Plan[Any]:
    """A try's answer, or (``outcome`` an error) what :func:`_leaving_if_failed` does
    after a failed call: leave the queue if the call may have queued, then raise."""
    if isinstance(outcome, BaseException):
        if give_back and _may_have_queued(outcome):
            yield from _give_back(attempt.name, attempt.token)
        raise outcome
    return outcome


def _may_have_queued(exc: BaseException) -> bool:
    """Whether the failed call may have left our entry queued with the server answering:
    an interruption (not a lock error), or a connection lost mid-call. Not a refusal (the
    server ran nothing: a password, an ACL, a wrong port), nor a call that timed out or
    could not connect, where the give-back would only fail the same way."""
    if not isinstance(exc, LockError):
        return True
    return isinstance(exc, BackendUnavailable) and not (exc.timed_out or exc.unreachable)


class LockBase:
    """Configuration and the shared acquire loop of :class:`Lock` and :class:`AsyncLock`."""

    #: Private: acquire under this token instead of a fresh one. A token that already
    #: holds the lock gets it back with the same fence (a Celery run taking over its
    #: publish-time lock in one server-side step); subclasses' ``acquire`` keep working.
    _token: str | None = None
    #: Private: acquire under this new token, which the caller knows (a Celery publish
    #: frees what an acquire with no answer may have taken: ``Releaser.free_later``).
    _fresh_token: str | None = None
    #: Private: a Celery run's check, sent with each acquire (``_plan.Acquire.run``).
    _run: RunCheck | None = None

    def _run_names(self) -> tuple[str, ...]:
        """The names whose holders a run check looks at: the lock's own."""
        return (self.name,)

    def __init__(
        self,
        name: str,
        ttl: float | None = None,
        *,
        backend: str | Backend | None = None,
        timeout: float | None = None,
        on_lost: Callable[[Any], object] | None = None,
        max_hold: float | None = None,
        renew: bool = True,
        require: Collection[str] = (),
    ) -> None:
        self.name = validate_name(name)
        self.ttl = validate_ttl(ttl, name=name) if ttl is not None else None
        self.timeout = validate_timeout(timeout, name)
        self.max_hold = None if max_hold is None else validate_ttl(max_hold, "max_hold", name=name)
        self.on_lost = on_lost
        self.renew = renew
        self.require = parse_capabilities(require, name=self.name)  # a typo fails here
        if isinstance(backend, str):
            backend = resolve_backend(backend)  # a bad URL fails here, not at acquire
        if backend is not None:
            backend.check_name(self.name)  # a name it cannot store fails here too
        self._backend = backend
        self._leases: dict[object, list[Any]] = {}

    @property
    def backend(self) -> Backend:
        """The backend this lock uses, checked against ``require``
        (:class:`MissingCapability` if it lacks one)."""
        backend = resolve_backend(self._backend, name=self.name)
        backend.check_name(self.name)
        if self.require:
            missing = backend.missing(self.require)
            if missing:
                raise MissingCapability(
                    f"lock {self.name!r} requires {sorted(c.value for c in missing)}, "
                    f"which {backend!r} lacks",
                    name=self.name,
                    missing=missing,
                )
        return backend

    @property
    def effective_ttl(self) -> float:
        """The TTL in force: ``ttl`` if given, else the configured default
        (``configure(default_ttl=...)``)."""
        return self.ttl if self.ttl is not None else default_ttl()

    def _timeout(self, timeout: float | Unset | None) -> float | None:
        return self.timeout if isinstance(timeout, Unset) else validate_timeout(timeout, self.name)

    def _lease_runtime(self) -> LeaseRuntime:
        """What leases acquired now run under (:func:`task_locks.leasing.use_runtime`)."""
        return current_runtime() or process_runtime()

    def _plan(
        self,
        backend: Backend,
        timeout: float | None,
        mine: tuple[LeaseBase, str] | None = None,
    ) -> Plan[Granted]:
        """The acquire loop: try, and while held, wait for the release or the holder's TTL.

        One plan per protocol, over the same rules of when a grant is taken and when the
        acquire gives up (:class:`_Attempt`): :func:`_plain_plan`, where a release wakes
        the waiter to try again, or :func:`_handoff_plan`, where the release hands the
        lock to the queued waiter inside the server (a :class:`ServerHandoff` backend).
        ``acquire()`` sends the first try itself (:class:`_FirstTry`, :meth:`_first_try`).
        """
        return _acquire_plan(self._attempt(backend, timeout, mine))

    def _first_try(
        self,
        backend: Backend,
        timeout: float | None,
        mine: tuple[LeaseBase, str] | None = None,
    ) -> _FirstTry:
        """An acquire's first try, for the front end to send (see :class:`_FirstTry`)."""
        return _FirstTry(self._attempt(backend, timeout, mine))

    def _attempt(
        self, backend: Backend, timeout: float | None, mine: tuple[LeaseBase, str] | None
    ) -> _Attempt:
        """``mine``: a lease of this lock that the calling thread or task holds (and who
        that is): see :meth:`_Attempt.refuse`. :attr:`_token`: the token to acquire
        under (Celery's publish-time lock), see :class:`_Attempt`."""
        return _Attempt(
            self.name,
            self.effective_ttl,
            backend,
            self._lease_runtime().clock,
            timeout,
            mine,
            held_token=self._token,
            fresh_token=self._fresh_token,
            run=self._run,
        )

    def _lease(
        self, cls: type[L], backend: Backend, name: str, token: str, fence: int, sent_at: float
    ) -> L:
        """The lease for a granted acquire (not yet renewed: see :meth:`_keep`)."""
        return cls(
            name,
            token,
            fence,
            self.effective_ttl,
            backend,
            sent_at,
            on_lost=self.on_lost,
            max_hold=self.max_hold,
            runtime=self._lease_runtime(),
        )

    def _keep(self, lease: L, holder: weakref.ref[Any] | None = None) -> L:
        """Hand ``lease`` to the deadline watch (always: it marks the lease lost at its local
        deadline) and to its renewer, unless this lock was made with ``renew=False``; and
        remember which thread or task holds it."""
        lease._watch()
        if self.renew:
            lease._schedule()
        if holder is not None:
            key = (id(lease.backend), self.name, holder)
            lease._holder_key = key
            _held_by[key] = weakref.ref(lease, functools.partial(_forget_holder, key))
        return lease

    def _held_here(
        self, backend: Backend, holder: weakref.ref[Any] | None, described: str
    ) -> tuple[LeaseBase, str] | None:
        """The lease of this lock that this same thread or task holds, if any (for _plan)."""
        ref = None if holder is None else _held_by.get((id(backend), self.name, holder))
        lease = None if ref is None else ref()
        if lease is None or not lease.held or lease.token == self._token:
            return None  # none (or a hand-over to our own token: Celery's lock_on="both")
        return lease, described

    # ``with`` blocks: one stack of leases per thread (sync) or task (asyncio), so one
    # lock object can be entered again, or by several threads or tasks at once.

    def _push(self, key: object, lease: L) -> L:
        self._leases.setdefault(key, []).append(lease)
        return lease

    def _pop(self, key: object) -> Any:
        """The lease of the ``with`` block being left in this thread or task.

        A block may be left in another one than it was entered in: an async generator
        left suspended inside ``async with`` is closed at loop shutdown in a task of its
        own (``shutdown_asyncgens``, which ``asyncio.run`` calls), a generator may be
        resumed from another thread. Its lease is then the only one this lock object has
        out (always so for a :class:`Lock`, which is not re-entrant); with several out
        (a semaphore's permits), which is meant cannot be told, and none is released."""
        if key not in self._leases:
            stacks = list(self._leases.items())
            out = sum(len(stack) for _, stack in stacks)
            if out != 1:
                raise LockError(
                    f"lock {self.name!r}: a with block was left in another thread or task "
                    f"than it entered, and this lock object has {out} leases out, so which "
                    "one to release is unknown: none is (enter and leave a with block in one "
                    "thread or task; close an async generator holding a lock before its "
                    "loop ends)",
                    name=self.name,
                )
            key = stacks[0][0]
        stack = self._leases[key]
        lease = stack.pop()
        if not stack:
            del self._leases[key]
        return lease

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} ttl={self.effective_ttl}>"


def unless_held(attempt: Callable[[], T]) -> T | None:
    """``attempt()`` (a ``timeout=0`` acquire or campaign), or ``None`` where it met
    :class:`LockHeld`: what every ``try_...`` method means by one attempt, in one place."""
    try:
        return attempt()
    except LockHeld:
        return None


async def aunless_held(attempt: Awaitable[T]) -> T | None:
    """The asyncio twin of :func:`unless_held`."""
    try:
        return await attempt
    except LockHeld:
        return None


class _SyncAcquire(LockBase, Generic[SL]):
    """``try_acquire`` and ``with`` over a sync ``acquire``, written once for the sync lock
    types (:class:`Lock`, :class:`~task_locks.Semaphore`): they differ only in how they
    acquire, and a fix to the per-thread stack of ``with`` blocks must reach both."""

    def acquire(self, timeout: float | Unset | None = UNSET) -> SL:
        raise NotImplementedError

    def try_acquire(self) -> SL | None:
        """One attempt: what :meth:`acquire` returns, or ``None`` if it is taken."""
        return unless_held(lambda: self.acquire(timeout=0))

    def __enter__(self) -> SL:
        return self._push(threading.get_ident(), self.acquire())

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._pop(threading.get_ident()).__exit__(exc_type, exc, tb)


class _AsyncAcquire(LockBase, Generic[AL]):
    """The asyncio twin of :class:`_SyncAcquire` (one stack of ``async with`` blocks per
    task), for :class:`AsyncLock` and :class:`~task_locks.AsyncSemaphore`."""

    async def acquire(self, timeout: float | Unset | None = UNSET) -> AL:
        raise NotImplementedError

    async def try_acquire(self) -> AL | None:
        """One attempt: what :meth:`acquire` returns, or ``None`` if it is taken."""
        return await aunless_held(self.acquire(timeout=0))

    async def __aenter__(self) -> AL:
        return self._push(asyncio.current_task(), await self.acquire())

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._pop(asyncio.current_task()).__aexit__(exc_type, exc, tb)


class Lock(_SyncAcquire[Lease]):
    """A named distributed lock. ``acquire()`` (or ``with``) returns a :class:`Lease`.

    Making a ``Lock`` takes nothing and sends nothing; bad arguments are refused here, with
    :class:`InvalidArgument` naming what was wrong, never at the first acquire.

    :param name: the lock's name, the same lock wherever it is used with the same backend
        (a non-empty string without control characters; the backend's prefix goes before it).
    :param ttl: seconds a dead holder keeps the lock (at most one year); live holders are
        renewed at ttl/3. ``None``: the configured default (``configure(default_ttl=...)``,
        30 s).
    :param backend: a backend URL (``redis://...``) or a :class:`Backend`; ``None``: the
        configured one (``configure(backend=...)``, ``TASK_LOCKS_URL``, or with Django
        ``TASK_LOCKS["BACKEND"]``), else :class:`NotConfigured` at the first acquire.
    :param timeout: the default wait of ``acquire()`` and ``with``, in seconds: ``None``
        waits as long as it takes, ``0`` tries once.
    :param on_lost: called with the lease when it is lost (renewals did not get through
        before its local deadline, a force release: at once where the backend announces
        it, else at the next renewal; ``max_hold``), where the loss is noticed
        (a background thread, or the lease's event loop: a coroutine it returns is run
        there); ``lease.lost`` is set either way.
    :param max_hold: seconds after the acquire at which the lease is marked lost and the
        lock released at once: a bound on a hung holder. ``None``: no bound.
    :param renew: ``False`` leaves the lease unrenewed: it ends at its TTL (for a holder
        that renews itself with ``lease.renew()``, or a test of a paused one).
    :param require: capabilities the backend must have (``"fencing"``, ``"consensus"``,
        ``"multiprocess"``, ``"wakeup"``, ``"holders"``, ``"release_notice"``,
        ``"server_handoff"``, or :class:`Capability` members);
        an unknown name is refused here, a missing one raises :class:`MissingCapability`.
    """

    def acquire(self, timeout: float | Unset | None = UNSET) -> Lease:
        """Take the lock, waiting up to ``timeout`` seconds; raise :class:`LockHeld` if not.

        In a thread that already holds this lock, :class:`LockHeld` is raised at once: the
        lock is not re-entrant, and waiting would wait for itself.
        """
        backend = self.backend
        thread = threading.current_thread()
        holder = weakref.ref(thread)
        mine = self._held_here(backend, holder, f"thread ({thread.name})")
        first = self._first_try(backend, self._timeout(timeout), mine)
        try:
            try:
                first.answered(answer(first.op, backend))
            except BaseException as exc:  # the plan decides (a give-back), then raises
                first.failed(exc)
            granted = first.granted
            if granted is None:
                granted = run_against(first.rest(), backend)
        except BackendUnavailable as exc:
            events.emit(events.Error(name=self.name, backend=backend.server, reason=str(exc)))
            raise
        return self._keep(self._lease(Lease, backend, self.name, *granted), holder)

    def holder(self) -> Holder | None:
        """Who holds the lock now, if anyone (one round trip)."""
        return self.backend.holder(self.name)


class AsyncLock(_AsyncAcquire[AsyncLease]):
    """The asyncio twin of :class:`Lock`: same arguments, same semantics."""

    async def acquire(self, timeout: float | Unset | None = UNSET) -> AsyncLease:
        """Take the lock, waiting up to ``timeout`` seconds; raise :class:`LockHeld` if not.

        In a task that already holds this lock, :class:`LockHeld` is raised at once: the lock
        is not re-entrant. The lease is renewed by a task of the running event loop.
        """
        backend = self.backend
        task = asyncio.current_task()
        holder = None if task is None else weakref.ref(task)
        name = task.get_name() if task is not None else "?"
        mine = self._held_here(backend, holder, f"task ({name})")
        first = self._first_try(backend, self._timeout(timeout), mine)
        try:
            try:
                first.answered(await aanswer(first.op, backend))
            except BaseException as exc:  # the plan decides (a give-back), then raises
                first.failed(exc)
            granted = first.granted
            if granted is None:
                granted = await arun_against(first.rest(), backend)
        except BackendUnavailable as exc:
            events.emit(events.Error(name=self.name, backend=backend.server, reason=str(exc)))
            raise
        return self._keep(self._lease(AsyncLease, backend, self.name, *granted), holder)

    async def holder(self) -> Holder | None:
        """Who holds the lock now, if anyone (one round trip)."""
        return await self.backend.aholder(self.name)
