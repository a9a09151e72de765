"""The everyday API, the same for Lock and AsyncLock: with-blocks, timeouts, LockHeld."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from task_locks import (
    AsyncLock,
    Lock,
    LockError,
    LockHeld,
    LockLost,
    Semaphore,
    configure,
    get_backend,
)
from task_locks.owner import owner_context
from task_locks.types import Owner, _parse_owner

from .support import SyncDriver, holder_token


def test_with_block_releases_even_when_the_body_fails(driver: SyncDriver, redis_url: str) -> None:
    lock = driver.lock("block", ttl=5, backend=redis_url, timeout=1)
    if driver.mode == "sync":

        def body() -> None:
            with lock as lease:
                assert holder_token(redis_url, "block") == lease.token
                raise KeyError("boom")

    else:

        async def body() -> None:
            async with lock as lease:
                assert holder_token(redis_url, "block") == lease.token
                raise KeyError("boom")

    with pytest.raises(KeyError):
        driver.call(body)
    assert holder_token(redis_url, "block") is None


def test_held_lock_names_its_holder(driver: SyncDriver, redis_url: str) -> None:
    handle = driver.acquire("busy", backend=redis_url, ttl=5)
    assert driver.try_acquire("busy", backend=redis_url, ttl=5) is None
    with pytest.raises(LockHeld) as caught:
        driver.acquire("busy", timeout=0, backend=redis_url, ttl=5)
    error = caught.value
    assert error.name == "busy"
    assert error.holder is not None and error.holder.fence == handle.fence
    assert error.holder.owner.pid == os.getpid()
    assert f"pid {os.getpid()}" in str(error) and "'busy'" in str(error)
    handle.release()


def test_acquire_timeout_is_kept(driver: SyncDriver, redis_url: str) -> None:
    """Waiting ends on time (Redis's coarse BLPOP timer is not allowed to stretch it)."""
    handle = driver.acquire("slowpoke", backend=redis_url, ttl=10)
    started = time.monotonic()
    with pytest.raises(LockHeld, match="after waiting"):
        driver.acquire("slowpoke", timeout=0.3, backend=redis_url, ttl=5)
    # Sanity bound: a BLPOP that ran to Redis's timer tick could end up to 0.1 s late.
    assert 0.3 <= time.monotonic() - started < 0.45
    handle.release()


def test_lease_state_and_idempotent_release(
    driver: SyncDriver, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="task_locks")
    handle = driver.acquire("state", backend=redis_url, ttl=5)
    assert handle.held and not handle.lost.is_set()
    assert handle.name == "state" and len(handle.token) >= 32
    assert 4 < handle.expires_at - time.time() <= 5
    handle.release()
    handle.release()  # a second release does nothing
    assert not handle.held
    with pytest.raises(LockLost, match="already released"):
        handle.check()
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("acquired lock 'state'" in m for m in messages)
    assert any("released lock 'state'" in m for m in messages)


TEXT = st.one_of(st.none(), st.text(alphabet=st.characters(blacklist_categories=("Cs",))))


@given(
    st.builds(
        Owner,
        host=st.text(max_size=8),
        pid=st.integers(0, 2**31),
        thread=st.text(max_size=8),
        task_id=TEXT,
        task_name=TEXT,
        command=TEXT,
        worker=TEXT,
    )
)
def test_an_owner_read_back_is_the_owner_written(owner: Owner) -> None:
    """Owners read from records are parsed once per distinct text (a waiter reads the
    same holder's at every try): the cached answer is what a fresh parse gives, for text
    and bytes alike, every time, and it writes back the same text (empty fields are not
    written: they read back as their defaults)."""
    raw = owner.to_json()
    for _ in range(2):
        for stored in (raw, raw.encode()):
            read = Owner.from_json(stored)
            assert read == _parse_owner(Owner, stored)
            assert read.to_json() == raw
    assert Owner.from_json(raw).task_id == (owner.task_id or None)


def test_an_owner_that_is_not_json_is_kept_as_its_text() -> None:
    assert Owner.from_json("not json") == Owner(command="not json")
    assert Owner.from_json("not json") == Owner(command="not json")  # cached: the same
    assert Owner.from_json("") == Owner() and Owner.from_json(None) == Owner()

    class Named(Owner):  # a subclass gets its own class back, not a cached Owner
        pass

    assert type(Named.from_json('{"host": "h"}')) is Named


def test_configured_backend_and_default_ttl(driver: SyncDriver, redis_url: str) -> None:
    configure(backend=redis_url, default_ttl=7)
    handle = driver.acquire("configured")
    assert handle.ttl == 7
    with redis.Redis.from_url(redis_url) as client:
        assert 6000 < client.pttl("task_locks:{configured}") <= 7000
    handle.release()


@pytest.mark.parametrize(
    "owner",
    [
        Owner("h", 1, "t", "abc-1", "n", None, "w"),
        Owner("h", 1, "t", 'we"ird\u00e9\\', "n", "c", "w", "i", 3),
        Owner("h", 1, "t", None, "n"),
        Owner(task_id=""),
        Owner(task_id="x", task_name="\udfff"),  # the placeholder elsewhere: no shortcut
        Owner(task_id="\udfff"),
    ],
)
def test_the_owner_json_shortcut_for_task_ids_writes_what_json_does(
    owner: Owner, redis_url: str
) -> None:
    """A run's owner JSON is spliced around its task id (cached per task and worker)."""
    fields = {k: getattr(owner, k) for k in owner.__dataclass_fields__}
    expected = json.dumps({k: v for k, v in fields.items() if v not in (None, "")})
    assert owner.to_json() == expected
    assert owner.to_json() == expected  # the cached cut gives the same
    with owner_context(task_id="t-1", task_name="n", worker="w@h"):
        lease = Lock("owner-json", ttl=5, backend=redis_url).acquire()
    holder = get_backend(redis_url).holder("owner-json")
    assert holder is not None and holder.owner.task_id == "t-1"
    assert holder.owner.worker == "w@h" and holder.owner.pid == os.getpid()
    lease.release()


def test_owner_context_nests_restores_and_decorates() -> None:
    """``owner_context`` adds to the owner of the block it is entered in, restores the
    outer one on the way out (an error included), refuses a field an owner lacks, and as
    a decorator describes each call afresh (a recursive call nests, and unwinds)."""
    from task_locks.owner import current_owner

    with owner_context(task_name="outer", worker="w@h"):
        with owner_context(task_id="inner-1"):
            inner = current_owner()
        outer = current_owner()
    assert (inner.task_id, inner.task_name, inner.worker) == ("inner-1", "outer", "w@h")
    assert (outer.task_id, outer.task_name) == (None, "outer")
    with pytest.raises(ValueError), owner_context(command="boom"):
        raise ValueError("inside")
    assert current_owner().command is None
    with pytest.raises(TypeError, match="unknown fields: \\['colour'\\]"):
        owner_context(colour="red")

    seen: list[tuple[str | None, str | None]] = []

    @owner_context(command="job")
    def job(depth: int) -> None:
        with owner_context(task_id=f"depth-{depth}"):
            seen.append((current_owner().command, current_owner().task_id))
            if depth:
                job(depth - 1)
        seen.append((current_owner().command, current_owner().task_id))

    job(1)
    assert seen == [("job", "depth-1"), ("job", "depth-0"), ("job", "depth-1"), ("job", None)]
    assert current_owner().command is None

    reused = owner_context(task_id="again")
    for _ in range(2):  # one after the other: fine
        with reused:
            assert current_owner().task_id == "again"
    with reused, pytest.raises(RuntimeError, match="already entered"), reused:
        pass  # inside itself: refused, not a context left set
    assert current_owner().task_id is None


def test_an_async_generator_dropped_inside_async_with_releases_its_lock(redis_url: str) -> None:
    """A generator left inside ``async with`` is closed in a task of its own: by the loop's
    finalizer hook once dropped, by ``shutdown_asyncgens`` (which ``asyncio.run`` calls)
    if still referenced when the loop ends. Either way the block is left in another task
    than it entered, and the lock must still be released."""
    lock = AsyncLock("agen", ttl=30, backend=redis_url)

    async def rows() -> AsyncIterator[int]:
        async with lock:
            yield 1
            yield 2

    async def dropped() -> None:
        stream = rows()
        assert await anext(stream) == 1
        assert holder_token(redis_url, "agen") is not None
        del stream  # a cut stream: its aclose() runs in a task the loop's hook makes
        deadline = time.monotonic() + 10
        while holder_token(redis_url, "agen") is not None:
            assert time.monotonic() < deadline, "the dropped generator's lock is still held"
            await asyncio.sleep(0.01)

    asyncio.run(dropped())

    kept: list[AsyncIterator[int]] = []

    async def left_open() -> None:
        kept.append(rows())
        assert await anext(kept[0]) == 1

    asyncio.run(left_open())
    assert holder_token(redis_url, "agen") is None


def test_a_generator_resumed_in_another_thread_releases_its_lock(redis_url: str) -> None:
    lock = Lock("gen-threads", ttl=30, backend=redis_url)

    def rows() -> Iterator[int]:
        with lock:
            yield 1
            yield 2

    stream = rows()
    assert next(stream) == 1
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(next, stream, None).result(timeout=10) == 2
        assert pool.submit(next, stream, None).result(timeout=10) is None  # the block ends
    assert holder_token(redis_url, "gen-threads") is None


def test_a_block_left_elsewhere_among_several_holders_is_refused_by_name(redis_url: str) -> None:
    """With two live threads' leases out on one Semaphore object, the one meant by a block
    left in a third thread cannot be told: a clear error, and nothing released."""
    semaphore = Semaphore("two-slots", limit=2, ttl=30, backend=redis_url)
    entered = threading.Barrier(3, timeout=10)
    done = threading.Event()

    def hold() -> None:
        with semaphore:
            entered.wait()
            done.wait(10)

    holders = [threading.Thread(target=hold) for _ in range(2)]
    for thread in holders:
        thread.start()
    entered.wait()
    try:
        with pytest.raises(LockError, match=r"'two-slots'.*which one to release is unknown"):
            semaphore.__exit__(None, None, None)
        assert len(semaphore.holders()) == 2
    finally:
        done.set()
        for thread in holders:
            thread.join(10)
    assert semaphore.holders() == []
