"""No lock kept forever, no thread waiting on itself."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest
from servers import wait_until

from task_locks import AsyncLock, Lease, Lock, LockHeld, events, get_backend

from .support import holder_token


def test_a_dropped_lease_stops_being_renewed_and_says_so(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # TTL 3 s: it would be renewed within the wait if renewal went on, and it is still
    # there after the collection on a loaded CI worker (with 1 s, CI once found it gone).
    Lock("dropped", ttl=3, backend=redis_url).acquire(timeout=0)  # the lease is dropped
    gc.collect()
    assert holder_token(redis_url, "dropped") is not None  # still there: its TTL runs
    # Without renewal the lock ends within its TTL, and a warning names it.
    wait_until(lambda: holder_token(redis_url, "dropped") is None, 6, "the dropped lock to end")
    assert events.flush(5.0)  # logged by the events' logging subscriber
    assert "'dropped'" in caplog.text and "garbage-collected" in caplog.text
    # holder() reports a lock ending a few ms before Redis drops the key: wait that long.
    successor = Lock("dropped", ttl=1, backend=redis_url).acquire(timeout=2)
    successor.release()


def test_a_dropped_async_lease_stops_being_renewed(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        await AsyncLock("dropped-async", ttl=1, backend=redis_url).acquire(timeout=0)
        gc.collect()
        deadline = time.monotonic() + 3
        while holder_token(redis_url, "dropped-async") is not None:
            assert time.monotonic() < deadline, "the dropped async lease is still renewed"
            await asyncio.sleep(0.05)
        await get_backend(redis_url).aclose()  # this loop's client, before the loop ends

    asyncio.run(main())
    assert events.flush(5.0)
    assert "'dropped-async'" in caplog.text and "garbage-collected" in caplog.text


def test_a_kept_lease_is_still_renewed(redis_url: str) -> None:
    # A TTL the renewer can keep on a loaded machine (renewals every ttl/3).
    lease = Lock("kept", ttl=1.5, backend=redis_url).acquire(timeout=0)
    gc.collect()
    wait_until(lambda: lease.renewals >= 3, 10, "three renewals of a kept lease")
    assert lease.held
    lease.release()


@pytest.mark.parametrize("contended", [False, True], ids=["fresh", "contended"])
def test_a_second_acquire_in_the_holding_thread_fails_at_once(
    redis_url: str, contended: bool
) -> None:
    """``contended``: the first lease came by a grant after a refusal, so the backend
    knows the name as contended and a waiter's first try would go with a pop of its grant
    (a slice, 1.9 s here): not when it would wait for itself."""
    if contended:
        other = Lock("mine", ttl=30, backend=redis_url).acquire(timeout=0)
        threading.Timer(0.2, other.release).start()
        first = Lock("mine", ttl=30, backend=redis_url).acquire(timeout=10)
    else:
        first = Lock("mine", ttl=30, backend=redis_url).acquire(timeout=0)
    start = time.monotonic()
    with pytest.raises(LockHeld) as refused:
        Lock("mine", ttl=30, backend=redis_url).acquire(timeout=None)
    assert time.monotonic() - start < 1.0, "it waited for itself"
    message = str(refused.value)
    assert "'mine'" in message and "this same thread" in message, message
    assert refused.value.name == "mine"
    first.release()
    again = Lock("mine", ttl=30, backend=redis_url).acquire(timeout=0)
    again.release()


def test_a_second_acquire_in_the_holding_task_fails_at_once(redis_url: str) -> None:
    async def main() -> None:
        first = await AsyncLock("mine-async", ttl=30, backend=redis_url).acquire(timeout=0)
        start = time.monotonic()
        with pytest.raises(LockHeld) as refused:
            await AsyncLock("mine-async", ttl=30, backend=redis_url).acquire(timeout=None)
        assert time.monotonic() - start < 1.0, "it waited for itself"
        assert "this same task" in str(refused.value)
        # Another task of the same loop is another holder: it waits, and gets the lock.
        waiter = asyncio.create_task(
            AsyncLock("mine-async", ttl=30, backend=redis_url).acquire(timeout=5)
        )
        await asyncio.sleep(0)
        await first.release()
        second = await waiter
        assert second.fence > first.fence
        await second.release()
        await get_backend(redis_url).aclose()

    asyncio.run(main())


def test_another_thread_still_waits_for_the_holder(redis_url: str) -> None:
    first = Lock("shared", ttl=30, backend=redis_url).acquire(timeout=0)
    got: list[Lease] = []
    waiter = threading.Thread(
        target=lambda: got.append(Lock("shared", ttl=30, backend=redis_url).acquire(timeout=5))
    )
    waiter.start()
    first.release()
    waiter.join(10)
    assert got and got[0].fence > first.fence
    got[0].release()


def test_a_new_task_with_a_dead_holders_id_is_not_taken_for_the_holder(redis_url: str) -> None:
    """A task's id is reused once it is gone: the holders map must not mistake the new task
    (waiting for a lease the dead task left to others) for the holder waiting on itself."""

    async def main() -> None:
        backend = get_backend(redis_url)

        async def take() -> tuple[object, int]:
            lease = await AsyncLock("reused", ttl=30, backend=backend).acquire(timeout=0)
            return lease, id(asyncio.current_task())

        lease, dead_id = await asyncio.create_task(take())  # the lease outlives its task
        for _ in range(3):  # the loop lets go of the finished task within a few turns
            await asyncio.sleep(0)
        gc.collect()

        async def attempt() -> bool:
            if id(asyncio.current_task()) != dead_id:
                return False
            # In this very task (wait_for would run it in another): it waits for the holder,
            # and is not refused at once as if it were the holder.
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):
                    await AsyncLock("reused", ttl=30, backend=backend).acquire(timeout=None)
            return True

        for _ in range(20):  # many tasks at once: one of them lands where the dead one was
            tried = await asyncio.gather(*(asyncio.create_task(attempt()) for _ in range(1000)))
            if any(tried):
                break
        else:
            pytest.fail("no new task got the finished task's id (CPython reuses it quickly)")
        await lease.release()  # type: ignore[attr-defined]
        again = await AsyncLock("reused", ttl=30, backend=backend).acquire(timeout=0)
        await again.release()
        await backend.aclose()

    asyncio.run(main())
