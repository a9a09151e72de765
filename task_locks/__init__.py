"""task-locks: named distributed locks that stay correct when holders crash or pause.

Every lock has a TTL, a unique token, a fencing token, renewal tied to the holder's life
and token-checked release. docs/backends/index.md says what each backend guarantees.
"""

from .backends import close_all, get_backend, register_backend
from .backends.base import Backend, Capability
from .config import configure
from .context import current_lease
from .decorators import locked
from .election import AsyncElection, Election
from .errors import (
    BackendMisconfigured,
    BackendUnavailable,
    InvalidArgument,
    LockError,
    LockHeld,
    LockLost,
    MissingCapability,
    NotConfigured,
    NotOwned,
    StaleFence,
)
from .lock import AsyncLease, AsyncLock, Lease, Lock
from .owner import current_owner, owner_context
from .semaphore import AsyncSemaphore, Semaphore
from .types import Holder, Owner

__version__ = "0.1.0"


def _warn_if_our_django_app_is_hidden() -> None:
    """In a Django project, say at once when its own ``django_app`` package hides ours
    (Django would load it silently: see :mod:`task_locks.app_identity`)."""
    import os

    if not os.environ.get("DJANGO_SETTINGS_MODULE"):
        return
    from . import app_identity

    hidden = app_identity.problem()
    if hidden:
        import warnings

        warnings.warn(hidden, RuntimeWarning, stacklevel=3)


_warn_if_our_django_app_is_hidden()

__all__ = [
    "AsyncElection",
    "AsyncLease",
    "AsyncLock",
    "AsyncSemaphore",
    "Backend",
    "BackendMisconfigured",
    "BackendUnavailable",
    "Capability",
    "Election",
    "Holder",
    "InvalidArgument",
    "Lease",
    "Lock",
    "LockError",
    "LockHeld",
    "LockLost",
    "MissingCapability",
    "NotConfigured",
    "NotOwned",
    "Owner",
    "Semaphore",
    "StaleFence",
    "close_all",
    "configure",
    "current_lease",
    "current_owner",
    "get_backend",
    "locked",
    "owner_context",
    "register_backend",
]
