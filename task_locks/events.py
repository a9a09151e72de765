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
import contextlib
import contextvars
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from .types import Owner, parse_slot

log = logging.getLogger("task_locks.events")

#: What can happen to a lock. ``conflict`` carries the policy taken (skip, retry, wait,
#: raise, exit 75...), ``lost`` the reason, ``acquired`` how long it waited, ``released``
#: how long it was held.
EVENT_KINDS: Final = (
    "acquired",
    "conflict",
    "released",
    "lost",
    "forced",
    "renewal_failed",
    "renewal_late",
    "duplicate",
    "error",
    "renewed",
)
#: ``released`` with this reason: the lease went on to another process (a published task's
#: worker, a beat tick's claim kept to its TTL) instead of being freed; this process no
#: longer holds it, and it is not lost.
HANDED_OVER: Final = "handed_over"
#: Events waiting for the dispatcher; past this, new ones are dropped and counted.
QUEUE_SIZE: Final = 10_000
#: Events handed to a batch subscriber at once.
BATCH: Final = 500
#: At most one warning about drops or failing subscribers per this many seconds.
WARN_EVERY: Final = 10.0


@dataclass(frozen=True, slots=True)
class LockEvent:
    """Something that happened to one lock, as operators and metrics see it."""

    kind: str
    name: str
    #: The backend's URL without its password.
    backend: str = ""
    fence: int | None = None
    owner: Owner | None = None
    #: ``acquired``/``conflict``: seconds spent waiting; ``released``/``lost``: held for.
    waited: float | None = None
    held: float | None = None
    #: ``conflict``: the policy taken (``skip``, ``retry``, ``wait``, ``raise``, ``exit``...).
    policy: str = ""
    #: ``lost``, ``renewal_failed``, ``error``: why. ``released``: :data:`HANDED_OVER` when
    #: the lock went on to another process (a queued task's worker) instead of being freed.
    reason: str = ""
    #: Who acted (an operator's user name, a command) and free text.
    actor: str = ""
    detail: str = ""
    #: ``renewed``, ``renewal_late``: the round trip of the renewal, seconds.
    duration: float | None = None
    #: ``conflict``: how long the caller was willing to wait (``0``: it tried once and gave
    #: up at once, a conflict; more: it waited that long in vain, a timeout).
    timeout: float | None = None
    at: float = field(default_factory=time.time)

    @property
    def family(self) -> str:
        """The lock name's family, a metrics label: the part before the first ``:``
        (``sync:42`` -> ``sync``); for a semaphore's slot, its semaphore's family
        (``semaphore:export:7#2`` -> ``export``), so each semaphore has its own label."""

        slot = parse_slot(self.name)
        return (self.name if slot is None else slot[0]).split(":", 1)[0]


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
        raise ValueError(f"unknown lock event kind(s) {unknown}; known: {list(EVENT_KINDS)}")
    subscription = Subscription(
        callback, chosen, batch, name or getattr(callback, "__qualname__", repr(callback))
    )
    with _subscribe_guard:
        _replace_subscriptions((*_hub.subscriptions, subscription))
    return subscription


def unsubscribe(subscription: Subscription) -> None:
    with _subscribe_guard:
        _replace_subscriptions(tuple(s for s in _hub.subscriptions if s is not subscription))


def _replace_subscriptions(subscriptions: tuple[Subscription, ...]) -> None:
    # Readers (emit, the dispatcher) see either the old tuple or the new one, never a
    # half-updated one: both are swapped in one assignment each.
    _hub.subscriptions = subscriptions
    _hub.wanted = frozenset().union(*(s.kinds for s in subscriptions))


@dataclass(frozen=True, slots=True)
class Context:
    """What a front end says about the locks it takes: the policy it applies to a conflict
    (``skip``, ``retry``, ``wait``, ``raise``, ``exit``; ``""``: a conflict here is
    routine, as an election follower's, and is not reported) and a detail for the audit."""

    policy: str = "raise"
    detail: str = ""


_DEFAULT_CONTEXT: Final = Context()
_context: contextvars.ContextVar[Context | None] = contextvars.ContextVar(
    "task_locks_event_context", default=None
)


@contextlib.contextmanager
def context(policy: str = "raise", detail: str = "") -> Iterator[Context]:
    """Within this block, lock events carry ``policy`` (conflicts) and ``detail``."""
    entered = Context(policy, detail)
    token = _context.set(entered)
    try:
        yield entered
    finally:
        _context.reset(token)


def current_context() -> Context:
    return _context.get() or _DEFAULT_CONTEXT


def wanted(kind: str) -> bool:
    """Whether any subscriber wants ``kind`` (callers skip building costly fields if not)."""
    return kind in _hub.wanted


def emit(kind: str, name: str, **fields: object) -> None:
    """Report that ``kind`` happened to lock ``name``; never blocks, never raises."""
    if kind not in _hub.wanted:
        return
    try:
        event = LockEvent(kind, name, **fields)  # type: ignore[arg-type]
    except TypeError:
        log.exception("bad lock event %r for %r", kind, name)
        return
    _hub.put(event)


#: What :func:`log_events` logs by default: the events nobody's call reports.
LOG_LEVELS: Final[Mapping[str, int]] = MappingProxyType(
    {
        "lost": logging.WARNING,
        "renewal_failed": logging.WARNING,
        "renewal_late": logging.WARNING,
    }
)


def _log_message(event: LockEvent) -> str:
    name, kind = event.name, event.kind
    if kind == "lost":
        by = f" ({event.detail})" if event.detail else ""
        return f"lock {name!r} (fence {event.fence}) lost: {event.reason}{by}"
    if kind == "renewal_failed":
        return f"renewing lock {name!r} failed, will retry: {event.reason}"
    if kind == "renewal_late":
        return (
            f"renewing lock {name!r} took {event.duration or 0:.3f}s, over "
            f"{event.detail or 'a large share of its TTL'}: the backend is slow"
        )
    if kind == "forced":
        by = f" by {event.actor}" if event.actor else ""
        return f"lock {name!r} (fence {event.fence}) force-released{by}: {event.detail}"
    parts = [f"lock {name!r}: {kind}"]
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
    "EVENT_KINDS",
    "HANDED_OVER",
    "LOG_LEVELS",
    "Context",
    "LockEvent",
    "Subscription",
    "context",
    "current_context",
    "dropped",
    "emit",
    "flush",
    "log_events",
    "logging_subscription",
    "subscribe",
    "unsubscribe",
    "wanted",
]
