"""Counting semaphores: at most ``limit`` holders of a name at once.

A semaphore is ``limit`` ordinary locks, its *slots*, named ``semaphore:<name>#<i>`` for
``i`` in ``0 .. limit-1`` (see :func:`slot_name`). A permit is a lease on one slot, so each
holder gets everything a lock gives: its own token (only it can release its permit), a
TTL (a holder that dies gives its permit back within one TTL), renewal by the watchdog
while it lives, a fence per slot, and ``max_hold``.

Acquiring tries the slots in a random order and takes the first free one: one round trip
when the first slot tried is free, at most ``limit`` when all are taken. Then it waits,
bounded by ``timeout``, until a slot is released (``Backend.wait_any``: one BLPOP over
every slot on Redis) or the soonest-expiring holder's TTL runs out, and tries again.
Meant for small limits (a handful to a few dozen permits).

The slots depend only on the name and the index, so processes that disagree on the
limit during a deploy overlap on the shared slots: while both run, up to the larger
limit can be inside. Each permit records the limit it was taken under, so listings can
show "2 / 3" (:func:`describe`).
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Final, TypeVar

from ._plan import (
    UNSET,
    Acquire,
    Plan,
    Unset,
    WaitAny,
    arun_against,
    pause,
    report_acquired,
    report_conflict,
    run_against,
)
from .backends.base import Backend
from .errors import InvalidArgument, LockHeld
from .lock import (
    AsyncLease,
    Lease,
    LockBase,
    _AsyncAcquire,
    _held_message,
    _SyncAcquire,
    format_wait,
    validate_name,
)
from .owner import current_owner
from .types import (
    SEMAPHORE_PREFIX,
    SLOT_SEPARATOR,
    AcquireResult,
    Holder,
    parse_slot,
    slot_name,
)

# Slot names are vocabulary shared with the event stream, so they live in types.
PREFIX: Final = SEMAPHORE_PREFIX
MAX_LIMIT: Final = 1024


def _validate_limit(limit: object, name: str) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise InvalidArgument(f"limit must be a whole number of permits, got {limit!r}", name=name)
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidArgument(f"limit must be between 1 and {MAX_LIMIT}, got {limit}", name=name)
    return limit


@dataclass(frozen=True, slots=True)
class SemaphoreInfo:
    """A semaphore as an operator sees it: who holds its permits, out of how many."""

    name: str
    limit: int | None  # as recorded by the holders; None if they did not say
    holders: list[Holder] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.holders)

    @property
    def summary(self) -> str:
        """``"2 / 3"``: permits held / limit."""
        return f"{self.count} / {'?' if self.limit is None else self.limit}"


def describe(holders: Iterable[Holder]) -> list[SemaphoreInfo]:
    """Group the slot locks among ``holders`` (e.g. ``backend.holders()``) by semaphore.

    For ``locks list`` and the admin; a semaphore with no permit taken holds no lock and
    does not appear. Other locks are ignored.
    """
    groups: dict[str, list[Holder]] = {}
    for holder in holders:
        parsed = parse_slot(holder.name)
        if parsed is not None:
            groups.setdefault(parsed[0], []).append(holder)
    infos = []
    for name, members in sorted(groups.items()):
        limits = [h.owner.limit for h in members if h.owner.limit]
        members.sort(key=lambda h: h.name)
        infos.append(SemaphoreInfo(name, max(limits) if limits else None, members))
    return infos


class _PermitMixin:
    """Which semaphore and slot a lease is a permit for."""

    semaphore: str
    slot: int
    limit: int

    def _place(self, semaphore: str, slot: int, limit: int) -> None:
        self.semaphore, self.slot, self.limit = semaphore, slot, limit


class Permit(_PermitMixin, Lease):
    """A :class:`~task_locks.Lease` on one slot: ``release()``, ``fence``, ``check()``..."""

    def __enter__(self) -> Permit:
        return self


class AsyncPermit(_PermitMixin, AsyncLease):
    async def __aenter__(self) -> AsyncPermit:
        return self


P = TypeVar("P", Permit, AsyncPermit)


class _SemaphoreBase(LockBase):
    """Configuration and the acquire loop shared by both flavours (no I/O here)."""

    def __init__(
        self,
        name: str,
        limit: int,
        ttl: float | None = None,
        *,
        backend: str | Backend | None = None,
        timeout: float | None = None,
        on_lost: Callable[[Any], object] | None = None,
        max_hold: float | None = None,
        renew: bool = True,
        require: Collection[str] = (),
    ) -> None:
        super().__init__(
            name,
            ttl,
            backend=backend,
            timeout=timeout,
            on_lost=on_lost,
            max_hold=max_hold,
            renew=renew,
            require=require,
        )
        self.limit = _validate_limit(limit, self.name)
        self.slot_names = tuple(slot_name(self.name, i) for i in range(self.limit))
        validate_name(self.slot_names[-1])  # the longest one must fit too

    def _run_names(self) -> tuple[str, ...]:
        """A run check looks at every slot: a copy must not take a free one while the
        original holds another."""
        return self.slot_names

    def _permit_plan(
        self, backend: Backend, timeout: float | None
    ) -> Plan[tuple[int, str, int, float]]:
        """Try the slots in random order; when all are taken, wait for a release or a TTL.

        Reports ``acquired`` under the slot's name and ``conflict`` under the semaphore's
        (both have the semaphore's family: :attr:`~task_locks.events.LockEvent.family`).
        """
        names = self.slot_names
        ttl_ms = max(1, int(self.effective_ttl * 1000))
        token = secrets.token_hex(16)
        owner = replace(current_owner(), limit=self.limit)
        clock = self._lease_runtime().clock
        run = self._run
        start = clock.monotonic()
        deadline = None if timeout is None else start + timeout
        while True:
            soonest: float | None = None
            copy: tuple[str, AcquireResult] | None = None  # this round's run check refusal
            for index in random.sample(range(self.limit), self.limit):
                sent_at = clock.monotonic()
                result: AcquireResult = yield Acquire(names[index], token, ttl_ms, owner, run)
                if run is not None and run.is_copy(result):
                    copy = (names[index], result)
                    if run.give_up_on_copy:
                        held = _held_message(names[index], result, clock.monotonic() - start)
                        report_conflict(self.name, backend, held, 0.0, timeout, owner)
                        raise held
                if result.fence is not None:
                    report_acquired(
                        names[index], backend, result.fence, owner, clock.monotonic() - start
                    )
                    return index, token, result.fence, sent_at
                if result.retry_after is not None and (
                    soonest is None or result.retry_after < soonest
                ):
                    soonest = result.retry_after
            now = clock.monotonic()
            if deadline is not None and now >= deadline:
                # Refused for a run of the same task id: say so (its holder), as a lock does.
                full = (
                    self._full(now - start) if copy is None else _held_message(*copy, now - start)
                )
                report_conflict(self.name, backend, full, now - start, timeout, owner)
                raise full
            yield WaitAny(names, pause(soonest, now, deadline))

    def _full(self, waited: float) -> LockHeld:
        after = f" after waiting {format_wait(waited)}" if waited else ""
        return LockHeld(
            f"semaphore {self.name!r}: all {self.limit} permits are taken{after}", name=self.name
        )

    def _mine(self, holders: list[Holder]) -> list[Holder]:
        return [h for h in holders if (parse_slot(h.name) or ("", 0))[0] == self.name]

    def _holder_prefix(self) -> str:
        return f"{PREFIX}{self.name}{SLOT_SEPARATOR}"

    def _info(self, holders: list[Holder]) -> SemaphoreInfo:
        return SemaphoreInfo(self.name, self.limit, self._mine(holders))

    def _permit(
        self, cls: type[P], backend: Backend, index: int, token: str, fence: int, sent_at: float
    ) -> P:
        permit = self._lease(cls, backend, self.slot_names[index], token, fence, sent_at)
        permit._place(self.name, index, self.limit)
        return self._keep(permit)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} limit={self.limit} ttl={self.effective_ttl}>"


class Semaphore(_SemaphoreBase, _SyncAcquire[Permit]):
    """At most ``limit`` holders of ``name`` at once; ``acquire()`` returns a :class:`Permit`.

    ``with Semaphore("export:tenant-7", limit=3, ttl=60) as permit:`` waits ``timeout``
    (default: as long as it takes) and releases the permit at the end of the block.
    """

    def acquire(self, timeout: float | Unset | None = UNSET) -> Permit:
        """Take a permit, waiting up to ``timeout`` s; raise :class:`LockHeld` if none frees."""
        backend = self.backend
        granted = run_against(self._permit_plan(backend, self._timeout(timeout)), backend)
        return self._permit(Permit, backend, *granted)

    def holders(self) -> list[Holder]:
        """The permits taken now (one round trip)."""
        return self._mine(self.backend.holders(self._holder_prefix()))

    def info(self) -> SemaphoreInfo:
        """The semaphore now: its limit and each permit's holder (one round trip)."""
        return self._info(self.backend.holders(self._holder_prefix()))


class AsyncSemaphore(_SemaphoreBase, _AsyncAcquire[AsyncPermit]):
    """The asyncio twin of :class:`Semaphore`: same arguments, same semantics."""

    async def acquire(self, timeout: float | Unset | None = UNSET) -> AsyncPermit:
        """Take a permit, waiting up to ``timeout`` s; raise :class:`LockHeld` if none frees."""
        backend = self.backend
        granted = await arun_against(self._permit_plan(backend, self._timeout(timeout)), backend)
        return self._permit(AsyncPermit, backend, *granted)

    async def holders(self) -> list[Holder]:
        """The permits taken now (one round trip)."""
        return self._mine(await self.backend.aholders(self._holder_prefix()))

    async def info(self) -> SemaphoreInfo:
        """The semaphore now: its limit and each permit's holder (one round trip)."""
        return self._info(await self.backend.aholders(self._holder_prefix()))


__all__ = [
    "MAX_LIMIT",
    "PREFIX",
    "SLOT_SEPARATOR",
    "AsyncPermit",
    "AsyncSemaphore",
    "Permit",
    "Semaphore",
    "SemaphoreInfo",
    "describe",
    "parse_slot",
    "slot_name",
]
