"""Leader election: one leader at a time, increasing terms, wake-ups, fail-over."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import threading
import time
import uuid
from typing import Any

import pytest
from procs import expiry_slack, output
from servers import wait_until

from task_locks import AsyncElection, Election, InvalidArgument, LockHeld, LockLost, get_backend
from task_locks.election import describe, leader_info


def unique(prefix: str = "e") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def spy_backend(url: str, event: threading.Event, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The real backend for ``url``, whose waits also say that a candidate is waiting
    (Redis's default server hand-off waits in the pop of its grant)."""
    backend = get_backend(url)
    sync_name, async_name = (
        ("await_grant", "aawait_grant")
        if backend.server_handoff
        else ("wait_release", "await_release")
    )
    wait, await_release = getattr(backend, sync_name), getattr(backend, async_name)

    def spied_wait(*args: Any) -> Any:
        event.set()
        return wait(*args)

    async def spied_await_release(*args: Any) -> Any:
        event.set()
        return await await_release(*args)

    monkeypatch.setattr(backend, sync_name, spied_wait)
    monkeypatch.setattr(backend, async_name, spied_await_release)
    return backend


def test_one_leader_terms_increase_and_leader_is_named(local_url: str) -> None:
    name = unique()
    first = Election(name, ttl=5, backend=local_url, identity="alpha")
    second = Election(name, ttl=5, backend=local_url, identity="beta")

    leadership = first.campaign(timeout=1)
    assert first.is_leader and leadership.held
    assert second.try_campaign() is None
    info = second.leader()
    assert info is not None
    assert (info.election, info.identity, info.term) == (name, "alpha", leadership.term)
    assert info.since is not None and abs(info.since - time.time()) < 5
    assert first.campaign() is leadership  # already leading: the same term

    with pytest.raises(LockHeld, match=f"election '{name}' is led by"):
        second.campaign(timeout=0.05)

    assert first.resign() is True
    assert first.resign() is False
    assert second.leader() is None
    later = second.campaign(timeout=1)
    assert later.term > leadership.term
    assert second.leader().identity == "beta"  # type: ignore[union-attr]
    later.resign()


def test_blocked_campaign_is_woken_by_resignation(
    local_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = unique()
    waiting = threading.Event()
    leader = Election(name, ttl=30, backend=local_url)
    waiter = Election(name, ttl=30, backend=spy_backend(local_url, waiting, monkeypatch))
    leader.campaign(timeout=1)
    won: list[tuple[float, int]] = []
    thread = threading.Thread(
        target=lambda: won.append((time.monotonic(), waiter.campaign(timeout=10).term))
    )
    thread.start()
    assert waiting.wait(5), "the candidate never waited"
    resigned = time.monotonic()
    leader.resign()
    thread.join(10)
    assert won, "the waiting candidate was not elected"
    # Woken by the resignation, not by the 30 s TTL.
    assert won[0][0] - resigned < 1.0
    waiter.resign()


def test_callbacks_and_loss_of_leadership(local_url: str) -> None:
    name = unique()
    elected: list[int] = []
    lost = threading.Event()
    election = Election(
        name,
        ttl=0.3,
        backend=local_url,
        on_elected=lambda leadership: elected.append(leadership.term),
        on_lost=lambda leadership: lost.set(),
    )
    leadership = election.campaign(timeout=1)
    assert elected == [leadership.term]
    # An operator takes the election away: the next renewal notices and says so.
    assert election.backend.force_release(election.lock_name)
    assert lost.wait(3), "on_lost was not called"
    assert not election.is_leader
    with pytest.raises(LockLost):
        leadership.check()
    assert election.resign() is False


def test_context_manager_and_describe(local_url: str) -> None:
    name = unique()
    with Election(name, ttl=5, backend=local_url, identity="ctx") as leadership:
        holders = get_backend(local_url).holders()
        infos = describe(holders)
        assert [(i.election, i.identity, i.term) for i in infos] == [(name, "ctx", leadership.term)]
        assert "ctx (term" in infos[0].describe()
    assert Election(name, backend=local_url).leader() is None
    assert leader_info(None) is None


def test_observe_reports_each_change(local_url: str) -> None:
    name = unique()
    seen: list[int | None] = []
    watcher = Election(name, ttl=5, backend=local_url)
    started = threading.Event()

    def observe() -> None:
        for info in watcher.observe(interval=0.01, timeout=3):
            seen.append(None if info is None else info.term)
            started.set()
            if len([t for t in seen if t is not None]) == 2:
                return

    thread = threading.Thread(target=observe)
    thread.start()
    assert started.wait(3)
    a, b = Election(name, backend=local_url), Election(name, backend=local_url)
    first = a.campaign(timeout=1)
    wait_until(lambda: first.term in seen, 3, "the first term observed")
    a.resign()
    second = b.campaign(timeout=1)
    thread.join(5)
    b.resign()
    assert seen[0] is None
    assert [t for t in seen if t is not None] == [first.term, second.term]


def test_bad_arguments_fail_at_definition() -> None:
    with pytest.raises(InvalidArgument):
        Election("", backend="memory://")
    with pytest.raises(InvalidArgument, match="identity"):
        Election("x", backend="memory://", identity="  ")
    with pytest.raises(InvalidArgument, match="ttl"):
        Election("x", ttl=0, backend="memory://")
    with pytest.raises(InvalidArgument, match="interval"):
        next(Election("x", backend="memory://").observe(interval=0))


def test_async_election(local_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        name = unique()
        elected = asyncio.Event()

        async def on_elected(leadership: Any) -> None:
            elected.set()

        waiting = threading.Event()
        first = AsyncElection(name, ttl=30, backend=local_url, on_elected=on_elected)
        second = AsyncElection(
            name, ttl=30, backend=spy_backend(local_url, waiting, monkeypatch), identity="second"
        )
        leadership = await first.campaign(timeout=1)
        assert elected.is_set()
        assert await second.try_campaign() is None
        waiting.clear()
        waiter = asyncio.create_task(second.campaign(timeout=10))
        assert await asyncio.to_thread(waiting.wait, 5), "the candidate never waited"
        resigned = time.monotonic()
        assert await first.resign()
        later = await waiter
        assert time.monotonic() - resigned < 1.0
        assert later.term > leadership.term
        info = await first.leader()
        assert info is not None and info.identity == "second"
        observed = [i async for i in second.observe(interval=0.01, timeout=0.05)]
        assert [i.term for i in observed if i] == [later.term]
        async with AsyncElection(unique(), backend=local_url) as other:
            assert other.held
        await second.resign()

    asyncio.run(main())


# -- three processes, one leader at any moment, fail-over on SIGKILL -----------------------


def test_three_processes_one_leader_and_failover_after_sigkill(
    shared_url: str, redis_url: str, log_redis: Any, spawn: Any
) -> None:
    name, ttl = unique("acceptance"), 2.0
    children = [spawn("candidate", shared_url, redis_url, name, ttl) for _ in range(3)]
    observer = Election(name, backend=shared_url)
    try:
        wait_until(
            lambda: log_redis.llen(f"{name}:terms") >= 8,
            20,
            "eight terms among three",
            alive=children,
        )
        log_redis.set(f"{name}:hold", 1)  # the leader now holds on, until killed

        def steady_leader() -> Any:
            info = observer.leader()
            time.sleep(0.1)
            again = observer.leader()
            return again if info and again and info.term == again.term else None

        victim = wait_until(steady_leader, 10, "a leader that holds on", alive=children)
        victim_pid = int(log_redis.hget(f"{name}:term:{victim.term}", "pid"))
        assert victim.identity == f"candidate-{victim_pid}"
        os.kill(victim_pid, signal.SIGKILL)
        killed_at = time.time()

        # The first term logged after the victim's (a candidate logs its term just after
        # campaign() returns). Not the first term `leader()` shows: under Redlock a
        # campaign that gives up (its timeout, or too little validity left) still shows
        # for a moment as the record it left on a majority, and is never logged.
        def first_term_after_the_victims() -> int | None:
            terms = [int(t) for t in log_redis.lrange(f"{name}:terms", 0, -1)]
            return next((t for t in terms if t > victim.term), None)

        term = wait_until(first_term_after_the_victims, ttl + 5, "a new leader after the SIGKILL")
        logged = log_redis.hgetall(f"{name}:term:{term}")
        took_over = float(logged["start"])
        assert int(logged["pid"]) != victim_pid
        successor = wait_until(
            lambda: (info := observer.leader()) is not None and info.term == term and info,
            5,
            "the observer to name the new leader",
        )
        assert successor.identity == f"candidate-{logged['pid']}"
        handover = took_over - killed_at
        assert handover <= ttl + expiry_slack(shared_url), f"hand-over took {handover:.2f}s"
    finally:
        log_redis.set(f"{name}:stop", 1)
    for child in children:
        if child.pid != victim_pid:
            assert child.wait(15) == 0, output(child)

    terms = [int(t) for t in log_redis.lrange(f"{name}:terms", 0, -1)]
    intervals = []
    for term in terms:
        data = log_redis.hgetall(f"{name}:term:{term}")
        assert "lost" not in data, f"term {term} was lost while held: {data}"
        intervals.append((float(data["start"]), float(data["end"]), term, data["pid"]))
    intervals.sort()
    assert len({pid for *_, pid in intervals}) >= 2
    for before, after in itertools.pairwise(intervals):
        assert after[0] >= before[1], f"two leaders at once: {before} and {after}"
        assert after[2] > before[2], f"terms out of order: {before} then {after}"
