"""What a lock backend must implement, said once.

A backend is a thin translator between the lock protocol and one lock service. It does
the I/O and nothing else: deadlines, retries, waking, renewal scheduling and the public
API live in :mod:`task_locks.lock` and are shared by every backend.

Each operation is atomic and token-checked on the server (one Lua script, one etcd
transaction, one SQL statement). Sync methods are required; the ``a``-prefixed async
methods default to running the sync one in a worker thread, and backends whose client
speaks asyncio natively override them. The adapter's *waits* (``await_release``,
``await_any``) block a thread for as long as the holder's TTL, so they run in a bounded
pool of their own (:data:`ASYNC_WAIT_THREADS`), never in the event loop's default
executor: there, a few waiters would hold up the holder's renewal and release queued
behind them, until its lease expired.

One word per concept, here and across the package:

- a **hand-off** is the server's: a release hands the lock to the first queued waiter
  (a :class:`ServerHandoff` backend, declaring :attr:`Capability.SERVER_HANDOFF`:
  ``enqueue``, ``await_grant``, ``dequeue``; the waiter is *granted* it);
- a **hand-over** is a holder's: a lease passed on with its token to another run or
  process (Celery's publish-time lock to its worker, a run to its retry, a beat tick to
  its message); here it ends as a release with reason ``handed_over``;
- a **deferred release** is a release given to :meth:`Backend.defer_release`, to ride the
  next acquire's round trip (Celery's background releaser) or be sent by its owner.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import contextvars
import difflib
import logging
import math
import os
import re
import threading
import time
from collections.abc import (
    Callable,
    Collection,
    Hashable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from typing import ClassVar
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from ..errors import InvalidArgument, LockError
from ..types import AcquireResult, Holder, Owner, RenewItem, RunCheck
from .notices import NoticeStream

_claims = threading.Lock()
_caller_reports: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "task_locks_caller_reports", default=False
)


@contextlib.contextmanager
def reported_by_caller() -> Iterator[None]:
    """Within this block a force release is said by the caller (an operator's CLI prints
    its own line): the backend does not log it too (:func:`log_forced`)."""
    token = _caller_reports.set(True)
    try:
        yield
    finally:
        _caller_reports.reset(token)


def log_forced(log: logging.Logger, name: str, server: str) -> None:
    """Log a force release once, at WARNING, unless the caller reports it itself."""
    if not _caller_reports.get():
        log.warning("lock %r was force-released at %s (operator override)", name, server)


def unknown_options(
    server: str, unknown: Collection[str], known: Collection[str], also: str = ""
) -> str:
    """"unknown option 'prefx' (did you mean 'prefix'?)" for each of ``unknown``, then the
    ``known`` ones (and ``also``: options too many to list, named as a group)."""
    said = []
    for option in sorted(unknown):
        close = difflib.get_close_matches(option, list(known), n=1)
        said.append(f"{option!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    plural = "s" if len(said) > 1 else ""
    listed = ", ".join(sorted(known))
    return f"{server}: unknown option{plural} {', '.join(said)}; known: {listed}{also}"


class DeferredRelease(abc.ABC):
    """A release deferred with :meth:`Backend.defer_release`: sent ahead of that backend's
    next acquire, in the acquire's round trip, unless someone else sends it first.

    Exactly one party sends it: whoever wins :meth:`claim` (the acquire that carries it,
    or the owner's own fallback after a short delay); the sender reports the outcome to
    :meth:`answer`. Token-checked like every release.
    """

    __slots__ = ("_claimed", "name", "token")

    def __init__(self, name: str, token: str) -> None:
        self.name = name
        self.token = token
        self._claimed = False

    @property
    def claimed(self) -> bool:
        return self._claimed

    def claim(self) -> bool:
        """``True`` for the one caller that is to send this release."""
        with _claims:
            if self._claimed:
                return False
            self._claimed = True
            return True

    @abc.abstractmethod
    def answer(self, outcome: bool | LockError) -> None:
        """What the claimed release did: ``True`` released, ``False`` not ours (any more),
        or the error that left its outcome unknown. Must not raise."""


class Capability(StrEnum):
    """What a backend may declare; ``Lock(..., require={...})`` demands them.

    A ``StrEnum`` so the plain names keep working (``require={"fencing"}``) while a
    misspelt one is caught where the lock is made, against this one list.
    """

    #: Fences strictly increase per name, even across a server restart.
    FENCING = "fencing"
    #: Mutual exclusion survives the failure of a minority of servers.
    CONSENSUS = "consensus"
    #: More than one process can share the lock.
    MULTIPROCESS = "multiprocess"
    #: Waiters are woken by the release, not only by polling.
    WAKEUP = "wakeup"
    #: The live holders can be listed and force-released.
    HOLDERS = "holders"
    #: A holder's process hears at once that its lock was freed by someone else (a
    #: force release): :meth:`Backend.release_notices`.
    RELEASE_NOTICE = "release_notice"
    #: A release hands the lock to the first queued waiter inside the server, in FIFO
    #: order: declared by a :class:`ServerHandoff` backend, and only by one.
    SERVER_HANDOFF = "server_handoff"
    #: An acquire can carry a :class:`~task_locks.types.RunCheck` (a Celery run's task
    #: id, checked against the holders of its names in the same step): declared by a
    #: :class:`RunChecked` backend, and only by one.
    RUN_CHECK = "run_check"


#: Every capability name (plain strings, derived from :class:`Capability`).
CAPABILITIES: frozenset[str] = frozenset(c.value for c in Capability)


_NO_CAPABILITIES: frozenset[Capability] = frozenset()


def parse_capabilities(
    names: Iterable[object], *, name: str | None = None
) -> frozenset[Capability]:
    """``names`` as :class:`Capability` members; an unknown one raises :exc:`InvalidArgument`.

    A typo must not pass as "nothing required".
    """
    if not names and not isinstance(names, str):  # the usual require=(): every lock built
        return _NO_CAPABILITIES
    where = f"lock {name!r}: " if name is not None else ""
    if isinstance(names, str):  # else "fencing" would be read as seven one-letter names
        raise InvalidArgument(
            f"{where}require= takes a collection of capability names, not the string "
            f"{names!r} (e.g. require={{{names!r}}}); known: {sorted(CAPABILITIES)}",
            name=name,
        )
    known: set[Capability] = set()
    unknown: set[str] = set()
    for item in names:
        if isinstance(item, str) and item in CAPABILITIES:
            known.add(Capability(item))
        else:
            unknown.add(str(item))
    if unknown:
        raise InvalidArgument(
            f"{where}unknown capabilities in require=: {sorted(unknown)}; "
            f"known: {sorted(CAPABILITIES)}",
            name=name,
        )
    return frozenset(known)


#: The longest TTL accepted, in seconds (one year). Far below what every backend can
#: store (Redis refuses an expiry past 2**63 ms, etcd a lease past 2**63 s...), so a TTL
#: is refused before any write, never half-written by a server (a lock without expiry
#: would be held forever). Here, not in :mod:`task_locks.config`, because backends check
#: it and modules below never import the ones above them.
MAX_TTL = 31_536_000.0


def check_ttl_ms(ttl_ms: int, name: str | None = None) -> int:
    """A backend's own guard on the TTL it is asked to write (:data:`MAX_TTL` at most).

    :func:`task_locks.config.validate_ttl` already bounds every public TTL; this refuses a
    direct backend call with more, before anything is written.
    """
    if not 0 < ttl_ms <= MAX_TTL * 1000:
        raise InvalidArgument(
            f"lock {name!r}: ttl must be > 0 and at most {MAX_TTL:,.0f} seconds (1 year), "
            f"got {ttl_ms} ms",
            name=name,
        )
    return ttl_ms


#: Longest sleep of the default :meth:`Backend.wait_any` before it looks again.
WAIT_ANY_SLICE = 0.1
#: Threads (per process, shared by every backend) for the asyncio adapter's blocking
#: waits. Beyond this many concurrent waiters, a wait starts when a thread frees up and
#: keeps its original deadline: a release is noticed later, never a deadline missed.
ASYNC_WAIT_THREADS = 32

_wait_pool: ThreadPoolExecutor | None = None
_wait_pool_guard = threading.Lock()


def _wait_executor() -> ThreadPoolExecutor:
    global _wait_pool
    with _wait_pool_guard:
        if _wait_pool is None:
            _wait_pool = ThreadPoolExecutor(
                ASYNC_WAIT_THREADS, thread_name_prefix="task-locks-wait"
            )
        return _wait_pool


def _forget_wait_pool() -> None:
    """A forked child has none of its parent's threads: it starts a pool of its own."""
    global _wait_pool, _wait_pool_guard
    _wait_pool = None
    _wait_pool_guard = threading.Lock()


os.register_at_fork(after_in_child=_forget_wait_pool)


async def _wait_in_thread(wait: Callable[[float], None], timeout: float) -> None:
    """Run the blocking ``wait(seconds)`` in the wait pool, ending ``timeout`` from now.

    The deadline is fixed here: a wait that queued for a thread only waits what is left.
    """
    deadline = time.monotonic() + timeout

    def run() -> None:
        remaining = deadline - time.monotonic()
        if remaining > 0:
            wait(remaining)

    await asyncio.get_running_loop().run_in_executor(_wait_executor(), run)


def redact_url(url: str) -> str:
    """The URL without its password, fit for logs and error messages."""
    try:
        parts = urlsplit(url)
    except ValueError:  # malformed: still never show what looks like a password
        return re.sub(r"(^|//)([^/@:]*):[^/@]*@", r"\1\2:***@", url)
    if parts.password is None:
        # Without "//" ("user:password@host") urlsplit sees no netloc, hence no password.
        return re.sub(r"(^|//)([^/@:]*):[^/@]*@", r"\1\2:***@", url) if "@" in url else url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


class ServerHandoff(abc.ABC):
    """What a :class:`Backend` whose release hands the lock to the first queued waiter
    inside the server also implements (the waiter is *granted* the lock, with no second
    acquire, in strict FIFO order). A backend inherits it exactly when it declares
    :attr:`Capability.SERVER_HANDOFF` (checked where the class is written).

    The lock's acquire runs its hand-off plan against these methods only on a backend
    that is one of these (:func:`isinstance`), so the capability and the methods cannot
    disagree. As with :class:`Backend`, the sync methods are required and the asyncio
    twins default to the sync one in a worker thread.
    """

    @abc.abstractmethod
    def enqueue(
        self, name: str, token: str, ttl_ms: int, owner: Owner, wait_ms: int, pop: float = 0.0
    ) -> AcquireResult:
        """Acquire, or else queue ``token`` for the lock (an entry living ``wait_ms``,
        refreshed by calling again), in one atomic step; ``wait_ms=0`` does not queue.

        ``pop``: the caller may also wait up to that many seconds for a grant, as
        :meth:`await_grant` with the fence this try reports, in the same request. A
        backend may do so (a grant is answered as the lock taken); it says it did, in
        vain, with :attr:`~task_locks.types.AcquireResult.grant_awaited`."""

    @abc.abstractmethod
    def await_grant(self, name: str, token: str, timeout: float, above: int | None) -> int | None:
        """Block up to ``timeout`` seconds for a release to hand the lock to ``token``:
        its fence, or ``None``. A grant is the lock, taken after this call was sent.

        ``above``: the holder's fence the last :meth:`enqueue` reported. A grant whose
        fence is not above it was made before that enqueue and taken back since (a force
        release): stale, it is dropped (``None``). ``None`` trusts no grant: each one is
        dropped, and the next enqueue finds the lock already this token's."""

    @abc.abstractmethod
    def dequeue(self, name: str, token: str) -> bool:
        """Leave the queue, giving back (token-checked) a grant that raced in: ``True``
        if one was given back."""

    async def aenqueue(
        self, name: str, token: str, ttl_ms: int, owner: Owner, wait_ms: int, pop: float = 0.0
    ) -> AcquireResult:
        """The asyncio twin of :meth:`enqueue`."""
        return await asyncio.to_thread(self.enqueue, name, token, ttl_ms, owner, wait_ms, pop)

    async def aawait_grant(
        self, name: str, token: str, timeout: float, above: int | None
    ) -> int | None:
        """The asyncio twin of :meth:`await_grant`."""
        return await asyncio.to_thread(self.await_grant, name, token, timeout, above)

    async def adequeue(self, name: str, token: str) -> bool:
        """The asyncio twin of :meth:`dequeue`."""
        return await asyncio.to_thread(self.dequeue, name, token)


class RunChecked(abc.ABC):
    """What a :class:`Backend` whose acquire can also refuse a second delivery of a
    Celery message implements: :meth:`acquire_run`, the acquire with a
    :class:`~task_locks.types.RunCheck` decided in the same server step. A backend
    inherits it exactly when it declares :attr:`Capability.RUN_CHECK` (checked where
    the class is written). Celery's runs take one lock on such a backend; elsewhere
    they also hold a lock named by their task id (:mod:`task_locks.celery.task`).
    """

    @abc.abstractmethod
    def acquire_run(
        self, name: str, token: str, ttl_ms: int, owner: Owner, run: RunCheck
    ) -> AcquireResult:
        """:meth:`Backend.acquire`, refused as :class:`~task_locks.types.RunCheck` says
        (its ``holder_name`` set when the holder found holds another of ``run.names``),
        and taking over a lock held by ``run.take_over`` under ``token``, in one step."""

    async def aacquire_run(
        self, name: str, token: str, ttl_ms: int, owner: Owner, run: RunCheck
    ) -> AcquireResult:
        """The asyncio twin of :meth:`acquire_run`."""
        return await asyncio.to_thread(self.acquire_run, name, token, ttl_ms, owner, run)

    def checks_together(self, names: Sequence[str]) -> bool:
        """Whether one :meth:`acquire_run` sees all of ``names`` (a semaphore's slots) in
        its one step; Redis Cluster keeps them in different hash slots."""
        return True


#: Each capability that is also a class of methods, and that class.
_IMPLEMENTED_BY: dict[Capability, type] = {
    Capability.SERVER_HANDOFF: ServerHandoff,
    Capability.RUN_CHECK: RunChecked,
}


class Backend(abc.ABC):
    """The contract between :class:`~task_locks.Lock` and a lock service."""

    #: What this backend guarantees (the URL schemes it serves are named only in the
    #: registry, :data:`task_locks.backends.BUILTIN_SCHEMES`).
    capabilities: ClassVar[frozenset[Capability]] = frozenset()
    #: The longest lock name this backend stores as given (``None``: no bound of its own
    #: below the library's). A longer one is refused by :meth:`check_name`, never cut.
    max_name_length: int | None = None

    def __init_subclass__(cls, **kwargs: object) -> None:
        """A backend declares :attr:`Capability.SERVER_HANDOFF` exactly when it is a
        :class:`ServerHandoff` (and :attr:`Capability.RUN_CHECK` when a
        :class:`RunChecked`): a claim without the methods, or the methods unclaimed,
        fails where the class is written, not in a waiter."""
        super().__init_subclass__(**kwargs)
        for capability, methods in _IMPLEMENTED_BY.items():
            declared = capability in cls.capabilities
            if declared != issubclass(cls, methods):
                missing = methods.__name__ if declared else f"Capability.{capability.name}"
                raise TypeError(
                    f"{cls.__qualname__}: Capability.{capability.name} is declared by "
                    f"the capability and implemented by {methods.__name__}, together; "
                    f"{missing} is missing"
                )

    def __init__(self, url: str) -> None:
        self.url = url
        self.server = redact_url(url)

    @property
    def server_handoff(self) -> bool:
        """Whether a release hands the lock to the next waiter inside the server: this
        backend is a :class:`ServerHandoff` (Redis by default; ``?handoff=client`` opts out)."""
        return isinstance(self, ServerHandoff)

    def check_name(self, name: str) -> None:
        """Refuse a name longer than :attr:`max_name_length`, naming the limit: a database
        column would refuse it mid-acquire, or cut it (MySQL outside strict mode) and make
        two names one lock."""
        limit = self.max_name_length
        if limit is not None and len(name) > limit:
            raise InvalidArgument(
                f"{self.server}: a lock name here must be at most {limit} characters "
                f"(the backend's limit), got {len(name)}",
                name=name[:40] + "...",
            )

    # -- URL options, read the same way by every backend -----------------------------

    def _options(self, known: Collection[str]) -> dict[str, str]:
        """The URL's query options; an option this backend does not know is refused."""
        query = dict(parse_qsl(urlsplit(self.url).query, keep_blank_values=True))
        unknown = set(query) - set(known)
        if unknown:
            raise InvalidArgument(unknown_options(self.server, unknown, known))
        return query

    def _number(
        self,
        options: Mapping[str, str],
        key: str,
        default: float,
        *,
        minimum: float = 0.0,
        positive: bool = False,
    ) -> float:
        """Option ``key`` as a finite number ``>= minimum`` (``> 0`` if ``positive``)."""
        if key not in options:
            return default
        try:
            value = float(options[key])
        except ValueError:
            raise InvalidArgument(
                f"{self.server}: option {key}={options[key]!r} is not a number"
            ) from None
        if not math.isfinite(value) or value < minimum or (positive and value <= 0):
            bound = "> 0" if positive else f">= {minimum:g}"
            raise InvalidArgument(f"{self.server}: option {key} must be {bound}, got {value}")
        return value

    # -- required ------------------------------------------------------------------

    @abc.abstractmethod
    def acquire(self, name: str, token: str, ttl_ms: int, owner: Owner) -> AcquireResult:
        """Take ``name`` for ``token`` if free (or already ours); never wait.

        An acquire for the token that already holds ``name`` (a retry after a lost reply,
        or a publish-time lock becoming the run lock) must answer the same fence *and*
        reset the TTL to ``ttl_ms`` and the owner to ``owner``, in the same atomic step:
        the caller counts its lease from this request's send time, so the server's TTL
        must not end sooner than that.
        """

    @abc.abstractmethod
    def renew(self, name: str, token: str, ttl_ms: int) -> bool:
        """Extend the TTL if the token is still ours; ``False`` means the lease is lost."""

    @abc.abstractmethod
    def release(self, name: str, token: str) -> bool:
        """Delete the lock if the token is ours and wake a waiter; ``False`` if not ours."""

    @abc.abstractmethod
    def holders(self, prefix: str = "") -> list[Holder]:
        """The live locks whose name starts with ``prefix``."""

    @abc.abstractmethod
    def force_release(self, name: str, fence: int | None = None) -> bool:
        """Operator override: delete the lock of a holder that is not us.

        ``fence`` is the fence of the holder the operator saw: the lock is deleted only
        if that holder still holds it, atomically on the server (a lock that changed hands
        meanwhile is left alone, and ``False`` is returned). ``fence=None`` deletes
        whoever holds it; no front end does that, since the holder may have changed
        while the operator was asked. ``True`` if a lock was deleted.
        """

    # -- optional, with a correct default ------------------------------------------

    def renew_many(self, items: Sequence[RenewItem], timeout: float | None = None) -> list[bool]:
        """Renew a batch; backends override this to use one round trip.

        ``timeout`` (seconds) is the validity left to the first lease of the batch to
        expire: an answer after it is useless, so a backend that can bound its call by it
        should (Redis does). The watchdog marks the leases lost at their deadline anyway.
        """
        return [self.renew(i.name, i.token, i.ttl_ms) for i in items]

    def renewal_lane(self, name: str, asynchronous: bool = False) -> Hashable:
        """Which renewal lane renews ``name``: leases in one lane are renewed together.

        Lanes are independent (own schedule, own thread or task, own timeout), so one
        stalled lane does not delay another. One lane per backend by default; Redis
        Cluster has one per primary. ``asynchronous``: the caller renews from asyncio.
        """
        return None

    def wait_release(self, name: str, timeout: float) -> None:
        """Block until ``name`` is probably released, or ``timeout`` seconds pass.

        A spurious early return is fine (the caller retries the acquire); sleeping past
        a release is what costs. The default polls: it sleeps at most 50 ms. The asyncio
        twin is :meth:`await_release` (``a`` + this name, like every pair).
        """
        time.sleep(min(timeout, 0.05))

    def wait(self, name: str, timeout: float) -> None:
        """:meth:`wait_release` under its first name (kept: :class:`Backend` is public)."""
        self.wait_release(name, timeout)

    def wait_any(self, names: Sequence[str], timeout: float) -> None:
        """Block until any of ``names`` is probably released, or ``timeout`` seconds pass.

        Semaphore waiters want whichever slot frees first. This default waits on the
        first name only, in slices of :data:`WAIT_ANY_SLICE`, so the release of another
        name is noticed within a slice; backends that can watch several names at once
        override it (Redis: one BLPOP on every signal list).
        """
        self.wait_release(names[0], timeout if len(names) == 1 else min(timeout, WAIT_ANY_SLICE))

    def holder(self, name: str) -> Holder | None:
        """The holder of exactly ``name``, if any."""
        return next((h for h in self.holders(name) if h.name == name), None)

    def clock_margin(self, ttl: float) -> float:
        """How much sooner than ``ttl`` after its request a lease must be taken as over.

        ``0`` when one server's TTL is the only clock: it starts after our request was
        sent, so counting from the send is already early. Redlock overrides it with its
        allowance for clock drift between the masters.
        """
        return 0.0

    def defer_release(self, release: DeferredRelease) -> bool:
        """Send ``release`` ahead of this backend's next (sync) acquire, in the same round
        trip, if it is still unclaimed then; ``False``: this backend cannot (the caller
        sends it itself). The caller must send it anyway if no acquire comes soon."""
        return False

    def release_notices(self) -> NoticeStream:
        """The locks someone other than their holder freed, as they are freed: a
        :class:`~task_locks.backends.notices.NoticeStream` with its own connection, read
        by one listener thread per process (:mod:`task_locks.notices`). Only where
        :attr:`Capability.RELEASE_NOTICE` is declared; elsewhere renewal finds the loss."""
        raise NotImplementedError(f"{self!r} does not announce force releases")

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to close by default
        """Release client resources (connections, threads)."""

    # -- asyncio: the shared adapter -----------------------------------------------

    async def aacquire(self, name: str, token: str, ttl_ms: int, owner: Owner) -> AcquireResult:
        """The asyncio twin of :meth:`acquire` (by default, the sync call in a thread)."""
        return await asyncio.to_thread(self.acquire, name, token, ttl_ms, owner)

    async def arenew(self, name: str, token: str, ttl_ms: int) -> bool:
        """The asyncio twin of :meth:`renew`."""
        return await asyncio.to_thread(self.renew, name, token, ttl_ms)

    async def arenew_many(
        self, items: Sequence[RenewItem], timeout: float | None = None
    ) -> list[bool]:
        """The asyncio twin of :meth:`renew_many`."""
        return await asyncio.to_thread(self.renew_many, items, timeout)

    async def arelease(self, name: str, token: str) -> bool:
        """The asyncio twin of :meth:`release`."""
        return await asyncio.to_thread(self.release, name, token)

    async def await_release(self, name: str, timeout: float) -> None:
        """The asyncio twin of :meth:`wait_release`: until ``name`` may be free, at most
        ``timeout`` seconds."""
        await _wait_in_thread(lambda remaining: self.wait_release(name, remaining), timeout)

    async def await_any(self, names: Sequence[str], timeout: float) -> None:
        """The asyncio twin of :meth:`wait_any`."""
        await _wait_in_thread(lambda remaining: self.wait_any(names, remaining), timeout)

    async def aholders(self, prefix: str = "") -> list[Holder]:
        """The asyncio twin of :meth:`holders`."""
        return await asyncio.to_thread(self.holders, prefix)

    async def aforce_release(self, name: str, fence: int | None = None) -> bool:
        """The asyncio twin of :meth:`force_release`."""
        return await asyncio.to_thread(self.force_release, name, fence)

    async def aholder(self, name: str) -> Holder | None:
        """The asyncio twin of :meth:`holder`."""
        return await asyncio.to_thread(self.holder, name)

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release what the running event loop's client holds (before the loop ends)."""

    # -------------------------------------------------------------------------------

    def missing(self, required: Iterable[str]) -> set[Capability]:
        """The capabilities in ``required`` this backend lacks (unknown names raise)."""
        return set(parse_capabilities(required)) - set(self.capabilities)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.server}>"
