"""``@locked``: any function, plain or async, under a named lock.

Runs on every backend (the conformance deployments, and Redis Sentinel and Cluster).
The key templates are the ones of ``@singleton_task`` (same code: task_locks.keys),
checked at definition time.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from deployments import REDIS_TOPOLOGIES, build_deployment, deployment_params

import task_locks
from task_locks import (
    AsyncLock,
    InvalidArgument,
    Lock,
    LockHeld,
    LockLost,
    current_lease,
    events,
    get_backend,
    locked,
)


@pytest.fixture(params=deployment_params(*REDIS_TOPOLOGIES))
def url(request: pytest.FixtureRequest) -> str:
    """Every conformance deployment (tests/deployments.py), Sentinel and Cluster too."""
    return build_deployment(request, request.param).url


def test_key_template_names_the_lock_and_the_lease_is_reachable_inside(url: str) -> None:
    seen: list[tuple[str, int, object]] = []

    @locked("sync:{account_id}:{mode}", ttl=10, backend=url)
    def sync_account(account_id: int, mode: str = "full") -> str:
        lease = current_lease()
        assert lease is not None and lease.held
        holder = get_backend(url).holder(lease.name)
        seen.append((lease.name, lease.fence, holder and holder.fence))
        return "done"

    assert current_lease() is None
    assert sync_account(42) == "done"
    assert sync_account(account_id=42, mode="full") == "done"  # defaults applied: same lock
    assert [name for name, _, _ in seen] == ["sync:42:full", "sync:42:full"]
    assert all(fence == server_fence for _, fence, server_fence in seen)
    assert seen[1][1] > seen[0][1]
    assert sync_account.lock_name(7) == "sync:7:full"  # type: ignore[attr-defined]
    assert sync_account.__name__ == "sync_account"
    assert current_lease() is None
    assert get_backend(url).holder("sync:42:full") is None  # released after the call


def test_templates_are_checked_against_the_signature_at_definition() -> None:
    def job(account_id: int) -> None: ...

    with pytest.raises(InvalidArgument, match="names unknown argument 'acount_id'"):
        locked("sync:{acount_id}")(job)
    with pytest.raises(InvalidArgument, match="positional field"):
        locked("sync:{0}")(job)
    with pytest.raises(InvalidArgument, match="on_conflict"):
        locked("sync:{account_id}", on_conflict="retry")
    with pytest.raises(InvalidArgument, match="ttl"):
        locked("sync:{account_id}", ttl=0)
    with pytest.raises(InvalidArgument, match="timeout"):
        locked("sync:{account_id}", timeout=-1)
    with pytest.raises(InvalidArgument):
        locked("sync:{account_id}", backend="redis://127.0.0.1:notaport/0")


def test_default_key_hashes_the_arguments(url: str) -> None:
    names: list[str] = []

    @locked(backend=url)
    def report(day: str, *, full: bool = False) -> None:
        lease = current_lease()
        assert lease is not None
        names.append(lease.name)

    report("2026-12-01")
    report(day="2026-12-01", full=False)
    report("2026-12-02")
    assert names[0] == names[1] != names[2]
    assert names[0].startswith(f"{__name__}.test_default_key_hashes_the_arguments.")


def test_skip_returns_none_without_calling(url: str) -> None:
    calls: list[int] = []

    @locked("job:{n}", backend=url)  # on_conflict="skip", timeout=0
    def job(n: int) -> int:
        calls.append(n)
        return n

    with Lock("job:1", ttl=10, backend=url):
        assert job(1) is None
        assert job(2) == 2  # another key is free
    assert calls == [2]
    assert job(1) == 1


def test_raise_names_the_holder(url: str) -> None:
    @locked("job:{n}", on_conflict="raise", backend=url)
    def job(n: int) -> int:
        return n

    with Lock("job:1", ttl=10, backend=url) as holding:
        with pytest.raises(LockHeld) as held:
            job(1)
    assert held.value.name == "job:1"
    assert held.value.holder is not None and held.value.holder.fence == holding.fence


def test_wait_runs_after_the_holder_releases(url: str) -> None:
    @locked("job:{n}", on_conflict="wait", timeout=10, backend=url)
    def job(n: int) -> int:
        lease = current_lease()
        assert lease is not None
        return lease.fence

    holding = Lock("job:1", ttl=10, backend=url).acquire()
    result: list[int] = []
    waiter = threading.Thread(target=lambda: result.append(job(1)))
    waiter.start()
    waiter.join(0.3)  # it waits while the lock is held
    assert waiter.is_alive() and not result
    holding.release()
    waiter.join(10)
    assert not waiter.is_alive() and result and result[0] > holding.fence

    @locked("job:{n}", on_conflict="wait", timeout=0.2, backend=url)
    def impatient(n: int) -> int:
        return n

    with Lock("job:1", ttl=10, backend=url), pytest.raises(LockHeld):
        impatient(1)


def test_a_failing_body_releases_and_a_lost_lease_fails_the_call(url: str) -> None:
    @locked("job:{n}", ttl=10, backend=url)
    def boom(n: int) -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        boom(1)
    assert get_backend(url).holder("job:1") is None

    @locked("job:{n}", ttl=10, backend=url)
    def taken_away(n: int) -> str:
        get_backend(url).force_release(f"job:{n}")  # as if the TTL ran out mid-call
        return "finished"

    with pytest.raises(LockLost):
        taken_away(2)


def test_async_functions_share_the_policies(url: str) -> None:
    async def scenario() -> None:
        inside = asyncio.Event()
        leave = asyncio.Event()
        fences: list[int] = []

        @locked("ajob:{n}", ttl=10, backend=url)
        async def ajob(n: int) -> int:
            lease = current_lease()
            assert lease is not None and lease.name == f"ajob:{n}"
            fences.append(lease.fence)
            inside.set()
            await leave.wait()
            return n

        first = asyncio.create_task(ajob(1))
        await asyncio.wait_for(inside.wait(), 5)
        assert await ajob(1) is None  # skipped: the first call holds ajob:1
        leave.set()
        assert await asyncio.wait_for(first, 5) == 1
        assert current_lease() is None
        assert await ajob(1) == 1
        assert len(fences) == 2 and fences[1] > fences[0]

        @locked("ajob:{n}", on_conflict="raise", backend=url)
        async def strict(n: int) -> int:
            return n

        held = await AsyncLock("ajob:3", ttl=10, backend=url).acquire()
        with pytest.raises(LockHeld):
            await strict(3)
        await held.release()
        assert await strict(3) == 3
        await get_backend(url).aclose()

    asyncio.run(scenario())


def test_a_conflict_is_reported_as_an_event_with_the_policy(url: str) -> None:
    """A skip is a ``conflict`` event with policy "skip" (as ``@singleton_task``'s), sync
    and async; "raise" and "wait" report theirs, naming the function."""
    seen: list[events.LockEvent] = []
    subscription = events.subscribe(seen.append, {"conflict"})

    @locked("ev:{n}", backend=url)
    def skipping(n: int) -> int:
        return n

    @locked("ev:{n}", backend=url)
    async def askipping(n: int) -> int:
        return n

    async def askip_once() -> int | None:
        try:
            return await askipping(1)
        finally:
            await get_backend(url).aclose()  # this loop's client ends with it

    @locked("ev:{n}", on_conflict="raise", backend=url)
    def raising(n: int) -> int:
        return n

    @locked("ev:{n}", on_conflict="wait", timeout=0.1, backend=url)
    def waiting(n: int) -> int:
        return n

    try:
        with Lock("ev:1", ttl=10, backend=url):
            assert skipping(1) is None
            assert asyncio.run(askip_once()) is None
            with pytest.raises(LockHeld):
                raising(1)
            with pytest.raises(LockHeld):
                waiting(1)
        assert events.flush(5.0)
    finally:
        subscription.close()
    got = [(e.name, e.policy, e.detail.rpartition(".")[2]) for e in seen]
    assert got == [
        ("ev:1", "skip", "skipping"),
        ("ev:1", "skip", "askipping"),
        ("ev:1", "raise", "raising"),
        ("ev:1", "wait", "waiting"),  # the wait ran out (meeting the holder gave up nothing)
    ]
    assert all(e.detail.startswith(f"function {__name__}.") for e in seen)


def test_one_current_lease_for_celery_and_locked() -> None:
    from task_locks import celery
    from task_locks.celery import keys

    assert celery.current_lease is task_locks.current_lease
    assert keys.TaskKey is task_locks.keys.TaskKey  # old import path kept
