"""Semaphores: at most ``limit`` holders, each a real lease; waiters woken by releases."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from typing import Any

import pytest
from procs import expiry_slack, output
from servers import wait_until

from task_locks import (
    AsyncSemaphore,
    InvalidArgument,
    LockHeld,
    NotOwned,
    Semaphore,
    get_backend,
)
from task_locks.semaphore import describe, parse_slot, slot_name


def unique(prefix: str = "s") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_at_most_limit_permits_each_its_own_slot(local_url: str) -> None:
    name = unique()
    semaphore = Semaphore(name, limit=2, ttl=5, backend=local_url)
    first, second = semaphore.try_acquire(), semaphore.try_acquire()
    assert first is not None and second is not None
    assert {first.slot, second.slot} == {0, 1}
    assert {first.name, second.name} == {slot_name(name, 0), slot_name(name, 1)}
    assert first.token != second.token
    assert semaphore.try_acquire() is None
    with pytest.raises(LockHeld, match=f"semaphore '{name}': all 2 permits are taken"):
        semaphore.acquire(timeout=0.05)

    info = semaphore.info()
    assert (info.name, info.limit, info.count, info.summary) == (name, 2, 2, "2 / 2")
    assert [h.name for h in semaphore.holders()] == sorted([first.name, second.name])
    listed = describe(get_backend(local_url).holders())
    assert [(i.name, i.summary) for i in listed] == [(name, "2 / 2")]

    first.release()
    third = semaphore.try_acquire()
    assert third is not None and third.slot == first.slot
    assert third.fence > first.fence  # fences increase per slot
    second.release()
    third.release()
    assert semaphore.holders() == []


def test_with_block_and_token_checked_release(local_url: str) -> None:
    name = unique()
    semaphore = Semaphore(name, limit=1, ttl=0.2, backend=local_url, renew=False)
    stale = semaphore.acquire(timeout=1)
    # Not renewed: its TTL runs out as a dead holder's would, and the permit comes back.
    with Semaphore(name, limit=1, ttl=5, backend=local_url, timeout=2) as permit:
        assert permit.slot == stale.slot
        with pytest.raises(NotOwned):
            stale.release()  # the expired holder cannot free the new holder's permit
        assert Semaphore(name, limit=1, backend=local_url).try_acquire() is None
    assert Semaphore(name, limit=1, backend=local_url).try_acquire() is not None


def test_permits_are_renewed_while_held(local_url: str) -> None:
    semaphore = Semaphore(unique(), limit=1, ttl=0.3, backend=local_url)
    with semaphore as permit:
        wait_until(lambda: permit.renewals >= 3, 3, "three renewals")
        assert permit.held
        assert semaphore.try_acquire() is None


def test_waiter_is_woken_by_a_release(local_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    name = unique()
    backend = get_backend(local_url)
    waiting = threading.Event()
    wait_any = backend.wait_any

    def spied(names: Any, timeout: float) -> None:
        waiting.set()
        wait_any(names, timeout)

    monkeypatch.setattr(backend, "wait_any", spied)
    semaphore = Semaphore(name, limit=3, ttl=30, backend=backend)
    held = [semaphore.acquire(timeout=1) for _ in range(3)]
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(semaphore.acquire(timeout=10)))
    thread.start()
    assert waiting.wait(5), "the waiter never waited"
    released = time.monotonic()
    held[1].release()  # not necessarily the slot the waiter tried first
    thread.join(10)
    assert got, "the waiter did not get the released permit"
    assert time.monotonic() - released < 1.0  # woken by the release, not the 30 s TTL
    for permit in [*held[::2], *got]:
        permit.release()


def test_threads_never_exceed_the_limit(local_url: str) -> None:
    semaphore = Semaphore(unique(), limit=3, ttl=5, backend=local_url, timeout=10)
    inside, peak, guard = [0], [0], threading.Lock()

    def work() -> None:
        for _ in range(4):
            with semaphore:
                with guard:
                    inside[0] += 1
                    peak[0] = max(peak[0], inside[0])
                time.sleep(0.005)
                with guard:
                    inside[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert peak[0] == 3
    assert inside[0] == 0


def test_async_semaphore(local_url: str) -> None:
    async def main() -> None:
        semaphore = AsyncSemaphore(unique(), limit=2, ttl=5, backend=local_url, timeout=10)
        inside, peak = [0], [0]

        async def work() -> None:
            async with semaphore as permit:
                assert permit.limit == 2
                inside[0] += 1
                peak[0] = max(peak[0], inside[0])
                await asyncio.sleep(0.01)
                inside[0] -= 1

        await asyncio.gather(*(work() for _ in range(6)))
        assert peak[0] == 2
        first = await semaphore.acquire()
        assert (await semaphore.info()).count == 1
        assert [h.name for h in await semaphore.holders()] == [first.name]
        await first.release()
        assert await semaphore.try_acquire() is not None

    asyncio.run(main())


@pytest.mark.parametrize("limit", [0, -1, True, 1.5, "3", 5000])
def test_bad_limit_fails_at_definition(limit: object) -> None:
    with pytest.raises(InvalidArgument, match="limit"):
        Semaphore("x", limit=limit, backend="memory://")  # type: ignore[arg-type]


def test_slot_names() -> None:
    assert slot_name("export:tenant#7", 2) == "semaphore:export:tenant#7#2"
    assert parse_slot("semaphore:export:tenant#7#2") == ("export:tenant#7", 2)
    for other in ["semaphore:x", "semaphore:#1", "lock:x#1", "semaphore:x#y"]:
        assert parse_slot(other) is None


# -- limit 3, eight processes; a SIGKILLed holder's permit comes back -----------------------


def test_eight_processes_limit_three(
    shared_url: str, redis_url: str, log_redis: Any, spawn: Any
) -> None:
    name, rounds = unique("acceptance"), 3
    children = [spawn("permits", shared_url, redis_url, name, 3, 5, rounds) for _ in range(8)]
    wait_until(
        lambda: log_redis.get(f"{name}:ready") == "8", 60, "eight processes ready", alive=children
    )
    log_redis.set(f"{name}:go", 1)
    for child in children:
        assert child.wait(60) == 0, output(child)
    assert int(log_redis.get(f"{name}:done")) == 8 * rounds
    assert int(log_redis.get(f"{name}:max")) == 3  # reached, never passed
    assert int(log_redis.get(f"{name}:inside")) == 0


def test_sigkilled_holder_gives_its_permit_back_within_one_ttl(
    shared_url: str, redis_url: str, log_redis: Any, spawn: Any
) -> None:
    name, ttl = unique("acceptance"), 2.0
    victim = spawn("hold-permit", shared_url, redis_url, name, 3, ttl)
    victim_slot = int(
        wait_until(lambda: log_redis.get(f"{name}:victim-slot"), 10, "the victim", alive=[victim])
    )
    semaphore = Semaphore(name, limit=3, ttl=10, backend=shared_url)
    mine = [semaphore.acquire(timeout=1) for _ in range(2)]
    assert semaphore.try_acquire() is None

    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    permit = semaphore.acquire(timeout=ttl + 5)
    came_back = time.monotonic() - killed
    assert permit.slot == victim_slot
    assert came_back <= ttl + expiry_slack(shared_url), f"it came back after {came_back:.2f}s"
    for held in [*mine, permit]:
        held.release()
