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


class Expiry(NamedTuple):
    """When a holder expires as read at one look: on this process's monotonic clock and
    on its wall clock (where the backend reports it: the read's wall clock plus the
    server's remaining TTL, or the server's own expiry)."""

    monotonic: float
    wall: float

    def later_than(self, before: Expiry) -> bool:
        """Moved later, by more than the slack, on *both* clocks: a renewal moves both,
        a step of one clock (NTP, a VM resumed or migrated) moves only its own."""
        return self.monotonic > before.monotonic + SLACK and self.wall > before.wall + SLACK

    def passed(self) -> bool:
        """Past, by more than the slack, on both clocks (a step of one cannot say so)."""
        return time.monotonic() > self.monotonic + SLACK and time.time() > self.wall + SLACK


def expiry(holder: Holder) -> Expiry | None:
    """When ``holder`` expires, read now (``None``: the backend cannot say)."""
    left = holder.expires_in
    if left is None or holder.expires_at is None:
        return None
    return Expiry(time.monotonic() + left, holder.expires_at)


def renewed(before: Holder, now: Holder, *, before_expiry: Expiry | None = None) -> bool:
    """Whether ``now`` (a later look at the same lock as ``before``) shows a renewal: its
    count moved on, or its expiry moved later (``before_expiry``: as :func:`expiry` read
    ``before``'s when it came)."""
    if now.renewals > before.renewals:
        return True
    before_expiry = before_expiry or expiry(before)
    now_expiry = expiry(now)
    return (
        before_expiry is not None
        and now_expiry is not None
        and now_expiry.later_than(before_expiry)
    )


def watch(backend: Backend, name: str, seen: Holder) -> Generator[Any, Any, bool]:
    """Watch ``seen`` (the holder a redelivered copy met) until it is renewed, released
    or expired: ``True`` if it expired unrenewed (its process is gone: take the key).

    A renewal is an expiry moved on both clocks (:class:`Expiry`): a step of either clock
    while the copy watches must not read as one (the copy refused, the message lost)."""
    expires = expiry(seen)
    if expires is None:  # the backend cannot say when it expires: never guess it dead
        return False
    poll = min(POLL, max(0.01, (expires.monotonic - time.monotonic()) / 10))
    counted = False  # whether ``seen`` carries the holder's renewal count yet
    while True:
        now: Holder | None = yield HolderOf(backend, name)
        if now is None or now.fence != seen.fence:
            # Gone: expired, or released early (the original finished).
            return time.monotonic() >= expires.monotonic - SLACK
        if not counted:
            # A refused acquire reports no renewal count: count from this first look, or a
            # run that renewed before its worker died would look renewed (alive) here.
            seen, counted = dataclasses.replace(seen, renewals=now.renewals), True
        if renewed(seen, now, before_expiry=expires):
            return False
        if expires.passed():  # still there past its expiry: not ours to judge
            return False
        yield Pause(poll)


__all__ = [
    "POLL",
    "SLACK",
    "Expiry",
    "HolderOf",
    "Pause",
    "expiry",
    "redelivered",
    "renewed",
    "watch",
]
