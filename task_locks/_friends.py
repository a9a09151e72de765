"""What the front ends may do to a lease and a lock beyond their public API.

:mod:`task_locks.celery` hands a lease to another process (the message it queued, the
run's retry, a beat tick's message), sends a finished run's release from a thread of its
own (:mod:`task_locks.celery.releaser`), parks a lease for a retry, hooks a lease's loss
to interrupt the task body, and takes a run lock under the token of its publish-time
lock. Those are steps of a lease's or a lock's life that application code never takes
on its own. They are declared here, as :class:`task_locks.leasing.Renewable` declares
what the watchdog needs, and the front ends use only these (a test reads the Celery
package's source and fails on any other private name of another module).

:class:`~task_locks.Lease` and :class:`~task_locks.AsyncLease` implement
:class:`FriendLease` (mypy checks it below); the lock's take-over token is set through
:func:`acquire_under`, so the acquire loop keeps it private.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .context import AnyLease
from .context import _current as _current_lease
from .errors import BackendUnavailable
from .types import RunCheck

if TYPE_CHECKING:
    from .backends.base import Backend
    from .lock import LockBase


class FriendLease(Protocol):
    """What a front end may do to a lease: the public API and these steps."""

    name: str
    token: str
    fence: int
    backend: Backend
    #: The lease's loss hook; a front end chains its own in front of the user's.
    on_lost: Callable[[Any], object] | None

    @property
    def held(self) -> bool: ...
    @property
    def lost_reason(self) -> str | None: ...
    def stop_renewal(self) -> None:
        """Stop renewing; the lock stays until its TTL (parked for a retry)."""

    def hand_over(self, to: str) -> None:
        """The lock goes on to another process; this one stops holding it, no request."""

    def begin_release(self) -> bool:
        """A release sent by the caller, not :meth:`Lease.release`: ``False`` if none is due."""

    def finish_release(self, ok: bool, handed_to: str | None = None) -> None:
        """The server's answer to that release (refused: lost, :class:`NotOwned`)."""

    def release_unknown(self, error: BackendUnavailable) -> None:
        """That release got no answer: the lease counts as lost."""


_Lock = TypeVar("_Lock", bound="LockBase")

#: The context variable behind :func:`~task_locks.context.current_lease`: a front end
#: that runs code under a lease it took sets it for the run (``set``/``reset``).
current_lease_var: ContextVar[AnyLease | None] = _current_lease


def acquire_under(lock: _Lock, token: str | None) -> _Lock:
    """Make ``lock``'s next acquire use ``token`` (``None``: a fresh one) and return it.

    A token that already holds the lock gets it back with the same fence: a Celery run
    takes over its publish-time lock in one server-side step. Set on the lock object, not
    passed to ``acquire``, so subclasses' ``acquire`` (a peer-checked lock) keep working.
    """
    lock._token = token
    return lock


def acquire_fresh(lock: _Lock, token: str) -> _Lock:
    """Make ``lock``'s acquires use the new ``token``, which the caller keeps: a Celery
    publish frees what an acquire with no answer may have taken under it
    (:meth:`~task_locks.celery.releaser.Releaser.free_later`). A lock made per call."""
    lock._fresh_token = token
    return lock


def acquire_as_run(
    lock: _Lock,
    token: str | None,
    task_id: str,
    *,
    also: tuple[str, ...] = (),
    mark: str | None = None,
    give_up_on_copy: bool = True,
) -> _Lock:
    """Make ``lock``'s next acquire a Celery run's: one server step that also refuses a
    run of ``task_id`` already holding any of its names or ``also`` (a second delivery
    of the same message) other than under ``mark`` (this run's own), and takes over the
    publish-time lock held by ``token`` (if any) under a token of its own
    (:class:`~task_locks.types.RunCheck`). The backend must be a
    :class:`~task_locks.backends.base.RunChecked`."""
    lock._token = None
    lock._run = RunCheck(
        task_id,
        (*lock._run_names(), *also),
        take_over=token,
        mark=mark,
        give_up_on_copy=give_up_on_copy,
    )
    return lock


if TYPE_CHECKING:
    from .lock import AsyncLease, Lease

    def _leases_are_friends(lease: Lease, alease: AsyncLease) -> tuple[FriendLease, ...]:
        return lease, alease


__all__ = ["FriendLease", "acquire_as_run", "acquire_fresh", "acquire_under", "current_lease_var"]
