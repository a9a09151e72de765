"""The error tree.

Every error the package raises derives from :class:`LockError` and names the lock it is
about, so a log line or a Celery failure always says *which* lock went wrong. Client
library errors (redis-py, etcd3gw, database drivers) are translated at the backend
boundary with ``raise ... from exc``; nothing above the backends sees them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from .types import Holder


class LockError(Exception):
    """Root of every task-locks error; ``name`` is the lock concerned (``None`` if none)."""

    def __init__(self, message: str, *, name: str | None = None) -> None:
        super().__init__(message)
        self.name = name


class InvalidArgument(LockError, ValueError):
    """Bad input: an empty name, a ttl <= 0, an unknown URL scheme...

    Also a :class:`ValueError`, so callers that validate input generically catch it.
    """


class LockHeld(LockError):
    """The lock is held by someone else and the timeout ran out (or was 0)."""

    def __init__(
        self, message: str, *, name: str | None = None, holder: Holder | None = None
    ) -> None:
        super().__init__(message, name=name)
        self.holder = holder


class LockLost(LockError):
    """The lease expired or was taken over: the holder must stop acting on the resource."""


class NotOwned(LockLost):
    """A release or renew was refused because the lock's token is no longer ours.

    The lock expired and may now belong to someone else; nothing was changed on the
    server. This is the "release by anyone" mistake being prevented, loudly. It is a
    :class:`LockLost` too: a token that is not ours means the lease is gone.
    """


class StaleFence(LockError):
    """A write presented a fencing token older than one the resource already accepted."""

    def __init__(
        self,
        message: str,
        *,
        name: str | None = None,
        resource: str | None = None,
        fence: int | None = None,
        current: int | None = None,
    ) -> None:
        super().__init__(message, name=name)
        self.resource = resource
        self.fence = fence
        self.current = current


class BackendUnavailable(LockError):
    """The lock service could not be reached or did not answer in time.

    ``server`` names the backend (URL without credentials). The outcome of the operation
    is unknown; a lock we might have taken expires by its TTL. ``timed_out``: the server
    did not answer within the socket timeout (paused, cut off), where a follow-up call
    would only wait as long again; ``False`` when unknown. ``unreachable``: the last try
    could not even connect (refused, no route), where a follow-up call would fail the same
    way; an earlier try may still have reached the server; ``False`` when unknown.
    """

    def __init__(
        self,
        message: str,
        *,
        name: str | None = None,
        server: str | None = None,
        timed_out: bool = False,
        unreachable: bool = False,
    ) -> None:
        super().__init__(message, name=name)
        self.server = server
        self.timed_out = timed_out
        self.unreachable = unreachable


class BackendMisconfigured(InvalidArgument):
    """The lock service answered, but not as this configuration expects: it requires a
    password (or another one), speaks TLS where the URL does not (or the reverse), or is
    not that kind of server at all, or its access rules (an ACL, an etcd role) do not
    cover the lock's keys. Retrying cannot help; fixing the URL does. It is an
    :class:`InvalidArgument` (bad configuration is bad input).

    ``server`` names the backend (URL without credentials).
    """

    def __init__(self, message: str, *, name: str | None = None, server: str | None = None) -> None:
        super().__init__(message, name=name)
        self.server = server


class RenewalUndecided(BackendUnavailable):
    """A batch renewal decided some leases but not all: each lease gets its own outcome.

    ``outcomes[i]`` is ``True`` (renewed), ``False`` (lost) or ``None`` (no majority either
    way yet: retry that lease until its own deadline). Raised instead of a list so that a
    caller that only knows ``list[bool]`` still sees "cannot renew", while the watchdog
    applies the decided outcomes lease by lease (one undecided lease must not cost the
    others their renewal). ``name`` is the first undecided lease.
    """

    def __init__(
        self,
        message: str,
        outcomes: list[bool | None],
        *,
        name: str | None = None,
        server: str | None = None,
    ) -> None:
        super().__init__(message, name=name, server=server)
        self.outcomes = outcomes


class MissingCapability(LockError):
    """The backend lacks a capability the caller demanded with ``require=``.

    ``missing`` holds the lacking :class:`~task_locks.Capability` members, so a caller
    can choose another backend without parsing the message.
    """

    def __init__(
        self, message: str, *, name: str | None = None, missing: Iterable[str] = ()
    ) -> None:
        super().__init__(message, name=name)
        self.missing = frozenset(missing)


class NotConfigured(LockError):
    """No backend was given or configured; the message says how to configure one.

    There is no default server: a silent local default would let two hosts that both
    forgot the setting each lock on their own Redis, with no exclusion between them.
    """


__all__ = [
    "BackendMisconfigured",
    "BackendUnavailable",
    "InvalidArgument",
    "LockError",
    "LockHeld",
    "LockLost",
    "MissingCapability",
    "NotConfigured",
    "NotOwned",
    "StaleFence",
]
