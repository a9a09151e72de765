"""What a front end does when the lock it wants is held: one decision for all of them.

``@singleton_task`` (Celery) and ``@locked`` (any function) offer the same conflict
choices. How they are checked, which acquire timeouts are tried, what a held lock then
means (try again, skip, raise), the skip's log line and the policy their ``conflict``
events report live here, below both, so that neither keeps a copy. What only a queue can
do with a conflict (retry later, finish in a ``SKIPPED`` state) stays in the Celery
layer, as a mapping of this module's :class:`Outcome`.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, Final, TypeVar

from . import events
from ._steps import Step
from .context import AnyLease
from .errors import InvalidArgument, LockHeld

#: Every conflict choice; a front end offers those it can carry out (``"retry"`` needs a
#: queue to run the call again later).
ON_CONFLICT: Final = ("skip", "retry", "wait", "raise")
_S = TypeVar("_S", bound=Step)


class Outcome(enum.Enum):
    """What a held lock means under a policy (raising is done by :func:`decide` itself)."""

    #: Try the next acquire timeout (``"wait"`` tried once, now it waits).
    AGAIN = "again"
    #: Logged: return without calling the function (``@locked`` returns ``None``).
    SKIP = "skip"
    #: The front end's queue runs the call again later (Celery's ``self.retry``).
    RETRY = "retry"


def check_on_conflict(value: object, where: str, choices: Sequence[str] = ON_CONFLICT) -> str:
    """``value`` if it is one of ``choices``, else :class:`~task_locks.InvalidArgument`."""
    if value not in choices:
        raise InvalidArgument(
            f"{where}: on_conflict must be one of {', '.join(map(repr, choices))}, got {value!r}"
        )
    return str(value)


def attempts(on_conflict: str, timeout: float | None) -> list[float | None]:
    """Acquire timeouts to try in turn.

    ``"wait"`` tries once first, so that the conflict is reported (and a front end can
    look at the holder) when it is met, not only when the wait runs out; then it waits
    up to ``timeout``. Any other choice makes one attempt of ``timeout``.
    """
    if on_conflict == "wait" and timeout != 0:
        return [0.0, timeout]
    return [timeout]


def holder_of(held: LockHeld, limit: int = 1) -> str:
    """Who holds the lock, for a log line."""
    if held.holder is not None:
        return held.holder.describe()
    if limit > 1:
        return f"others (all {limit} permits are taken)"
    return "another holder"


def decide(
    on_conflict: str,
    held: LockHeld,
    *,
    last: bool,
    name: str,
    label: str,
    logger: logging.Logger,
    who: str | None = None,
    note: str = "",
) -> Outcome:
    """Act on ``held`` (found by the ``last`` attempt or not) as ``on_conflict`` says.

    Raises ``held`` for ``"raise"``, and for ``"wait"`` once its wait ran out; a skip is
    logged at INFO as ``"<label> skipped: lock <name> is held by <who><note>"``.
    """
    if not last:
        return Outcome.AGAIN
    if on_conflict in ("raise", "wait"):
        raise held
    if on_conflict == "retry":
        return Outcome.RETRY
    logger.info("%s skipped: lock %r is held by %s%s", label, name, who or holder_of(held), note)
    return Outcome.SKIP


def take(
    acquire: Callable[[float | None], _S],
    timeouts: list[float | None],
    on_conflict: str,
    detail: str,
    on_held: Callable[[LockHeld, int], bool],
) -> Generator[_S, Any, AnyLease | None]:
    """Acquire with each of ``timeouts`` in turn (a plan: see :mod:`task_locks._steps`).

    Conflict events carry ``on_conflict`` as their policy and ``detail``; an attempt that
    is not the last (the first try of ``"wait"``) gives up nothing, so it reports no
    conflict, and the ``acquired`` event reports the wait from the first try. A held lock
    goes to ``on_held`` with the number of the attempt (from 1) that found it;
    ``True`` ends the plan with ``None`` (skip), ``False`` tries the next timeout, and it
    raises to end the call. ``timeouts`` is read as it goes (a front end may add one).
    """
    number = 0
    since = time.monotonic()
    while True:
        timeout = timeouts[number]
        number += 1
        policy = on_conflict if number >= len(timeouts) else ""  # "": not given up yet
        try:
            with events.context(policy=policy, detail=detail, since=since):
                lease: AnyLease = yield acquire(timeout)
                return lease
        except LockHeld as held:
            if on_held(held, number):
                return None


__all__ = ["ON_CONFLICT", "Outcome", "attempts", "check_on_conflict", "decide", "holder_of", "take"]
