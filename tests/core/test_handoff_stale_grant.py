"""Redis ``?handoff=server``: a grant freed by an operator before its waiter popped it,
and clients of both hand-off modes on one name.

A waiter's plan goes from the try that queued it straight to the blocking pop of its
grant list. If the waiter is paused between the two (a GC pause, SIGSTOP, a loaded
machine), a release can grant it the lock, an operator can force-release that grant
(the holder looks stuck: it is), and another process can take the lock, all before the
pop. The grant left in the list must not then be popped as the lock: two holders.
Against a real Redis; the pause is the test holding the plan between two of its steps.
"""

from __future__ import annotations

import threading

import pytest
import redis

from task_locks import Lock, get_backend
from task_locks._plan import AwaitGrant, Enqueue
from task_locks.types import Owner

from .holder import critical_section_sync


def handoff(url: str) -> str:
    return url + ("&" if "?" in url else "?") + "handoff=server"


def client_handoff(url: str) -> str:
    """The opt-out (the server hand-off is the default): a release wakes a waiter."""
    return url + ("&" if "?" in url else "?") + "handoff=client"


@pytest.mark.parametrize("operator_url", ["same", "plain"])
def test_a_grant_force_released_before_its_pop_is_not_popped(
    redis_url: str, operator_url: str
) -> None:
    """``plain``: the operator's URL says ``handoff=client`` (its force release is the
    plain script); the grant must go all the same."""
    url = handoff(redis_url)
    backend = get_backend(url)
    operator = backend if operator_url == "same" else get_backend(client_handoff(redis_url))
    assert backend.acquire("freed", "holder", 10_000, Owner()).acquired
    queued = backend.enqueue("freed", "w", 10_000, Owner(), 5_000)
    assert queued.fence is None  # held: w is queued, and its next step is the pop
    assert backend.release("freed", "holder")  # granted to w, which has not popped yet
    assert backend.holder("freed").token == "w"  # type: ignore[union-attr]
    assert operator.force_release("freed")  # the operator frees w's grant
    assert backend.acquire("freed", "x", 10_000, Owner()).acquired
    # w's pop finds nothing (the grant's fence is above the holder's that w's try saw:
    # only its removal with the lock keeps w from taking it)
    assert backend.await_grant("freed", "w", 0.2, queued.holder_fence) is None
    with redis.Redis.from_url(redis_url) as raw:
        assert not raw.exists("task_locks:{freed}:grant:w")
    assert backend.holder("freed").token == "x"  # type: ignore[union-attr]
    backend.dequeue("freed", "w")
    assert backend.release("freed", "x")


def test_the_plan_paused_before_its_pop_does_not_take_a_freed_grant(redis_url: str) -> None:
    """The same, through the lock's own acquire plan, paused between its two steps."""
    url = handoff(redis_url)
    backend = get_backend(url)
    holder = Lock("paused", ttl=10, backend=url).acquire(timeout=0)
    plan = Lock("paused", ttl=10, backend=url)._plan(backend, timeout=1.0)
    op = next(plan)
    assert isinstance(op, Enqueue)
    op = plan.send(backend.enqueue(op.name, op.token, op.ttl_ms, op.owner, op.wait_ms))
    assert isinstance(op, AwaitGrant)  # queued; the waiter pauses here
    holder.release()  # granted to the paused waiter
    assert backend.force_release("paused")  # the operator frees it
    other = Lock("paused", ttl=10, backend=url).acquire(timeout=0)
    answer = backend.await_grant(op.name, op.token, op.seconds, op.above)
    try:
        step = plan.send(answer)
    except StopIteration as done:  # the plan took the lock: it must not have
        raise AssertionError(f"two holders: the paused waiter got {done.value}") from None
    assert isinstance(step, Enqueue)  # it tries again instead: queued behind the holder
    plan.close()
    backend.dequeue("paused", op.token)
    assert backend.holder("paused").token == other.token  # type: ignore[union-attr]
    other.release()


def test_clients_of_both_modes_on_one_name_never_overlap(redis_url: str) -> None:
    """The README asks every client of a name to use one mode; a mixed fleet (a rolling
    change of the option) must still never make two holders, only hand over slower: a
    waiter of one mode is not woken by a release of the other until its next try."""
    name, counter = "mixed", "mixed:counter"
    client = redis.Redis.from_url(redis_url)
    faults: list[int] = []

    def work(url: str) -> None:
        lock = Lock(name, ttl=1, backend=url, timeout=30)
        for _ in range(8):
            with lock as lease:
                if not critical_section_sync(client, counter, lease.fence):
                    faults.append(lease.fence)

    urls = [client_handoff(redis_url), handoff(redis_url)] * 2
    workers = [threading.Thread(target=work, args=(url,)) for url in urls]
    for worker in workers:
        worker.start()
    try:
        for worker in workers:
            worker.join(60)
        assert not any(worker.is_alive() for worker in workers)
        assert int(client.get(counter) or 0) == 8 * len(urls)
        assert faults == []
    finally:
        client.close()


def test_a_lock_taken_from_a_tombstone_is_not_handed_back_to_its_taker(redis_url: str) -> None:
    """A queued waiter whose try finds a release's tombstone (here a plain-URL release
    woke it by signal) takes the lock. Its queue entry must go with that: else its own
    release "hands" the lock to it (a grant nobody pops), answering "released" while the
    lock stays held until its TTL, and everyone else is kept out that long."""
    url = handoff(redis_url)
    backend = get_backend(url)
    plain = get_backend(client_handoff(redis_url))
    assert backend.acquire("tomb", "holder", 10_000, Owner()).acquired
    assert backend.enqueue("tomb", "w", 10_000, Owner(), 5_000).fence is None
    assert backend.enqueue("tomb", "later", 10_000, Owner(), 5_000).fence is None
    assert plain.release("tomb", "holder")  # a tombstone; the waiters stay queued
    assert backend.enqueue("tomb", "w", 10_000, Owner(), 5_000).fence is not None
    backend.dequeue("tomb", "later")  # the other waiter gives up
    assert backend.release("tomb", "w")
    assert backend.holder("tomb") is None, "released, yet still held"
    assert backend.acquire("tomb", "x", 10_000, Owner()).acquired
    with redis.Redis.from_url(redis_url) as client:
        assert not client.exists("task_locks:{tomb}:wait:w", "task_locks:{tomb}:grant:w")
        assert not client.zscore("task_locks:{tomb}:queue", "w")
    assert backend.release("tomb", "x")
