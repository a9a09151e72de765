"""A redelivered message whose own task id holds its lock: running elsewhere, or dead?

A second delivery of a message that is still running (a Redis visibility timeout, an
``acks_late`` redelivery, a broker's duplicate) finds its own task id on the key and is
refused: the original is doing the work. But a message is also redelivered when the
worker running it died whole (a host lost, the worker SIGKILLed: no main process is left
to release its child's lock), and RabbitMQ does so at once, to another worker, while the
dead run's lock still names that task id. Refused, the copy would be acknowledged and the
message lost; the lock would expire a TTL later with nothing left to run.

So a *redelivered* copy (``delivery_info["redelivered"]``) that meets its own task id
watches that holder first (:func:`watch`), polling it, for at most the holder's remaining
TTL: a renewal (its renewal count or expiry moves on) or a release before its expiry
means the original is alive (it renews, or it finished): the copy is refused, as ever.
An expiry without a renewal means nobody renews it (its process is gone): the copy takes
the key and runs, at most one TTL after the crash. A copy that is not a redelivery (a
broker's duplicate, a second publish with the same id) is refused at once, as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Generator
from typing import Any, Final, NamedTuple

from ..backends.base import Backend
from ..types import Holder

#: Seconds between two looks at the holder (at most; a tenth of its TTL if shorter).
POLL: Final = 0.25
#: A holder that vanishes this close to its expiry, or later, expired rather than was
#: released (a live holder renews a third of its TTL ahead, so never lets it come this
#: close); it is also the slack given to the server's expiry and the reads' latency.
SLACK: Final = 0.25


class HolderOf(NamedTuple):
    """Who holds ``name`` now (``None``: nobody)."""

    backend: Backend
    name: str

    def run(self) -> Holder | None:
        return self.backend.holder(self.name)

    async def arun(self) -> Holder | None:
        return await self.backend.aholder(self.name)


class Pause(NamedTuple):
    seconds: float

    def run(self) -> None:
        time.sleep(self.seconds)

    async def arun(self) -> None:
        await asyncio.sleep(self.seconds)


def redelivered(request: Any) -> bool:
    """Whether the broker says it delivered this message before."""
    info = getattr(request, "delivery_info", None) or {}
    return bool(info.get("redelivered"))


def expiry(holder: Holder) -> float | None:
    """When ``holder`` expires on this process's monotonic clock (``None``: unknown).

    Its ``expires_at`` is the wall clock at the read plus the server's remaining TTL, and
    ``expires_in`` takes the wall clock off again at once, so a step of the wall clock
    (NTP, a VM resumed) cancels out: two looks compared this way see a renewal only
    where the server's expiry moved, never where this host's wall clock did."""
    left = holder.expires_in
    return None if left is None else time.monotonic() + left


def renewed(before: Holder, now: Holder, *, before_expiry: float | None = None) -> bool:
    """Whether ``now`` (a later look at the same lock as ``before``) shows a renewal: its
    count moved on, or its expiry (``before_expiry`` on the monotonic clock, as
    :func:`expiry` gave it when ``before`` was read) moved later by more than the slack."""
    if now.renewals > before.renewals:
        return True
    if before_expiry is None:
        before_expiry = expiry(before)
    now_expiry = expiry(now)
    return (
        before_expiry is not None and now_expiry is not None and now_expiry > before_expiry + SLACK
    )


def watch(backend: Backend, name: str, seen: Holder) -> Generator[Any, Any, bool]:
    """Watch ``seen`` (the holder a redelivered copy met) until it is renewed, released
    or expired: ``True`` if it expired unrenewed (its process is gone: take the key).

    Every time here is on the monotonic clock: a wall clock stepped forward while the
    copy watches must not read as a renewal (the copy refused, the message lost)."""
    expires = expiry(seen)
    if expires is None:  # the backend cannot say when it expires: never guess it dead
        return False
    poll = min(POLL, max(0.01, (expires - time.monotonic()) / 10))
    counted = False  # whether ``seen`` carries the holder's renewal count yet
    while True:
        now: Holder | None = yield HolderOf(backend, name)
        if now is None or now.fence != seen.fence:
            return time.monotonic() >= expires - SLACK  # gone: expired, or released early
        if not counted:
            # A refused acquire reports no renewal count: count from this first look, or a
            # run that renewed before its worker died would look renewed (alive) here.
            seen, counted = dataclasses.replace(seen, renewals=now.renewals), True
        if renewed(seen, now, before_expiry=expires):
            return False
        if time.monotonic() > expires + SLACK:  # still there past its expiry: not ours to judge
            return False
        yield Pause(poll)


__all__ = ["POLL", "SLACK", "HolderOf", "Pause", "expiry", "redelivered", "renewed", "watch"]
