"""Redlock: ``redlock://[:password@]h1:p1,h2:p2,h3:p3[/db][?options]``.

N independent Redis masters (no replication between them); a lock is held when a
majority of them hold it for the same token. Each master is one
:class:`~task_locks.backends.redis.RedisBackend` (same Lua scripts, same key layout),
and this module only fans requests out to them and counts the answers:

- **acquire**: sent to every master at once, each with a short timeout (``node_timeout``).
  The answer is decided as soon as a majority has granted it (or can no longer grant
  it); a straggler is not waited for (closing the backend does wait for it, up to
  ``node_timeout``). The lock is ours when a majority granted it and
  the validity ``ttl - elapsed - drift`` is still positive (``elapsed`` measured on a
  monotonic clock after the majority answered, ``drift = ttl * drift_factor + 2 ms``).
  Otherwise the partial grants are released everywhere and the caller retries after
  the holder's TTL or, when the vote was split between contenders, a random delay.
- **fence** = the largest fence among the granting masters. Each master's fence is
  ``max(counter + 1, server time in microseconds)``; after a successful acquire the
  fence counter on every master is raised to that maximum (``fence_sync=1``, one more
  parallel round trip), so the next majority, which overlaps ours, hands out a larger
  one even when the masters' clocks disagree.
- **renew / release**: a majority must confirm the token; answers from fewer masters
  than a majority raise :class:`~task_locks.errors.BackendUnavailable` (the watchdog
  retries a renewal until the lease would have run out).
- **restarted masters**: every new connection to a master reads its ``run_id`` and
  uptime. A master whose ``run_id`` changed since we last saw it may have lost locks it
  held, so its answers do not count until its uptime reaches the longest TTL this
  process has used (or ``restart_delay``, if longer). A master first seen with an uptime
  below ``restart_delay`` waits likewise.
- **ordering**: calls for one (name, token) reach each master in order (a cleanup
  release never overtakes that master's straggling grant), and release waits for every
  master that answers, so a released lock is free everywhere reachable. A cleanup
  release a master did not answer may still land there later (it was sent before its
  connection was dropped), after our next grant of that token: that master's answers
  for that token no longer count, in later tries and in the lease's renewals. Likewise a
  grant a master did not answer may land later and restart its copy at the acquire's
  TTL: renewals with a longer TTL do not count that master.
- **wake-ups**: a waiter blocks on the release signal list of one master (one that
  refused its last try for the holder, where the release signals; else chosen by the
  name; skipping masters that just failed), with a deadline of its own, so a paused
  master cannot stretch a wait.
- **holders**: a holder is listed when a majority of masters agree on its token.

Capabilities: ``fencing`` (with ``fence_sync``, see above and below), ``multiprocess``,
``wakeup``, ``holders``; not ``consensus``: a majority of masters is no consensus
protocol, so ``Lock(..., require={"consensus"})`` refuses this backend.

Limits (also in the safety table, README and docs/backends/):

- Safety assumes the masters' clocks run at about the same rate: a master whose clock
  jumps forward expires a lock early. ``drift_factor`` covers only bounded drift.
- A master that restarts *without persistence* forgets its locks. The restart check
  above only works when this process talks to that master and ``restart_delay``
  (default: the longest TTL this process used) covers the longest TTL of *every*
  process; run masters with ``appendfsync always`` or delay their restarts by the
  longest TTL for full safety.
- Fences stay increasing as long as, between two acquires, a majority of masters keep
  their fence counters (no restart without persistence); past that they fall back on
  the masters' clocks, like a single Redis restarted without persistence.
- A paused or partitioned client can still act after its lease ran out: pass the fence
  to the resource.
- A local lease's expiry is ``ttl - drift`` after the request was sent (the Redlock
  validity, :meth:`RedlockBackend.clock_margin`), after an acquire and after each
  renewal alike.
- A grant that reaches a paused master after the client gave up on it (and after its
  cleanup release timed out) stays there, with our token, until its TTL runs out: it
  cannot form a majority for anyone, but it can delay the next acquire while another
  master is down.
- Sync calls fan out through a thread pool of this backend (up to 8 threads per
  master); async calls fan out as tasks on the running loop (redis.asyncio).

URL options: ``prefix`` (default ``task_locks:``), ``node_timeout`` (seconds per master
and request, default 0.25), ``retry_delay`` (upper bound of the random delay after a
split vote, default 0.2), ``drift_factor`` (default 0.01), ``restart_delay`` (seconds a
restarted master gets no vote, at least the longest TTL used; default 0), ``fence_sync``
(``1``/``0``, default 1), ``fence_ttl`` (seconds, as for ``redis://``).
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
import weakref
import zlib
from asyncio import FIRST_COMPLETED
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, TypeVar
from urllib.parse import quote, urlsplit

from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._steps import arun, run
from ..errors import BackendUnavailable, InvalidArgument, LockError, RenewalUndecided
from ..types import AcquireResult, Holder, Owner, RenewItem, RunCheck
from ._redis_compat import aget_connection, get_connection
from .base import Backend, Capability, RunChecked, check_ttl_ms
from .redis import RedisBackend
from .redis_scripts import BUMP_FENCE, Commands, script_command

T = TypeVar("T")


_OPTIONS: Final = {
    "prefix",
    "node_timeout",
    "retry_delay",
    "drift_factor",
    "restart_delay",
    "fence_sync",
    "fence_ttl",
}
#: After a master failed, waiters prefer other masters for this long.
_DOWN_FOR: Final = 1.0
#: Added to ``ttl * drift_factor``: the clocks' resolution (as in the Redlock algorithm).
_DRIFT_FLOOR: Final = 0.002
#: Names whose holder's masters are remembered for the waits (the oldest are forgotten).
_HOLDING_NAMES: Final = 1024


class _Silence:
    """A master without a usable answer: none yet (or in time), or no vote after a restart."""

    def __init__(self, why: str) -> None:
        self.why = why

    def __repr__(self) -> str:
        return self.why


PENDING: Final = _Silence("not awaited: the outcome was already decided")
TIMED_OUT: Final = _Silence("no answer within node_timeout")
NO_VOTE: Final = _Silence("restarted recently, no vote")
UNSETTLED: Final = _Silence("an undo of ours may still land there: no vote for this token")


def _parse_info(raw: Any) -> dict[str, str]:
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    fields = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k.strip(): v.strip() for k, v in fields}


class _MasterBackend(RedisBackend):
    """One master: a :class:`RedisBackend` that reports each new connection's server.

    Every (re)connection, sync or async, first reads ``INFO server``, so a restart is
    noticed before the restarted master's answer is counted.
    """

    #: No release notices: nobody listens on a master (a Redlock lease is renewed, and a
    #: force release found, through the majority), and a PUBLISH there would only need
    #: one more ACL right.
    notice_channel = ""

    def __init__(self, url: str, master: _Master) -> None:
        self.master = master
        super().__init__(url)
        self.client.connection_pool.connection_kwargs["redis_connect_func"] = self._sync_hook

    def _async_client(self) -> Any:
        client = super()._async_client()
        client.connection_pool.connection_kwargs.setdefault("redis_connect_func", self._async_hook)
        return client

    def _sync_hook(self, conn: Any) -> None:
        conn.on_connect()
        conn.send_command("INFO", "server")
        self.master.observe(_parse_info(conn.read_response()))

    async def _async_hook(self, conn: Any) -> None:
        await conn.on_connect()
        await conn.send_command("INFO", "server")
        self.master.observe(_parse_info(await conn.read_response()))

    # -- requests shaped once, sent by the sync or the async client --------------------

    def _grant_commands(
        self, name: str, token: str, ttl_ms: int, owner: Owner, run: RunCheck | None
    ) -> Commands:
        # A grant that was already ours (left by a straggler of an earlier attempt) gets
        # its TTL restarted by ACQUIRE itself (same token), so every vote lasts ttl from now.
        acquire = self._acquire_args(name, token, ttl_ms, owner, run)
        script = "acquire" if run is None else "acquire_run"
        return lambda by_sha: [script_command(script, by_sha, acquire)]

    def _grant_result(
        self, name: str, token: str, ttl_ms: int, owner: Owner, run: RunCheck | None,
        replies: list[Any],
    ) -> AcquireResult:  # fmt: skip
        for reply in replies:
            if isinstance(reply, Exception):
                self._fail(name, reply)
        named = None if run is None else self._acquire_args(name, token, ttl_ms, owner, run)
        return self._acquire_result(replies[0], named)

    def _bump_commands(self, name: str, token: str, fence: int) -> Commands:
        key = self._key(name)
        args = [2, key, self._counter(name), token, fence, self.fence_ttl_ms]
        return lambda by_sha: [script_command("bump_fence", by_sha, args)]

    # -- sync ----------------------------------------------------------------------------

    def grant(
        self, name: str, token: str, ttl_ms: int, owner: Owner, run: RunCheck | None = None
    ) -> AcquireResult:
        replies = self._scripts(name, self._grant_commands(name, token, ttl_ms, owner, run))
        return self._grant_result(name, token, ttl_ms, owner, run, replies)

    def bump_fence(self, name: str, token: str, fence: int) -> bool:
        return bool(self._scripts(name, self._bump_commands(name, token, fence))[0])

    def block_on_signal(self, name: str, timeout: float) -> None:
        """BLPOP with a client-side deadline: a paused master cannot stretch the wait."""
        pool = self.client.connection_pool
        try:
            conn = get_connection(pool, "BLPOP")
        except RedisError as exc:
            self._fail(name, exc)
        try:
            conn.send_command("BLPOP", self._key(name) + ":signal", max(0.001, timeout))
            if conn.can_read(timeout=timeout + self.socket_timeout):
                conn.read_response()
            else:
                conn.disconnect()  # the server is stuck; drop the half-done BLPOP
        except RedisError as exc:
            conn.disconnect()
            self._fail(name, exc)
        finally:
            pool.release(conn)

    # -- async ---------------------------------------------------------------------------

    async def agrant(
        self, name: str, token: str, ttl_ms: int, owner: Owner, run: RunCheck | None = None
    ) -> AcquireResult:
        commands = self._grant_commands(name, token, ttl_ms, owner, run)
        replies = await self._ascripts(name, commands)
        return self._grant_result(name, token, ttl_ms, owner, run, replies)

    async def abump_fence(self, name: str, token: str, fence: int) -> bool:
        return bool((await self._ascripts(name, self._bump_commands(name, token, fence)))[0])

    async def ablock_on_signal(self, name: str, timeout: float) -> None:
        pool = self._async_client().connection_pool
        try:
            conn = await aget_connection(pool, "BLPOP")
        except RedisError as exc:
            self._fail(name, exc)
        try:
            await conn.send_command("BLPOP", self._key(name) + ":signal", max(0.001, timeout))
            await conn.read_response(timeout=timeout + self.socket_timeout)
        except RedisTimeoutError:
            await conn.disconnect()  # the server is stuck; drop the half-done BLPOP
        except RedisError as exc:
            await conn.disconnect()
            self._fail(name, exc)
        finally:
            await pool.release(conn)


class _Master:
    """What this process knows about one master's lifetime, and whether it may vote."""

    def __init__(self, redlock: RedlockBackend, address: str, url: str) -> None:
        self.redlock = redlock
        self.address = address
        self.run_id: str | None = None
        self.vote_after = 0.0  # time.monotonic()
        self.down_until = 0.0
        self.backend = _MasterBackend(url, self)

    def observe(self, info: dict[str, str]) -> None:
        """A new connection told us the server's ``run_id`` and uptime."""
        run_id = info.get("run_id", "")
        try:
            uptime = float(info.get("uptime_in_seconds", "0"))
        except ValueError:
            uptime = 0.0
        if self.run_id is None:  # first sight: only an explicit restart_delay applies
            delay = self.redlock.restart_delay
        elif run_id != self.run_id:  # restarted since we last saw it: it may have forgotten
            delay = self.redlock.restart_quarantine()
        else:
            delay = 0.0
        if uptime < delay:
            self.vote_after = max(self.vote_after, time.monotonic() + delay - uptime)
        self.run_id = run_id

    def votes(self, now: float) -> bool:
        return now >= self.vote_after

    def describe(self, answer: object, now: float) -> str:
        if answer is NO_VOTE or not self.votes(now):
            more = max(0.0, self.vote_after - now)
            return f"{self.address}: restarted, no vote for {more:.1f}s more"
        if isinstance(answer, BaseException):
            return f"{self.address}: {answer.__cause__ or answer}"
        return f"{self.address}: {answer!r}"


# One fan-out request: the same method called on every master.
@dataclass(frozen=True, slots=True)
class _Call:
    method: str  # sync name on _MasterBackend; the async one is "a" + method
    args: tuple[Any, ...]
    #: True once the answers so far decide the outcome (stragglers are not awaited).
    enough: Callable[[list[Any]], bool]
    #: (name, token) whose calls must reach each master in order: a release must not
    #: overtake a straggling grant, or the grant would land after it and linger.
    chain: tuple[str, str] | None = None
    #: Another chain this call also waits for, and that later calls of it wait for: a
    #: Celery run's take-over of its publish-time lock waits for that token's fence bump,
    #: or it could read the fence a master had before the bump.
    after: tuple[str, str] | None = None

    def keys(self, *prefix: Any) -> list[tuple[Any, ...]]:
        """The chains' keys, each under ``prefix`` (which master, which event loop)."""
        return [(*prefix, *chain) for chain in (self.chain, self.after) if chain is not None]


_Plan = Generator[_Call, list[Any], T]


def _after_fork(ref: weakref.ReferenceType[RedlockBackend]) -> None:
    backend = ref()
    if backend is not None:
        backend._forked()


class RedlockBackend(Backend, RunChecked):
    capabilities = frozenset(
        {
            Capability.FENCING,
            Capability.HOLDERS,
            Capability.MULTIPROCESS,
            Capability.WAKEUP,
            Capability.RUN_CHECK,
        }
    )

    def __init__(self, url: str) -> None:
        super().__init__(url)
        parts = urlsplit(url)
        query = self._options(_OPTIONS)
        self.prefix = query.get("prefix", "task_locks:")
        self.node_timeout = self._number(query, "node_timeout", 0.25, minimum=0.001)
        self.retry_delay = self._number(query, "retry_delay", 0.2)
        self.drift_factor = self._number(query, "drift_factor", 0.01)
        self.restart_delay = self._number(query, "restart_delay", 0.0)
        self.fence_sync = query.get("fence_sync", "1") not in ("0", "false", "no")
        fence_ttl = self._number(query, "fence_ttl", 7 * 86400, positive=True)
        self._longest_ttl = 0.0
        self.masters = self._masters(parts, fence_ttl)
        self.quorum = len(self.masters) // 2 + 1
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._pool_lock = threading.Lock()
        self._background: set[asyncio.Future[Any]] = set()
        self._chains: dict[tuple[Any, ...], Future[Any]] = {}
        self._chain_lock = threading.Lock()
        self._achains: dict[tuple[Any, ...], asyncio.Future[Any]] = {}
        #: name -> the masters that refused our last try for its holder (wait on those)
        self._holding: dict[str, frozenset[int]] = {}
        #: (name, token) -> masters an unanswered undo of that token may still reach
        self._unsettled: dict[tuple[str, str], frozenset[int]] = {}
        #: (name, token) -> masters a grant of ours may still reach, and its TTL (ms)
        self._straggling: dict[tuple[str, str], tuple[frozenset[int], int]] = {}
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _after_fork(ref))

    def _forked(self) -> None:
        """In a forked child: the parent's threads, locks and in-flight calls are not ours."""
        self._pool = None
        self._pool_lock = threading.Lock()
        self._chain_lock = threading.Lock()
        self._chains = {}
        self._achains = {}
        self._background = set()

    # -- construction -------------------------------------------------------------------

    def _masters(self, parts: Any, fence_ttl: float) -> list[_Master]:
        userinfo, _, hosts = parts.netloc.rpartition("@")
        auth = f"{userinfo}@" if userinfo else ""
        path = parts.path.strip("/")
        if path and not path.isdigit():
            raise InvalidArgument(
                f"{self.server}: the path must be a database number, got {path!r}"
            )
        db = path or "0"
        masters: list[_Master] = []
        seen: set[str] = set()
        for item in hosts.split(","):
            host, _, port = item.strip().rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise InvalidArgument(
                    f"{self.server}: expected host:port[,host:port...], got {item.strip()!r}"
                )
            address = f"{host}:{int(port)}"
            if address in seen:
                raise InvalidArgument(f"{self.server}: master {address} is listed twice")
            seen.add(address)
            options = (
                f"prefix={quote(self.prefix, safe='')}&socket_timeout={self.node_timeout}"
                f"&connect_timeout={self.node_timeout}&fence_ttl={fence_ttl}"
            )
            masters.append(_Master(self, address, f"redis://{auth}{address}/{db}?{options}"))
        return masters

    def clock_margin(self, ttl: float) -> float:
        """Redlock's drift allowance: a lock is valid ``ttl`` less this after the request."""
        return ttl * self.drift_factor + _DRIFT_FLOOR

    def restart_quarantine(self) -> float:
        """How long a restarted master may have held a lock it forgot: no vote for that long."""
        return max(self._longest_ttl, self.restart_delay)

    def _executor(self) -> ThreadPoolExecutor:
        # A forked child inherits the parent's executor without its threads: make a new one.
        pid = os.getpid()
        with self._pool_lock:
            if self._pool is None or self._pool_pid != pid:
                self._pool = ThreadPoolExecutor(
                    max_workers=min(64, 8 * len(self.masters)),
                    thread_name_prefix="task-locks-redlock",
                )
                self._pool_pid = pid
            return self._pool

    # -- counting answers (no I/O) ---------------------------------------------------------

    def _voters(self, answers: list[Any]) -> list[Any]:
        """Answers that count: a master in its post-restart quarantine has ``NO_VOTE``."""
        now = time.monotonic()
        return [a if m.votes(now) else NO_VOTE for m, a in zip(self.masters, answers, strict=True)]

    def _unavailable(self, name: str | None, what: str, answers: list[Any]) -> BackendUnavailable:
        """The error for a failed majority; pass the voters the decision was made on, so a
        quarantine that ended in between is still named."""
        now = time.monotonic()
        failed = [
            m.describe(a, now)
            for m, a in zip(self.masters, answers, strict=True)
            if a is NO_VOTE
            or not m.votes(now)
            or (a is not PENDING and isinstance(a, _Silence | BaseException))
        ]
        subject = f"lock {name!r}" if name else "listing locks"
        return BackendUnavailable(
            f"{subject}: {what}: a majority of the Redis masters ({self.quorum} of "
            f"{len(self.masters)}) must answer, but {len(failed)} did not: " + "; ".join(failed),
            name=name,
            server=self.server,
        )

    def _tally(self, answers: list[Any], index: int | None = None) -> tuple[int, int]:
        """(yes, no) among voting masters, for a bool answer or item ``index`` of a list."""
        yes = no = 0
        for answer in self._voters(answers):
            if isinstance(answer, _Silence | BaseException):
                continue
            value = answer if index is None else answer[index]
            if value:
                yes += 1
            else:
                no += 1
        return yes, no

    def _all_answered(self, answers: list[Any]) -> bool:
        return all(a is not PENDING for a in answers)

    def _majority_answered(self, answers: list[Any]) -> bool:
        return sum(a is not PENDING for a in answers) >= self.quorum

    # -- the algorithms, written once as plans of fan-outs ---------------------------------

    def _acquire_plan(
        self, name: str, token: str, ttl_ms: int, owner: Owner, run: RunCheck | None = None
    ) -> _Plan[AcquireResult]:
        """A grant from a majority in time. A run check is each master's: a copy is
        refused where the original holds, a majority, so it never wins one."""
        check_ttl_ms(ttl_ms, name)  # here: a master's refusal would only count as no vote
        ttl = ttl_ms / 1000
        self._longest_ttl = max(self._longest_ttl, ttl)
        started = time.monotonic()

        def granted(answers: list[Any]) -> list[AcquireResult]:
            return [a for a in answers if isinstance(a, AcquireResult) and a.acquired]

        unsettled = self._unsettled.get((name, token), frozenset())

        def enough(answers: list[Any]) -> bool:
            voters = self._trusted(answers, unsettled)
            won = len(granted(voters))
            answered = sum(1 for a in voters if isinstance(a, AcquireResult))
            undecided = sum(1 for a in voters if a is PENDING)
            if won >= self.quorum:
                return True
            # Lost; stop once we can also tell "held" from "unavailable".
            return won + undecided < self.quorum and (
                answered >= self.quorum or answered + undecided < self.quorum
            )

        taken_over = (name, run.take_over) if run is not None and run.take_over else None
        answers = yield _Call(
            "grant", (name, token, ttl_ms, owner, run), enough, (name, token), taken_over
        )
        elapsed = time.monotonic() - started
        validity = ttl - elapsed - self.clock_margin(ttl)
        voters = self._trusted(answers, unsettled)
        won = granted(voters)
        # A grant not answered may still land (in this try or a failed one, whose undo may
        # overtake it), restarting that master's copy at this TTL: a lease renewed with a
        # longer one must not count that master then.
        late = {i for i, a in enumerate(answers) if not isinstance(a, AcquireResult)}
        if late:
            self._note_straggler(name, token, late, ttl_ms)
        if len(won) >= self.quorum and validity > 0:
            fence = max(a.fence or 0 for a in granted(answers))
            if self.fence_sync:
                yield _Call(
                    "bump_fence", (name, token, fence), self._majority_answered, (name, token)
                )
            return AcquireResult(fence)
        # Not ours: undo the partial grants everywhere. Wait for the masters that answered
        # (so our next attempt cannot overtake the undo); a stuck one is not waited for.
        responsive = [not isinstance(a, _Silence) for a in answers]

        def undone(cleanup: list[Any]) -> bool:
            return all(a is not PENDING for a, r in zip(cleanup, responsive, strict=True) if r)

        cleanup = yield _Call("release", (name, token), undone, (name, token))
        # An undo not answered may still be on its way (sent before its connection was
        # dropped): landing after our next grant of this token there, it would delete that
        # grant under a lease that counts it. That master's answers for this token no
        # longer count (the calls of a chain wait for each other's return, not landing).
        unsettled |= {i for i, a in enumerate(cleanup) if not isinstance(a, bool)}
        if unsettled:
            self._remember(self._unsettled, (name, token), frozenset(unsettled))
        refused = [a for a in voters if isinstance(a, AcquireResult) and not a.acquired]
        if len(won) + len(refused) < self.quorum:
            raise self._unavailable(name, "cannot acquire", voters)
        result = self._refusal(refused, complete=len(won) + len(refused) == len(self.masters))
        self._note_holding(name, voters, result.holder_fence)
        return result

    def _note_straggler(self, name: str, token: str, late: set[int], ttl_ms: int) -> None:
        """Masters a call of ours setting ``ttl_ms`` may still reach: renewals with a
        longer TTL do not count them (see ``_untrusted``)."""
        with self._chain_lock:
            before, shortest = self._straggling.get((name, token), (frozenset(), ttl_ms))
        self._remember(self._straggling, (name, token), (before | late, min(shortest, ttl_ms)))

    def _remember(self, book: dict[Any, Any], key: Any, value: Any) -> None:
        """``book[key] = value``, the oldest entries forgotten past a bound."""
        with self._chain_lock:
            book.pop(key, None)
            book[key] = value
            while len(book) > _HOLDING_NAMES:
                del book[next(iter(book))]

    def _untrusted(self, item: RenewItem) -> frozenset[int] | set[int]:
        """Masters whose answers for this renewal do not count: an undo of ours may still
        land there, or a grant of a shorter TTL than this renewal's."""
        unsettled = self._unsettled.get((item.name, item.token), frozenset())
        late, ttl_ms = self._straggling.get((item.name, item.token), (frozenset(), 0))
        return unsettled | late if item.ttl_ms > ttl_ms else unsettled

    def _trusted(self, answers: list[Any], unsettled: frozenset[int] | set[int]) -> list[Any]:
        """The voters' answers, without those of masters an undo of ours may still reach."""
        voters = self._voters(answers)
        return [UNSETTLED if i in unsettled else a for i, a in enumerate(voters)]

    def _note_holding(self, name: str, voters: list[Any], fence: int | None) -> None:
        """Remember which masters refused us for the holder we saw: its release signals
        only where it held the lock, so a waiter blocks on one of those."""
        holding = frozenset(
            index
            for index, answer in enumerate(voters)
            if isinstance(answer, AcquireResult)
            and not answer.acquired
            and answer.holder_fence == fence
        )
        with self._chain_lock:
            self._holding.pop(name, None)
            self._holding[name] = holding
            while len(self._holding) > _HOLDING_NAMES:
                del self._holding[next(iter(self._holding))]

    def _refusal(self, refused: list[AcquireResult], complete: bool) -> AcquireResult:
        """What a loser learns: who holds the lock, and when to try again."""
        if not refused:  # a majority granted, but too late (validity ran out): go again
            return AcquireResult(None, retry_after=random.uniform(0, self.retry_delay))
        groups: dict[int | None, list[AcquireResult]] = defaultdict(list)
        for answer in refused:
            groups[answer.holder_fence].append(answer)
        best = max(groups.values(), key=len)
        ttls = [a.retry_after for a in best if a.retry_after is not None]
        if len(best) < self.quorum and complete:
            # Split vote between contenders: desynchronise with a random delay.
            retry_after: float | None = random.uniform(self.retry_delay / 2, self.retry_delay)
        elif ttls:
            retry_after = min(ttls) + random.uniform(0, self.retry_delay / 4)
        else:
            retry_after = None
        return AcquireResult(
            None,
            retry_after=retry_after,
            holder=best[0].holder,
            holder_fence=best[0].holder_fence,
            holder_acquired_at=best[0].holder_acquired_at,
            holder_name=best[0].holder_name,
        )

    def _renew_plan(self, items: Sequence[RenewItem]) -> _Plan[list[bool]]:
        for item in items:
            check_ttl_ms(item.ttl_ms, item.name)
        started = time.monotonic()

        def outcome(answers: list[Any], index: int, validity: float = 1.0) -> bool | None:
            """Each lease on its own: renewed (a majority said yes in time), lost (a
            majority of yes is out of reach: masters that said no, or cannot vote, leave
            too few), or undecided (``None``: retried until that lease's deadline)."""
            item = items[index]
            voters = self._trusted(answers, self._untrusted(item))
            yes, _ = self._tally(voters, index)
            silent = sum(
                1
                for a in voters
                if a not in (NO_VOTE, UNSETTLED) and isinstance(a, _Silence | BaseException)
            )
            if yes >= self.quorum:
                return True if validity > 0 else None
            if yes + silent < self.quorum:
                return False
            return None

        def enough(answers: list[Any]) -> bool:
            return all(outcome(answers, i) is not None for i in range(len(items)))

        answers = yield _Call("renew_many", (list(items),), enough)
        elapsed = time.monotonic() - started
        # A renewal a master did not answer may land there later, even after a renewal
        # with a longer TTL that a majority granted, cutting that master's copy back to
        # this TTL from its arrival: like a straggling grant (seed 3234).
        late = {i for i, a in enumerate(answers) if isinstance(a, _Silence | BaseException)}
        if late:
            for item in items:
                self._note_straggler(item.name, item.token, late, item.ttl_ms)
        outcomes: list[bool | None] = []
        for index, item in enumerate(items):
            ttl = item.ttl_ms / 1000
            outcomes.append(outcome(answers, index, ttl - elapsed - self.clock_margin(ttl)))
        if None in outcomes:
            # One lease without a majority either way must not cost the others theirs:
            # the decided outcomes travel with the error, the watchdog applies them.
            first = items[outcomes.index(None)].name
            error = self._unavailable(first, "cannot renew", answers)
            raise RenewalUndecided(str(error), outcomes, name=first, server=self.server)
        return [bool(o) for o in outcomes]

    def _release_plan(self, name: str, token: str) -> _Plan[bool]:
        # Every master is awaited (up to node_timeout), not just a majority: once release()
        # returns, the lock is free wherever a master answers.
        answers = yield _Call("release", (name, token), self._all_answered, (name, token))
        with self._chain_lock:
            self._unsettled.pop((name, token), None)
            self._straggling.pop((name, token), None)
        yes, no = self._tally(answers)
        if yes >= self.quorum:
            return True
        if no > len(self.masters) - self.quorum:
            return False
        raise self._unavailable(name, "cannot release", answers)

    def _force_release_plan(self, name: str, fence: int | None) -> _Plan[bool]:
        if fence is None:
            answers = yield _Call("force_release", (name,), self._all_answered)
        else:
            # The masters need not agree on the fence (without fence_sync each keeps its
            # own), so "the holder with this fence" is decided here, from a majority's
            # copies, the way holder() reports it; then that holder's *token* is deleted,
            # atomically on each master. A lock that changed hands has another token:
            # it stays, wherever it is.
            holders = yield from self._holders_plan(name, exact=True)
            seen = next(iter(holders), None)
            if seen is None or seen.fence != fence:
                return False
            answers = yield _Call("release", (name, seen.token), self._all_answered)
        yes, no = self._tally(answers)
        if yes + no < self.quorum:
            raise self._unavailable(name, "cannot force-release", answers)
        # A holder was freed only if a majority may have held it: a copy left on a
        # minority by an earlier partial release (a master that timed out) held nothing.
        unanswered = len(self.masters) - yes - no
        return yes > 0 and yes + unanswered >= self.quorum

    def _holders_plan(self, prefix: str, exact: bool) -> _Plan[list[Holder]]:
        if exact:
            answers = yield _Call("holder", (prefix,), self._all_answered)
            lists = [[a] if isinstance(a, Holder) else [] if a is None else a for a in answers]
        else:
            lists = yield _Call("holders", (prefix,), self._all_answered)
        voters = self._voters(lists)
        if sum(1 for a in voters if isinstance(a, list)) < self.quorum:
            raise self._unavailable(prefix or None, "cannot list holders", voters)
        seen: dict[tuple[str, str], list[Holder]] = defaultdict(list)
        for answer in voters:
            if isinstance(answer, list):
                for holder in answer:
                    seen[(holder.name, holder.token)].append(holder)
        found = [self._agreed(copies) for copies in seen.values() if len(copies) >= self.quorum]
        return sorted(found, key=lambda h: h.name)

    def _agreed(self, copies: list[Holder]) -> Holder:
        """One holder from a majority's copies: the lock lasts while a majority keeps it."""
        expiries = sorted((h.expires_at for h in copies if h.expires_at is not None), reverse=True)
        acquired = [h.acquired_at for h in copies if h.acquired_at is not None]
        fences = Counter(h.fence for h in copies)
        # The fence the acquire returned: the one a majority agreed on (fence_sync), or
        # else the largest.
        fence, votes = max(fences.items(), key=lambda item: (item[1], item[0]))
        # The copies share a token, but not always an owner: a hand-over to the same token
        # (Celery's run taking its publish-time lock) rewrites the owner, and a master
        # that missed it keeps the old one. Name the owner most copies have (on a tie,
        # the latest written: it expires last), not whichever master answered first.
        owners = Counter(h.owner for h in copies)
        owner = max(copies, key=lambda h: (owners[h.owner], h.expires_at or float("-inf"))).owner
        return Holder(
            name=copies[0].name,
            fence=fence if votes >= self.quorum else max(fences),
            owner=owner,
            acquired_at=min(acquired) if acquired else None,
            expires_at=expiries[self.quorum - 1] if len(expiries) >= self.quorum else None,
            renewals=max(h.renewals for h in copies),
            token=copies[0].token,
        )

    # -- sync I/O: a thread pool fans each call out -------------------------------------------

    def _call_master(self, master: _Master, call: _Call) -> Any:
        try:
            return getattr(master.backend, call.method)(*call.args)
        except Exception as exc:  # an answer like any other; counted, never raised here
            return exc

    def _submit(self, index: int, call: _Call) -> Future[Any]:
        """Run ``call`` on master ``index`` in the pool, after its chained predecessor."""
        executor = self._executor()
        keys = call.keys(index)
        if not keys:
            return executor.submit(self._call_master, self.masters[index], call)
        result: Future[Any] = Future()

        def run() -> None:
            result.set_result(self._call_master(self.masters[index], call))

        def start(_: object = None) -> None:
            try:
                executor.submit(run)
            except RuntimeError as exc:  # the backend was closed meanwhile
                result.set_result(exc)

        def forget(done: Future[Any]) -> None:
            with self._chain_lock:
                for key in keys:
                    if self._chains.get(key) is done:
                        del self._chains[key]

        with self._chain_lock:
            previous = {id(f): f for key in keys if (f := self._chains.get(key)) is not None}
            for key in keys:
                self._chains[key] = result
        result.add_done_callback(forget)
        waiting = len(previous)
        if not waiting:
            start()
            return result
        count = threading.Lock()

        def one_returned(_: object) -> None:
            nonlocal waiting
            with count:
                waiting -= 1
                last = waiting == 0
            if last:
                start()

        for future in previous.values():
            future.add_done_callback(one_returned)
        return result

    def _fan_out(self, call: _Call) -> list[Any]:
        """Call every master at once; return when the answers decide, or at the deadline.

        Each answer is recorded by the pool thread that got it, which also judges whether
        the outcome is decided, so the caller wakes up once.
        """
        deadline = time.monotonic() + self.node_timeout
        answers: list[Any] = [PENDING] * len(self.masters)
        guard = threading.Lock()
        decided = threading.Event()

        def record(index: int, future: Future[Any]) -> None:
            with guard:
                answers[index] = future.result()
                if self._all_answered(answers) or call.enough(answers):
                    decided.set()

        for index in range(len(self.masters)):
            self._submit(index, call).add_done_callback(partial(record, index))
        decided.wait(max(0.0, deadline - time.monotonic()))
        with guard:  # stragglers keep writing into ``answers``: take a snapshot
            snapshot = list(answers)
        return self._note_failures(snapshot, timed_out=not decided.is_set())

    def _drive(self, plan: _Plan[T]) -> T:
        """Step a fan-out plan with blocking I/O: :func:`task_locks._steps.run`, the
        package's one stepping loop (a fan-out records each master's error as an answer:
        nothing is thrown into the plan but an interrupt)."""
        return run(plan, self._fan_out)  # type: ignore[no-any-return]

    def _note_failures(self, answers: list[Any], timed_out: bool) -> list[Any]:
        """Mark the silent as timed out; waiters avoid failing masters for a while."""
        now = time.monotonic()
        if timed_out:
            answers = [TIMED_OUT if a is PENDING else a for a in answers]
        for master, answer in zip(self.masters, answers, strict=True):
            if answer is TIMED_OUT or isinstance(answer, BackendUnavailable):
                master.down_until = now + _DOWN_FOR
        return answers

    def acquire(self, name: str, token: str, ttl_ms: int, owner: Owner) -> AcquireResult:
        return self._drive(self._acquire_plan(name, token, ttl_ms, owner))

    def acquire_run(
        self, name: str, token: str, ttl_ms: int, owner: Owner, run: RunCheck
    ) -> AcquireResult:
        return self._drive(self._acquire_plan(name, token, ttl_ms, owner, run))

    def renew(self, name: str, token: str, ttl_ms: int) -> bool:
        return self.renew_many([RenewItem(name, token, ttl_ms)])[0]

    def renew_many(self, items: Sequence[RenewItem], timeout: float | None = None) -> list[bool]:
        # Every master is already asked with node_timeout (0.25 s by default), far below
        # any TTL's validity: ``timeout`` adds nothing.
        return self._drive(self._renew_plan(items)) if items else []

    def release(self, name: str, token: str) -> bool:
        return self._drive(self._release_plan(name, token))

    def force_release(self, name: str, fence: int | None = None) -> bool:
        return self._drive(self._force_release_plan(name, fence))

    def holders(self, prefix: str = "") -> list[Holder]:
        return self._drive(self._holders_plan(prefix, exact=False))

    def holder(self, name: str) -> Holder | None:
        return next(iter(self._drive(self._holders_plan(name, exact=True))), None)

    def _signal_masters(self, name: str) -> list[_Master]:
        """Masters to wait on, in a stable order per name: first those that refused our
        last try for its holder (a release signals only where it held the lock, and a
        waiter on another master would sleep until its retry), recently failed ones last."""
        count = len(self.masters)
        start = zlib.crc32(name.encode()) % count
        order = [(start + step) % count for step in range(count)]
        holding = self._holding.get(name, frozenset())
        now = time.monotonic()

        def rank(index: int) -> tuple[bool, bool]:
            master = self.masters[index]
            return master.down_until > now or not master.votes(now), index not in holding

        return [self.masters[index] for index in sorted(order, key=rank)]

    def _signal_waits(
        self, name: str, timeout: float
    ) -> Generator[tuple[_Master, float], None, None]:
        """Which master to block on, and for how long, until one wait works.

        Written once for :meth:`wait_release` and :meth:`await_release`, which step it with
        :func:`task_locks._steps.run` / ``arun``: a wait's error is thrown in at its
        ``yield`` (a wait that returns ends the plan).
        """
        deadline = time.monotonic() + timeout
        errors: list[str] = []
        for master in self._signal_masters(name):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                yield master, remaining
            except LockError as error:
                master.down_until = time.monotonic() + _DOWN_FOR
                errors.append(f"{master.address}: {error.__cause__ or error}")
                continue
            return
        raise BackendUnavailable(
            f"lock {name!r}: cannot wait for its release, no Redis master answered: "
            + "; ".join(errors),
            name=name,
            server=self.server,
        )

    def wait_release(self, name: str, timeout: float) -> None:
        if timeout <= self.retry_delay:
            time.sleep(max(0.0, timeout))  # a (random) back-off, not a wait for a holder
            return
        run(
            self._signal_waits(name, timeout),
            lambda wait: wait[0].backend.block_on_signal(name, wait[1]),
        )

    def close(self) -> None:
        """As :meth:`aclose`: the calls still in flight land first (up to ``node_timeout``)."""
        if self._pool is not None and self._pool_pid == os.getpid():
            with self._chain_lock:
                in_flight = list(self._chains.values())
            futures_wait(in_flight, timeout=self.node_timeout)
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None
        for master in self.masters:
            master.backend.close()

    async def aclose(self) -> None:
        """Close every master's client once this loop's stragglers have landed (waiting up to
        ``node_timeout``): a grant or a fence bump cut short leaves that master's copy out
        of step, and a same-token acquire (a retried one) could answer with its fence."""
        loop = asyncio.get_running_loop()
        stragglers = [task for task in self._background if task.get_loop() is loop]
        if stragglers:
            await asyncio.wait(stragglers, timeout=self.node_timeout)
        for master in self.masters:
            await master.backend.aclose()

    # -- async I/O: the same plans, fanned out as tasks on the running loop --------------------

    async def _acall_master(self, master: _Master, call: _Call) -> Any:
        method: Callable[..., Awaitable[Any]] = getattr(master.backend, "a" + call.method)
        try:
            return await method(*call.args)
        except Exception as exc:
            return exc

    def _astart(self, index: int, call: _Call) -> asyncio.Future[Any]:
        """The async twin of :meth:`_submit`: chained calls wait for their predecessor."""
        keys = call.keys(id(asyncio.get_running_loop()), index)
        if not keys:
            return asyncio.ensure_future(self._acall_master(self.masters[index], call))
        previous = {id(f): f for key in keys if (f := self._achains.get(key)) is not None}

        async def run() -> Any:
            if previous:
                await asyncio.wait(previous.values())
            return await self._acall_master(self.masters[index], call)

        task = asyncio.ensure_future(run())
        for key in keys:
            self._achains[key] = task

        def forget(done: asyncio.Future[Any]) -> None:
            for key in keys:
                if self._achains.get(key) is done:
                    del self._achains[key]

        task.add_done_callback(forget)
        return task

    async def _afan_out(self, call: _Call) -> list[Any]:
        deadline = time.monotonic() + self.node_timeout
        tasks: dict[asyncio.Future[Any], int] = {
            self._astart(index, call): index for index in range(len(self.masters))
        }
        answers: list[Any] = [PENDING] * len(self.masters)
        pending: set[asyncio.Future[Any]] = set(tasks)
        while pending:
            done, pending = await asyncio.wait(
                pending, timeout=max(0.0, deadline - time.monotonic()), return_when=FIRST_COMPLETED
            )
            for task in done:
                answers[tasks[task]] = task.result()
            if not done or call.enough(answers):
                break
        for task in pending:  # stragglers finish on their own (bounded by the socket timeout)
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return self._note_failures(answers, timed_out=time.monotonic() >= deadline)

    async def _adrive(self, plan: _Plan[T]) -> T:
        """:meth:`_drive` with awaited I/O (:func:`task_locks._steps.arun`)."""
        return await arun(plan, self._afan_out)  # type: ignore[no-any-return]

    async def aacquire(self, name: str, token: str, ttl_ms: int, owner: Owner) -> AcquireResult:
        return await self._adrive(self._acquire_plan(name, token, ttl_ms, owner))

    async def aacquire_run(
        self, name: str, token: str, ttl_ms: int, owner: Owner, run: RunCheck
    ) -> AcquireResult:
        return await self._adrive(self._acquire_plan(name, token, ttl_ms, owner, run))

    async def arenew(self, name: str, token: str, ttl_ms: int) -> bool:
        return (await self.arenew_many([RenewItem(name, token, ttl_ms)]))[0]

    async def arenew_many(
        self, items: Sequence[RenewItem], timeout: float | None = None
    ) -> list[bool]:
        return await self._adrive(self._renew_plan(items)) if items else []

    async def arelease(self, name: str, token: str) -> bool:
        return await self._adrive(self._release_plan(name, token))

    async def aforce_release(self, name: str, fence: int | None = None) -> bool:
        return await self._adrive(self._force_release_plan(name, fence))

    async def aholders(self, prefix: str = "") -> list[Holder]:
        return await self._adrive(self._holders_plan(prefix, exact=False))

    async def aholder(self, name: str) -> Holder | None:
        return next(iter(await self._adrive(self._holders_plan(name, exact=True))), None)

    async def await_release(self, name: str, timeout: float) -> None:
        if timeout <= self.retry_delay:
            await asyncio.sleep(max(0.0, timeout))
            return
        await arun(
            self._signal_waits(name, timeout),
            lambda wait: wait[0].backend.ablock_on_signal(name, wait[1]),
        )


__all__ = ["BUMP_FENCE", "RedlockBackend"]
