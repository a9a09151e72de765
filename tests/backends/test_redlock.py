"""Redlock over three independent masters when some of them fail."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from chaoskit.proxy import Proxy, ProxyHub, _Link
from servers import RedisMasters, wait_until

from task_locks import AsyncLock, BackendUnavailable, Lock, LockHeld, NotOwned, get_backend
from task_locks.backends.redis_scripts import counter_key, record_fields
from task_locks.backends.redlock import RedlockBackend
from task_locks.errors import RenewalUndecided
from task_locks.types import Owner, RenewItem

MastersFactory = Callable[..., RedisMasters]


def test_one_master_down_still_locks(masters_factory: MastersFactory) -> None:
    masters = masters_factory(3)
    url = masters.url()
    masters[1].kill()

    lease = Lock("one-down", ttl=5, backend=url).acquire(timeout=2)
    assert Lock("one-down", ttl=5, backend=url).try_acquire() is None
    holder = get_backend(url).holder("one-down")
    assert holder is not None and holder.fence == lease.fence
    lease.renew()
    lease.release()
    successor = Lock("one-down", ttl=5, backend=url).acquire(timeout=2)
    assert successor.fence > lease.fence
    successor.release()


def test_two_masters_down_fail_with_a_clear_error(masters_factory: MastersFactory) -> None:
    masters = masters_factory(3)
    url = masters.url()
    masters[0].kill()
    masters[2].kill()

    started = time.monotonic()
    with pytest.raises(BackendUnavailable) as down:
        Lock("two-down", ttl=5, backend=url).acquire(timeout=2)
    assert time.monotonic() - started < 1.0, "an outage must fail fast, not wait out the timeout"
    message = str(down.value)
    assert down.value.name == "two-down"
    assert "majority" in message and "2 of 3" in message
    for dead in (masters[0], masters[2]):
        assert f"127.0.0.1:{dead.port}" in message
    assert f"127.0.0.1:{masters[1].port}:" not in message  # the live one is not blamed


def test_paused_master_does_not_stretch_acquire(masters_factory: MastersFactory) -> None:
    masters = masters_factory(3)
    node_timeout = 0.2
    url = masters.url(node_timeout=node_timeout)
    holder = Lock("paused", ttl=10, backend=url).acquire(timeout=0)
    masters[0].pause()
    try:
        started = time.monotonic()
        free = Lock("free", ttl=5, backend=url).acquire(timeout=1)
        assert time.monotonic() - started < node_timeout + 0.3  # the majority answered
        free.release()

        timeout = 1.0
        started = time.monotonic()
        with pytest.raises(LockHeld):
            Lock("paused", ttl=5, backend=url).acquire(timeout=timeout)
        took = time.monotonic() - started
        assert timeout <= took <= timeout + 2 * node_timeout + 0.3, f"acquire took {took:.3f}s"

        holder.renew()
        holder.release()
        started = time.monotonic()
        Lock("paused", ttl=5, backend=url).acquire(timeout=timeout).release()
        assert time.monotonic() - started < timeout
    finally:
        masters[0].resume()


def test_restarted_master_gets_no_vote_until_the_longest_ttl(
    masters_factory: MastersFactory,
) -> None:
    """The classic Redlock failure: a master restarts empty and hands out a held lock."""
    masters = masters_factory(3)
    url = masters.url()
    ttl = 2.0
    Lock("warm-up", ttl=0.5, backend=url).acquire(timeout=0).release()  # sees every run_id
    masters[2].kill()
    holder = Lock("amnesia", ttl=ttl, backend=url).acquire(timeout=0)  # on masters 0 and 1
    masters[2].start()  # back, empty
    masters[0].restart()  # forgets the holder's lock: without the rule 0 + 2 are a majority

    rival = Lock("amnesia", ttl=ttl, backend=url)
    granted = None
    while granted is None:
        try:
            granted = rival.acquire(timeout=0)
        except BackendUnavailable as exc:  # only master 1 may vote for now
            assert "restarted, no vote" in str(exc)
        except LockHeld:
            pass
        assert not (granted is not None and holder.held), "two holders at once"
        time.sleep(0.05)  # sampling: the vote comes back on a timer
    assert holder.lost.is_set() or not holder.held
    assert granted.fence > holder.fence
    granted.release()


@pytest.mark.parametrize("fence_sync", [1, 0])
def test_fences_grow_when_masters_disagree(
    masters_factory: MastersFactory, fence_sync: int
) -> None:
    """One master hands out far larger fences, as one whose clock ran an hour ahead would.

    (Its fence counter is set an hour ahead: the acquire script takes max(counter + 1,
    server time), so this is the same disagreement; libfaketime cannot run redis-server.)
    """
    masters = masters_factory(3)
    url = masters.url(fence_sync=fence_sync)
    ahead = int((time.time() + 3600) * 1e6)
    redis.Redis(port=masters[2].port).set(counter_key("task_locks:"), ahead)
    masters[1].kill()  # so the first majority must include the master that is ahead
    first = Lock("skew", ttl=5, backend=url).acquire(timeout=0)
    assert first.fence > ahead
    first.release()
    masters[1].start()
    masters[2].kill()  # the next majority has only masters that were behind
    second = Lock("skew", ttl=5, backend=url).acquire(timeout=0)
    if fence_sync:
        assert second.fence > first.fence
    else:  # the documented limit: without fence_sync, fences follow each master's clock
        assert second.fence < first.fence
    second.release()


def test_local_lease_ends_by_the_redlock_validity(masters_factory: MastersFactory) -> None:
    """A lease counts ``ttl - drift`` from its request, as Redlock's validity does.

    The masters' TTLs run the full ``ttl``; the holder must stop believing in its lease
    ``drift`` earlier, after the acquire and after each renewal.
    """
    masters = masters_factory(3)
    ttl, drift_factor = 5.0, 0.1
    drift = ttl * drift_factor + 0.002
    lease = Lock("validity", ttl=ttl, backend=masters.url(drift_factor=drift_factor)).acquire(
        timeout=0
    )
    assert ttl - drift - 0.5 < lease.remaining <= ttl - drift
    lease.renew()
    assert ttl - drift - 0.5 < lease.remaining <= ttl - drift
    assert lease.expires_at <= time.time() + ttl - drift
    lease.release()


def test_async_lock_with_one_master_down(masters_factory: MastersFactory) -> None:
    masters = masters_factory(3)
    url = masters.url()
    masters[2].kill()

    async def scenario() -> None:
        backend = get_backend(url)
        lease = await AsyncLock("async-one-down", ttl=5, backend=url).acquire(timeout=2)
        assert await AsyncLock("async-one-down", ttl=5, backend=url).try_acquire() is None
        await lease.renew()
        await lease.release()
        await backend.aclose()

    asyncio.run(scenario())


def test_url_options_and_capabilities(masters_factory: MastersFactory) -> None:
    masters = masters_factory(3)
    backend = get_backend(masters.url(node_timeout=0.1, retry_delay=0.05, prefix="x:"))
    assert isinstance(backend, RedlockBackend)
    assert backend.quorum == 2 and backend.node_timeout == 0.1 and backend.prefix == "x:"
    assert "consensus" not in backend.capabilities
    assert {"fencing", "multiprocess", "wakeup", "holders"} <= backend.capabilities
    assert all(m.run_id is None for m in backend.masters)  # made without contacting them


@pytest.mark.parametrize("fence_sync", [1, 0])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_force_release_by_fence_frees_the_holder_on_every_master(
    masters_factory: MastersFactory, fence_sync: int, mode: str
) -> None:
    """Without ``fence_sync`` each master keeps its own fence for the same holder, so a
    per-master "delete if the fence matches" would free it on one master only and leave
    a majority holding it. The fence is matched once, against the holder a majority
    reports; that holder's token is then deleted everywhere."""
    from task_locks.types import Owner

    masters = masters_factory(3)
    url = masters.url(fence_sync=fence_sync)
    backend = get_backend(url)
    # Each master far apart: the fences they hand out for one acquire all differ.
    for offset, server in enumerate(masters):
        ahead = int((time.time() + 3600 * offset) * 1e6)
        redis.Redis(port=server.port).set(counter_key("task_locks:"), ahead)

    def force(fence: int) -> bool:
        if mode == "sync":
            return backend.force_release("audit", fence)

        async def run() -> bool:
            try:
                return await backend.aforce_release("audit", fence)
            finally:
                await backend.aclose()

        return asyncio.run(run())

    assert backend.acquire("audit", "token-a", 30_000, Owner()).acquired

    def stored() -> set[str | None]:
        records = (
            record_fields(redis.Redis(port=s.port).get("task_locks:{audit}")) for s in masters
        )
        return {None if r is None else r["fence"] for r in records}

    # The acquire returns once a majority took the synced fence; the last master's copy
    # of it may still be on its way.
    wait_until(lambda: len(stored()) == (1 if fence_sync else 3), 5, "the masters' fences")
    seen = backend.holder("audit")
    assert seen is not None
    assert backend.release("audit", "token-a")
    assert backend.acquire("audit", "token-b", 30_000, Owner()).acquired
    assert force(seen.fence) is False  # changed hands: the new holder stays, everywhere
    now = backend.holder("audit")
    assert now is not None and now.token == "token-b"
    assert force(now.fence) is True
    for server in masters:
        assert record_fields(redis.Redis(port=server.port).get("task_locks:{audit}")) is None


def test_force_release_of_a_minority_remnant_reports_nothing_held(
    masters_factory: MastersFactory,
) -> None:
    """A force release whose call one master missed (a timeout) leaves a copy there. That
    copy held nothing (no majority): a later force release cleans it up and says so,
    instead of reporting that it freed a holder (seen as a conformance flake)."""
    masters = masters_factory(3)
    url = masters.url()
    backend = get_backend(url)
    single = get_backend(masters.servers[2].url())  # the remnant: one master's copy only
    from task_locks.types import Owner

    assert single.acquire("remnant", "token-old", 30_000, Owner()).acquired
    assert backend.holder("remnant") is None
    assert backend.force_release("remnant") is False
    assert (
        record_fields(redis.Redis(port=masters.servers[2].port).get("task_locks:{remnant}")) is None
    )
    lease = Lock("remnant", ttl=30, backend=url).acquire(timeout=0)
    assert backend.force_release("remnant") is True  # a majority held it
    with pytest.raises(NotOwned):
        lease.renew()


def test_holder_is_the_majoritys_copy_when_the_first_master_differs(
    masters_factory: MastersFactory,
) -> None:
    """The first master to answer may keep a stale copy: the holder named is the one a
    majority of masters keeps (its token, and its owner), never that master's."""
    from task_locks.types import Owner

    masters = masters_factory(3)
    backend = get_backend(masters.url())
    single = [get_backend(server.url()) for server in masters.servers]
    # A hand-over to the same token (Celery's run taking its publish-time lock) rewrote
    # the owner on masters 1 and 2; master 0 missed it and keeps the publisher's.
    assert backend.acquire("handed", "token-x", 30_000, Owner(task_id="publish")).acquired
    # The acquire returns at a majority: the third master's grant may still be on its way,
    # and would land on top of the rewrite below.
    wait_until(
        lambda: all(s.holder("handed") is not None for s in single), 5, "every master's copy"
    )
    for other in single[1:]:
        assert other.acquire("handed", "token-x", 30_000, Owner(task_id="run")).acquired
    seen = backend.holder("handed")
    assert seen is not None and seen.token == "token-x"
    assert seen.owner.task_id == "run"
    assert [h.owner.task_id for h in backend.holders("hand")] == ["run"]
    # Master 0 holds another token's leftover copy; masters 1 and 2 agree on token-y.
    assert single[0].acquire("split", "token-old", 30_000, Owner(task_id="old")).acquired
    for other in single[1:]:
        assert other.acquire("split", "token-y", 30_000, Owner(task_id="new")).acquired
    seen = backend.holder("split")
    assert seen is not None and seen.token == "token-y" and seen.owner.task_id == "new"


def _delete_lock_record(server: object, name: str) -> None:
    """Delete ``name``'s lock record on one master only (that master now says "not yours")."""
    client = redis.Redis(port=server.port)  # type: ignore[attr-defined]
    assert client.delete(f"task_locks:{{{name}}}"), f"no lock {name!r} on {server.port}"  # type: ignore[attr-defined]
    client.close()


def test_renewal_is_decided_per_lease(masters_factory: MastersFactory) -> None:
    """A lease without a majority either way must not sink its batch.

    ``b`` is held on the two masters that answer; ``a`` was deleted on one of them and the
    third master is paused, so ``a`` has one yes, one no and one silence: undecided. ``b``
    must stay renewed; ``a`` is retried and lost only when its own deadline passes.
    """
    masters = masters_factory(3)
    ttl = 1.5
    # Room for a loaded machine's masters to answer, short enough for the batch to run
    # several times within a TTL.
    url = masters.url(node_timeout=0.5)
    backend = get_backend(url)
    a = Lock("per-lease-a", ttl=ttl, backend=backend).acquire(timeout=0)
    b = Lock("per-lease-b", ttl=ttl, backend=backend).acquire(timeout=0)
    # An acquire returns once a majority granted it; the third master's grant may still be
    # on its way (two CI runs saw b's land on master 1 after the renewal, undecided too).
    for server in masters.servers:
        with redis.Redis(port=server.port) as direct:
            wait_until(
                lambda: direct.exists("task_locks:{per-lease-a}", "task_locks:{per-lease-b}") == 2,
                5,
                f"both leases on {server.port}",
            )
    _delete_lock_record(masters[1], "per-lease-a")
    masters[2].pause()
    try:
        items = [RenewItem("per-lease-a", a.token, 1500), RenewItem("per-lease-b", b.token, 1500)]
        with pytest.raises(RenewalUndecided) as undecided:
            backend.renew_many(items)
        assert undecided.value.outcomes == [None, True]
        assert undecided.value.name == "per-lease-a"

        async def arenew() -> None:
            with pytest.raises(RenewalUndecided) as undecided:
                await backend.arenew_many(items)
            assert undecided.value.outcomes == [None, True]

        asyncio.run(arenew())

        # Through the watchdog: the two leases ride in one batch (same TTL, same backend).
        assert a.lost.wait(ttl + 1.0), "the undecided lease must be lost by its deadline"
        assert "unreachable" in (a.lost_reason or "")
        assert not b.lost.wait(2 * ttl), f"b was renewed by 2 of 3 masters: {b.lost_reason}"
        assert b.remaining > 0
    finally:
        masters[2].resume()
    b.release()


def test_a_waiter_wakes_on_a_master_that_holds_the_lock(masters_factory: MastersFactory) -> None:
    """A release signals only the masters where it held the lock, so a waiter blocks on
    one that refused it for the holder. It used to block on the master its name hashes
    to; when the holder missed that master, the waiter slept through the release until
    its timeout (found by the simulator: a lock free for 770 ms while three waited)."""
    import threading
    import zlib

    masters = masters_factory(3)
    url = masters.url()
    # A name whose first master by hash is master 0, and a holder that missed master 0.
    name = next(f"wake-{i}" for i in range(100) if zlib.crc32(f"wake-{i}".encode()) % 3 == 0)
    pair = f"redlock://127.0.0.1:{masters[1].port},127.0.0.1:{masters[2].port}"
    holder = Lock(name, ttl=30, backend=pair).acquire(timeout=0)

    got: list[object] = []
    waiter = threading.Thread(
        target=lambda: got.append(Lock(name, ttl=5, backend=url).acquire(timeout=8))
    )
    waiter.start()
    try:

        def blocked() -> bool:  # the waiter is in its BLPOP on some master
            return any(
                c.get("cmd") == "blpop" for m in masters.servers
                for c in redis.Redis(port=m.port).client_list()
            )  # fmt: skip

        wait_until(blocked, 5, "the waiter to block on a release signal")
        released = time.monotonic()
        holder.release()
        waiter.join(timeout=10)
        assert got, "the waiter gave up"
        woke = time.monotonic() - released
        assert woke < 2.0, f"the waiter took {woke:.1f} s after the release"
    finally:
        waiter.join(timeout=10)
        for lease in got:
            lease.release()  # type: ignore[attr-defined]


class _HoldFirst(Proxy):
    """A proxy that holds the first request carrying ``marker`` for 1.5 s (it lands after
    the client gave up on it and went on)."""

    def __init__(self, hub: ProxyHub, port: int, marker: bytes) -> None:
        super().__init__(hub, port)
        self.marker = marker
        self.held = False
        self.last = b""

    async def _pump(self, reader: Any, writer: Any, link: _Link, upstream: bool) -> None:
        if upstream:  # (read, then _drops, with no await between)
            inner, proxy = reader, self

            class Peek:
                async def read(self, n: int) -> bytes:
                    proxy.last = await inner.read(n)
                    return proxy.last

            reader = Peek()
        await super()._pump(reader, writer, link, upstream)

    def _drops(self, link: _Link, upstream: bool) -> bool:
        if upstream and not self.held and self.marker in self.last:
            self.held = True
            self._hold[True] = 1.5
        return super()._drops(link, upstream)


def _hold_first(hub: ProxyHub, port: int, sha: str) -> _HoldFirst:
    proxy = _HoldFirst(hub, port, sha.encode())
    hub.call(proxy._start())
    hub.proxies.append(proxy)
    return proxy


def test_a_late_undo_cannot_take_our_next_grant(masters_factory: MastersFactory) -> None:
    """A failed try's undo (a release of our token) that a master does not answer in time
    may still land there after our next try's grant of that token, and delete it. Before,
    that master's grant counted, and the lease stood on one master's copy once the late
    undo landed (found by the simulator: a lease counting 760 ms past its majority)."""
    from task_locks.backends.redis_scripts import SCRIPTS
    from task_locks.types import Owner

    masters = masters_factory(3)
    hub = ProxyHub()
    proxy = _hold_first(hub, masters[1].port, SCRIPTS.sha["release"])
    try:
        name = "late-undo"
        for server in masters.servers:  # (a late EVALSHA must not meet NOSCRIPT)
            with redis.Redis(port=server.port) as direct:
                direct.script_load(SCRIPTS.source["release"])
        # The holder misses master 1: our first try gets only master 1's grant, and fails.
        pair = f"redlock://127.0.0.1:{masters[0].port},127.0.0.1:{masters[2].port}"
        holder = Lock(name, ttl=30, backend=pair).acquire(timeout=0)
        slow = [hub.proxy(masters[0].port), hub.proxy(masters[2].port)]
        ours = RedlockBackend(
            f"redlock://127.0.0.1:{slow[0].port},127.0.0.1:{proxy.port},"
            f"127.0.0.1:{slow[1].port}?node_timeout=0.3"
        )
        for other in slow:  # master 1's grant is answered first, so its undo is awaited
            other.latency(0.05)
        first = ours.acquire(name, "ours", 30_000, Owner())
        for other in slow:
            other.heal()
        assert not first.acquired
        wait_until(lambda: proxy.held, 5, "our undo on master 1 to be on its way")
        holder.release()
        on_master_1 = redis.Redis(port=masters[1].port)
        masters[2].pause()  # our next try: master 0 and master 1 only
        try:
            try:
                second = ours.acquire(name, "ours", 30_000, Owner()).acquired
            except BackendUnavailable:
                second = False

            def undone() -> bool:  # the late undo landed on master 1
                return record_fields(on_master_1.get(f"task_locks:{{{name}}}")) is None

            wait_until(undone, 5, "the late undo to land")
            if second:  # a lease from this try must still stand on a majority
                assert ours.holder(name) is not None, "our lock stands on one master's copy"
        finally:
            masters[2].resume()
            on_master_1.close()
            ours.close()
    finally:
        hub.close()


def test_a_runs_take_over_keeps_the_fence_its_publish_time_lock_was_given(
    masters_factory: MastersFactory,
) -> None:
    """The fence of a publish-time lock is the largest of the first majority's, written
    back to every master (``fence_sync``); a master that granted later keeps its own until
    that write lands. A Celery run taking the lock over must not read that master's own
    fence first: before, the take-over reached it on another connection, ahead of the
    write, and the run's lease had a fence the queued lock never had (seen in CI, about
    one take-over in 400 on loopback). Here the write to master 2 is held in flight."""
    from task_locks.backends.redis_scripts import SCRIPTS
    from task_locks.types import Owner, RunCheck

    masters = masters_factory(3)
    hub = ProxyHub()
    late = _hold_first(hub, masters[2].port, SCRIPTS.sha["bump_fence"])
    try:
        for server in masters.servers:  # (a held EVALSHA must not meet NOSCRIPT)
            with redis.Redis(port=server.port) as direct:
                direct.script_load(SCRIPTS.source["bump_fence"])
        fast = [hub.proxy(masters[0].port), hub.proxy(masters[1].port)]
        backend = RedlockBackend(  # node_timeout: 1 s, below the 1.5 s hold, far above 0.1 s
            f"redlock://127.0.0.1:{fast[0].port},127.0.0.1:{fast[1].port},"
            f"127.0.0.1:{late.port}?node_timeout=1"
        )
        late.latency(0.0, 0.1)  # master 2 grants 100 ms after the others: a larger fence
        queued = backend.acquire("taken", "queued", 30_000, Owner(task_id="task-1"))
        assert queued.acquired
        late.latency(0.0)
        for proxy in fast:  # now master 2 answers first
            proxy.latency(0.1)
        wait_until(lambda: late.held, 5, "the fence write to master 2 to be on its way")
        run = RunCheck("task-1", ("taken",), take_over="queued")
        owner = Owner(host="h", pid=1, thread="t", task_id="task-1", task_name="t.x")
        taken = backend.acquire_run("taken", "run", 30_000, owner, run)
        assert taken.acquired and taken.fence == queued.fence
        assert backend.release("taken", "run")
        backend.close()
    finally:
        hub.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_close_lets_a_straggler_master_land_its_grant_and_fence_bump(
    masters_factory: MastersFactory, mode: str
) -> None:
    """The majority answers; the third master's grant and its fence bump are still on the
    way when the app closes the backend. Closing waits for them (up to ``node_timeout``):
    cut short, that master was left without the lock or with the fence it made itself,
    and a same-token acquire (a retried one) answered with a fence of its own."""
    masters = masters_factory(3)
    url = masters.url(node_timeout=5)
    masters[2].pause()
    resume = threading.Timer(0.3, masters[2].resume)
    resume.start()

    async def acquire_then_aclose() -> int:
        backend = get_backend(url)
        try:
            return (await backend.aacquire("straggler", "tok", 30_000, Owner())).fence
        finally:
            await backend.aclose()

    try:
        if mode == "async":
            fence = asyncio.run(acquire_then_aclose())
        else:
            backend = get_backend(url)
            fence = backend.acquire("straggler", "tok", 30_000, Owner()).fence
            backend.close()
    finally:
        resume.join()
    copies = [
        record_fields(redis.Redis(port=master.port).get("task_locks:{straggler}")) or {}
        for master in masters
    ]
    assert [int(copy.get("fence", 0)) for copy in copies] == [fence] * 3
    again = get_backend(url).acquire("straggler", "tok", 30_000, Owner())
    assert again.fence == fence
