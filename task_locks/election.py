"""Leader election: at most one leader per name, and a term that works as a fencing token.

Leading ``name`` means holding the lock ``election:<name>`` (see :func:`lock_name`), so an
election gets every guarantee of the lock it is built on, on every backend: a TTL (a dead
leader is replaced within one TTL), a unique token (only the leader can resign), renewal
by the watchdog while the leader lives, and wake-ups (a blocked :meth:`Election.campaign`
is woken by the leader's resignation or by its TTL running out, not by polling).

The **term** is the lease's fence: strictly greater than every term handed out before for
the same election, on every backend (on etcd it is the key's create revision, which is
etcd's own election order). Pass it to whatever the leader writes, as a fencing token, so
a deposed leader that wakes from a pause is refused by the resource. A leader that must
stop when it loses the lease calls ``leadership.check()`` before acting, or passes
``on_lost=``.

Whom the backend names as leader (:meth:`Election.leader`) is the candidate's
``identity`` (default ``host:pid``), stored in the lock's owner metadata; ``locks list``
and the admin show it through :func:`describe`.

Sync and async share everything but the I/O: :class:`AsyncElection` drives an
:class:`~task_locks.AsyncLock` where :class:`Election` drives a :class:`~task_locks.Lock`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

from . import events
from ._plan import UNSET, Unset
from .backends.base import Backend
from .errors import InvalidArgument, LockHeld, LockLost
from .lock import (
    AsyncLease,
    AsyncLock,
    Lease,
    LeaseBase,
    Lock,
    aunless_held,
    unless_held,
    validate_name,
)
from .owner import owner_context
from .types import Holder, Owner

log = logging.getLogger("task_locks.election")

#: Every election's lock name starts with this; :func:`describe` recognises them by it.
PREFIX: Final = "election:"
#: Longest pause between two looks of :meth:`Election.observe` by default.
MAX_OBSERVE_INTERVAL: Final = 1.0

L = TypeVar("L", bound=LeaseBase)


def lock_name(election: str) -> str:
    """The name of the lock whose holder leads ``election``."""
    return f"{PREFIX}{election}"


def default_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _validate_identity(identity: object) -> str:
    if identity is None:
        return default_identity()
    if not isinstance(identity, str) or not identity.strip():
        raise InvalidArgument(f"identity must be a non-empty string, got {identity!r}")
    return identity


@dataclass(frozen=True, slots=True)
class LeaderInfo:
    """Who leads an election, as the backend says now."""

    election: str
    identity: str
    term: int
    since: float | None  # epoch seconds the term began (server clock where there is one)
    expires_at: float | None  # epoch seconds the lease ends unless renewed
    owner: Owner

    def describe(self) -> str:
        since = "" if self.since is None else f", for {max(0.0, time.time() - self.since):.1f}s"
        return f"{self.identity} (term {self.term}{since})"


def leader_info(holder: Holder | None) -> LeaderInfo | None:
    """The election view of an ``election:`` lock's holder (``None`` for other locks)."""
    if holder is None or not holder.name.startswith(PREFIX):
        return None
    owner = holder.owner
    identity = owner.identity or (f"{owner.host}:{owner.pid}" if owner.host else owner.describe())
    return LeaderInfo(
        election=holder.name[len(PREFIX) :],
        identity=identity,
        term=holder.fence,
        since=holder.acquired_at,
        expires_at=holder.expires_at,
        owner=owner,
    )


def describe(holders: Iterable[Holder]) -> list[LeaderInfo]:
    """The elections among ``holders`` (e.g. ``backend.holders()``), each with its leader.

    For ``locks list`` and the admin: an election without a leader holds no lock, so
    only led elections appear.
    """
    found = (leader_info(h) for h in holders)
    return sorted((info for info in found if info is not None), key=lambda i: i.election)


class _LeadershipBase(Generic[L]):
    """One term of leadership: the lease that proves it, and what users ask of it."""

    def __init__(self, election: str, identity: str, lease: L) -> None:
        self.election = election
        self.identity = identity
        self.lease: L = lease
        self._resigned = False

    @property
    def term(self) -> int:
        """Strictly increasing per election: hand it to resources as a fencing token."""
        return self.lease.fence

    @property
    def since(self) -> float:
        return self.lease.acquired_at

    @property
    def held(self) -> bool:
        """Still the leader, as far as this process knows (no round trip)."""
        return self.lease.held

    @property
    def lost(self) -> Any:
        """Set (``threading.Event``-like: ``is_set()``, ``wait()``) when the leadership is lost."""
        return self.lease.lost

    def check(self) -> None:
        """Raise :class:`~task_locks.LockLost` unless still leading; call before acting."""
        self.lease.check()

    def _begin_resign(self) -> bool:
        if self._resigned:
            return False
        self._resigned = True
        return True

    def _resign_refused(self, exc: LockLost) -> bool:
        # Its loss was logged when it happened (task_locks.events).
        log.debug("election %r: term %s was already over at resignation: %s", *self._who(), exc)
        return False

    def _who(self) -> tuple[str, int]:
        return self.election, self.term

    def __repr__(self) -> str:
        state = "leading" if self.held else "over"
        return f"<{type(self).__name__} {self.election!r} {self.identity} term={self.term} {state}>"


class Leadership(_LeadershipBase[Lease]):
    def resign(self) -> bool:
        """Step down now (waking a blocked candidate). ``False`` if the term was already over."""
        if not self._begin_resign():
            return False
        try:
            self.lease.release()
        except LockLost as exc:
            return self._resign_refused(exc)
        log.info("election %r: resigned term %s", *self._who())
        return True

    def __enter__(self) -> Leadership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.resign()


class AsyncLeadership(_LeadershipBase[AsyncLease]):
    async def resign(self) -> bool:
        if not self._begin_resign():
            return False
        try:
            await self.lease.release()
        except LockLost as exc:
            return self._resign_refused(exc)
        log.info("election %r: resigned term %s", *self._who())
        return True

    async def __aenter__(self) -> AsyncLeadership:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.resign()


Callback = Callable[[Any], object]
LS = TypeVar("LS", Leadership, AsyncLeadership)


class _ElectionBase(Generic[LS]):
    """Configuration, callbacks and the no-I/O decisions shared by both flavours."""

    def __init__(
        self,
        name: str,
        ttl: float | None = None,
        *,
        backend: str | Backend | None = None,
        identity: str | None = None,
        timeout: float | None = None,
        on_elected: Callback | None = None,
        on_lost: Callback | None = None,
    ) -> None:
        self.name = validate_name(name)
        self.lock_name = validate_name(lock_name(name))
        self.identity = _validate_identity(identity)
        self.on_elected = on_elected
        self.on_lost = on_lost
        #: The term this object holds, if any (also after it was lost: see ``is_leader``).
        self.leadership: LS | None = None
        self._lock = self._make_lock(ttl, backend, timeout)

    def _make_lock(self, ttl: float | None, backend: Any, timeout: float | None) -> Any:
        raise NotImplementedError

    @property
    def ttl(self) -> float:
        """Seconds a dead leader keeps the election (the lock's TTL in force)."""
        return float(self._lock.effective_ttl)

    @property
    def backend(self) -> Backend:
        """The backend the election's lock lives on."""
        backend: Backend = self._lock.backend
        return backend

    @property
    def is_leader(self) -> bool:
        """This candidate leads now, as far as it knows (no round trip)."""
        return self.leadership is not None and self.leadership.held

    def _current(self) -> LS | None:
        return self.leadership if self.is_leader else None

    @property
    def _detail(self) -> str:
        """The leader's lease events say whose it is (the lost one is logged with it)."""
        return f"election {self.name!r}, candidate {self.identity}"

    def _lease_lost(self, lease: Any) -> object:
        leadership = self.leadership
        if leadership is None or leadership.lease is not lease:
            return None
        # The lost term is logged once, as the lease's loss (task_locks.events).
        return None if self.on_lost is None else self.on_lost(leadership)

    @contextlib.contextmanager
    def _campaigning(self) -> Iterator[None]:
        """What a campaign's acquire runs under, for both flavours: this candidate's
        identity as the owner, no conflict event (a follower finding a leader is no
        conflict), and :class:`LockHeld` naming the election's leader."""
        try:
            with (
                owner_context(identity=self.identity),
                events.context(policy="", detail=self._detail),
            ):
                yield
        except LockHeld as exc:
            raise self._held_error(exc) from None

    def _held_error(self, exc: LockHeld) -> LockHeld:
        who = exc.holder.describe() if exc.holder else "another candidate"
        return LockHeld(
            f"election {self.name!r} is led by {who}", name=self.lock_name, holder=exc.holder
        )

    def _announce(self, leadership: LS) -> object:
        self.leadership = leadership
        log.info("election %r: %s leads, term %s", self.name, self.identity, leadership.term)
        return None if self.on_elected is None else self.on_elected(leadership)

    def _observe_interval(self, interval: float | None) -> float:
        if interval is None:
            return max(0.01, min(self.ttl / 4, MAX_OBSERVE_INTERVAL))
        if isinstance(interval, bool) or not isinstance(interval, int | float) or interval <= 0:
            raise InvalidArgument(f"interval must be seconds > 0, got {interval!r}", name=self.name)
        return float(interval)

    @staticmethod
    def _changed(before: LeaderInfo | Unset | None, now: LeaderInfo | None) -> bool:
        if isinstance(before, Unset):
            return True
        return (before.term if before else None) != (now.term if now else None)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.identity} ttl={self.ttl}>"


class Election(_ElectionBase[Leadership]):
    """Campaign for, hold and give up the leadership of ``name``.

    ``ttl`` bounds how long a dead leader keeps the election; ``identity`` names this
    candidate to observers. ``on_elected(leadership)`` runs when this candidate becomes
    leader, ``on_lost(leadership)`` when its term ends without a resignation (lease
    expired or taken over), from the renewal thread.

    ``with Election("beat", ttl=10) as leadership:`` campaigns (waiting ``timeout``) and
    resigns at the end of the block.
    """

    def _make_lock(self, ttl: float | None, backend: Any, timeout: float | None) -> Lock:
        return Lock(self.lock_name, ttl, backend=backend, timeout=timeout, on_lost=self._lease_lost)

    def campaign(self, timeout: float | Unset | None = UNSET) -> Leadership:
        """Become leader, waiting up to ``timeout`` seconds (``None``: as long as it takes).

        Returns the current term if this candidate already leads. Raises
        :class:`~task_locks.LockHeld` naming the leader when the timeout runs out.
        """
        current = self._current()
        if current is not None:
            return current
        with self._campaigning():
            lease = self._lock.acquire(timeout)
        leadership = Leadership(self.name, self.identity, lease)
        self._announce(leadership)
        return leadership

    def try_campaign(self) -> Leadership | None:
        """One attempt (one round trip): the term, or ``None`` while someone else leads."""
        return unless_held(lambda: self.campaign(timeout=0))

    def resign(self) -> bool:
        """Give up this candidate's term, if any; ``False`` if it did not lead."""
        leadership, self.leadership = self.leadership, None
        return leadership.resign() if leadership is not None else False

    def leader(self) -> LeaderInfo | None:
        """Who leads now, by the backend (one round trip); ``None`` between terms."""
        return leader_info(self.backend.holder(self.lock_name))

    def observe(
        self, interval: float | None = None, timeout: float | None = None
    ) -> Iterator[LeaderInfo | None]:
        """Yield the leader now, then again each time it changes (new term, or none).

        Observers poll every ``interval`` seconds (default: ttl/4, at most 1 s) rather
        than taking the release wake-up, which belongs to the candidates. Stops after
        ``timeout`` seconds if given.
        """
        pause = self._observe_interval(interval)
        deadline = None if timeout is None else time.monotonic() + timeout
        last: LeaderInfo | Unset | None = UNSET
        while True:
            now_leader = self.leader()
            if self._changed(last, now_leader):
                last = now_leader
                yield now_leader
            if deadline is not None and time.monotonic() + pause > deadline:
                return
            time.sleep(pause)

    def __enter__(self) -> Leadership:
        return self.campaign()

    def __exit__(self, *exc: object) -> None:
        self.resign()


class AsyncElection(_ElectionBase[AsyncLeadership]):
    """The asyncio twin of :class:`Election`; callbacks may be coroutines."""

    def _make_lock(self, ttl: float | None, backend: Any, timeout: float | None) -> AsyncLock:
        return AsyncLock(
            self.lock_name, ttl, backend=backend, timeout=timeout, on_lost=self._lease_lost
        )

    async def campaign(self, timeout: float | Unset | None = UNSET) -> AsyncLeadership:
        """The asyncio twin of :meth:`Election.campaign`: become leader, waiting up to ``timeout``
        seconds."""
        current = self._current()
        if current is not None:
            return current
        with self._campaigning():
            lease = await self._lock.acquire(timeout)
        leadership = AsyncLeadership(self.name, self.identity, lease)
        outcome = self._announce(leadership)
        if inspect.isawaitable(outcome):
            await outcome
        return leadership

    async def try_campaign(self) -> AsyncLeadership | None:
        """One attempt (one round trip): the term, or ``None`` while someone else leads."""
        return await aunless_held(self.campaign(timeout=0))

    async def resign(self) -> bool:
        """Give up this candidate's term, if any; ``False`` if it did not lead."""
        leadership, self.leadership = self.leadership, None
        return await leadership.resign() if leadership is not None else False

    async def leader(self) -> LeaderInfo | None:
        """Who leads now, by the backend (one round trip); ``None`` between terms."""
        return leader_info(await self.backend.aholder(self.lock_name))

    async def observe(
        self, interval: float | None = None, timeout: float | None = None
    ) -> AsyncIterator[LeaderInfo | None]:
        """The asyncio twin of :meth:`Election.observe`: yield the leader now, then each time it
        changes."""
        pause = self._observe_interval(interval)
        deadline = None if timeout is None else time.monotonic() + timeout
        last: LeaderInfo | Unset | None = UNSET
        while True:
            now_leader = await self.leader()
            if self._changed(last, now_leader):
                last = now_leader
                yield now_leader
            if deadline is not None and time.monotonic() + pause > deadline:
                return
            await asyncio.sleep(pause)

    async def __aenter__(self) -> AsyncLeadership:
        return await self.campaign()

    async def __aexit__(self, *exc: object) -> None:
        await self.resign()


__all__ = [
    "PREFIX",
    "AsyncElection",
    "AsyncLeadership",
    "Election",
    "LeaderInfo",
    "Leadership",
    "default_identity",
    "describe",
    "leader_info",
    "lock_name",
]
