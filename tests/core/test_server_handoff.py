"""Redis's server hand-off (the default; ``?handoff=server`` names it): the release hands
the lock to the first live waiter in the server.

Against real Redis servers (and the chaoskit TCP proxy for a lost reply): exclusion across
threads and processes, FIFO order with increasing fences, a killed waiter skipped, a
timed-out waiter giving back a grant that raced in, and a lost grant reply never making
two holders.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from chaoskit.proxy import ProxyHub
from servers import RedisServer, wait_until

from task_locks import AsyncLock, Lock, LockError, LockHeld, get_backend
from task_locks._plan import entry_ms
from task_locks.backends.redis_scripts import counter_key, record_fields
from task_locks.types import Owner

from .holder import hammer_async, hammer_sync
from .support import SyncDriver


def handoff(url: str) -> str:
    return url + ("&" if "?" in url else "?") + "handoff=server"


@pytest.fixture
def url(redis_url: str) -> str:
    return handoff(redis_url)


def raw(url: str) -> redis.Redis:
    return redis.Redis.from_url(url.split("?", 1)[0])


def queued(url: str, name: str) -> int:
    return int(raw(url).zcard(f"task_locks:{{{name}}}:queue"))


def entries(url: str, name: str) -> int:
    return len(list(raw(url).scan_iter(match=f"task_locks:{{{name}}}:wait:*")))


def test_the_url_option_is_checked(redis_url: str) -> None:
    assert get_backend(handoff(redis_url)).server_handoff
    assert get_backend(redis_url).server_handoff  # the default
    assert not get_backend(redis_url + "?handoff=client").server_handoff
    assert not get_backend(redis_url + "?wait_replicas=1").server_handoff
    with pytest.raises(LockError, match="handoff"):
        get_backend(redis_url + "?handoff=sometimes")
    with pytest.raises(LockError, match="wait_replicas"):
        get_backend(redis_url + "?handoff=server&wait_replicas=1")


def test_threads_and_processes_never_overlap(driver: SyncDriver, children, url: str) -> None:
    """The hammer of test_exclusion, with the hand-off: 4 local workers and 2 processes."""
    name, counter = "handoff-hammer", "handoff-hammer:counter"
    processes = [children(url, name, 10, driver.mode) for _ in range(2)]
    for process in processes:
        process.send("hammer", counter=counter, n=25, workers=2)
    hammer = hammer_sync if driver.mode == "sync" else hammer_async
    local_faults = driver.call(hammer, url, name, counter, 25, 4)
    answers = [process.answer(timeout=120) for process in processes]
    assert int(raw(url).get(counter) or 0) == 25 * (4 + 2 * 2)
    assert local_faults == 0
    assert [a.get("faults") for a in answers] == [0, 0], answers


def test_waiters_get_the_lock_in_arrival_order_with_growing_fences(url: str) -> None:
    name = "fifo"
    first = Lock(name, ttl=10, backend=url).acquire(timeout=0)
    order: list[tuple[int, int]] = []
    guard = threading.Lock()

    def wait(index: int) -> None:
        lease = Lock(name, ttl=10, backend=url).acquire(timeout=20)
        with guard:
            order.append((index, lease.fence))
        lease.release()

    workers = []
    for index in range(4):
        worker = threading.Thread(target=wait, args=(index,))
        worker.start()
        workers.append(worker)
        wait_until(lambda n=index + 1: queued(url, name) == n, 5, f"{index + 1} queued")
    first.release()
    for worker in workers:
        worker.join(20)
    assert [index for index, _ in order] == [0, 1, 2, 3]
    fences = [first.fence] + [fence for _, fence in order]
    assert fences == sorted(set(fences)), fences
    assert queued(url, name) == 0
    client = raw(url)  # granted waiters' entries are left to expire, and do
    assert all(client.pttl(k) > 0 for k in client.scan_iter(match=f"task_locks:{{{name}}}:*"))


def test_a_grant_reaches_the_waiter_without_a_second_acquire(url: str) -> None:
    """The waiter's pop returns the grant: it holds the lock from the release's script on."""
    backend = get_backend(url)
    assert backend.acquire("direct", "holder", 10_000, Owner()).acquired
    held = backend.enqueue("direct", "waiter", 10_000, Owner(task_id="w"), 5_000)
    assert held.fence is None and held.holder_fence is not None
    assert backend.release("direct", "holder")
    now = backend.holder("direct")
    assert now is not None and now.token == "waiter" and now.owner.task_id == "w"
    assert now.fence > held.holder_fence
    assert backend.await_grant("direct", "waiter", 1.0, held.holder_fence) == now.fence
    assert backend.release("direct", "waiter")
    assert backend.holder("direct") is None


def test_a_killed_waiter_is_skipped(children, url: str) -> None:
    name, ttl = "killed-waiter", 1.0
    holder = Lock(name, ttl=ttl, backend=url).acquire(timeout=0)
    doomed = children(url, name, ttl, "sync")
    doomed.send("acquire", timeout=30)
    wait_until(lambda: queued(url, name) == 1, 5, "the doomed waiter queued")
    got: list[Any] = []
    live = threading.Thread(
        target=lambda: got.append(Lock(name, ttl=ttl, backend=url).acquire(timeout=20))
    )
    live.start()
    wait_until(lambda: queued(url, name) == 2, 5, "the live waiter queued")
    doomed.kill()  # SIGKILL: its wait entry is no longer refreshed
    wait_until(lambda: entries(url, name) == 1, entry_ms(ttl) / 1000 + 3, "the entry to expire")
    released = time.monotonic()
    holder.release()
    live.join(10)
    assert got, "the live waiter did not get the lock"
    # Handed straight to the live waiter (no TTL of a dead grantee to wait out).
    assert time.monotonic() - released < ttl / 2
    assert got[0].fence > holder.fence
    got[0].release()


def test_a_waiter_that_times_out_gives_back_a_grant_that_raced_in(url: str) -> None:
    backend = get_backend(url)
    assert backend.acquire("raced", "holder", 10_000, Owner()).acquired
    assert backend.enqueue("raced", "late", 10_000, Owner(), 5_000).fence is None
    queued = backend.enqueue("raced", "next", 10_000, Owner(), 5_000)
    assert queued.fence is None
    assert backend.release("raced", "holder")  # granted to "late", which is timing out
    assert backend.holder("raced").token == "late"  # type: ignore[union-attr]
    assert backend.dequeue("raced", "late") is True  # given back, and on to "next"
    now = backend.holder("raced")
    assert now is not None and now.token == "next"
    assert backend.dequeue("raced", "late") is False  # nothing left to give back
    assert not raw(url).exists("task_locks:{raced}:grant:late")
    assert backend.await_grant("raced", "next", 1.0, queued.holder_fence) == now.fence
    assert backend.release("raced", "next")


def expire_lock_only(url: str, name: str, waiter: str = "w") -> None:
    """The lock's hash expires, its grant list not yet: Redis expires the two keys a
    script gave the same TTL separately, up to a millisecond apart. That window is too
    short to hit on purpose, so the hash alone is deleted, on the real server. (A force
    release drops the grant with the lock: test_handoff_stale_grant.py.)"""
    with redis.Redis.from_url(url.split("?", 1)[0]) as client:
        assert client.delete(f"task_locks:{{{name}}}") == 1
        assert client.exists(f"task_locks:{{{name}}}:grant:{waiter}")


def test_a_grant_that_outlived_its_lock_is_never_popped(url: str) -> None:
    """A grant left in a waiter's list after its lock ended (and the lock went on to
    someone else) must not be taken later as the lock: two holders."""
    backend = get_backend(url)
    assert backend.acquire("stale", "holder", 10_000, Owner()).acquired
    assert backend.enqueue("stale", "w", 10_000, Owner(), 5_000).fence is None
    assert backend.release("stale", "holder")  # granted to "w", not popped yet
    assert backend.holder("stale").token == "w"  # type: ignore[union-attr]
    expire_lock_only(url, "stale")
    assert backend.acquire("stale", "x", 10_000, Owner()).acquired
    # w tries again before its next pop (as its plan does): queued; the pop finds the
    # stale grant, at most x's fence, and drops it
    queued = backend.enqueue("stale", "w", 10_000, Owner(), 5_000)
    assert queued.fence is None
    assert backend.await_grant("stale", "w", 0.2, queued.holder_fence) is None
    assert not raw(url).exists("task_locks:{stale}:grant:w")
    assert backend.holder("stale").token == "x"  # type: ignore[union-attr]
    assert backend.dequeue("stale", "w") is False
    assert backend.release("stale", "x")


def test_a_waiter_with_a_stale_grant_waits_for_a_real_one(url: str) -> None:
    """Through the acquire loop: a waiter whose list still holds a grant that outlived
    its lock must not return it as the lock while another holds it, and gets the lock
    (with a larger fence) when that holder releases."""
    backend = get_backend(url)
    assert backend.acquire("stale-loop", "holder", 10_000, Owner()).acquired
    assert backend.enqueue("stale-loop", "w", 10_000, Owner(), 5_000).fence is None
    assert backend.release("stale-loop", "holder")  # granted to "w", not popped
    expire_lock_only(url, "stale-loop")
    x = Lock("stale-loop", ttl=10, backend=url).acquire(timeout=0)
    lock = Lock("stale-loop", ttl=10, backend=url)
    lock._token = "w"  # the waiter whose stale grant is in its list
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(lock.acquire(timeout=10)))
    waiter.start()
    # The waiter's pop takes the stale grant out of its list (and must drop it); had it
    # kept it, its lease would carry that grant's fence, below x's (checked at the end).
    with raw(url) as client:
        wait_until(lambda: not client.exists("task_locks:{stale-loop}:grant:w"), 5, "the pop")
    assert not got, "the stale grant was taken as the lock while x holds it"
    assert backend.holder("stale-loop").token == x.token  # type: ignore[union-attr]
    x.release()
    waiter.join(10)
    assert got and got[0].fence > x.fence
    got[0].release()


def test_a_hand_off_fence_is_above_the_holders_even_with_the_clock_and_counter_behind(
    url: str,
) -> None:
    """The fence handed on counts from the holder's own: the server's clock stepped back
    below it and its counter gone (``fence_ttl`` ran out under a long-held lock), the
    next holder's fence must still be the larger."""
    backend = get_backend(url)
    client = raw(url)
    assert backend.acquire("behind", "holder", 10_000, Owner()).acquired
    record = client.get("task_locks:{behind}").decode()
    fence = record_fields(record)["fence"]  # type: ignore[index]
    ahead = int(fence) + 10**12  # ~11 days ahead
    client.set("task_locks:{behind}", record.replace(fence, str(ahead), 1), keepttl=True)
    client.delete(counter_key("task_locks:"))
    queued = backend.enqueue("behind", "next", 10_000, Owner(), 5_000)
    assert queued.fence is None and queued.holder_fence == ahead
    assert backend.release("behind", "holder")
    assert backend.await_grant("behind", "next", 1.0, queued.holder_fence) == ahead + 1
    assert int(client.get(counter_key("task_locks:"))) == ahead + 1
    assert backend.release("behind", "next")
    assert backend.acquire("behind", "later", 10_000, Owner()).fence == ahead + 2


def test_a_short_waiter_does_not_shorten_the_queue_for_the_others(url: str) -> None:
    backend = get_backend(url)
    assert backend.acquire("line", "holder", 10_000, Owner()).acquired
    assert backend.enqueue("line", "long", 10_000, Owner(), 5_000).fence is None
    assert backend.enqueue("line", "short", 10_000, Owner(), 300).fence is None
    assert raw(url).pttl("task_locks:{line}:queue") > 4_000
    assert backend.dequeue("line", "long") is False and backend.dequeue("line", "short") is False
    assert backend.release("line", "holder")


def test_a_timed_out_acquire_leaves_the_queue(url: str) -> None:
    holder = Lock("bounded", ttl=10, backend=url).acquire(timeout=0)
    started = time.monotonic()
    with pytest.raises(LockHeld):
        Lock("bounded", ttl=10, backend=url).acquire(timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 1.0
    assert queued(url, "bounded") == 0 and entries(url, "bounded") == 0
    with pytest.raises(LockHeld):
        Lock("bounded", ttl=10, backend=url).acquire(timeout=0)  # a try never queues
    assert queued(url, "bounded") == 0
    holder.release()
    assert Lock("bounded", ttl=10, backend=url).acquire(timeout=0).release() is None


def test_a_cancelled_waiter_leaves_the_queue(url: str) -> None:
    """A waiter interrupted while it waits for a grant (task cancelled, Ctrl-C, a task's
    time limit) leaves the queue: the next release must not hand the lock to it."""

    async def main() -> None:
        holder = await AsyncLock("cancelled", ttl=10, backend=url).acquire(timeout=0)
        waiter = asyncio.ensure_future(AsyncLock("cancelled", ttl=10, backend=url).acquire())
        deadline = time.monotonic() + 5
        while queued(url, "cancelled") == 0:
            assert time.monotonic() < deadline, "the waiter never queued"
            await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert queued(url, "cancelled") == 0 and entries(url, "cancelled") == 0
        await holder.release()
        lease = await AsyncLock("cancelled", ttl=10, backend=url).acquire(timeout=0)
        await lease.release()
        await get_backend(url).aclose()  # this loop's connections, before it closes

    asyncio.run(main())


def test_a_lease_handed_over_counts_from_the_try_before_the_pop(url: str) -> None:
    """The grant may land right after the last try; the lease must not count from later."""
    name, ttl = "counted", 2.0
    holder = Lock(name, ttl=ttl, backend=url).acquire(timeout=0)
    got: list[Any] = []
    waiter = threading.Thread(
        target=lambda: got.append(Lock(name, ttl=ttl, backend=url).acquire(timeout=10))
    )
    waiter.start()
    wait_until(lambda: queued(url, name) == 1, 5, "the waiter queued")
    holder.release()
    released = time.monotonic()
    waiter.join(10)
    assert got
    # The server's TTL started at the release; the lease must end no later than that.
    assert got[0]._expires_mono <= released + ttl
    got[0].release()


@pytest.fixture
def hub() -> Iterator[ProxyHub]:
    proxies = ProxyHub()
    yield proxies
    proxies.close()


def _learn_contended(name: str, url: str) -> None:
    """A try refused through ``url``'s backend: it now knows ``name`` as contended, so
    its next waiter sends its try and its first pop of the grant as one request."""
    with pytest.raises(LockHeld):
        Lock(name, ttl=10, backend=url).acquire(timeout=0)


def test_a_waiter_for_a_contended_name_is_granted_after_one_round_trip(
    hub: ProxyHub, redis_server: RedisServer, url: str
) -> None:
    """Every request to the waiter's server arrives a second late: a try, then a pop,
    would take two seconds; the waiter has the lock after one."""
    name = "one-trip"
    proxy = hub.proxy(redis_server.port)
    slow = handoff(f"redis://127.0.0.1:{proxy.port}/0")
    holder = Lock(name, ttl=10, backend=url).acquire(timeout=0)
    _learn_contended(name, slow)
    proxy.latency(0.0, 1.0)
    got: list[Any] = []

    def wait() -> None:
        started = time.monotonic()
        got.append(Lock(name, ttl=10, backend=slow).acquire(timeout=10))
        got.append(time.monotonic() - started)

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_until(lambda: queued(url, name) == 1, 5, "the waiter queued")
    holder.release()
    waiter.join(10)
    lease, took = got
    assert 1.0 <= took < 1.8, f"the waiter took {took:.2f} s"
    assert lease.fence > holder.fence
    assert get_backend(url).holder(name).token == lease.token  # type: ignore[union-attr]
    proxy.heal()
    lease.release()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_contended_name_found_free_is_taken_at_once(url: str, mode: str) -> None:
    """The try that goes with a pop takes a free lock and unblocks its own pop: it does
    not wait the pop's slice (a second here), and leaves no grant list behind."""
    name = f"found-free-{mode}"
    holder = Lock(name, ttl=10, backend=url).acquire(timeout=0)
    _learn_contended(name, url)
    holder.release()
    started = time.monotonic()
    if mode == "sync":
        lease = Lock(name, ttl=10, backend=url).acquire()
        lease.release()
    else:

        async def main() -> None:
            lease = await AsyncLock(name, ttl=10, backend=url).acquire()
            await lease.release()
            await get_backend(url).aclose()

        asyncio.run(main())
    took = time.monotonic() - started
    assert took < 0.5, f"the acquire waited {took:.2f} s"
    assert not list(raw(url).scan_iter(match=f"task_locks:{{{name}}}:grant:*"))


def test_a_waiter_for_a_contended_name_waits_no_longer_than_a_dead_holders_ttl(
    url: str,
) -> None:
    """The pop sent with the try would block a slice (1.9 s for a 30 s TTL); a holder
    whose record ends sooner (it died: no release comes) cuts it short, and the waiter
    takes the lock when that record ends."""
    name = "dead-holder"
    # A holder with no process behind it: nothing releases its record, its TTL ends it.
    dead = get_backend(url).acquire(name, "dead", 500, Owner())
    assert dead.fence is not None
    _learn_contended(name, url)
    started = time.monotonic()
    lease = Lock(name, ttl=30, backend=url).acquire(timeout=10)
    took = time.monotonic() - started
    assert took < 1.3, f"the waiter took {took:.2f} s"
    assert lease.fence > dead.fence
    lease.release()


def test_a_waiter_whose_server_forgot_the_scripts_still_gets_the_lock(url: str) -> None:
    """A restart empties Redis's script cache: the pop sent with the try then blocks
    its slice in vain (the try was refused, unrun). The waiter tries again, alone."""
    name = "forgotten"
    holder = Lock(name, ttl=1, backend=url).acquire(timeout=0)
    _learn_contended(name, url)
    raw(url).script_flush()
    got: list[Any] = []
    waiter = threading.Thread(
        target=lambda: got.append(Lock(name, ttl=1, backend=url).acquire(timeout=10))
    )
    waiter.start()
    wait_until(lambda: queued(url, name) == 1, 5, "the waiter queued")
    holder.release()
    waiter.join(10)
    assert got and got[0].fence > holder.fence and got[0].held
    got[0].release()


@pytest.mark.parametrize("contended", [False, True], ids=["pop-alone", "pop-with-try"])
@pytest.mark.parametrize("fault", ["drop_reply", "reset_once"])
def test_a_lost_grant_reply_never_makes_two_holders(
    hub: ProxyHub, fault: str, contended: bool
) -> None:
    """``drop_reply``: the pop's reply (and every reply after it) is lost, the waiter fails;
    ``reset_once``: the reply is lost with the connection, and redis-py's retry pops an
    empty list, so the next try finds the lock already the waiter's (``pop-with-try``:
    the retry resends the try and the pop together; the try finds the lock the waiter's
    and unblocks the pop). ``contended``: the waiter's backend knows the name as
    contended, so its first pop goes with its try."""
    server = RedisServer().start()
    try:
        proxy = hub.proxy(server.port)
        direct = handoff(server.url())
        # Long TTL, so the waiter sits in one long BLPOP when its reply is dropped.
        faulty = handoff(f"redis://127.0.0.1:{proxy.port}/0?socket_timeout=3")
        name, ttl = "lost-grant", 20.0
        holder = Lock(name, ttl=ttl, backend=direct).acquire(timeout=0)
        if contended:
            _learn_contended(name, faulty)
        outcome: list[Any] = []

        def wait() -> None:
            try:
                outcome.append(Lock(name, ttl=ttl, backend=faulty).acquire(timeout=15))
            except LockError as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        wait_until(lambda: queued(direct, name) == 1, 5, "the waiter queued")
        proxy.fault(fault)
        holder.release()  # granted inside the server; the waiter's pop loses the reply
        waiter.join(20)
        proxy.heal()
        assert outcome, "the waiter never came back"
        second = Lock(name, ttl=ttl, backend=direct).try_acquire()
        if isinstance(outcome[0], LockError):
            # The waiter holds nothing. Its give-back (DEQUEUE) may not have got through
            # the same broken link: then the orphaned grant holds the lock until its TTL.
            if second is not None:
                assert second.fence > holder.fence
                second.release()
        else:
            assert second is None and outcome[0].held
            outcome[0].release()
    finally:
        server.cleanup()


def test_an_election_is_handed_over_and_a_semaphore_still_works(url: str) -> None:
    """The election campaigns through Lock (so through the hand-off); the semaphore's
    slots keep their own waits, and its releases still wake them."""
    from task_locks import Election, Semaphore

    first = Election("leader", ttl=5, backend=url, identity="a").campaign(timeout=0)
    terms: list[int] = []
    rival = threading.Thread(
        target=lambda: terms.append(
            Election("leader", ttl=5, backend=url, identity="b").campaign(timeout=10).term
        )
    )
    rival.start()
    wait_until(lambda: queued(url, "election:leader") == 1, 5, "the rival queued")
    first.resign()
    rival.join(10)
    assert terms and terms[0] > first.term

    semaphore = Semaphore("pool", limit=1, ttl=5, backend=url)
    permit = semaphore.acquire(timeout=0)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(semaphore.acquire(timeout=10)))
    waiter.start()
    permit.release()
    waiter.join(10)
    assert got and got[0].fence > permit.fence
    got[0].release()
