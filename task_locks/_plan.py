"""The acquire engine: the ops a plan yields, and the two functions that answer them
against a backend.

Internal interface (not part of the public API), shared by :mod:`task_locks.lock`,
:mod:`task_locks.semaphore` and :mod:`task_locks.election`. An acquire loop is written
once, as a generator (a *plan*) that yields the I/O it needs as one of the frozen op
dataclasses below and receives the answer. :func:`run_against` answers with a
backend's blocking calls, :func:`arun_against` with its asyncio ones, so sync and async share every
decision and differ only in how they talk to the server.

The ops are a closed union (:data:`Op`): both ``match`` on it, mypy checks that
every kind is handled, and an object that is not an op raises :class:`TypeError` instead
of being taken for some other kind. An op that fails is thrown into the plan at its
``yield``: a plan that does not catch it fails with it, one that does can clean up (the
server hand-off gives back a grant whose reply was lost).

Also here, because every front end needs them: the pause rule (how long a waiter waits
before it tries again), the ``acquired`` / ``conflict`` events a plan reports, and the
*unset* sentinel (an argument left out, told apart from an explicit ``None``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Final, Never, NoReturn, TypeVar

from . import events
from ._steps import arun, run
from .backends.base import Backend, RunChecked, ServerHandoff
from .errors import LockHeld
from .types import Owner, RunCheck

T = TypeVar("T")

#: How long a waiter sleeps when the backend could not say when the holder's TTL ends.
UNKNOWN_TTL_POLL: Final = 0.5
#: Shortest wait between attempts: a TTL reported as "0 ms left" must not spin.
MIN_PAUSE: Final = 0.001


class Unset:
    """The type of :data:`UNSET`: "not given", where ``None`` means something."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = Unset()


def pause(retry_after: float | None, now: float, deadline: float | None) -> float:
    """How long a waiter waits before it tries again: until the holder's TTL ends (a poll
    interval when that is unknown), at least :data:`MIN_PAUSE`, never past ``deadline``."""
    wait = max(MIN_PAUSE, UNKNOWN_TTL_POLL if retry_after is None else retry_after)
    return wait if deadline is None else min(wait, deadline - now)


def _waited(waited: float, context: events.Context) -> float:
    """The wait to report: from the front end's first try when it made several (a
    ``wait`` policy tries once, then waits), else this acquire's own."""
    return waited if context.since is None else max(waited, time.monotonic() - context.since)


def report_acquired(name: str, backend: Backend, fence: int, owner: Owner, waited: float) -> None:
    """The ``acquired`` event of a lock or a semaphore's permit (none for an internal one)."""
    if events.wanted(events.EventKind.ACQUIRED) and not owner.internal:
        context = events.current_context()  # no context look-up when nobody listens
        events.emit(
            events.Acquired(
                name=name,
                backend=backend.server,
                fence=fence,
                owner=owner,
                waited=_waited(waited, context),
                detail=context.detail,
            )
        )


def report_conflict(
    name: str,
    backend: Backend,
    held: LockHeld,
    waited: float,
    timeout: float | None,
    owner: Owner,
    fence: int | None = None,
) -> None:
    """The ``conflict`` event of an acquire given up: at once (``timeout`` 0, a conflict)
    or after waiting ``timeout`` in vain (a timeout), with the front end's policy. None
    for an internal lock (``owner``: the acquirer's), nor under policy ``""``."""
    context = events.current_context()
    if context.policy and events.wanted(events.EventKind.CONFLICT) and not owner.internal:
        events.emit(
            events.Conflict(
                name=name,
                backend=backend.server,
                fence=fence,
                owner=held.holder.owner if held.holder else None,
                waited=_waited(waited, context),
                timeout=timeout,
                policy=context.policy,
                detail=context.detail,
            )
        )


def handoff_slice(ttl: float) -> float:
    """How long one blocking pop for a server grant lasts: a slice of the TTL, since a
    grant may land at its start while the lease counts from the try before it."""
    return min(max(ttl / 10, 0.05), 2.0)


def entry_ms(ttl: float) -> int:
    """How long a wait entry lives unless refreshed: past one pop and the try after it,
    so a live waiter keeps its place and a dead one is skipped soon after."""
    return int((2 * handoff_slice(ttl) + 0.5) * 1000)


# -- the ops: what a plan asks for, and (in each docstring) what it is answered ----------


@dataclass(frozen=True, slots=True)
class Acquire:
    """Try once to take ``name`` for ``token``; answered with an ``AcquireResult``.
    ``run``: a Celery run's check, decided in the same step (a :class:`RunChecked`
    backend's ``acquire_run``)."""

    name: str
    token: str
    ttl_ms: int
    owner: Owner
    run: RunCheck | None = None


@dataclass(frozen=True, slots=True)
class Release:
    """Release ``name`` if ``token`` holds it; answered with ``bool`` (it did)."""

    name: str
    token: str


@dataclass(frozen=True, slots=True)
class Wait:
    """Block until ``name`` is released or ``seconds`` pass; answered with ``None``."""

    name: str
    seconds: float


@dataclass(frozen=True, slots=True)
class WaitAny:
    """Block until any of ``names`` is released or ``seconds`` pass; answered with ``None``."""

    names: tuple[str, ...]
    seconds: float


@dataclass(frozen=True, slots=True)
class Enqueue:
    """Server hand-off: acquire, or else queue ``token`` for a grant (a wait entry living
    ``wait_ms``; sent again, it refreshes the entry, keeping its place in line; ``0``: do
    not queue); answered with an ``AcquireResult``. ``pop``: it may also wait that long
    for the grant in the same request (``ServerHandoff.enqueue``)."""

    name: str
    token: str
    ttl_ms: int
    owner: Owner
    wait_ms: int
    pop: float = 0.0


@dataclass(frozen=True, slots=True)
class AwaitGrant:
    """Server hand-off: block up to ``seconds`` for a release to hand ``name`` to ``token``;
    answered with the grant's fence, or ``None``. Only a fence above ``above`` (the
    holder's fence the last ``Enqueue`` reported) counts: a grant at or below it was made
    before that try and taken back since (a force release), and is dropped."""

    name: str
    token: str
    seconds: float
    above: int | None


@dataclass(frozen=True, slots=True)
class Dequeue:
    """Server hand-off: leave the queue and give back a grant that raced in (token-checked);
    answered with ``bool`` (a grant was given back)."""

    name: str
    token: str


Op = Acquire | Release | Wait | WaitAny | Enqueue | AwaitGrant | Dequeue
#: A plan: yields ops, is sent their answers, returns its result.
Plan = Generator[Op, Any, T]


def _unknown(op: Never) -> NoReturn:
    """``typing.assert_never`` with a :class:`TypeError`: mypy proves it unreachable (once
    every kind of :data:`Op` is matched, ``op`` is ``Never``), and at run time a plan that
    yields something else fails loudly instead of being answered as some other op."""
    raise TypeError(f"a plan yielded {op!r}, which is not an op of task_locks._plan")


def _handoff(backend: Backend, name: str) -> ServerHandoff:
    """``backend`` as the server hand-off a hand-off op needs. Only the lock's hand-off
    plan yields those, and only against a :class:`ServerHandoff`: any other plan that
    does is a bug, told as such (thrown into the plan, like every failed op)."""
    if not isinstance(backend, ServerHandoff):
        raise NotImplementedError(
            f"lock {name!r}: {backend!r} does not hand locks off in the server"
        )
    return backend


def _run_checked(backend: Backend, name: str) -> RunChecked:
    """``backend`` as the :class:`RunChecked` an acquire with a run check needs (Celery
    asks only those: :attr:`~task_locks.backends.base.Capability.RUN_CHECK`)."""
    if not isinstance(backend, RunChecked):
        raise NotImplementedError(f"lock {name!r}: {backend!r} has no run check")
    return backend


def run_against(plan: Plan[T], backend: Backend) -> T:
    """Run ``plan`` with the backend's blocking calls; return what the plan returns.

    A failed op, an interrupt included, is thrown into the plan, which may clean up."""
    return run(plan, functools.partial(answer, backend=backend))  # type: ignore[no-any-return]


def answer(op: Op, backend: Backend) -> Any:
    """``op``'s answer from the backend's blocking calls (a front end sends an acquire's
    first try itself: :class:`task_locks.lock.LockBase`)."""
    match op:
        case Acquire(name, token, ttl_ms, owner, check):
            if check is None:
                return backend.acquire(name, token, ttl_ms, owner)
            return _run_checked(backend, name).acquire_run(name, token, ttl_ms, owner, check)
        case Release(name, token):
            return backend.release(name, token)
        case Wait(name, seconds):
            return backend.wait_release(name, seconds)
        case WaitAny(names, seconds):
            return backend.wait_any(names, seconds)
        case Enqueue(name, token, ttl_ms, owner, wait_ms, pop):
            return _handoff(backend, name).enqueue(name, token, ttl_ms, owner, wait_ms, pop)
        case AwaitGrant(name, token, seconds, above):
            return _handoff(backend, name).await_grant(name, token, seconds, above)
        case Dequeue(name, token):
            return _handoff(backend, name).dequeue(name, token)
        case _:
            _unknown(op)


async def arun_against(plan: Plan[T], backend: Backend) -> T:
    """Run ``plan`` with the backend's asyncio calls; return what the plan returns."""
    return await arun(plan, functools.partial(aanswer, backend=backend))  # type: ignore[no-any-return]


async def aanswer(op: Op, backend: Backend) -> Any:
    """:func:`answer` from the backend's asyncio calls."""
    match op:
        case Acquire(name, token, ttl_ms, owner, check):
            if check is None:
                return await backend.aacquire(name, token, ttl_ms, owner)
            return await _run_checked(backend, name).aacquire_run(name, token, ttl_ms, owner, check)
        case Release(name, token):
            return await backend.arelease(name, token)
        case Wait(name, seconds):
            return await backend.await_release(name, seconds)
        case WaitAny(names, seconds):
            return await backend.await_any(names, seconds)
        case Enqueue(name, token, ttl_ms, owner, wait_ms, pop):
            handoff = _handoff(backend, name)
            return await handoff.aenqueue(name, token, ttl_ms, owner, wait_ms, pop)
        case AwaitGrant(name, token, seconds, above):
            return await _handoff(backend, name).aawait_grant(name, token, seconds, above)
        case Dequeue(name, token):
            return await _handoff(backend, name).adequeue(name, token)
        case _:
            _unknown(op)
