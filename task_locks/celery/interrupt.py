"""``on_lost``: what a singleton task's run does when its lock is lost while the body runs.

A lease is known lost when a renewal finds its token gone (a force release, an expiry
while the holder was paused), at once when the backend announces a force release
(:mod:`task_locks.notices`), at its local deadline (renewals could not reach the
server), at ``max_hold``, or when the body's own ``lease.check()``/``renew()`` finds it.
:class:`RunWatch` hears of it through the lease's ``on_lost`` hook, from whichever
thread found it, and does what the task's ``on_lost`` says:

- ``"interrupt"`` (default) raises :class:`~task_locks.LockLost` inside the body, the way
  Celery's soft time limit raises ``SoftTimeLimitExceeded``:

  - a body on its process's main thread (prefork children, ``solo``, direct calls from
    the main thread) gets it from a signal handler: :data:`LOST_SIGNAL` is sent to that
    thread (``pthread_kill``), so a blocking ``sleep``, socket read or lock wait is cut
    short at once;
  - a body on another thread (the ``threads`` pool) gets it through
    ``PyThreadState_SetAsyncExc`` at its next Python bytecode: a blocking C call
    (``sleep``, a socket read) finishes first;
  - a body in a greenlet (the ``gevent`` and ``eventlet`` pools) gets it thrown in by
    its hub at the body's next switch: a sleep, a socket wait, or any other yield to
    the hub (a body that never yields cannot be interrupted, nor renewed);
  - an ``async def`` body has its task cancelled and sees ``CancelledError`` at its
    current ``await``; the run then ends with ``LockLost``.

  The body may catch it to roll back; however it ends, the run fails with ``LockLost``.
- ``"fail"`` lets the body finish; the run then fails with ``LockLost``.
- ``"ignore"`` lets it finish and keeps its result (idempotent work).

Each loss is logged once, at WARNING, when it is found (:mod:`task_locks.events`).

A lease whose loss no one had noticed by the time the body returned (a force release
since the last renewal) is found by the release, which logs it; the run's outcome was
already decided. So the outcome is the same whether its release is sent at once (a stored
result) or after the run (see :mod:`task_locks.celery.releaser`).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any, Final

from ..context import AnyLease, current_lease
from ..errors import LockLost

log = logging.getLogger("task_locks.celery")

#: The signal that interrupts a body on its process's main thread. Its handler is
#: installed the first time such a run starts; a signal that finds no run to interrupt
#: goes to the handler that was there before.
LOST_SIGNAL: Final = signal.SIGUSR2


class _Interrupt(LockLost):
    """What ``PyThreadState_SetAsyncExc`` raises in a ``threads``-pool body.

    That call can only name a class; the exception is built in the body's own thread,
    so it reads which lease was lost from the run's context.
    """

    def __init__(self, message: str | None = None, *, name: str | None = None) -> None:
        if message is None:
            lease = current_lease()
            name = lease.name if lease is not None else None
            reason = lease.lost_reason if lease is not None else None
            message = f"lock {name!r} was lost while the task ran: {reason}"
        super().__init__(message, name=name)


#: The run on this process's main thread, which :data:`LOST_SIGNAL` interrupts.
_main_run: RunWatch | None = None
_previous_handler: Any = None
_installed = False


def _on_signal(signum: int, frame: FrameType | None) -> None:
    run = _main_run
    if run is not None and run._in_body and run._sent and not run._raised:
        run._raised = True
        raise run.interrupt_error()
    previous = _previous_handler
    if callable(previous):
        previous(signum, frame)


def _install() -> bool:
    """Install the :data:`LOST_SIGNAL` handler (main thread only); ``False`` if not here."""
    global _installed, _previous_handler
    if _installed:
        return True
    try:
        _previous_handler = signal.signal(LOST_SIGNAL, _on_signal)
    except ValueError:  # not the main thread of the main interpreter
        return False
    _installed = True
    return True


class RunWatch:
    """One run's body and its lease: interrupts the body (``"interrupt"``) when the lease is
    lost, and says how the run ends (:meth:`outcome`)."""

    def __init__(self, lease: AnyLease, mode: str, label: str) -> None:
        self.lease = lease
        self.mode = mode
        self.label = label
        self._guard = threading.Lock()
        self._in_body = False
        self._sent = False  # an interrupt was sent to the body
        self._raised = False  # ...and raised there (the signal path)
        self._ident = 0
        self._on_main = False
        self._task: asyncio.Task[Any] | None = None
        self._green: Any = None  # the body's greenlet (gevent, eventlet)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lost_at_end = False
        self._previous = lease.on_lost
        lease.on_lost = self._lost

    @property
    def lost_known(self) -> bool:
        """Whether the lease counts as lost (not merely released) as far as we know."""
        return self.lease.lost.is_set()

    def interrupt_error(self) -> LockLost:
        return LockLost(
            f"{self.label}: lock {self.lease.name!r} was lost while the task ran "
            f"({self.lease.lost_reason}); the run was interrupted",
            name=self.lease.name,
        )

    def failure(self) -> LockLost:
        """The error a run whose lease was lost ends with: one line, no internals."""
        if self._sent:
            return self.interrupt_error()
        return LockLost(
            f"{self.label}: lock {self.lease.name!r} was lost while the task ran "
            f"({self.lease.lost_reason}); it finished without exclusivity",
            name=self.lease.name,
        )

    # -- the body, wrapped ------------------------------------------------------------

    def body(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            global _main_run
            self._ident = threading.get_ident()
            self._green = _greenlet() if self.mode == "interrupt" else None
            self._on_main = (
                self.mode == "interrupt"
                and self._green is None
                and (threading.current_thread() is threading.main_thread() and _install())
            )
            if self._on_main:
                _main_run = self
            self._enter()
            try:
                return function(*args, **kwargs)
            finally:
                self._leave()
                if self._on_main:
                    _main_run = None

        return run

    def abody(self, function: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def run(*args: Any, **kwargs: Any) -> Any:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
            self._enter()
            try:
                return await function(*args, **kwargs)
            except asyncio.CancelledError:
                if not self._sent or self._task is None:
                    raise
                self._task.uncancel()
                raise self.interrupt_error() from None
            finally:
                self._leave()

        return run

    def _enter(self) -> None:
        with self._guard:
            if self.mode == "interrupt" and self.lost_known:
                self._sent = self._raised = True  # lost before the body began: not run
                raise self.interrupt_error()
            self._in_body = True

    def _leave(self) -> None:
        with self._guard:
            self._in_body = False
            if self._sent and not self._on_main and self._task is None and self._green is None:
                # Not raised yet (the body ended first): take the pending one back.
                _set_async_exc(self._ident, None)

    # -- the lease's on_lost hook (any thread) ---------------------------------------------

    def _lost(self, lease: Any) -> object:
        outcome = self._previous(lease) if self._previous is not None else None
        if self.mode != "interrupt":
            return outcome
        with self._guard:
            if not self._in_body or self._sent:
                return outcome
            if _greenlet() is self._green is not None or (
                self._green is None and threading.get_ident() == self._ident and not self._task
            ):
                # The body's own check()/renew() found it, and raises LockLost itself.
                return outcome
            self._sent = True
            if self._green is not None:
                _throw_green(self._green, self._throw)
            elif self._task is not None and self._loop is not None:
                self._loop.call_soon_threadsafe(self._cancel)
            elif self._on_main:
                signal.pthread_kill(self._ident, LOST_SIGNAL)
            else:
                _set_async_exc(self._ident, _Interrupt)
        log.info("%s: its lock %r was lost; interrupting the task", self.label, lease.name)
        return outcome

    def _throw(self) -> None:
        """In the hub: raise the interrupt in the body's greenlet, if it is still there."""
        if self._in_body and self._green is not None and not self._raised:
            self._raised = True
            self._green.throw(self.interrupt_error())

    def _cancel(self) -> None:
        if self._in_body and self._task is not None:
            self._task.cancel(f"lock {self.lease.name!r} was lost")

    # -- how the run ends ----------------------------------------------------------------

    def end(self) -> None:
        """The body is over: whether the run counts as lost is decided now, before its
        release (which may find the lock gone, or be sent after the run)."""
        self._lost_at_end = self._sent or self.lost_known

    def is_interrupt(self, exc: BaseException) -> bool:
        """Whether ``exc`` is this run's interrupt, not an error of the body's own."""
        return self._sent and isinstance(exc, LockLost)

    def outcome(self, result: Any) -> Any:
        """The run's result, for a body that returned (after :meth:`end`)."""
        if not self._lost_at_end:
            return result
        if self.mode == "ignore":
            log.info(  # the loss itself was logged at WARNING when it was found
                "%s: lock %r was lost while the task ran (%s); on_lost='ignore': its result stands",
                self.label,
                self.lease.name,
                self.lease.lost_reason,
            )
            return result
        raise self.failure()


def _greenlet() -> Any:
    """The greenlet running this code if it is a hub's child (gevent, eventlet), else None."""
    module = sys.modules.get("greenlet")
    if module is None or not ("gevent" in sys.modules or "eventlet" in sys.modules):
        return None
    current = module.getcurrent()
    return current if current.parent is not None else None


def _throw_green(green: Any, throw: Callable[[], None]) -> None:
    """Have the body's hub call ``throw`` at its next turn (the body is not running now:
    whoever found the loss is, in the same thread)."""
    if "gevent" in sys.modules:
        import gevent

        gevent.get_hub().loop.run_callback_threadsafe(throw)
    elif "eventlet" in sys.modules:
        from eventlet import hubs

        hubs.get_hub().schedule_call_global(0, throw)


def _set_async_exc(ident: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(exc) if exc is not None else None
    )


__all__ = ["LOST_SIGNAL", "RunWatch"]
