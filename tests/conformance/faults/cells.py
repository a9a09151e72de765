"""One cell of the fault matrix: set up, arm the fault, make the call, heal, check.

The invariants after every cell, read on the server by a second client that does not
cross the proxy (``Target.checker``):

1. **never two holders**: while the faulty client believes it holds the lock (a lease
   whose ``held`` is true), the second client's ``try_acquire`` fails;
2. **a lease reported held is held on the server**, with its token and fence;
3. **a call reports what the server did**: ``renew``/``release``/``force_release``
   answer True/False as the server state shows, or raise ``BackendUnavailable`` (a
   ``LockError``) when they cannot know; ``holders`` lists what the server has;
   nothing but a ``LockError`` leaves the library;
4. **fences never go backwards**: the next holder's fence is above every fence seen;
5. **nothing is left without an expiry** (Redis: PTTL of every key > 0);
6. **a lease counts as lost at its local deadline** even while its call is still in
   flight (``lease.lost`` is set by then), and no call blocks past a
   bound when its reply is lost.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from task_locks import AsyncLock, Lock, LockError, NotOwned
from task_locks.backends import Backend, get_backend
from task_locks.backends.redis_scripts import record_fields

from .targets import DELAY, SLOW_TIMEOUT, TTL, Target, wait_until

OPERATIONS = ("acquire", "renew", "release", "force_release", "holders")
FAULTS = ("drop_request", "drop_reply", "reset_mid_call", "delay", "retry")
#: What each fault does, for the table.
FAULT_TEXT = {
    "drop_request": "request dropped before the server",
    "drop_reply": "reply dropped after the server applied it",
    "reset_mid_call": "connection reset mid-call (every attempt)",
    "delay": f"reply delayed past the TTL ({DELAY:g} s per reply, TTL {TTL:g} s)",
    "retry": "reset once: the client library's own retry goes through",
}
#: Proxy mode per fault (``retry`` = one reset, then the library's retry passes).
PROXY_MODE = {
    "drop_request": "drop_request",
    "drop_reply": "drop_reply",
    "reset_mid_call": "reset_mid_call",
    "delay": "delay",
    "retry": "reset_once",
}
#: A lease is taken as lost this long after its local deadline, at the latest.
LOST_GRACE = 0.1


@dataclass
class Call:
    """What the call under test did."""

    value: Any = None
    error: BaseException | None = None
    finished: bool = False
    seconds: float = 0.0
    #: ``lease.lost`` at the lease's local deadline (+ grace) while the call was in
    #: flight; ``None`` if the call ended before that deadline (or there is no lease).
    lost_in_flight: bool | None = None


def _bound(target: Target, fault: str) -> float:
    """How long the call may take before it counts as blocked."""
    if fault == "delay":
        return 8 * DELAY + SLOW_TIMEOUT  # a few round trips, each delayed
    # A lost packet costs a socket timeout per attempt; Redis Cluster tries 3 times and
    # refreshes its slot map in between (about 4 s here). PostgreSQL has no read timeout.
    return 3 * TTL if target.unbounded_reads else 10.0


def run_call(
    target: Target, name: str, fault: str, call: Callable[[], Any], lease: Any = None
) -> Call:
    """Arm ``fault``, run ``call`` in a thread, watch the lease's deadline, heal."""
    outcome = Call()
    done = threading.Event()

    def body() -> None:
        try:
            outcome.value = call()
        except BaseException as exc:
            outcome.error = exc
        finally:
            done.set()

    deadline = None if lease is None else time.monotonic() + lease.remaining + LOST_GRACE
    target.arm(PROXY_MODE[fault], name)
    started = time.monotonic()
    worker = threading.Thread(target=body, name="fault-cell-call", daemon=True)
    worker.start()
    try:
        if deadline is not None and not done.wait(max(0.0, deadline - time.monotonic())):
            outcome.lost_in_flight = bool(lease.lost.is_set())
        outcome.finished = done.wait(max(0.0, started + _bound(target, fault) - time.monotonic()))
        outcome.seconds = time.monotonic() - started
    finally:
        # A call that is still blocked (no read timeout) is freed by resetting its link.
        target.heal(reset=not done.is_set())
    if not done.wait(10):
        raise AssertionError("the call did not end within 10 s of its link being reset")
    return outcome


class SyncApi:
    """The calls under test, through the public sync API (``Lock``, ``Lease``)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def acquire(self, name: str) -> Any:
        return Lock(name, ttl=TTL, backend=self.backend, renew=False).acquire(timeout=0)

    def renew(self, lease: Any) -> None:
        lease.renew()

    def release(self, lease: Any) -> None:
        lease.release()

    def force_release(self, name: str, fence: int) -> bool:
        return self.backend.force_release(name, fence=fence)  # type: ignore[call-arg]

    def holders(self, name: str) -> list[Any]:
        return self.backend.holders(name)

    def close(self) -> None:
        pass


class AsyncApi(SyncApi):
    """The same calls through ``AsyncLock``/``AsyncLease`` and the backend's ``a*``
    methods, on an event loop of this cell (redis.asyncio: a client of its own)."""

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fault-cell-loop")
        self.thread.start()

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def acquire(self, name: str) -> Any:
        lock = AsyncLock(name, ttl=TTL, backend=self.backend, renew=False)
        return self._run(lock.acquire(timeout=0))

    def renew(self, lease: Any) -> None:
        self._run(lease.renew())

    def release(self, lease: Any) -> None:
        self._run(lease.release())

    def force_release(self, name: str, fence: int) -> bool:
        return bool(self._run(self.backend.aforce_release(name, fence=fence)))  # type: ignore[call-arg]

    def holders(self, name: str) -> list[Any]:
        return list(self._run(self.backend.aholders(name)))

    def close(self) -> None:
        async def close() -> None:
            await self.backend.aclose()
            # redis.asyncio's cluster client disconnects the nodes a slot-map refresh
            # dropped in tasks of their own: let them finish before the loop stops.
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 10)

        try:
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(15)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@dataclass
class Cell:
    target: Target
    operation: str
    fault: str
    name: str = field(default_factory=lambda: f"cell-{uuid.uuid4().hex[:10]}")
    problems: list[str] = field(default_factory=list)
    fences: list[int] = field(default_factory=list)

    def fail(self, text: str) -> None:
        self.problems.append(text)

    # -- the run --------------------------------------------------------------------

    def run(self) -> list[str]:
        target, name = self.target, self.name
        checker = target.checker(name)
        faulty = get_backend(target.slow_url if self.fault == "delay" else target.url)
        api: SyncApi = AsyncApi(faulty) if target.api == "asyncio" else SyncApi(faulty)
        lease = holder_lease = None
        try:
            # Connect before the fault: the cell is about the call, not the client's
            # handshake (redis-py's HELLO/CLIENT SETINFO would each pay the delay);
            # holders() reaches every server (all cluster primaries, all Redlock masters).
            api.holders(name)
            if self.operation == "acquire":
                if target.replica_link is not None:
                    target.replica_link.blackhole()  # no replica can acknowledge
                try:
                    outcome = run_call(target, name, self.fault, lambda: api.acquire(name))
                    lease = outcome.value
                    self._check_replica(lease)
                finally:
                    if target.replica_link is not None:
                        # Abort the stalled replication link, or the replica waits out its
                        # repl-timeout (60 s) and the next cell's acquire finds no replica.
                        target.replica_link.reset()
                        target.replica_link.heal()
                        assert target.replica_acks is not None
                        wait_until(target.replica_acks, 20, "the replica to acknowledge again")
            elif self.operation in ("renew", "release"):
                lease = api.acquire(name)
                self.fences.append(lease.fence)
                method = api.renew if self.operation == "renew" else api.release
                outcome = run_call(target, name, self.fault, lambda: method(lease), lease)
            else:
                ttl = 5 * TTL  # force release: a holder that outlives the call
                if self.operation == "holders":
                    # alive when the delayed request is served, gone before its reply lands
                    ttl = DELAY + 0.5 if self.fault == "delay" else TTL
                holder_lease = Lock(name, ttl=ttl, backend=checker, renew=False).acquire(0)
                self.fences.append(holder_lease.fence)
                if self.operation == "force_release":
                    fence = holder_lease.fence
                    outcome = run_call(
                        target, name, self.fault, lambda: api.force_release(name, fence)
                    )
                else:
                    outcome = run_call(target, name, self.fault, lambda: api.holders(name))
            self._check(outcome, checker, lease, holder_lease)
        finally:
            self._cleanup(checker, lease, holder_lease)
            api.close()
        return self.problems

    # -- the invariants -----------------------------------------------------------------

    def _check_replica(self, lease: Any) -> None:
        """With ``?wait_replicas=1`` and the replica cut off, a granted lease is a lie."""
        replica = self.target.replica
        if replica is None or lease is None or not lease.held:
            return
        record = record_fields(replica.get(f"{self.target.prefix}{{{self.name}}}"))
        if record is None or record["token"] != lease.token:
            self.fail(
                f"acquire under {self.fault}: granted with wait_replicas=1 while the "
                "replica was cut off and never got the lock (the WAIT did not cover the "
                "acquire's write)"
            )

    def _check(self, outcome: Call, checker: Backend, lease: Any, holder_lease: Any) -> None:
        error = outcome.error
        what = f"{self.operation} under {self.fault}"
        if not outcome.finished:
            self.fail(
                f"{what}: the call was still blocked after {outcome.seconds:.1f} s "
                "(a lost reply is waited for without a read timeout)"
            )
        if error is not None and not isinstance(error, LockError):
            self.fail(f"{what}: raised {type(error).__name__} (not a LockError): {error}")
        if outcome.lost_in_flight is False:
            self.fail(
                f"{what}: the call was still in flight at the lease's local deadline and "
                "lease.lost was not set by the deadline"
            )
        if lease is not None and getattr(lease, "fence", None) is not None:
            self.fences.append(lease.fence)

        # 1 and 2: what the faulty client believes, against the server.
        # A force-released holder cannot know until its next renewal: that is the operator
        # override's documented cost (fence the resource), so it is no believer here.
        believer = (
            lease
            if self.operation in ("acquire", "renew", "release")
            else holder_lease
            if self.operation == "holders"
            else None
        )
        if believer is not None and believer.held:
            until = time.monotonic() + believer.remaining
            state = checker.holder(self.name)
            if time.monotonic() < until and (state is None or state.token != believer.token):
                seen = "nothing" if state is None else f"fence {state.fence} (another token)"
                self.fail(
                    f"{what}: the lease (fence {believer.fence}) reports held "
                    f"({'call returned' if error is None else type(error).__name__}), "
                    f"but the server has {seen}"
                )
            asked = time.monotonic()
            rival = Lock(self.name, ttl=TTL, backend=checker, renew=False).try_acquire()
            if rival is not None:
                self.fences.append(rival.fence)
                if asked < until:
                    self.fail(
                        f"{what}: TWO HOLDERS: a second client acquired (fence {rival.fence}) "
                        f"while the lease (fence {believer.fence}) still reports held"
                    )
                rival.release()

        # 3: the report against the server.
        state = checker.holder(self.name)
        if self.operation == "renew" and lease is not None:
            if isinstance(error, NotOwned) and state is not None and state.token == lease.token:
                self.fail(f"{what}: renew reported NotOwned but the server still has our lock")
        if self.operation == "release" and lease is not None:
            if error is None and state is not None and state.token == lease.token:
                self.fail(f"{what}: release reported success but the server still has our lock")
            if isinstance(error, NotOwned):
                self.fail(
                    f'{what}: release raised NotOwned ("nothing was released") though the '
                    "lock was ours when it was sent and the server freed it: the first "
                    "attempt's reply was lost and the retry found the lock gone"
                )
        if self.operation == "force_release" and holder_lease is not None:
            still = state is not None and state.fence == holder_lease.fence
            if error is None and outcome.value is True and still:
                self.fail(f"{what}: force_release returned True but the holder still holds")
            if error is None and outcome.value is False and not still:
                self.fail(
                    f"{what}: force_release returned False (nothing released) but the "
                    "server freed the holder: the first attempt's reply was lost and the "
                    "retry found the lock gone"
                )
        if self.operation == "holders" and error is None and holder_lease is not None:
            listed = [h for h in outcome.value if h.name == self.name]
            if state is not None and not listed:
                self.fail(f"{what}: holders() listed nothing while the server has the lock")
            for holder in listed:
                self.fences.append(holder.fence)
                if holder.token and holder.token != holder_lease.token:
                    self.fail(f"{what}: holders() listed a token the server never had")
                alive_for = (holder.expires_at or 0) - time.time()
                if state is None and alive_for > LOST_GRACE:
                    self.fail(
                        f"{what}: holders() lists the lock as live for another "
                        f"{alive_for:.2f} s, but the server had already dropped it "
                        "(its expiry was counted from the late reply, not the request)"
                    )

        # 5: nothing without an expiry.
        forever = self.target.no_expiry()
        if forever:
            self.fail(f"{what}: keys without an expiry: {forever}")
        for holder in checker.holders(self.name):
            if holder.expires_at is None:
                self.fail(f"{what}: {holder.name!r} is held with no expiry on the server")

        # 4: fences never go backwards: free the name, take it again.
        checker.force_release(self.name)
        nxt = Lock(self.name, ttl=TTL, backend=checker, renew=False).acquire(timeout=TTL * 3)
        if self.fences and nxt.fence <= max(self.fences):
            self.fail(f"{what}: fence went backwards: {nxt.fence} after {max(self.fences)}")
        nxt.release()

    def _cleanup(self, checker: Backend, lease: Any, holder_lease: Any) -> None:
        """Free the name through the checker (the leases are ``renew=False``: nothing to stop)."""
        try:
            checker.force_release(self.name)
        except LockError:
            pass


__all__ = ["FAULTS", "FAULT_TEXT", "OPERATIONS", "Cell", "run_call"]
