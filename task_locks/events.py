"""One stream of lock events, off the critical path, for audit rows, metrics and logs.

Every front end (``Lock``/``AsyncLock``, ``@singleton_task``, ``LockedCommand``,
``Election``, ``Semaphore``, the beat scheduler, both CLIs, the admin) reports what
happened to a lock with :func:`emit`. Subscribers (:func:`subscribe`) receive the events
in a background dispatcher thread, never on the lock's path:

- :func:`emit` with no subscriber for that kind returns at once and allocates nothing;
- otherwise it puts the event on a bounded queue and returns; when the queue is full
  the event is dropped and counted (:func:`dropped`), with a rate-limited warning, so a
  slow subscriber can never slow down or block a lock operation;
- a subscriber that raises is logged (rate-limited) and keeps its subscription: it can
  never fail a lock operation, and one bad subscriber does not starve the others.

A forked child starts with an empty queue and its own dispatcher; it keeps the parent's
subscriptions (a Celery prefork child reports through the subscribers its parent set up).

Logging is one subscriber among the others (:func:`log_events`, installed at import): it
logs what happens to a lease in the background, where no caller's return value or
exception says so (``lost``, ``renewal_failed``, ``renewal_late``), at WARNING on the
``task_locks.events`` logger. What a caller sees (a lock acquired, a conflict, a duplicate,
a release) is logged once by the front end that acted on it (``task_locks.lock`` at DEBUG,
a skipped task at INFO...), and a force release by the backend that did it (for every
caller, the API's included), never again here: nothing is logged twice.
"""

from __future__ import annotations

import atexit
import contextvars
import enum
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar, Final

from .types import Owner, parse_slot

log = logging.getLogger("task_locks.events")


class EventKind(enum.StrEnum):
    """What can happen to a lock: each kind is one event class below (its ``kind``).

    A ``str`` enum: the values are the public names (``TASK_LOCKS["AUDIT"]``, audit rows,
    :func:`subscribe`'s ``kinds``), and ``EventKind.LOST == "lost"``.
    """

    ACQUIRED = "acquired"
    CONFLICT = "conflict"
    RELEASED = "released"
    LOST = "lost"
    FORCED = "forced"
    RENEWAL_FAILED = "renewal_failed"
    RENEWAL_LATE = "renewal_late"
    DUPLICATE = "duplicate"
    ERROR = "error"
    RENEWED = "renewed"


class LostReason(enum.StrEnum):
    """Why a lease was lost, as the code that found it decided (the ``reason`` label of
    ``task_locks_lost_total``); :attr:`Lost.message` says it in words."""

    #: ``max_hold`` exceeded: the lease was given up and the lock released.
    MAX_HOLD = "max_hold"
    #: Renewals failed until the TTL ran out (or ``run`` stopped its program before the
    #: deadline, renewals not getting through).
    UNREACHABLE = "unreachable"
    #: No renewal answered in time: a stalled link, a paused process, a ``renew=False``
    #: lease held past its TTL, a renewal's reply after the deadline.
    DEADLINE = "deadline"
    #: The token was gone before the TTL ran out: a force release, a server restart or
    #: failover.
    FORCED = "forced"
    #: A release got no reply: the lock may be free already.
    UNKNOWN = "unknown"
    #: A renewed lease was garbage-collected while held.
    DROPPED = "dropped"
    #: Reported from outside the lease (an audit record naming no reason).
    OTHER = "other"


class ReleaseReason(enum.StrEnum):
    """How a lease ended without being lost: freed, or handed over."""

    FREED = ""
    #: The lease went on to another process (a published task's worker, a beat tick's
    #: claim kept to its TTL) instead of being freed; this process no longer holds it,
    #: and it is not lost.
    HANDED_OVER = "handed_over"


#: Every kind, in :class:`EventKind` order (the ``str`` values work too).
EVENT_KINDS: Final = tuple(EventKind)
#: :class:`Released` with this reason: handed over (:attr:`ReleaseReason.HANDED_OVER`).
HANDED_OVER: Final = ReleaseReason.HANDED_OVER
#: Events waiting for the dispatcher; past this, new ones are dropped and counted.
QUEUE_SIZE: Final = 10_000
#: Events handed to a batch subscriber at once.
BATCH: Final = 500
#: At most one warning about drops or failing subscribers per this many seconds.
WARN_EVERY: Final = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class LockEvent:
    """Something that happened to one lock, as operators and metrics see it.

    The base of the event classes (one per :class:`EventKind`, its class attribute
    ``kind``), each frozen and carrying only its own fields, checked where it is made.
    Read them with ``match``; the fields a kind does not carry read as ``None``/``""``
    here, so a subscriber that looks at every event can read any of them.
    """

    kind: ClassVar[EventKind]
    name: str
    #: The backend's URL without its password.
    backend: str = ""
    fence: int | None = None
    owner: Owner | None = None
    #: Who acted (an operator's user name, a command) and what the front end said.
    actor: str = ""
    detail: str = ""
    at: float = field(default_factory=time.time)

    @property
    def waited(self) -> float | None:
        """:class:`Acquired`, :class:`Conflict`: seconds spent waiting."""
        return None

    @property
    def held(self) -> float | None:
        """:class:`Released`, :class:`Lost`: seconds the lease was held."""
        return None

    @property
    def policy(self) -> str:
        """:class:`Conflict`: the front end's policy (``skip``, ``wait``, ``exit``...)."""
        return ""

    @property
    def reason(self) -> str:
        """:class:`Lost`: a :class:`LostReason`; :class:`Released`: a
        :class:`ReleaseReason`; :class:`RenewalFailed`, :class:`Error`: the error."""
        return ""

    @property
    def timeout(self) -> float | None:
        """:class:`Conflict`: how long the caller was willing to wait."""
        return None

    @property
    def duration(self) -> float | None:
        """:class:`Renewed`, :class:`RenewalLate`: the renewal's round trip, seconds."""
        return None

    @property
    def family(self) -> str:
        """The lock name's family, a metrics label: the part before the first ``:``
        (``sync:42`` -> ``sync``); for a semaphore's slot, its semaphore's family
        (``semaphore:export:7#2`` -> ``export``), so each semaphore has its own label."""

        slot = parse_slot(self.name)
        return (self.name if slot is None else slot[0]).split(":", 1)[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class Acquired(LockEvent):
    """A lock (or a semaphore's permit) taken, after ``waited`` seconds (from the first
    try: a wait that met a holder and then got the lock is this, not a conflict)."""

    kind: ClassVar[EventKind] = EventKind.ACQUIRED
    waited: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Conflict(LockEvent):
    """An acquire given up: at once (``timeout`` 0, a skip) or after waiting ``timeout``
    in vain, with the front end's ``policy``."""

    kind: ClassVar[EventKind] = EventKind.CONFLICT
    waited: float | None = None
    timeout: float | None = None
    policy: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Released(LockEvent):
    """A lease freed (or handed over to another process), ``held`` seconds after it was taken."""

    kind: ClassVar[EventKind] = EventKind.RELEASED
    held: float | None = None
    reason: ReleaseReason = ReleaseReason.FREED


@dataclass(frozen=True, slots=True, kw_only=True)
class Lost(LockEvent):
    """A lease lost: ``reason`` as the code decided it, ``message`` in words."""

    kind: ClassVar[EventKind] = EventKind.LOST
    held: float | None = None
    reason: LostReason = LostReason.OTHER
    message: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Forced(LockEvent):
    """An operator force-released the lock (``actor``, ``detail``)."""

    kind: ClassVar[EventKind] = EventKind.FORCED


@dataclass(frozen=True, slots=True, kw_only=True)
class RenewalFailed(LockEvent):
    """A renewal could not reach the server (``reason``); it is retried while time remains."""

    kind: ClassVar[EventKind] = EventKind.RENEWAL_FAILED
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class RenewalLate(LockEvent):
    """A renewal took ``duration`` seconds, a large share of the TTL (``detail``)."""

    kind: ClassVar[EventKind] = EventKind.RENEWAL_LATE
    duration: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Duplicate(LockEvent):
    """A publish dropped: the key's lock is held by a queued or running task."""

    kind: ClassVar[EventKind] = EventKind.DUPLICATE


@dataclass(frozen=True, slots=True, kw_only=True)
class Error(LockEvent):
    """An acquire failed on the backend (``reason``: the ``BackendUnavailable``)."""

    kind: ClassVar[EventKind] = EventKind.ERROR
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Renewed(LockEvent):
    """One renewal batch answered, in ``duration`` seconds (``name``: its first lease)."""

    kind: ClassVar[EventKind] = EventKind.RENEWED
    duration: float | None = None


Subscriber = Callable[[LockEvent], object]
BatchSubscriber = Callable[[Sequence[LockEvent]], object]


@dataclass(eq=False)
class Subscription:
    """A subscriber and the kinds it wants; :meth:`close` ends it."""

    callback: Callable[..., object]
    kinds: frozenset[str]
    batch: bool
    name: str
    #: When its last failure was logged (failures are logged once per WARN_EVERY).
    warned_at: float = -WARN_EVERY

    def close(self) -> None:
        unsubscribe(self)


class _Hub:
    """The subscribers, the queue and the dispatcher thread of this process."""

    def __init__(self, subscriptions: tuple[Subscription, ...] = ()) -> None:
        self.subscriptions = subscriptions
        self.wanted: frozenset[str] = frozenset().union(*(s.kinds for s in subscriptions))
        # Unbounded itself: ``pending`` (counted under the guard) is the bound.
        self.queue: queue.SimpleQueue[LockEvent] = queue.SimpleQueue()
        self.guard = threading.Lock()
        self.idle = threading.Condition(self.guard)
        self.pending = 0
        self.dropped = 0
        self.thread: threading.Thread | None = None
        self._warned_at = -WARN_EVERY

    # -- producer side (any thread, on the lock's path: cheap and never blocking) ------

    def put(self, event: LockEvent) -> None:
        with self.guard:
            if self.pending >= QUEUE_SIZE:
                self.dropped += 1
                self._warn_drop()
                return
            self.pending += 1
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, name="task-locks-events", daemon=True
                )
                self.thread.start()
        self.queue.put_nowait(event)

    def _warn_drop(self) -> None:
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY:
            self._warned_at = now
            log.warning(
                "lock event queue full (%d events): dropped %d so far; a subscriber is too slow",
                QUEUE_SIZE,
                self.dropped,
            )

    # -- the dispatcher thread ---------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                batch = [self.queue.get(timeout=5.0)]
            except queue.Empty:
                with self.guard:
                    if self.pending == 0:
                        self.thread = None
                        return
                continue
            while len(batch) < BATCH:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            self._deliver(batch)
            with self.guard:
                self.pending -= len(batch)
                self.idle.notify_all()

    def _deliver(self, batch: list[LockEvent]) -> None:
        for subscription in self.subscriptions:
            wanted = [e for e in batch if e.kind in subscription.kinds]
            if not wanted:
                continue
            try:
                if subscription.batch:
                    subscription.callback(wanted)
                else:
                    for event in wanted:
                        subscription.callback(event)
            except Exception:
                now = time.monotonic()
                if now - subscription.warned_at >= WARN_EVERY:
                    subscription.warned_at = now
                    log.exception("lock event subscriber %s failed", subscription.name)

    def flush(self, timeout: float) -> bool:
        with self.idle:
            return self.idle.wait_for(lambda: self.pending <= 0, timeout)


_hub = _Hub()
_subscribe_guard = threading.Lock()


def subscribe(
    callback: Subscriber | BatchSubscriber,
    kinds: Collection[str] | None = None,
    *,
    batch: bool = False,
    name: str = "",
) -> Subscription:
    """Call ``callback`` (in the dispatcher thread) for each event of ``kinds`` (all if None).

    With ``batch=True`` it receives a list of events at a time (an audit writer's
    ``bulk_create``). Returns a :class:`Subscription`; ``close()`` it to stop.
    """
    chosen = frozenset(EVENT_KINDS if kinds is None else kinds)
    unknown = sorted(chosen - set(EVENT_KINDS))
    if unknown:
        known = [str(kind) for kind in EVENT_KINDS]
        raise ValueError(f"unknown lock event kind(s) {unknown}; known: {known}")
    subscription = Subscription(
        callback, chosen, batch, name or getattr(callback, "__qualname__", repr(callback))
    )
    with _subscribe_guard:
        _replace_subscriptions((*_hub.subscriptions, subscription))
    return subscription


def unsubscribe(subscription: Subscription) -> None:
    with _subscribe_guard:
        _replace_subscriptions(tuple(s for s in _hub.subscriptions if s is not subscription))


def subscriptions() -> tuple[Subscription, ...]:
    """Every open subscription, the logging one among them: what a test closes to leave
    only that one behind, or an operator lists to see who reads the stream."""
    return _hub.subscriptions


def _replace_subscriptions(subscriptions: tuple[Subscription, ...]) -> None:
    # Readers (emit, the dispatcher) see either the old tuple or the new one, never a
    # half-updated one: both are swapped in one assignment each.
    _hub.subscriptions = subscriptions
    _hub.wanted = frozenset().union(*(s.kinds for s in subscriptions))


@dataclass(frozen=True, slots=True)
class Context:
    """What a front end says about the locks it takes: the policy it applies to a conflict
    (``skip``, ``retry``, ``wait``, ``raise``, ``exit``; ``""``: a conflict here is
    routine, as an election follower's, or not the last word, as the first try of a
    wait, and is not reported) and a detail for the audit. ``since``: when the front
    end's first try began (monotonic), the start of an ``acquired`` event's wait."""

    policy: str = "raise"
    detail: str = ""
    since: float | None = None


_DEFAULT_CONTEXT: Final = Context()
_context: contextvars.ContextVar[Context | None] = contextvars.ContextVar(
    "task_locks_event_context", default=None
)


class context:
    """Within this block, lock events carry ``policy`` (conflicts), ``detail``, and wait
    times counted from ``since`` (see :class:`Context`); ``as`` gives that Context.

    A class, not ``@contextmanager``: each try of a front end enters one."""

    __slots__ = ("_entered", "_token")

    def __init__(
        self, policy: str = "raise", detail: str = "", since: float | None = None
    ) -> None:
        self._entered = Context(policy, detail, since)
        self._token: contextvars.Token[Context | None] | None = None

    def __enter__(self) -> Context:
        if self._token is not None:  # its token would be lost: the outer one never reset
            raise RuntimeError("this events.context is already entered: make one per block")
        self._token = _context.set(self._entered)
        return self._entered

    def __exit__(self, *exc: object) -> None:
        token, self._token = self._token, None
        if token is not None:
            _context.reset(token)


def current_context() -> Context:
    return _context.get() or _DEFAULT_CONTEXT


def wanted(kind: str) -> bool:
    """Whether any subscriber wants ``kind`` (callers skip building costly fields if not)."""
    return kind in _hub.wanted


def emit(event: LockEvent) -> None:
    """Report ``event``; never blocks, never raises (build it only if :func:`wanted`)."""
    if event.kind in _hub.wanted:
        _hub.put(event)


#: What :func:`log_events` logs by default: the events nobody's call reports.
LOG_LEVELS: Final[Mapping[str, int]] = MappingProxyType(
    {
        EventKind.LOST: logging.WARNING,
        EventKind.RENEWAL_FAILED: logging.WARNING,
        EventKind.RENEWAL_LATE: logging.WARNING,
    }
)


def _log_message(event: LockEvent) -> str:
    name = event.name
    match event:
        case Lost(fence=fence, message=message, detail=detail):
            by = f" ({detail})" if detail else ""
            return f"lock {name!r} (fence {fence}) lost: {message}{by}"
        case RenewalFailed(reason=reason):
            return f"renewing lock {name!r} failed, will retry: {reason}"
        case RenewalLate(duration=duration, detail=detail):
            return (
                f"renewing lock {name!r} took {duration or 0:.3f}s, over "
                f"{detail or 'a large share of its TTL'}: the backend is slow"
            )
        case Forced(fence=fence, actor=actor, detail=detail):
            by = f" by {actor}" if actor else ""
            return f"lock {name!r} (fence {fence}) force-released{by}: {detail}"
    parts = [f"lock {name!r}: {event.kind}"]
    parts += [f"{k} {v}" for k, v in (("policy", event.policy), ("reason", event.reason)) if v]
    return "; ".join(parts + ([event.detail] if event.detail else []))


def log_events(
    levels: Mapping[str, int] = LOG_LEVELS, logger: logging.Logger | None = None
) -> Subscription:
    """Subscribe a logger (default ``task_locks.events``) to the kinds of ``levels``, each
    logged at its level. Installed at import with :data:`LOG_LEVELS`; close
    :data:`logging_subscription` to replace it (another logger, more kinds). Adding a
    kind a front end already logs (``acquired``...) logs that event twice."""
    target = log if logger is None else logger
    chosen = dict(levels)

    def write(event: LockEvent) -> None:
        level = chosen[event.kind]
        if target.isEnabledFor(level):
            target.log(level, "%s", _log_message(event))

    return subscribe(write, chosen, name=f"logging {target.name}")


#: The logging subscriber installed at import (see the module doc).
logging_subscription: Final = log_events()


def dropped() -> int:
    """Events dropped because the queue was full, since the process started."""
    return _hub.dropped


def flush(timeout: float = 5.0) -> bool:
    """Wait until every queued event reached its subscribers; ``False`` on timeout."""
    return _hub.flush(timeout)


def _after_fork_in_child() -> None:
    global _hub, _subscribe_guard
    _hub = _Hub(_hub.subscriptions)
    _subscribe_guard = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(flush, 2.0)

__all__ = [
    "BATCH",
    "EVENT_KINDS",
    "HANDED_OVER",
    "LOG_LEVELS",
    "QUEUE_SIZE",
    "Acquired",
    "Conflict",
    "Context",
    "Duplicate",
    "Error",
    "EventKind",
    "Forced",
    "LockEvent",
    "Lost",
    "LostReason",
    "ReleaseReason",
    "Released",
    "RenewalFailed",
    "RenewalLate",
    "Renewed",
    "Subscription",
    "context",
    "current_context",
    "dropped",
    "emit",
    "flush",
    "log_events",
    "logging_subscription",
    "subscribe",
    "subscriptions",
    "unsubscribe",
    "wanted",
]
