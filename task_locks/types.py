"""Plain data shared by every layer: who holds a lock, and what a backend answered."""

from __future__ import annotations

import dataclasses
import functools
import json
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Final


@dataclass(frozen=True, slots=True)
class Owner:
    """Who took a lock: enough for an operator to find the process and the job.

    Stored beside the lock on the server so ``holders()``, the admin and ``locks list``
    can name the holder, and so a Celery worker can release the locks of a child that
    was killed (``task_id``).
    """

    host: str = ""
    pid: int = 0
    thread: str = ""
    task_id: str | None = None
    task_name: str | None = None
    command: str | None = None
    worker: str | None = None
    #: Coordination primitives: an election candidate's chosen name, and the permit
    #: count of the semaphore a slot belongs to (so listings can show "2 / 3").
    identity: str | None = None
    limit: int | None = None
    #: ``True``: a record the library keeps for its own bookkeeping (a Celery run's
    #: task-id guard), not a lock a user took. Listings, the admin, metrics and the event
    #: stream leave such locks out: one run is one row and one count.
    internal: bool | None = None

    def to_json(self) -> str:
        """The owner as the JSON stored beside the lock on the server."""
        # Cached: a process acquires with the same few owners over and over.
        return _owner_json(self)

    @classmethod
    def from_json(cls, raw: str | bytes | None) -> Owner:
        """The owner stored as ``raw`` JSON; an empty owner for none, unknown fields ignored (a
        newer writer's). Parsed once per distinct ``raw``: a waiter reads the same holder's
        record at every try, and an owner is immutable, so one instance serves them all."""
        if not raw:
            return cls()
        if cls is Owner:
            return _parsed_owner(raw)
        return _parse_owner(cls, raw)

    def describe(self) -> str:
        """One human line: ``task sync_account[abc] on web-1 pid 42``."""
        parts: list[str] = []
        if self.task_name or self.task_id:
            parts.append(f"task {self.task_name or '?'}[{self.task_id or '?'}]")
        elif self.command:
            parts.append(f"command {self.command!r}")
        elif self.host or self.pid:
            parts.append("a process")  # "held by a process on vm pid 42", not "held by on"
        if self.host:
            parts.append(f"on {self.host}")
        if self.pid:
            parts.append(f"pid {self.pid}")
        return " ".join(parts) or "unknown holder"


def _parse_owner(cls: type[Owner], raw: str | bytes) -> Owner:
    try:
        data = json.loads(raw)
    except ValueError:
        return cls(command=str(raw))
    known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
    return cls(**known)


@functools.lru_cache(maxsize=1024)
def _parsed_owner(raw: str | bytes) -> Owner:
    return _parse_owner(Owner, raw)


@functools.lru_cache(maxsize=1024)
def _cached_owner_json(owner: Owner) -> str:
    # getattr, not dataclasses.asdict: asdict deep-copies every field.
    fields = ((k, getattr(owner, k)) for k in owner.__dataclass_fields__)
    return json.dumps({k: v for k, v in fields if v not in (None, "")})


#: Placeholder task id that cannot occur in a real one (a lone surrogate: not UTF-8).
_TASK_ID_SLOT: Final = "\udfff"
#: Every field of an owner but its task id, as a tuple (the key of the cut below).
_all_but_task_id: Final = operator.attrgetter(
    *(name for name in Owner.__dataclass_fields__ if name != "task_id")
)
#: An owner's other fields -> its JSON cut where the task id goes (see _owner_json).
_by_task: dict[tuple[Any, ...], tuple[str, str]] = {}


def _owner_json(owner: Owner) -> str:
    """The owner's JSON. A Celery run's owner differs from the last run's only by its task
    id, which the cache would never see again: the JSON around it is cached instead."""
    task_id = owner.task_id
    if type(task_id) is not str or not task_id:
        return _cached_owner_json(owner)
    rest = _all_but_task_id(owner)
    cut = _by_task.get(rest)
    if cut is None:
        slot = json.dumps(_TASK_ID_SLOT)
        template = _cached_owner_json(dataclasses.replace(owner, task_id=_TASK_ID_SLOT))
        if template.count(slot) != 1:  # another field holds the placeholder: no shortcut
            return _cached_owner_json(owner)
        if len(_by_task) >= 1024:
            _by_task.clear()
        head, _, tail = template.partition(slot)
        cut = _by_task[rest] = (head, tail)
    return cut[0] + json.dumps(task_id) + cut[1]


@dataclass(frozen=True, slots=True)
class Holder:
    """One live lock as an operator sees it (the token is deliberately not exposed)."""

    name: str
    fence: int
    owner: Owner
    acquired_at: float | None  # epoch seconds, by the server's clock where it has one
    expires_at: float | None  # epoch seconds, estimated from the remaining TTL
    renewals: int = 0
    kind: str = "lock"  # "lock", "election" or "semaphore"
    extra: dict[str, Any] = field(default_factory=dict)
    #: The holder's token, for token-checked clean-up by the same system (a Celery
    #: worker releasing a killed child's lock); never shown to operators.
    token: str = field(default="", repr=False)

    @property
    def held_for(self) -> float | None:
        """Seconds since the lock was taken (``None`` when the backend does not know)."""
        return None if self.acquired_at is None else max(0.0, time.time() - self.acquired_at)

    @property
    def expires_in(self) -> float | None:
        """Seconds until the lock expires unless renewed (``None`` when unknown; negative once
        past)."""
        return None if self.expires_at is None else self.expires_at - time.time()

    def describe(self) -> str:
        """One human line: the owner, its fence and how long it has held the lock."""
        held = f", held for {self.held_for:.1f}s" if self.held_for is not None else ""
        return f"{self.owner.describe()} (fence {self.fence}{held})"


@dataclass(frozen=True, slots=True)
class AcquireResult:
    """A backend's answer to one acquire attempt.

    Either ``fence`` is set (we hold the lock), or ``retry_after`` says how long the
    current holder's TTL still runs (seconds; ``None`` when unknown) and ``holder`` may
    name it.
    """

    fence: int | None
    retry_after: float | None = None
    holder: Owner | None = None
    holder_fence: int | None = None
    holder_acquired_at: float | None = None
    #: The name that holder holds, when it is not the one asked for (a run check's
    #: refusal by another slot of a semaphore: :class:`RunCheck`).
    holder_name: str | None = None
    #: The try also waited for a grant, in vain (a server hand-off's ``enqueue`` with
    #: ``pop``): its caller tries again rather than wait once more.
    grant_awaited: bool = False

    @property
    def acquired(self) -> bool:
        return self.fence is not None


@dataclass(frozen=True, slots=True)
class RunCheck:
    """What a Celery run's acquire carries, so that the server step that takes its lock
    also refuses a second delivery of the same message (same task id) while the first
    one holds it: one lock per run, and no second record to leave behind.

    The server refuses the acquire, answering that holder (and its name), when any of
    ``names`` is held under a token other than the acquire's own, ``take_over`` and
    ``mark`` whose owner's ``task_id`` is ``task_id``; even when the name asked for is free (a
    semaphore's other slot) or held by ``take_over``. Otherwise the acquire is an
    ordinary one, except that a lock held by ``take_over`` (the lock taken when the
    message was published, ``lock_on="both"``) becomes this acquire's: its token is
    swapped for the acquire's, keeping its fence, with a fresh TTL and owner. So a copy
    carrying the same publish-time token finds the run's own token there, not its own.
    """

    task_id: str
    #: The lock's own name, or every slot of a semaphore.
    names: tuple[str, ...]
    #: The token of the publish-time lock this run takes over, if any.
    take_over: str | None = None
    #: The token under which this run itself holds one of ``names`` (its mark while it
    #: waits), never taken for a copy.
    mark: str | None = None
    #: ``True``: an acquire that meets a copy gives up at once instead of waiting (a
    #: retry waiting for its own previous attempt to let go passes ``False``).
    give_up_on_copy: bool = True

    def is_copy(self, result: AcquireResult) -> bool:
        """Whether ``result`` is a refusal by a run of this same task id."""
        return (
            result.fence is None
            and result.holder is not None
            and result.holder.task_id == self.task_id
        )


@dataclass(frozen=True, slots=True)
class RenewItem:
    """One lease in a batched renewal round."""

    name: str
    token: str
    ttl_ms: int


#: Every slot's lock name starts with this; :func:`describe` recognises them by it.
SEMAPHORE_PREFIX: Final = "semaphore:"
#: Separates the semaphore's name from the slot index in a slot's lock name.
SLOT_SEPARATOR: Final = "#"


def slot_name(name: str, index: int) -> str:
    """The lock name of slot ``index`` of semaphore ``name``."""
    return f"{SEMAPHORE_PREFIX}{name}{SLOT_SEPARATOR}{index}"


def parse_slot(lock_name: str) -> tuple[str, int] | None:
    """``(semaphore name, slot index)`` for a slot's lock name, else ``None``."""
    if not lock_name.startswith(SEMAPHORE_PREFIX):
        return None
    name, sep, index = lock_name[len(SEMAPHORE_PREFIX) :].rpartition(SLOT_SEPARATOR)
    if not sep or not name or not index.isdigit():
        return None
    return name, int(index)
