"""``@locked``: run any function, plain or ``async def``, under a named lock.

For code that is not a Celery task: Dramatiq, RQ, Huey or APScheduler jobs, cron
scripts, python-redis-lock's decorator patterns::

    from task_locks import current_lease, locked

    @locked("sync:{account_id}", ttl=60, timeout=0, on_conflict="skip")
    def sync_account(account_id: int) -> None:
        write(account_id, fence=current_lease().fence)

The key is rendered by the same code as ``@singleton_task``'s (:mod:`task_locks.keys`):
a ``str.format`` template over the call's arguments (defaults applied; checked against
the signature when the function is decorated), a callable taking the same arguments, or
``None`` (the function's qualified name and a hash of the arguments). Inside the call,
:func:`~task_locks.current_lease` is the lease (the same context variable the Celery
path sets). The lease is renewed by the watchdog while the function runs and released
when it returns or raises.

``on_conflict`` when the lock is held by someone else (the choices of
``@singleton_task`` that make sense outside a queue; ``"retry"`` needs one):

- ``"skip"`` (default): log at INFO naming the holder and return ``None`` without
  calling the function, as a direct call of a singleton task does. Use a return value
  other than ``None`` in the function if callers must tell a skip from a run.
- ``"raise"``: raise :class:`~task_locks.LockHeld` naming the holder.
- ``"wait"``: wait for the holder to release (woken by the release, not polling),
  then run; ``LockHeld`` if ``timeout`` runs out.

``timeout`` is how long to wait for the lock before the conflict choice applies:
``0`` (the default for ``"skip"``/``"raise"``) tries once; for ``"wait"`` the default
is ``None``, as long as it takes.

A lease lost while the function ran (its TTL ran out: the process was paused, the
backend unreachable) makes an otherwise successful call raise
:class:`~task_locks.LockLost`; a failed release that only could not reach the backend is
logged (the lock ends by its TTL) and the function's result is returned.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, Final, TypeVar

from . import events
from .backends.base import Backend
from .config import resolve_backend, validate_ttl
from .context import AnyLease, _current
from .errors import BackendUnavailable, InvalidArgument, LockHeld, LockLost
from .keys import KeySpec, TaskKey
from .lock import AsyncLease, AsyncLock, Lease, Lock, _Unset, validate_timeout

log = logging.getLogger("task_locks.decorators")

#: ``on_conflict`` choices of :func:`locked`.
LOCKED_ON_CONFLICT: Final = ("skip", "raise", "wait")
F = TypeVar("F", bound=Callable[..., Any])
_DEFAULT: Final = _Unset()


def _conflict(on_conflict: str, label: str, name: str, held: LockHeld) -> None:
    """``"skip"``: log and return (the call returns ``None``); otherwise raise ``held``."""
    if on_conflict != "skip":
        raise held
    who = held.holder.describe() if held.holder is not None else "another holder"
    log.info("%s skipped: lock %r is held by %s", label, name, who)


def _release_failed(label: str, lease: AnyLease, exc: LockLost | BackendUnavailable) -> None:
    """After a successful body: a lost lease is an error, an unreachable backend is not."""
    if isinstance(exc, LockLost):
        raise exc
    # Unreachable: the lease was marked lost (outcome unknown), and that was logged.


def locked(
    key: KeySpec = None,
    *,
    ttl: float | None = None,
    timeout: float | _Unset | None = _DEFAULT,
    on_conflict: str = "skip",
    backend: str | Backend | None = None,
    max_hold: float | None = None,
) -> Callable[[F], F]:
    """Decorate a function so each call holds the lock named by ``key`` (see module doc).

    ``on_conflict="skip"`` returns ``None`` without calling the function; ``"raise"``
    and ``"wait"`` (after ``timeout``) raise :class:`~task_locks.LockHeld`. Use
    parentheses even without options (``@locked()``): a bare ``@locked`` would take the
    function for a key callable.
    ``ttl``/``backend``/``max_hold`` are :class:`~task_locks.Lock`'s. Bad options, and a
    template naming an argument the function does not take, raise
    :class:`~task_locks.InvalidArgument` here, when the function is decorated. The
    decorated function gets ``lock_name(*args, **kwargs)``: the lock a call would take.
    """
    if on_conflict not in LOCKED_ON_CONFLICT:
        raise InvalidArgument(
            "locked: on_conflict must be one of "
            f"{', '.join(map(repr, LOCKED_ON_CONFLICT))}, got {on_conflict!r}"
        )
    if ttl is not None:
        validate_ttl(ttl)
    if max_hold is not None:
        validate_ttl(max_hold, "max_hold")
    if isinstance(timeout, _Unset):
        timeout = None if on_conflict == "wait" else 0.0
    wait = validate_timeout(timeout)
    options: dict[str, Any] = {"ttl": ttl, "backend": backend, "max_hold": max_hold}
    if isinstance(backend, str):
        resolve_backend(backend)  # a bad URL fails here, not at the first call

    def decorate(function: F) -> F:
        if not callable(function):
            raise InvalidArgument(f"locked decorates a function, got {function!r}")
        qualified = f"{function.__module__}.{function.__qualname__}"
        render = TaskKey(key, function, qualified, bound=False, kind="function")
        label = f"function {qualified}"

        if inspect.iscoroutinefunction(function):

            @functools.wraps(function)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                name = render(args, kwargs)
                try:
                    with events.context(policy=on_conflict, detail=label):
                        lease = await AsyncLock(name, **options).acquire(timeout=wait)
                except LockHeld as held:
                    return _conflict(on_conflict, label, name, held)
                reset = _current.set(lease)
                try:
                    result = await function(*args, **kwargs)
                except BaseException:
                    await _arelease_quietly(label, lease)
                    raise
                finally:
                    _current.reset(reset)
                try:
                    await lease.release()
                except (LockLost, BackendUnavailable) as exc:
                    _release_failed(label, lease, exc)
                return result

            wrapper: Any = run_async
        else:

            @functools.wraps(function)
            def run(*args: Any, **kwargs: Any) -> Any:
                name = render(args, kwargs)
                try:
                    with events.context(policy=on_conflict, detail=label):
                        lease = Lock(name, **options).acquire(timeout=wait)
                except LockHeld as held:
                    return _conflict(on_conflict, label, name, held)
                reset = _current.set(lease)
                try:
                    result = function(*args, **kwargs)
                except BaseException:
                    _release_quietly(label, lease)
                    raise
                finally:
                    _current.reset(reset)
                try:
                    lease.release()
                except (LockLost, BackendUnavailable) as exc:
                    _release_failed(label, lease, exc)
                return result

            wrapper = run
        wrapper.lock_name = lambda *args, **kwargs: render(args, kwargs)
        return wrapper  # type: ignore[no-any-return]

    return decorate


def _release_quietly(label: str, lease: Lease) -> None:
    """Release after the body raised: its exception is the one the caller must see."""
    try:
        lease.release()
    except (LockLost, BackendUnavailable):
        pass  # the lease was marked lost, and that was logged (task_locks.events)


async def _arelease_quietly(label: str, lease: AsyncLease) -> None:
    try:
        await lease.release()
    except (LockLost, BackendUnavailable):
        pass  # the lease was marked lost, and that was logged (task_locks.events)


__all__ = ["LOCKED_ON_CONFLICT", "locked"]
