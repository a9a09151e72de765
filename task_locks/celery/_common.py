"""What :mod:`~task_locks.celery.task` and :mod:`~task_locks.celery.publish` share.

The publish guard (enqueue time) and the task (run time) speak about the same message
headers, states and hand-overs; both import them from here, below them both, so neither
imports the other's module for them (so that no import cycle forms). ``task`` imports
``publish`` (it installs the guard), never the other way round: the guard recognises a
singleton task by :class:`LockedTask`.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Final, Protocol

from kombu.utils.json import register_type

from ..context import AnyLease, current_lease
from ..errors import LockHeld
from ..policies import ON_CONFLICT

if TYPE_CHECKING:
    from ..backends.base import Backend

#: The word skipped runs are reported with (the worker's INFO line, :class:`Skipped`'s
#: ``state``). A skipped run no longer *ends* in this custom state, which Celery never
#: counts as ready (``.get()`` hung, chords never fired): it ends ``SUCCESS`` with a
#: :class:`Skipped` result, or ``FAILURE`` with :class:`DuplicateTask` (``skip_as``).
SKIPPED: Final = "SKIPPED"
#: ``skip_as``: how a skipped run ends, in Celery's own states.
SKIP_AS: Final = ("success", "failure")
#: ``on_lost``: what a run does when its lock is lost while the body runs.
ON_LOST: Final = ("interrupt", "fail", "ignore")
#: The word a beat tick refused as sent under an old leader's term is reported with (the
#: worker's WARNING line, :class:`StaleTick`'s ``state``). Like :data:`SKIPPED` it is no
#: longer a state a run ends in (Celery never counts a custom state as ready): the run
#: ends ``SUCCESS`` with a :class:`StaleTick` result, or ``FAILURE`` with
#: :class:`DuplicateTask` (``skip_as="failure"``).
STALE_TICK: Final = "STALE_TICK"
LOCK_ON: Final = ("run", "enqueue", "both")
#: Message header carrying the token of the lock taken at publish time.
TOKEN_HEADER: Final = "task_locks_token"
#: Message header carrying the fence of that lock (to tell if it expired before the run).
FENCE_HEADER: Final = "task_locks_fence"

#: Leases a ``lock_on="both"`` run handed to its own retry message -> seconds to keep them.
_parked_for_retry: weakref.WeakKeyDictionary[AnyLease, float] = weakref.WeakKeyDictionary()


class LockedTask:
    """Marker base of :class:`~task_locks.celery.SingletonTask`: what the publish guard
    checks for, without importing the task module."""

    __slots__ = ()


class LockingTask(Protocol):
    """What the modules below :mod:`~task_locks.celery.task` (the publish guard, the
    recovery in the worker's main process, the signal handlers, the outage probe) may use
    of a singleton task: its options, Celery's own members, and these public methods,
    never its private ones (a test reads the package's source for that)."""

    name: str
    lock_on: str
    on_conflict: str
    lock_unavailable: str
    wait_timeout: float | None
    enqueue_ttl: float | None
    lock_backend: Any

    @property
    def request(self) -> Any: ...
    def lock_name(self, /, *args: Any, **kwargs: Any) -> str: ...
    def held_lock_names(self, name: str, task_id: str | None = None) -> list[str]: ...
    def resolved_lock_backend(self) -> Backend: ...


class DuplicateTask(LockHeld):
    """A publish was dropped because the same key is already queued (or running), or,
    with ``skip_as="failure"``, a run was skipped because its key was held or refused as
    a possible second send of its beat tick (:class:`StaleTick`).

    ``existing`` is the :class:`~celery.result.AsyncResult` of the task that holds the
    key, when its id is known. ``apply_async``/``delay`` return it instead of raising
    unless ``on_conflict="raise"``; ``app.send_task`` raises this error.
    """

    def __init__(
        self, message: str, *, name: str | None = None, holder: Any = None, existing: Any = None
    ) -> None:
        super().__init__(message, name=name, holder=holder)
        self.existing = existing


class _NotRun:
    """What :class:`Skipped` and :class:`StaleTick` share: the result of a run that did not
    run its body, falsy and compared by value, carried by ``json`` (a registered kombu
    type each) and ``pickle``."""

    __slots__ = ()
    _fields: ClassVar[tuple[str, ...]] = ()

    def as_dict(self) -> dict[str, Any]:
        """Its fields, as the ``json`` serializer carries them."""
        return {name: getattr(self, name) for name in self._fields}

    def __reduce__(self) -> tuple[type[_NotRun], tuple[Any, ...]]:
        return type(self), tuple(getattr(self, name) for name in self._fields)

    def __bool__(self) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _NotRun)
            and type(other) is type(self)
            and self.as_dict() == other.as_dict()
        )

    def __hash__(self) -> int:
        return hash((type(self), *self.as_dict().values()))


class Skipped(_NotRun):
    """The result of a run skipped because its key was held (``on_conflict="skip"``).

    ``AsyncResult.get()`` of a skipped call returns one (state ``SUCCESS``), a chain
    passes it to the next task and a chord's callback gets it in its list. It is falsy,
    compares by value, and survives the ``json`` serializer (a registered kombu type:
    the reading side must have imported :mod:`task_locks.celery`, else it gets the dict
    ``{"__type__": "task_locks.skipped", "__value__": {...}}``) and ``pickle``.
    """

    __slots__ = ("holder", "holder_task_id", "lock")
    _fields = ("lock", "holder_task_id", "holder")
    #: The word the worker's log line uses (:data:`SKIPPED`).
    state: Final = SKIPPED

    def __init__(
        self, lock: str, holder_task_id: str | None = None, holder: str | None = None
    ) -> None:
        self.lock = lock
        self.holder_task_id = holder_task_id
        self.holder = holder

    def __repr__(self) -> str:
        return f"Skipped(lock={self.lock!r}, holder_task_id={self.holder_task_id!r})"


class StaleTick(_NotRun):
    """The result of a beat tick refused because it may be a second send of its tick.

    A message sent under an election term older than the current leader's, whose tick
    claim is gone (:mod:`task_locks.celery.beat`), does not run. Like a skipped run it
    ends ready: ``SUCCESS`` with this as its result, or with ``skip_as="failure"``
    ``FAILURE`` with :class:`DuplicateTask`. Falsy, compared by value, carried by the
    ``json`` serializer (kombu type ``task_locks.stale_tick``) and ``pickle``.
    """

    __slots__ = ("current_term", "election", "term", "tick")
    _fields = ("election", "tick", "term", "current_term")
    #: The word the worker's WARNING line and the docs use (:data:`STALE_TICK`).
    state: Final = STALE_TICK

    def __init__(self, election: str, tick: str, term: int, current_term: int) -> None:
        self.election = election
        self.tick = tick
        self.term = term
        self.current_term = current_term

    def __repr__(self) -> str:
        return (
            f"StaleTick(election={self.election!r}, tick={self.tick!r}, term={self.term}, "
            f"current_term={self.current_term})"
        )


register_type(Skipped, "task_locks.skipped", Skipped.as_dict, lambda fields: Skipped(**fields))
register_type(
    StaleTick, "task_locks.stale_tick", StaleTick.as_dict, lambda fields: StaleTick(**fields)
)


def hand_over_to_retry(task: LockingTask, task_id: str, args: Any, kwargs: Any) -> AnyLease | None:
    """The running lease a ``lock_on="both"`` task passes to its own retry message, if any.

    ``self.retry()`` publishes the next attempt while this one still holds the key.
    Releasing at the end of this attempt would leave the key free during the retry's
    countdown, and a duplicate could be queued; instead the lease is parked (renewal
    stops, TTL = countdown + ``enqueue_ttl``) and the retry adopts it like any queued lock.
    """
    lease = current_lease()
    if task.lock_on != "both" or lease is None or not lease.held:
        return None
    if task.request.id != task_id or task.lock_name(*(args or ()), **(kwargs or {})) != lease.name:
        return None
    return lease


def park_for_retry(lease: AnyLease, countdown: float, ttl: float) -> None:
    """Keep ``lease`` (unrenewed) for ``countdown + ttl`` seconds when its run ends."""
    _parked_for_retry[lease] = max(0.0, countdown) + ttl


def unpark(lease: AnyLease) -> float | None:
    """Seconds to keep ``lease`` for its retry (:func:`park_for_retry`), once; else None."""
    return _parked_for_retry.pop(lease, None) if _parked_for_retry else None


def message_arguments(body: Any) -> tuple[tuple[Any, ...], Mapping[str, Any]]:
    """``(args, kwargs)`` of a task message body (protocol 2 tuple or protocol 1 dict)."""
    if isinstance(body, dict):
        return tuple(body.get("args") or ()), body.get("kwargs") or {}
    return tuple(body[0] or ()), body[1] or {}


__all__ = [
    "FENCE_HEADER",
    "LOCK_ON",
    "ON_CONFLICT",
    "ON_LOST",
    "SKIPPED",
    "SKIP_AS",
    "STALE_TICK",
    "TOKEN_HEADER",
    "DuplicateTask",
    "LockedTask",
    "LockingTask",
    "Skipped",
    "StaleTick",
    "hand_over_to_retry",
    "message_arguments",
    "park_for_retry",
    "unpark",
]
