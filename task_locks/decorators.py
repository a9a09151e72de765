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
is ``None``, as long as it takes. The decision, its log line and the ``conflict``
event (carrying the choice as its policy, :mod:`task_locks.events`) are
``@singleton_task``'s own, from :mod:`task_locks.policies`.

A lease lost while the function ran (its TTL ran out: the process was paused, the
backend unreachable) makes an otherwise successful call raise
:class:`~task_locks.LockLost`; a failed release that only could not reach the backend is
logged (the lock ends by its TTL) and the function's result is returned.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Generator
from typing import Any, Final, NamedTuple, TypeVar, cast

from ._plan import UNSET, Unset
from ._steps import Call, Step, adrive, drive
from .backends.base import Backend
from .config import resolve_backend, validate_ttl
from .context import AnyLease, _current
from .errors import BackendUnavailable, InvalidArgument, LockHeld, LockLost
from .keys import KeySpec, TaskKey
from .lock import AsyncLease, AsyncLock, Lease, Lock, validate_timeout
from .policies import Outcome, attempts, check_on_conflict, decide, take

log = logging.getLogger("task_locks.decorators")

#: ``on_conflict`` choices of :func:`locked`.
LOCKED_ON_CONFLICT: Final = ("skip", "raise", "wait")
F = TypeVar("F", bound=Callable[..., Any])


def locked(
    key: KeySpec = None,
    *,
    ttl: float | None = None,
    timeout: float | Unset | None = UNSET,
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
    check_on_conflict(on_conflict, "locked", LOCKED_ON_CONFLICT)
    if ttl is not None:
        validate_ttl(ttl)
    if max_hold is not None:
        validate_ttl(max_hold, "max_hold")
    if isinstance(timeout, Unset):
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

        def plan(args: Any, kwargs: Any) -> Generator[Step, Any, Any]:
            """One call: take the lock as ``on_conflict`` says, run, release."""
            name = render(args, kwargs)

            def on_held(held: LockHeld, number: int) -> bool:
                last = number >= len(timeouts)
                return (
                    decide(on_conflict, held, last=last, name=name, label=label, logger=log)
                    is Outcome.SKIP
                )

            timeouts = attempts(on_conflict, wait)
            acquire = functools.partial(_Acquire, name, options)
            lease = yield from take(acquire, timeouts, on_conflict, label, on_held)
            if lease is None:
                return None
            reset = _current.set(lease)
            try:
                result = yield Call(function, args, kwargs)
            except BaseException:
                try:
                    yield _Release(lease)
                except (LockLost, BackendUnavailable):
                    pass  # the lease was marked lost, and that was logged (task_locks.events)
                raise  # the body's exception is the one the caller must see
            finally:
                _current.reset(reset)
            try:
                yield _Release(lease)
            except BackendUnavailable:
                # Unreachable: the lease was marked lost (outcome unknown), and that was
                # logged. A LockLost (lost while the body ran) fails the call.
                pass
            return result

        if inspect.iscoroutinefunction(function):

            @functools.wraps(function)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                return await adrive(plan(args, kwargs))

            wrapper: Any = run_async
        else:

            @functools.wraps(function)
            def run(*args: Any, **kwargs: Any) -> Any:
                return drive(plan(args, kwargs))

            wrapper = run
        wrapper.lock_name = lambda *args, **kwargs: render(args, kwargs)
        return wrapper  # type: ignore[no-any-return]

    return decorate


class _Acquire(NamedTuple):
    """Take the call's lock once, waiting up to ``timeout``."""

    name: str
    options: dict[str, Any]
    timeout: float | None

    def run(self) -> Lease:
        return Lock(self.name, **self.options).acquire(timeout=self.timeout)

    async def arun(self) -> AsyncLease:
        return await AsyncLock(self.name, **self.options).acquire(timeout=self.timeout)


class _Release(NamedTuple):
    """Release the call's lease (token-checked)."""

    lease: AnyLease

    def run(self) -> None:
        cast(Lease, self.lease).release()

    async def arun(self) -> None:
        await cast(AsyncLease, self.lease).release()


__all__ = ["LOCKED_ON_CONFLICT", "locked"]
