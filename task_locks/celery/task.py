"""``SingletonTask`` and ``@singleton_task``: a Celery task whose runs hold a named lock.

Run-time locking happens in ``__call__``, the one hook Celery's tracer calls around the
task body in every pool (prefork, threads, solo) and also for direct calls: the lock is
taken before the body, renewed by the process's watchdog thread while it runs (no thread
per task) and released when it ends (a run whose result nobody stores hands the release
to the process's thread in :mod:`task_locks.celery.releaser`, so the worker does not
wait for it). The run's decisions are one plan, driven by a blocking and an awaiting
driver (``async def`` tasks). What a ``finally`` cannot cover (a child killed by
SIGKILL, the OOM killer, a hard time limit or ``revoke(terminate=True)``) is covered by
the worker's main process (:mod:`task_locks.celery.request`), which releases the dead
child's lock, token-checked, as soon as the child is gone.

Enqueue-time de-duplication (``lock_on="enqueue"`` or ``"both"``) happens where every
publish passes: :mod:`task_locks.celery.publish`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import random
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from typing import Any, Final, NamedTuple, NoReturn, TypeVar, cast

from celery import Task, shared_task
from celery.exceptions import Ignore

from .._friends import acquire_as_run, acquire_under, current_lease_var
from .._steps import Call, adrive, drive
from ..backends.base import Backend, RunChecked
from ..config import resolve_backend, validate_ttl
from ..context import AnyLease, current_lease
from ..errors import BackendUnavailable, InvalidArgument, LockError, LockHeld, LockLost
from ..lock import AsyncLease, AsyncLock, Lease, LeaseBase, Lock, validate_timeout
from ..owner import owner_context
from ..policies import Outcome, attempts, check_on_conflict, decide, holder_of, take
from ..semaphore import MAX_LIMIT, AsyncSemaphore, Semaphore, slot_name
from ..types import Holder
from ._celery_compat import get_actual_ignore_result
from ._common import (
    FENCE_HEADER,
    LOCK_ON,
    ON_CONFLICT,
    ON_LOST,
    SKIP_AS,
    SKIPPED,
    STALE_TICK,
    TOKEN_HEADER,
    DuplicateTask,
    LockedTask,
    Skipped,
    StaleTick,
    unpark,
)
from .beat import (
    ELECTION_HEADER,
    BeatTick,
    aclaim_holds,
    aelection_holder,
    beat_backend,
    beat_tick,
    claim_holds,
    election_holder,
    stale_tick_term,
)
from .interrupt import RunWatch
from .keys import KeySpec, TaskKey
from .options import call_options, for_this_call, with_lock_options
from .publish import install_publish_guard
from .redelivery import HolderOf, Pause, redelivered, watch
from .registry import live_leases
from .releaser import releaser
from .unavailable import check_lock_unavailable, on_unavailable

log = logging.getLogger("task_locks.celery")

#: Joins a key and a task id into the name of that task id's run guard (see
#: :func:`task_id_lock_name`).
TASK_ID_SEPARATOR: Final = "#task:"
#: Seconds a retry (``request.retries`` > 0) waits for its previous attempt, which has
#: the same task id and may still be letting go of the key, before refusing as a copy.
RETRY_HANDOVER_WAIT: Final = 5.0


def task_id_lock_name(name: str, task_id: str) -> str:
    """The lock a run of task ``task_id`` on key ``name`` holds besides its run lock, on
    a backend without a run check (:class:`~task_locks.backends.base.RunChecked`).

    With ``limit`` > 1, a second delivery of a running message (same task id: an
    ``acks_late`` redelivery, a visibility timeout, a broker's duplicate) would find a
    free permit; with ``lock_on="both"`` it carries the same publish-time token as the
    run. Where the run lock's own server step cannot tell the copy from the original,
    every run of those tasks first takes this lock, named by the key *and* the task id:
    a copy finds it held by its own task id and is refused, as with ``limit=1``. A
    :class:`~task_locks.backends.base.RunChecked` backend decides it in the run lock's
    acquire instead, and no such lock is taken.
    """
    return f"{name}{TASK_ID_SEPARATOR}{task_id}"


def check_options(
    task_name: str,
    function: Callable[..., Any],
    *,
    bound: bool,
    key: KeySpec,
    ttl: object,
    on_conflict: object,
    lock_on: object,
    max_hold: object,
    wait_timeout: object,
    retry_countdown: object,
    enqueue_ttl: object,
    limit: object = 1,
    lock_unavailable: object = "fail",
    on_lost: object = "interrupt",
    skip_as: object = "success",
) -> TaskKey:
    """Validate a singleton task's lock options; the compiled key, or InvalidArgument."""
    check_on_conflict(on_conflict, f"task {task_name}", ON_CONFLICT)
    check_lock_unavailable(task_name, lock_unavailable)
    for what, value, allowed in (("on_lost", on_lost, ON_LOST), ("skip_as", skip_as, SKIP_AS)):
        if not isinstance(value, str) or value not in allowed:
            raise InvalidArgument(
                f"task {task_name}: {what} must be one of {', '.join(map(repr, allowed))}, "
                f"got {value!r}"
            )
    if lock_on not in LOCK_ON:
        raise InvalidArgument(
            f"task {task_name}: lock_on must be one of {', '.join(map(repr, LOCK_ON))}, "
            f"got {lock_on!r}"
        )
    for what, value in (("ttl", ttl), ("max_hold", max_hold), ("enqueue_ttl", enqueue_ttl)):
        if value is not None:
            validate_ttl(value, f"task {task_name}: {what}")
    validate_ttl(retry_countdown, f"task {task_name}: retry_countdown")
    try:
        validate_timeout(wait_timeout)
    except InvalidArgument as exc:
        raise InvalidArgument(f"task {task_name}: wait_timeout: {exc}") from None
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise InvalidArgument(
            f"task {task_name}: limit must be a whole number of runs from 1 to {MAX_LIMIT}, "
            f"got {limit!r}"
        )
    if limit > 1 and lock_on != "run":
        raise InvalidArgument(
            f"task {task_name}: limit={limit} needs lock_on='run', got {lock_on!r}: "
            "enqueue-time de-duplication keeps one queued message per key, not N"
        )
    return TaskKey(key, function, task_name, bound=bound)


def _task_function(cls: type) -> tuple[Callable[..., Any], bool] | None:
    """The function a task class runs and whether it takes ``self`` (``None``: abstract)."""
    run = cls.__dict__.get("run")
    if run is None:
        return None
    if isinstance(run, staticmethod):
        return run.__func__, False
    return run, True


class SingletonTask(Task, LockedTask):  # type: ignore[misc]
    """A Celery task base whose runs hold the lock named by ``lock_key``.

    Use through :func:`singleton_task`, or ``@app.task(base=SingletonTask, lock_key=...)``.
    Options are class attributes, so every Celery way of setting task options works.
    """

    #: Lock name: a format string over the task's arguments, a callable, or ``None``
    #: (task name + a hash of all arguments).
    lock_key: KeySpec = None
    #: Seconds a dead holder keeps the lock (``None``: the configured default).
    lock_ttl: float | None = None
    on_conflict: str = "skip"
    lock_on: str = "run"
    #: Seconds after which renewal stops and the lease is marked lost (hung tasks).
    max_hold: float | None = None
    #: ``on_conflict="wait"``: seconds to wait for the holder (``None``: as long as it takes).
    wait_timeout: float | None = None
    #: Backend URL or instance (``None``: the configured default).
    lock_backend: str | Backend | None = None
    #: ``on_conflict="retry"``: base countdown in seconds, jittered by +-50%.
    retry_countdown: float = 1.0
    #: Seconds a lock taken at publish outlives an unconsumed message (``None``: until the
    #: message's ``expires``, else ``publish.DEFAULT_ENQUEUE_TTL``, an hour).
    enqueue_ttl: float | None = None
    #: Runs of one key allowed at once: 1 is a :class:`~task_locks.Lock` named by the
    #: key; N > 1 a :class:`~task_locks.Semaphore` of that name (``lock_on="run"`` only).
    lock_limit: int = 1
    #: What a run does when its acquire meets ``BackendUnavailable``: ``"fail"`` or
    #: ``"retry"`` (:mod:`task_locks.celery.unavailable`).
    lock_unavailable: str = "fail"
    #: A lock lost while the body runs: ``"interrupt"`` raises ``LockLost`` in the body,
    #: ``"fail"`` fails the run when the body ends, ``"ignore"`` keeps its result
    #: (:mod:`task_locks.celery.interrupt`).
    on_lost: str = "interrupt"
    #: A skipped run ends ``"success"`` (result: a :class:`Skipped`) or ``"failure"``
    #: (:class:`DuplicateTask`).
    skip_as: str = "success"
    #: A run that lost its lock fails with one line, not a traceback (Celery's expected
    #: errors); a task's own ``throws`` are kept beside it.
    throws: tuple[type[BaseException], ...] = (LockLost,)

    #: The worker's main process recovers locks of killed children through this class.
    Request = "task_locks.celery.request:SingletonRequest"

    _task_key: TaskKey | None = None
    _is_async: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        found = _task_function(cls)
        if found is None:
            return
        function, bound = found
        name = cls.__dict__.get("name") or f"{cls.__module__}.{cls.__name__}"
        cls._task_key = check_options(
            name,
            function,
            bound=bound,
            key=cls.lock_key,
            ttl=cls.lock_ttl,
            on_conflict=cls.on_conflict,
            lock_on=cls.lock_on,
            max_hold=cls.max_hold,
            wait_timeout=cls.wait_timeout,
            retry_countdown=cls.retry_countdown,
            enqueue_ttl=cls.enqueue_ttl,
            limit=cls.lock_limit,
            lock_unavailable=cls.lock_unavailable,
            on_lost=cls.on_lost,
            skip_as=cls.skip_as,
        )
        if LockLost not in cls.throws:
            cls.throws = (*cls.throws, LockLost)
        cls._is_async = inspect.iscoroutinefunction(function)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Celery's hook when the task is bound to an app: a task that locks at publish installs the
        app's publish guard."""
        super().on_bound(app)
        if cls.lock_on != "run":
            install_publish_guard(app)

    # -- what users call -------------------------------------------------------------

    @property
    def lease(self) -> AnyLease | None:
        """The lease of the current run (bound tasks: ``self.lease.fence``)."""
        return current_lease()

    def lock_name(self, /, *args: Any, **kwargs: Any) -> str:
        """The lock a call with these arguments takes: ``sync_account.lock_name(42)``.

        With ``limit`` > 1 it is the name of the :class:`~task_locks.Semaphore`.
        """
        return self._lock_name(args, kwargs)

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: Any = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: Any = None,
        **options: Any,
    ) -> Any:
        """Publish; a duplicate dropped at enqueue returns the queued task's result handle.

        ``lock_options={...}``: this call's lock options (:mod:`task_locks.celery.options`).
        """
        lock_options = options.pop("lock_options", None)
        if lock_options is not None:
            options["headers"] = with_lock_options(self.name, lock_options, options.get("headers"))
        try:
            return super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        except DuplicateTask as duplicate:
            on_conflict = (lock_options or {}).get("on_conflict", self.on_conflict)
            if on_conflict == "raise" or duplicate.existing is None:
                raise
            return duplicate.existing

    # -- what the publish guard, the recovery and subclasses use (LockingTask) ------------

    def _lock_name(self, args: Any, kwargs: Any) -> str:
        key = type(self)._task_key
        if key is None:  # a class-based task registered without a run() of its own
            raise InvalidArgument(f"task {self.name} has no run() to key its lock on")
        return key(tuple(args or ()), kwargs or {})

    def resolved_lock_backend(self) -> Backend:
        """The backend this task's locks live on (``lock_backend``, else the default)."""
        return resolve_backend(self.lock_backend)

    def lock_arguments(self) -> dict[str, Any]:
        """The keyword arguments of the locks a run takes (``ttl``, ``backend``,
        ``max_hold``): a subclass building its own run lock passes them on."""
        return {"ttl": self.lock_ttl, "backend": self.lock_backend, "max_hold": self.max_hold}

    def run_lock(self, name: str) -> Lock | Semaphore:
        """The lock a run of key ``name`` takes (a :class:`~task_locks.Semaphore` if
        ``limit`` > 1). A subclass may return its own (``PeerCheckedTask`` does)."""
        if self.lock_limit == 1:
            return Lock(name, **self.lock_arguments())
        return Semaphore(name, self.lock_limit, **self.lock_arguments())

    def async_run_lock(self, name: str) -> AsyncLock | AsyncSemaphore:
        """:meth:`run_lock` of an ``async def`` task."""
        if self.lock_limit == 1:
            return AsyncLock(name, **self.lock_arguments())
        return AsyncSemaphore(name, self.lock_limit, **self.lock_arguments())

    def held_lock_names(self, name: str, task_id: str | None = None) -> list[str]:
        """The lock names a run of key ``name`` may hold (the semaphore's slots if limit > 1,
        and the run guard of ``task_id``)."""
        names = [name]
        if self.lock_limit > 1:
            names = [slot_name(name, index) for index in range(self.lock_limit)]
        # Always the guard too: a call's lock_options may have needed one (owner-checked).
        return names if task_id is None else [*names, task_id_lock_name(name, task_id)]

    def _run_checked(self, name: str, task_id: str) -> bool:
        """Whether the run lock's own acquire can refuse a copy of this message: the
        backend is a :class:`~task_locks.backends.base.RunChecked` that sees, in one
        step, every name the run lock may hold (every slot if ``limit`` > 1) and, for
        the options that may wait, the task id's own name (:func:`task_id_lock_name`: a
        waiting run's mark, or a previous release's guard held for a whole run)."""
        backend = self.resolved_lock_backend()
        if not isinstance(backend, RunChecked):
            return False
        names = self.held_lock_names(name)
        mark = self._guard_name(name, task_id)
        return backend.checks_together(names if mark is None else [*names, mark])

    def _checked_apart(self, exc: BaseException, name: str, task_id: str | None) -> bool:
        """Whether the run-checked acquire failed with ``exc`` because its names turned
        out to live apart: a ``redis://`` URL to a Redis Cluster node is known to be one
        only once a script is refused CROSSSLOT (refused before it runs), after which
        the backend no longer :meth:`checks_together` those names. The run then takes
        the guard instead of failing."""
        return (
            task_id is not None
            and isinstance(exc, LockError)
            and not isinstance(exc, LockHeld)
            and not self._run_checked(name, task_id)
        )

    def _guard_name(self, name: str, task_id: str | None) -> str | None:
        """The run guard of ``task_id`` (:func:`task_id_lock_name`), if this task needs one.

        ``limit=1``, ``lock_on="run"`` with ``on_conflict`` ``"skip"``/``"raise"`` does
        not: its one attempt meets either its own task id (refused) or another holder
        (skipped/raised). ``"wait"``/``"retry"`` would go on waiting or retrying past the
        original's run, so they need the guard too.
        """
        if task_id is None:
            return None
        if (
            self.lock_limit == 1
            and self.lock_on != "both"
            and self.on_conflict in ("skip", "raise")
        ):
            return None
        return task_id_lock_name(name, task_id)

    def _attempts(self) -> list[float | None]:
        """Acquire timeouts to try in turn: once, then (``wait``) for up to wait_timeout."""
        return attempts(self.on_conflict, self.wait_timeout if self.on_conflict == "wait" else 0.0)

    def _run_token(self, handed: str | None) -> str | None:
        """The token the run acquires under: ``"both"`` takes over its publish-time lock.

        Acquiring under the token that holds the queued lock resets its TTL and owner and
        keeps its fence, in one server-side step: the key is never free between the
        queued message and its run, so no duplicate can be accepted in between.
        """
        return handed if self.lock_on == "both" else None

    def _owner(self, request: Any) -> dict[str, Any]:
        return {
            "task_id": request.id,
            "task_name": self.name,
            "worker": getattr(request, "hostname", None),
            "command": None,
        }

    # -- the run -----------------------------------------------------------------------
    #
    # One plan (:meth:`_plan`, a generator) makes every decision of a run and yields the
    # I/O it needs as typed steps; :mod:`task_locks._steps` drives it with blocking or
    # awaited calls (async tasks). Errors of a step are thrown back into the plan, which
    # handles them where the decision is made.

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        per_call = call_options(self)  # apply_async(lock_options=...): run on a copy
        if per_call is not None:
            return for_this_call(self, per_call)(*args, **kwargs)
        # In a worker the tracer has pushed the request; a direct call has none, and
        # Task.__call__ pushes one for it.
        direct = self.request_stack.top is None
        body: Callable[..., Any] = super().__call__ if direct else self.run
        request = self.request
        name = self._lock_name(args, kwargs)
        handed = None if direct else getattr(request, TOKEN_HEADER, None)
        with owner_context(**self._owner(request)):
            if self._is_async:
                return asyncio.run(self._arun_in_own_loop(body, name, handed, args, kwargs))
            return drive(self._plan(body, name, handed, args, kwargs))

    async def _arun_in_own_loop(
        self, body: Callable[..., Any], name: str, handed: str | None, args: Any, kwargs: Any
    ) -> Any:
        """The run's plan in the loop ``asyncio.run`` made for it, closing its client after.

        The backend keeps one async client per event loop; this loop ends with the run, so
        its sockets are closed now instead of being left to the garbage collector.
        """
        try:
            return await adrive(self._plan(body, name, handed, args, kwargs))
        finally:
            used = [self.resolved_lock_backend()]
            if _beat_tick(self.request) is not None:
                used.append(beat_backend(self.app))
            for backend in dict.fromkeys(used):
                try:
                    await backend.aclose()
                except Exception as exc:  # closing must not hide the run's own outcome
                    log.debug("closing %r's client of this run failed: %s", backend, exc)

    def _plan(
        self, body: Callable[..., Any], name: str, handed: str | None, args: Any, kwargs: Any
    ) -> Generator[_Step, Any, Any]:
        """Every decision of one run; yields its I/O (see :mod:`task_locks._steps`)."""
        request = self.request
        if handed and self.lock_on == "enqueue":
            yield from self._drop_queued_lock(name, handed)
        tick = _beat_tick(request)
        if tick is not None:
            leader = yield _ElectionHolder(self.app, tick)
            current = stale_tick_term(tick, leader)
            if current is not None and not (yield _ClaimHolds(self.app, tick)):
                if handed and self.lock_on == "both":
                    yield from self._drop_queued_lock(name, handed)  # refused below: free it
                stale = self._refuse_stale(tick, leader, current)
                return None if request.called_directly or request.id is None else stale
        if self.lock_on == "enqueue":
            return (yield Call(body, args, kwargs))
        if releaser.pending(name):  # this process's last run of the key is letting go
            releaser.flush_key(name)
        task_id = request.id
        guard: AnyLease | None = None
        # One lock per run where the backend checks the task id itself; else a guard.
        checked = task_id is not None and self._run_checked(name, task_id)
        while True:
            guard_name = None if checked else self._guard_name(name, task_id)
            if guard_name is not None:
                taken = yield from self._take(guard_name, None, guard=True)
                if not isinstance(taken, LeaseBase):
                    return None if request.called_directly or task_id is None else taken
                guard = taken
            try:
                lease = yield from self._take(
                    name, self._run_token(handed), guard=False, run_of=task_id if checked else None
                )
            except BaseException as exc:
                if checked and self._checked_apart(exc, name, task_id):
                    checked = False  # refused unrun: take the guard, as a cluster URL does
                    continue
                if isinstance(exc, (LockHeld, BackendUnavailable)):
                    # Before the guard goes: while it holds, no copy of this message (same
                    # token) can have taken the queued lock over.
                    yield from self._free_refused(name, handed)
                yield from self._release_guard(guard, task_id)
                raise
            break
        if not isinstance(lease, LeaseBase):
            yield from self._free_refused(name, handed)
            yield from self._release_guard(guard, task_id)
            return None if request.called_directly or task_id is None else lease
        if handed and _queued_fence(request) not in (None, lease.fence):
            self._queued_lock_expired(name)
        reset = current_lease_var.set(lease)  # shared with @locked
        live_leases.add(task_id, lease)
        if guard is not None:
            live_leases.add(task_id, guard)
        watch = RunWatch(lease, self.on_lost, f"task {self.name}[{task_id}]")
        run = watch.abody(body) if self._is_async else watch.body(body)
        try:
            result = yield Call(run, args, kwargs)
        except BaseException as exc:
            watch.end()
            yield from self._release(lease, task_id)
            yield from self._release_guard(guard, task_id)
            if watch.is_interrupt(exc):
                raise watch.failure() from None
            raise
        finally:
            current_lease_var.reset(reset)
        watch.end()
        later = name if self._releases_later(request) else None
        yield from self._release(lease, task_id, later=later)
        yield from self._release_guard(guard, task_id, later=later)
        return watch.outcome(result)

    def _take(
        self, name: str, token: str | None, *, guard: bool, run_of: str | None = None
    ) -> Generator[_Step, Any, AnyLease | Skipped | None]:
        """Acquire as ``on_conflict`` says (the run guard if ``guard``; with the run
        check of task ``run_of`` if given); a :class:`Skipped` (or ``None``): return it
        without running."""
        dead: int | None = None  # the fence of the holder the watch found expired unrenewed
        refused: list[Skipped] = []
        while True:
            timeouts = self._attempts()
            try:
                lease = yield from take(
                    functools.partial(_Acquire, self, name, token, guard, run_of),
                    timeouts,
                    self.on_conflict,
                    f"task {self.name}",
                    functools.partial(self._on_held, name, timeouts, dead, refused),
                )
            except BackendUnavailable as exc:
                on_unavailable(self, exc)  # lock_unavailable="retry": Celery's Retry
                raise
            except _OwnCopy as copy:  # a redelivery met its own task id: alive or dead?
                if not (yield from watch(self.resolved_lock_backend(), copy.held.name, copy.held)):
                    self._refuse_copy(copy.who)  # renewed, or released: never run it again
                if dead != copy.held.fence:
                    self._dead_holder(copy.held)  # expired unrenewed: take the key (next loop)
                dead = copy.held.fence
            else:
                return lease if lease is not None or not refused else refused[0]

    def _on_held(
        self,
        name: str,
        timeouts: list[float | None],
        dead: int | None,
        refused: list[Skipped],
        held: LockHeld,
        number: int,
    ) -> bool:
        """A redelivered copy watches a holder of its own task id, once; again only if it
        meets the very holder the watch found expired (``dead``: its fence), whose key the
        server may keep a few milliseconds longer than the copy's estimate of its expiry."""
        watch = dead is None or (held.holder is not None and held.holder.fence == dead)
        skipped = self._conflict(name, held, timeouts, number, watch=watch)
        if skipped is not None:
            refused.append(skipped)
        return skipped is not None

    def _free_refused(self, name: str, handed: str | None) -> Generator[_Step, Any, None]:
        """A ``lock_on="both"`` run refused by another holder, or failing because its
        take-over got no answer (``BackendUnavailable``, ``lock_unavailable="fail"``),
        frees its publish-time lock (token-checked), else that lock would drop every
        publish of the key as a duplicate of this message until ``enqueue_ttl`` (as when
        an old library's key is met by :class:`~task_locks.celery.peers.PeerCheckedTask`).
        The take-over may have reached the server: the token is this message's either
        way. A second delivery of a running message never comes here: it is ignored."""
        if handed and self.lock_on == "both":
            try:
                yield _DropQueued(self.resolved_lock_backend(), name, handed)
            except LockError as exc:  # it expires by its TTL; the refusal goes on
                log.warning(
                    "task %s[%s]: freeing the queued lock %r: %s",
                    self.name,
                    self.request.id,
                    name,
                    exc,
                )

    def _release_guard(
        self, guard: AnyLease | None, task_id: str | None, later: str | None = None
    ) -> Generator[_Step, Any, None]:
        """Free the run guard after the run lock (a lost guard only costs a log line)."""
        if guard is None:
            return
        try:
            yield _Release(guard, self._late(guard, later, task_id))
        except LockError as exc:
            log.warning("task %s[%s]: releasing %r: %s", self.name, task_id, guard.name, exc)
        finally:
            live_leases.discard(task_id, guard)

    def _release(
        self, lease: AnyLease, task_id: str | None, later: str | None = None
    ) -> Generator[_Step, Any, None]:
        keep = unpark(lease)
        try:
            if keep is not None:
                lease.stop_renewal()
                self._parked(lease, (yield _Renew(lease, int(keep * 1000))))
                return
            yield _Release(lease, self._late(lease, later, task_id))
        except (LockLost, BackendUnavailable):
            # The lease is marked lost, and that was logged (task_locks.events). The run's
            # outcome was decided when its body ended (RunWatch.end): the same whether
            # this release is sent now or after the run, stored result or not.
            pass
        finally:
            live_leases.discard(task_id, lease)

    def _refuse_copy(self, who: str) -> NoReturn:
        """End a second delivery of a message that is still running (or just finished).

        Records nothing: the id's state belongs to the run in progress.
        """
        log.info(
            "task %s[%s]: already running (%s); ignoring this duplicate delivery",
            self.name,
            self.request.id,
            who,
        )
        raise Ignore()

    def _dead_holder(self, holder: Holder) -> None:
        log.warning(
            "task %s[%s]: redelivered or retried, and lock %r of this task id expired "
            "unrenewed (%s): the run that held it is gone; running this delivery",
            self.name,
            self.request.id,
            holder.name,
            holder.describe(),
        )

    def _parked(self, lease: AnyLease, kept: bool) -> None:
        if kept:
            lease.hand_over(f"the retry of {self.name}[{self.request.id}]")
            log.info(
                "task %s[%s]: lock %r handed to its retry", self.name, self.request.id, lease.name
            )
        else:
            log.warning(
                "task %s[%s]: lock %r was lost before its retry could take it over",
                self.name,
                self.request.id,
                lease.name,
            )

    def _releases_later(self, request: Any) -> bool:
        """Whether this run's releases may be sent after it ends (off the critical path).

        Only when nothing could act on the run's end before they are sent: its result
        is not stored (no one can see it finish), no callback or chain is published after
        it, it runs in a worker (not eagerly or directly) and is not ``async def`` (its
        event loop ends with the run). See :mod:`task_locks.celery.releaser`.
        """
        if self._is_async or request.called_directly or request.is_eager:
            return False
        if request.callbacks or request.chain or not get_actual_ignore_result(self, request):
            return False
        return True

    def _late(self, lease: AnyLease, later: str | None, task_id: str | None) -> _Late | None:
        """How to hand ``lease``'s release to the releaser, or ``None``: release it now.

        A lease already lost here is released now (the releaser is for live ones).
        """
        if later is None or not isinstance(lease, Lease) or not lease.held:
            return None
        return _Late(later, functools.partial(_late_release_failed, self.name, task_id))

    def _drop_queued_lock(self, name: str, token: str) -> Generator[_Step, Any, None]:
        """Free the lock taken when this message was published (token-checked).

        ``"enqueue"``: the key is free again once the task starts. ``"both"`` takes the
        queued lock over instead (:meth:`_run_token`), and drops it only for a run it
        refuses before that (a stale beat tick).
        """
        if not (yield _DropQueued(self.resolved_lock_backend(), name, token)):
            self._queued_lock_expired(name)

    def _queued_lock_expired(self, name: str) -> None:
        """The lock taken when this message was published was gone when it started."""
        log.warning(
            "task %s[%s]: the queued lock %r of this message expired before it ran (or this "
            "is a second delivery of it): duplicates may have been queued meanwhile; raise "
            "enqueue_ttl or set expires if the queue is that long",
            self.name,
            self.request.id,
            name,
        )

    # -- beat ticks sent under an old term (issue: HA beat) ------------------------------

    def _refuse_stale(self, tick: BeatTick, leader: Holder, current: int) -> StaleTick:
        """Refuse a beat message that may be a second send of its tick.

        Called for a message sent under a term older than the ``current`` leader's whose
        tick claim no longer holds (expired, or another sender's): a deposed leader
        (paused, partitioned) and the new one may both have sent that tick. A message
        whose claim holds is the only send of its tick and runs (a clean hand-over).
        The refusal ends ready, as a skip does (Celery never counts a custom state as
        ready, so ``.get()`` would wait for ever): the :class:`StaleTick` returned is the
        run's result, or with ``skip_as="failure"`` :class:`DuplicateTask` is raised.
        """
        request = self.request
        log.warning(
            "task %s[%s] refused: beat tick %s of %r was sent under term %s, the current "
            "leader's term is %s, and the tick's claim is gone: it may have been sent "
            "twice; this copy is not run",
            self.name,
            request.id,
            tick.tick,
            tick.election,
            tick.term,
            current,
        )
        if self.skip_as == "failure":
            raise DuplicateTask(
                f"task {self.name}[{request.id}] refused: beat tick {tick.tick} of "
                f"{tick.election!r} was sent under term {tick.term}, the current leader's "
                f"term is {current}: it may have been sent twice",
                name=leader.name,
                holder=leader,
            ) from None
        return StaleTick(tick.election, tick.tick, tick.term, current)

    # -- conflicts (no I/O except Celery's own) ------------------------------------------

    def _conflict(
        self,
        name: str,
        held: LockHeld,
        attempts: list[float | None],
        number: int,
        *,
        watch: bool = False,
    ) -> Skipped | None:
        """Act on a held lock: a :class:`Skipped` to return without running; raise to end
        the run.

        ``number`` is the attempt of ``attempts`` (timeouts) that found the lock held;
        ``None`` means: go on with the next one (``on_conflict="wait"``, a retry waiting
        for its previous attempt, or a direct call's retry).
        """
        request = self.request
        holder_id = held.holder.owner.task_id if held.holder is not None else None
        who = holder_of(held, self.lock_limit)
        if request.id is not None and holder_id == request.id:
            # The same task id holds the key: a second delivery of a message that is still
            # running (acks_late redelivery, visibility timeout, duplicate delivery), refused
            # whatever on_conflict says: waiting or retrying would run the same id twice.
            # A retry may instead meet its own previous attempt letting go: it waits a
            # little for that first.
            if request.retries and number == 1:
                attempts.insert(1, RETRY_HANDOVER_WAIT)
                return None
            # A redelivery, or a retry whose previous attempt's acquire was applied with
            # its reply lost (nobody renews that lock): watch the holder before refusing.
            if watch and held.holder is not None and (redelivered(request) or request.retries):
                raise _OwnCopy(held.holder, who)  # alive? (task_locks.celery.redelivery)
            self._refuse_copy(who)
        outcome = decide(
            self.on_conflict,
            held,
            last=number >= len(attempts),
            name=name,
            label=f"task {self.name}[{request.id}]",
            logger=log,
            who=who,
            note=f" (holder task id {holder_id})",
        )
        if outcome is Outcome.AGAIN:
            return None
        if outcome is Outcome.RETRY:
            countdown = self.retry_countdown * random.uniform(0.5, 1.5)
            if request.called_directly:
                # No message to send again (a direct call; each item of chunks/map/starmap
                # is one): Celery's retry would re-raise at once. Wait here instead, up to
                # the countdown per retry (woken by the release), max_retries times.
                if self.max_retries is not None and number > self.max_retries:
                    raise held
                attempts.append(countdown)
                return None
            log.info(
                "task %s[%s]: lock %r is held by %s; retrying in %.2fs",
                self.name,
                request.id,
                name,
                who,
                countdown,
            )
            raise self.retry(exc=held, countdown=countdown)
        if self.skip_as == "failure":
            raise DuplicateTask(
                f"task {self.name}[{request.id}] skipped: lock {name!r} is held by {who}",
                name=name,
                holder=held.holder,
            ) from None
        return Skipped(name, holder_id, who)


# -- the run's I/O: each step's blocking and awaited form, and the two drivers -----------


_L = TypeVar("_L", Lock | Semaphore, AsyncLock | AsyncSemaphore)


class _Acquire(NamedTuple):
    """Take the run lock (or, ``guard``, the run guard) once, waiting up to ``timeout``.

    ``run_of``: with the run check of that task id (:class:`~task_locks.types.RunCheck`:
    the run lock's own acquire refuses a copy of this message that holds it). A run
    that is to *wait* also marks its task id while it waits (:func:`task_id_lock_name`,
    taken at once and let go as soon as the run lock is its, or the wait ends): a
    copy waiting beside it would otherwise take the key after it and run again. A
    retry's wait for its previous attempt to let go does not give up on meeting it.
    """

    task: SingletonTask
    name: str
    token: str | None
    guard: bool
    run_of: str | None
    timeout: float | None

    def run(self) -> Lease:
        marker = self._marker(Lock)
        if marker is None:
            with self._as_owner():
                return self._lock(Lock, self.task.run_lock).acquire(timeout=self.timeout)
        with owner_context(internal=True):
            mark = marker.acquire(timeout=0)  # held by a copy: LockHeld naming this task id
        try:
            return self._lock(Lock, self.task.run_lock, mark.token).acquire(timeout=self.timeout)
        finally:
            with contextlib.suppress(LockError):
                mark.release()

    async def arun(self) -> AsyncLease:
        marker = self._marker(AsyncLock)
        if marker is None:
            lock = self._lock(AsyncLock, self.task.async_run_lock)
            with self._as_owner():
                return await lock.acquire(timeout=self.timeout)
        with owner_context(internal=True):
            mark = await marker.acquire(timeout=0)
        try:
            lock = self._lock(AsyncLock, self.task.async_run_lock, mark.token)
            return await lock.acquire(timeout=self.timeout)
        finally:
            with contextlib.suppress(LockError):
                await mark.release()

    def _as_owner(self) -> AbstractContextManager[None]:
        """The guard is the library's own record (``Owner.internal``): operators and the
        metrics see one lock per run, the run lock."""
        return owner_context(internal=True) if self.guard else contextlib.nullcontext()

    def _marks(self) -> bool:
        """Whether this task's runs mark their task id while they wait, and look for it:
        those the previous release guarded (``_guard_name``). ``limit=1``, ``"skip"`` or
        ``"raise"`` and ``lock_on="run"`` never waits, and its copies meet the run lock."""
        return self.run_of is not None and self.task._guard_name(self.name, self.run_of) is not None

    def _marker(self, cls: Callable[..., _L]) -> _L | None:
        """The lock marking this task id while the run waits, if it is to wait."""
        run_of = self.run_of
        if run_of is None or self.timeout == 0 or not self._marks():
            return None
        return cls(task_id_lock_name(self.name, run_of), **self.task.lock_arguments())

    def _lock(
        self, guard_lock: Callable[..., _L], run_lock: Callable[[str], _L], mark: str | None = None
    ) -> _L:
        if self.guard:
            return guard_lock(self.name, **self.task.lock_arguments())
        if self.run_of is not None:
            return acquire_as_run(
                run_lock(self.name),
                self.token,
                self.run_of,
                also=(task_id_lock_name(self.name, self.run_of),) if self._marks() else (),
                mark=mark,
                give_up_on_copy=not self.task.request.retries,
            )
        return acquire_under(run_lock(self.name), self.token)


class _OwnCopy(Exception):
    """A redelivered copy met its own task id on the key (:mod:`.redelivery`): a signal
    inside the run's plan, never raised out of it."""

    def __init__(self, held: Holder, who: str) -> None:
        super().__init__(held.name)
        self.held = held
        self.who = who


class _Late(NamedTuple):
    """A release handed to the releaser: its key, and who hears of its failure."""

    key: str
    on_error: Callable[[Lease, LockError], None]


class _Release(NamedTuple):
    """Release a lease (token-checked); ``later``: hand it to the releaser thread."""

    lease: AnyLease
    later: _Late | None = None

    def run(self) -> None:
        if self.later is not None:
            releaser.submit(self.later.key, cast(Lease, self.lease), self.later.on_error)
            return
        cast(Lease, self.lease).release()

    async def arun(self) -> None:
        await cast(AsyncLease, self.lease).release()


class _Renew(NamedTuple):
    """Keep a lease for ``ttl_ms`` more (parked for a retry); ``True`` if it was held."""

    lease: AnyLease
    ttl_ms: int

    def run(self) -> bool:
        return self.lease.backend.renew(self.lease.name, self.lease.token, self.ttl_ms)

    async def arun(self) -> bool:
        return await self.lease.backend.arenew(self.lease.name, self.lease.token, self.ttl_ms)


class _DropQueued(NamedTuple):
    """Free the lock taken at publish (token-checked); ``True`` if it was still held."""

    backend: Backend
    name: str
    token: str

    def run(self) -> bool:
        return self.backend.release(self.name, self.token)

    async def arun(self) -> bool:
        return await self.backend.arelease(self.name, self.token)


class _ElectionHolder(NamedTuple):
    """Who leads the beat election a tick was sent under."""

    app: Any
    tick: BeatTick

    def run(self) -> Holder | None:
        return election_holder(self.app, self.tick.election)

    async def arun(self) -> Holder | None:
        return await aelection_holder(self.app, self.tick.election)


class _ClaimHolds(NamedTuple):
    """Whether the tick's claim is still this message's."""

    app: Any
    tick: BeatTick

    def run(self) -> bool:
        return claim_holds(self.app, self.tick)

    async def arun(self) -> bool:
        return await aclaim_holds(self.app, self.tick)


_Step = (
    _Acquire
    | Call
    | _Release
    | _Renew
    | _DropQueued
    | _ElectionHolder
    | _ClaimHolds
    | HolderOf
    | Pause
)


def _late_release_failed(task_name: str, task_id: str | None, lease: Lease, exc: LockError) -> None:
    """A release sent after its run failed: the run has ended, so it is only logged."""
    log.warning(
        "task %s[%s]: releasing lock %r after the run: %s", task_name, task_id, lease.name, exc
    )


def singleton_task(
    fun: Callable[..., Any] | None = None,
    *,
    key: KeySpec = None,
    ttl: float | None = None,
    on_conflict: str = "skip",
    lock_on: str = "run",
    max_hold: float | None = None,
    wait_timeout: float | None = None,
    backend: str | Backend | None = None,
    retry_countdown: float = 1.0,
    enqueue_ttl: float | None = None,
    limit: int = 1,
    lock_unavailable: str = "fail",
    on_lost: str = "interrupt",
    skip_as: str = "success",
    app: Any = None,
    base: type[SingletonTask] = SingletonTask,
    **task_options: Any,
) -> Any:
    """Register a Celery task whose runs hold the lock ``key`` (each option and its default:
    the "@singleton_task options" table of docs/celery.md).

    ``limit=N`` allows up to N runs of one key at once (a :class:`~task_locks.Semaphore`
    named by the key; ``on_conflict`` applies when all N permits are taken).
    ``lock_unavailable="retry"`` retries a run whose lock service does not answer, as
    ``autoretry_for`` would (:mod:`task_locks.celery.unavailable`).
    ``skip_as``: a skipped run ends ``"success"`` (its result a :class:`Skipped`) or
    ``"failure"`` (:class:`DuplicateTask`). ``on_lost``: ``"interrupt"`` (``LockLost``
    raised in the body), ``"fail"`` or ``"ignore"`` (:mod:`task_locks.celery.interrupt`).
    Usable bare (``@singleton_task``) or with options; with ``app=`` it registers on that
    app (``app.task``), else it is a ``shared_task``. Other keyword arguments are ordinary
    task options (``bind``, ``max_retries``, ``acks_late``, ``soft_time_limit``...). Bad
    options raise :class:`~task_locks.InvalidArgument` here, when the task is defined.
    """
    if not (isinstance(base, type) and issubclass(base, SingletonTask)):
        raise InvalidArgument(f"base must be a SingletonTask subclass, got {base!r}")

    def decorate(function: Callable[..., Any]) -> Any:
        if not callable(function):
            raise InvalidArgument(f"singleton_task decorates a function, got {function!r}")
        name = task_options.get("name") or f"{function.__module__}.{function.__name__}"
        check_options(
            name,
            function,
            bound=bool(task_options.get("bind")),
            key=key,
            ttl=ttl,
            on_conflict=on_conflict,
            lock_on=lock_on,
            max_hold=max_hold,
            wait_timeout=wait_timeout,
            retry_countdown=retry_countdown,
            enqueue_ttl=enqueue_ttl,
            limit=limit,
            lock_unavailable=lock_unavailable,
            on_lost=on_lost,
            skip_as=skip_as,
        )
        options: dict[str, Any] = {
            **task_options,
            "base": base,
            "lock_key": key,
            "lock_ttl": ttl,
            "on_conflict": on_conflict,
            "lock_on": lock_on,
            "max_hold": max_hold,
            "wait_timeout": wait_timeout,
            "lock_backend": backend,
            "retry_countdown": retry_countdown,
            "enqueue_ttl": enqueue_ttl,
            "lock_limit": limit,
            "lock_unavailable": lock_unavailable,
            "on_lost": on_lost,
            "skip_as": skip_as,
        }
        register = shared_task if app is None else app.task
        return register(**options)(function)

    return decorate(fun) if fun is not None else decorate


def _beat_tick(request: Any) -> BeatTick | None:
    """The beat tick a running message carries; one attribute look-up for the others."""
    if getattr(request, ELECTION_HEADER, None) is None:
        headers = getattr(request, "headers", None)
        if not headers or ELECTION_HEADER not in headers:
            return None
    return beat_tick(request)


def _queued_fence(request: Any) -> int | None:
    """The fence of the lock taken when the running message was published, if it says."""
    fence = getattr(request, FENCE_HEADER, None)
    try:
        return None if fence is None else int(fence)
    except (TypeError, ValueError):
        return None


__all__ = [
    "LOCK_ON",
    "ON_CONFLICT",
    "ON_LOST",
    "SKIPPED",
    "SKIP_AS",
    "STALE_TICK",
    "TOKEN_HEADER",
    "DuplicateTask",
    "SingletonTask",
    "Skipped",
    "StaleTick",
    "current_lease",
    "singleton_task",
]
