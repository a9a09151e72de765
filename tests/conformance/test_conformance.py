"""One set of test bodies, run against every backend.

What every backend promises, checked the way a user would: mutual exclusion under
thread and process contention, strictly increasing fences, token-checked release,
expiry of a dead holder within one TTL, renewal, hand-off wake-up, holders listing,
force release, capability demands, bad input and backend-down errors.
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from servers import wait_until

from task_locks import (
    AsyncLock,
    BackendUnavailable,
    Lock,
    LockHeld,
    LockLost,
    NotOwned,
    get_backend,
)
from task_locks.errors import InvalidArgument, MissingCapability
from task_locks.owner import owner_context
from task_locks.types import RenewItem

from .conftest import Deployment

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def check_turns(events: list[tuple[str, int]]) -> list[int]:
    """Events in the order they happened: enter/leave must alternate, fences grow."""
    fences: list[int] = []
    inside: int | None = None
    for kind, fence in events:
        if kind == "enter":
            assert inside is None, f"fence {fence} entered while fence {inside} was inside"
            assert not fences or fence > fences[-1], f"fence {fence} after {fences[-1]}"
            inside = fence
            fences.append(fence)
        else:
            assert inside == fence, f"fence {fence} left while {inside} was inside"
            inside = None
    assert inside is None
    return fences


def test_mutual_exclusion_between_threads(deployment: Deployment) -> None:
    threads, rounds = 4, 8
    events: list[tuple[str, int]] = []
    counter = [0]
    errors: list[BaseException] = []

    def contend() -> None:
        lock = Lock("threads", ttl=10, backend=deployment.url, timeout=30)
        try:
            for _ in range(rounds):
                with lock as lease:
                    events.append(("enter", lease.fence))
                    seen = counter[0]
                    time.sleep(0.001)  # widen the window a broken lock would let through
                    counter[0] = seen + 1
                    events.append(("leave", lease.fence))
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=contend) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert not errors, errors
    assert counter[0] == threads * rounds
    assert len(check_turns(events)) == threads * rounds


def test_mutual_exclusion_between_processes(deployment: Deployment, tmp_path: Path) -> None:
    if "multiprocess" not in deployment.capabilities:
        pytest.skip(
            f"not applicable: {deployment.kind}:// locks live in one process (no 'multiprocess')"
        )
    processes, rounds = 3, 6
    log = tmp_path / "turns.log"
    env = dict(os.environ, **deployment.env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    children = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "contender.py"),
                deployment.url,
                "procs",
                str(rounds),
                str(log),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for _ in range(processes)
    ]
    for child in children:
        out, _ = child.communicate(timeout=90)
        assert child.returncode == 0, out.decode(errors="replace")[-3000:]
    lines = [line.split() for line in log.read_text().splitlines()]
    fences = check_turns([(kind, int(fence)) for kind, fence, _pid in lines])
    assert len(fences) == processes * rounds
    assert len({pid for _k, _f, pid in lines}) == processes


def test_fences_strictly_increase(deployment: Deployment) -> None:
    backend = get_backend(deployment.url)
    fences = []
    for attempt in range(4):
        lease = Lock("fenced", ttl=5, backend=deployment.url).acquire(timeout=5)
        fences.append(lease.fence)
        holder = backend.holder("fenced")
        assert holder is not None and holder.fence == lease.fence
        if attempt == 2:
            assert backend.force_release("fenced")
            with pytest.raises(NotOwned):
                lease.release()
        else:
            lease.release()
    other = Lock("other-name", ttl=5, backend=deployment.url).acquire(timeout=5)
    other.release()
    last = Lock("fenced", ttl=5, backend=deployment.url).acquire(timeout=5)
    fences.append(last.fence)
    last.release()
    assert all(isinstance(f, int) for f in fences)
    assert fences == sorted(set(fences)), fences


def test_release_and_renew_are_token_checked(deployment: Deployment) -> None:
    backend = get_backend(deployment.url)
    first = Lock("checked", ttl=5, backend=deployment.url, renew=False).acquire(timeout=0)
    assert backend.release("checked", "not-the-token") is False
    assert backend.renew("checked", "not-the-token", 5000) is False
    assert backend.holder("checked").fence == first.fence  # type: ignore[union-attr]

    assert backend.force_release("checked")  # as if the first holder's TTL ran out
    second = Lock("checked", ttl=5, backend=deployment.url).acquire(timeout=5)
    with pytest.raises(NotOwned) as refused:
        first.release()
    assert refused.value.name == "checked"
    assert first.lost.is_set()
    with pytest.raises(LockLost):
        first.renew()

    holder = backend.holder("checked")
    assert holder is not None and holder.token == second.token and holder.fence == second.fence
    assert second.held
    second.release()
    assert backend.holder("checked") is None


def test_dead_holder_expires_within_one_ttl(deployment: Deployment) -> None:
    ttl = 1.0
    started = time.monotonic()
    # renew=False: the holder stops renewing, exactly what a crashed process does.
    dead = Lock("dead", ttl=ttl, backend=deployment.url, renew=False).acquire(timeout=0)
    lease = Lock("dead", ttl=10, backend=deployment.url).acquire(timeout=ttl + 5)
    freed_after = time.monotonic() - started
    assert lease.fence > dead.fence
    assert freed_after >= ttl * 0.98, f"granted {freed_after:.3f}s into a {ttl}s TTL"
    bound = math.ceil(ttl) + deployment.expiry_slack
    assert freed_after <= bound, f"freed after {freed_after:.3f}s, TTL {ttl}s"
    assert not dead.held
    with pytest.raises(LockLost):
        dead.check()
    lease.release()


def test_renewal_keeps_the_lock_past_its_ttl(deployment: Deployment) -> None:
    ttl = 1.0
    lease = Lock("renewed", ttl=ttl, backend=deployment.url).acquire(timeout=0)
    rival = Lock("renewed", ttl=ttl, backend=deployment.url)
    until = time.monotonic() + 1.8 * ttl
    while time.monotonic() < until:
        assert rival.try_acquire() is None
        time.sleep(0.2)  # sampling the lock over time, not synchronising
    assert lease.held and not lease.lost.is_set()
    assert lease.renewals >= 2
    lease.renew()  # an explicit renewal works too
    holder = get_backend(deployment.url).holder("renewed")
    assert holder is not None and holder.fence == lease.fence
    lease.release()
    successor = rival.try_acquire()
    assert successor is not None
    successor.release()


def blocking_wait(backend: Any, asynchronous: bool) -> str:
    """The backend method a waiting lock blocks in: with the server hand-off
    (Redis's default) it is the pop of its grant."""
    if backend.server_handoff:
        return "aawait_grant" if asynchronous else "await_grant"
    return "await_release" if asynchronous else "wait_release"


def test_release_wakes_a_waiter_at_once(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = get_backend(deployment.url)
    waiting = threading.Event()
    method = blocking_wait(backend, asynchronous=False)
    real_wait = getattr(backend, method)

    def spy_wait(*args: Any) -> Any:  # the real wait, observed
        waiting.set()
        return real_wait(*args)

    monkeypatch.setattr(backend, method, spy_wait)
    holder = Lock("handoff", ttl=30, backend=deployment.url).acquire(timeout=0)
    granted: list[float] = []
    fences: list[int] = []

    def wait_for_it() -> None:
        lease = Lock("handoff", ttl=30, backend=deployment.url).acquire(timeout=20)
        granted.append(time.perf_counter())
        fences.append(lease.fence)
        lease.release()

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    assert waiting.wait(10), "the waiter never started waiting"
    released = time.perf_counter()
    holder.release()
    waiter.join(timeout=20)
    assert granted, "the waiter did not get the lock"
    assert granted[0] - released < 0.5, f"hand-off took {granted[0] - released:.3f}s"
    assert fences[0] > holder.fence


def test_holders_lists_live_locks_with_owner(deployment: Deployment) -> None:
    backend = get_backend(deployment.url)
    with owner_context(task_id="task-123", task_name="app.sync"):
        first = Lock("jobs:a", ttl=30, backend=deployment.url).acquire(timeout=0)
    second = Lock("jobs:b", ttl=30, backend=deployment.url).acquire(timeout=0)
    other = Lock("other:c", ttl=30, backend=deployment.url).acquire(timeout=0)
    now = time.time()

    listed = backend.holders("jobs:")
    assert [h.name for h in listed] == ["jobs:a", "jobs:b"]
    a, b = listed
    assert (a.fence, b.fence) == (first.fence, second.fence)
    assert a.owner.task_id == "task-123" and a.owner.task_name == "app.sync"
    assert a.owner.pid == b.owner.pid == os.getpid()
    assert a.owner.host == socket.gethostname()
    assert a.acquired_at is not None and abs(a.acquired_at - now) < 5
    assert a.expires_at is not None and now < a.expires_at <= now + 32
    assert {h.name for h in backend.holders()} >= {"jobs:a", "jobs:b", "other:c"}

    first.release()
    assert [h.name for h in backend.holders("jobs:")] == ["jobs:b"]
    assert backend.holder("jobs:a") is None
    second.release()
    other.release()
    assert backend.holders() == []


def test_force_release_takes_the_lock_away(deployment: Deployment) -> None:
    backend = get_backend(deployment.url)
    lost: list[object] = []
    lease = Lock("forced", ttl=30, backend=deployment.url, on_lost=lost.append).acquire(timeout=0)
    assert backend.force_release("forced") is True
    assert backend.holder("forced") is None
    # NotOwned from the server; or LockLost at once where the release notice got here
    # first (etcd's watch can beat the holder() read above: seen on main, 1 run in 3).
    with pytest.raises(LockLost):
        lease.renew()
    # on_lost runs on the callback thread, never on the caller's or a lane's.
    wait_until(lambda: lost == [lease], timeout=5, what="on_lost for the forced lease")
    successor = Lock("forced", ttl=30, backend=deployment.url).acquire(timeout=0)
    assert successor.fence > lease.fence
    successor.release()
    assert backend.force_release("forced") is False
    assert backend.force_release("never-held") is False


def test_renew_many_answers_per_lease(deployment: Deployment) -> None:
    backend = get_backend(deployment.url)
    mine = Lock("batch:1", ttl=5, backend=deployment.url, renew=False).acquire(timeout=0)
    other = Lock("batch:2", ttl=5, backend=deployment.url, renew=False).acquire(timeout=0)
    answers = backend.renew_many(
        [
            RenewItem("batch:1", mine.token, 5000),
            RenewItem("batch:2", "someone-else", 5000),
            RenewItem("batch:3", "nobody", 5000),
        ]
    )
    assert answers == [True, False, False]
    mine.release()
    other.release()


def test_capabilities_are_declared_and_demanded(deployment: Deployment) -> None:
    capabilities = deployment.capabilities
    assert capabilities <= {
        "fencing", "consensus", "multiprocess", "wakeup", "holders", "release_notice",
        "server_handoff", "run_check",
    }  # fmt: skip
    assert {"fencing", "holders", "run_check"} <= capabilities
    assert ("consensus" in capabilities) == deployment.kind.startswith("etcd")
    # A force release is announced to the holder's process (Redis pub/sub, etcd's watch,
    # PostgreSQL's NOTIFY); Redis Cluster, Redlock, MySQL, SQLite and memory do not.
    silent = {"cluster", "redlock", "memory", "django-sqlite", "django-mysql"}
    assert ("release_notice" in capabilities) == (deployment.kind not in silent)
    # Redis's default (not Redlock's; TASK_LOCKS_TEST_HANDOFF=client opts out).
    redis_kinds = {"redis", "rediss", "redis-acl", "sentinel", "cluster"}
    assert ("server_handoff" in capabilities) == (
        deployment.kind in redis_kinds and "handoff=client" not in deployment.url
    )
    lock = Lock("demanding", ttl=5, backend=deployment.url, require={"fencing", "consensus"})
    if "consensus" in capabilities:
        lock.acquire(timeout=0).release()
    else:
        with pytest.raises(MissingCapability) as missing:
            lock.acquire(timeout=0)
        assert "consensus" in str(missing.value) and missing.value.name == "demanding"


def test_bad_input_is_refused_at_definition(deployment: Deployment) -> None:
    for bad in [{"name": ""}, {"name": "   "}, {"name": "x" * 600}]:
        with pytest.raises(InvalidArgument):
            Lock(bad["name"], ttl=5, backend=deployment.url)
    for ttl in [0, -1, float("nan"), float("inf"), "10"]:
        with pytest.raises(InvalidArgument, match="ttl"):
            Lock("ok", ttl=ttl, backend=deployment.url)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="timeout"):
        Lock("ok", ttl=5, backend=deployment.url, timeout=-1)
    with pytest.raises(InvalidArgument, match="timeout"):
        Lock("ok", ttl=5, backend=deployment.url).acquire(timeout="soon")  # type: ignore[arg-type]
    for url in deployment.bad_urls:
        with pytest.raises(InvalidArgument) as refused:
            Lock("ok", ttl=5, backend=url)
        assert "password" not in str(refused.value)


def test_acquire_times_out_with_the_holder_named(deployment: Deployment) -> None:
    with owner_context(command="nightly-report"):
        held = Lock("busy", ttl=30, backend=deployment.url).acquire(timeout=0)
    started = time.monotonic()
    with pytest.raises(LockHeld) as refused:
        Lock("busy", ttl=30, backend=deployment.url).acquire(timeout=0.3)
    assert 0.25 <= time.monotonic() - started < 3
    assert refused.value.name == "busy"
    assert refused.value.holder is not None
    assert refused.value.holder.owner.command == "nightly-report"
    assert "nightly-report" in str(refused.value)
    held.release()


def test_async_lock_hands_over_and_fences_grow(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = get_backend(deployment.url)
    waiting: list[str] = []
    method = blocking_wait(backend, asynchronous=True)
    real_await_release = getattr(backend, method)

    async def spy_await_release(*args: Any) -> Any:  # the real wait, observed
        waiting.append(args[0])
        return await real_await_release(*args)

    monkeypatch.setattr(backend, method, spy_await_release)

    async def scenario() -> None:
        first = await AsyncLock("async", ttl=10, backend=deployment.url).acquire(timeout=0)
        assert await AsyncLock("async", ttl=10, backend=deployment.url).try_acquire() is None
        waiter = asyncio.create_task(
            AsyncLock("async", ttl=10, backend=deployment.url).acquire(timeout=10)
        )
        await eventually(lambda: waiting, 10, "the waiter to wait")
        released = time.perf_counter()
        await first.release()
        second = await asyncio.wait_for(waiter, 10)
        assert time.perf_counter() - released < 0.5
        assert second.fence > first.fence
        holder = await AsyncLock("async", backend=deployment.url).holder()
        assert holder is not None and holder.fence == second.fence
        assert [h.name for h in await backend.aholders("async")] == ["async"]
        await second.release()
        with pytest.raises(LockLost):
            await second.renew()
        await backend.aclose()

    asyncio.run(scenario())


async def eventually(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """``wait_until`` for code running in the event loop (bounded polling, no thread)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.01)


def test_async_waiters_do_not_hold_up_the_holder(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More waiting AsyncLocks than the loop's default executor has threads: the holder
    is still renewed, and its release goes through at once.

    (A backend whose asyncio calls run its sync ones in threads used to wait in that
    executor as well: the holder's renewal queued behind the waits until its lease ran
    out, and its release raised ``NotOwned``.)
    """
    # The default executor has min(32, cpus + 4) threads. The TTL leaves a loaded
    # machine room for the holder's renewals (0.6 s lost it under load on Redlock).
    waiters, ttl = 12, 1.2
    backend = get_backend(deployment.url)
    waiting: set[object] = set()
    method = blocking_wait(backend, asynchronous=True)
    real_await_release = getattr(backend, method)

    async def spy_await_release(*args: Any) -> Any:  # the real wait, observed
        waiting.add(asyncio.current_task())
        return await real_await_release(*args)

    monkeypatch.setattr(backend, method, spy_await_release)

    async def scenario() -> None:
        holder = await AsyncLock("crowd", ttl=ttl, backend=deployment.url).acquire(timeout=0)
        fences: list[int] = []

        async def wait_for_it() -> None:
            lease = await AsyncLock("crowd", ttl=10, backend=deployment.url).acquire(timeout=30)
            fences.append(lease.fence)
            await lease.release()

        tasks = [asyncio.create_task(wait_for_it()) for _ in range(waiters)]
        await eventually(lambda: len(waiting) == waiters, 10, f"{waiters} waiters to wait")
        renewals = holder.renewals
        await eventually(lambda: holder.renewals >= renewals + 2, 5 * ttl, "two renewals")
        assert holder.held and not holder.lost.is_set()
        started = time.monotonic()
        await holder.release()
        assert time.monotonic() - started < 1.0  # sanity bound: not queued behind the waits
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert len(fences) == waiters
        assert fences == sorted(set(fences)) and fences[0] > holder.fence
        await backend.aclose()

    asyncio.run(scenario())


def test_backend_down_raises_backend_unavailable(private_deployment: Deployment) -> None:
    deployment = private_deployment
    lease = Lock("outage", ttl=5, backend=deployment.url, renew=False).acquire(timeout=0)
    assert deployment.stop is not None
    deployment.stop()
    backend = get_backend(deployment.url)
    started = time.monotonic()
    with pytest.raises(BackendUnavailable) as down:
        Lock("outage", ttl=5, backend=deployment.url).acquire(timeout=1)
    assert time.monotonic() - started < 10
    assert down.value.name == "outage"
    assert down.value.server == backend.server
    assert "unavailable" in str(down.value) or "answer" in str(down.value)
    with pytest.raises(BackendUnavailable):
        lease.release()
    with pytest.raises(BackendUnavailable):
        backend.holders()
    with pytest.raises(BackendUnavailable):
        backend.renew_many([RenewItem("outage", lease.token, 5000)])
