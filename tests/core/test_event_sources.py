"""Real lock operations through the event stream into the Prometheus collectors.

Every front end here takes real locks on a real Redis; the assertions read the registry
the metrics subscriber fed, and the events and log records the operations produced.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from chaoskit.proxy import Proxy, ProxyHub
from event_fixtures import Value
from servers import RedisServer, wait_until

from task_locks import (
    AsyncLock,
    AsyncSemaphore,
    Election,
    Lock,
    LockHeld,
    LockLost,
    NotOwned,
    Semaphore,
    events,
    get_backend,
    locked,
)
from task_locks.events import LockEvent

prometheus_client = pytest.importorskip("prometheus_client")
pytestmark = pytest.mark.usefixtures("only_logging_stays")


def lock_labels(metric: Value) -> set[str]:
    assert events.flush(5.0)
    registry = metric.registry  # type: ignore[attr-defined]
    return {
        s.labels["lock"]
        for m in registry.collect()
        for s in m.samples
        if s.name.startswith("task_locks_") and "lock" in s.labels
    }


def acquisitions(metric: Value, lock: str, outcome: str) -> float:
    return metric("task_locks_acquisitions_total", lock=lock, outcome=outcome)


def loss_records(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    """Records from any task_locks logger about lock ``name`` being lost (not the force
    release itself, which the backend logs)."""
    assert events.flush(5.0)
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("task_locks")
        and repr(name) in r.getMessage()
        and "lost" in r.getMessage()
    ]


# -- conflict vs timeout ---------------------------------------------------------------


def test_a_try_once_is_a_conflict_and_a_bounded_wait_a_timeout(
    redis_url: str, metric: Value, seen: list[LockEvent]
) -> None:
    with Lock("sync:1", ttl=5, backend=redis_url):
        assert Lock("sync:1", ttl=5, backend=redis_url).try_acquire() is None
        with pytest.raises(LockHeld):
            Lock("sync:1", ttl=5, backend=redis_url).acquire(timeout=0.2)
    assert acquisitions(metric, "sync", "acquired") == 1
    assert acquisitions(metric, "sync", "conflict") == 1
    assert acquisitions(metric, "sync", "timeout") == 1
    assert metric("task_locks_held", lock="sync") == 0
    assert metric("task_locks_wait_seconds_count", lock="sync") == 3
    conflicts = [e for e in seen if e.kind == "conflict"]
    assert [e.timeout for e in conflicts] == [0, 0.2]
    assert 0 < conflicts[0].waited < 0.2 <= conflicts[1].waited  # type: ignore[operator]


def test_async_lock_feeds_the_same_metrics(redis_url: str, metric: Value) -> None:
    async def main() -> None:
        async with AsyncLock("report:1", ttl=5, backend=redis_url):
            assert await AsyncLock("report:1", ttl=5, backend=redis_url).try_acquire() is None
            with pytest.raises(LockHeld):
                await AsyncLock("report:1", ttl=5, backend=redis_url).acquire(timeout=0.1)
            assert metric("task_locks_held", lock="report") == 1
        await get_backend(redis_url).aclose()

    asyncio.run(main())
    assert acquisitions(metric, "report", "acquired") == 1
    assert acquisitions(metric, "report", "conflict") == 1
    assert acquisitions(metric, "report", "timeout") == 1
    assert metric("task_locks_held", lock="report") == 0
    assert metric("task_locks_hold_seconds_count", lock="report") == 1


def test_locked_reports_its_policy_and_a_skip_is_a_conflict(
    redis_url: str, metric: Value, seen: list[LockEvent]
) -> None:
    @locked("job:{n}", ttl=5, backend=redis_url, on_conflict="skip")
    def job(n: int) -> int:
        return n

    with Lock("job:1", ttl=5, backend=redis_url):
        assert job(1) is None
    assert job(1) == 1
    assert events.flush(5.0)
    conflict = next(e for e in seen if e.kind == "conflict")
    assert conflict.policy == "skip" and "job" in conflict.detail
    assert acquisitions(metric, "job", "conflict") == 1
    assert acquisitions(metric, "job", "acquired") == 2
    assert metric("task_locks_held", lock="job") == 0


def test_a_wait_that_ends_acquired_is_an_acquisition_not_a_conflict(
    redis_url: str, metric: Value, seen: list[LockEvent]
) -> None:
    """``on_conflict="wait"`` meets the holder, waits, runs: one
    ``acquired`` with the whole wait in ``waited``, no ``conflict`` (a conflict is an
    acquire given up); only a wait that runs out is one, as a timeout."""

    @locked("report:{n}", ttl=5, backend=redis_url, on_conflict="wait", timeout=10)
    def report(n: int) -> int:
        return n

    for _ in range(3):  # three calls, all of which met a holder and ran
        holder = Lock("report:1", ttl=5, backend=redis_url).acquire()
        threading.Timer(0.2, holder.release).start()
        assert report(1) == 1
    assert events.flush(5.0)
    assert [e for e in seen if e.kind == "conflict"] == []
    waits = [e.waited for e in seen if e.kind == "acquired" and "report" in e.detail]
    assert len(waits) == 3 and all(w is not None and w >= 0.15 for w in waits), waits
    assert acquisitions(metric, "report", "conflict") == 0
    assert acquisitions(metric, "report", "acquired") == 6  # 3 holders, 3 waiters
    assert metric("task_locks_wait_seconds_bucket", lock="report", le="0.1") == 3  # holders

    @locked("report:{n}", ttl=5, backend=redis_url, on_conflict="wait", timeout=0.2)
    def impatient(n: int) -> int:
        return n

    with Lock("report:1", ttl=5, backend=redis_url), pytest.raises(LockHeld):
        impatient(1)
    assert events.flush(5.0)
    [gave_up] = [e for e in seen if e.kind == "conflict"]
    assert gave_up.policy == "wait" and gave_up.timeout == 0.2 and gave_up.waited >= 0.2  # type: ignore[operator]
    assert acquisitions(metric, "report", "timeout") == 1
    assert acquisitions(metric, "report", "conflict") == 0


def test_a_lost_reason_is_the_one_the_code_decided_never_read_from_words(
    metric: Value,
) -> None:
    """The metric's label is the event's :class:`LostReason`; a message
    that would read as another reason changes nothing (the words were matched before)."""
    misleading = "its TTL ran out: it was force-released, or max_hold, or unreachable"
    events.emit(events.Lost(name="sync:1", reason=events.LostReason.DEADLINE, message=misleading))
    events.emit(events.Lost(name="sync:2", reason=events.LostReason.UNKNOWN, message="whatever"))
    assert metric("task_locks_lost_total", lock="sync", reason="deadline") == 1
    assert metric("task_locks_lost_total", lock="sync", reason="unknown") == 1
    assert metric("task_locks_lost_total", lock="sync", reason="forced") == 0
    with pytest.raises(TypeError):  # each kind takes its own fields, checked where made
        events.Acquired(name="x", reason="why")  # type: ignore[call-arg]
    with pytest.raises(dataclasses.FrozenInstanceError):
        events.Acquired(name="x").name = "y"  # type: ignore[misc]
    assert events.EventKind.LOST == "lost" and events.Lost.kind == "lost"  # the public names


# -- semaphores, elections -------------------------------------------------------------


def test_semaphore_permits_are_counted_under_the_semaphores_family(
    redis_url: str, metric: Value, seen: list[LockEvent]
) -> None:
    pool = Semaphore("export:7", limit=2, ttl=5, backend=redis_url)
    first, second = pool.acquire(timeout=0), pool.acquire(timeout=0)
    assert metric("task_locks_held", lock="export") == 2
    assert pool.try_acquire() is None
    with pytest.raises(LockHeld):
        pool.acquire(timeout=0.1)
    first.release()
    second.release()
    assert acquisitions(metric, "export", "acquired") == 2
    assert acquisitions(metric, "export", "conflict") == 1
    assert acquisitions(metric, "export", "timeout") == 1
    assert metric("task_locks_held", lock="export") == 0
    assert lock_labels(metric) == {"export"}
    acquired = [e.name for e in seen if e.kind == "acquired"]
    assert sorted(acquired) == sorted([first.name, second.name])
    assert {e.name for e in seen if e.kind == "conflict"} == {"export:7"}


def test_async_semaphore_balances_held(redis_url: str, metric: Value) -> None:
    async def main() -> None:
        async with AsyncSemaphore("pool", limit=3, ttl=5, backend=redis_url):
            assert metric("task_locks_held", lock="pool") == 1
        await get_backend(redis_url).aclose()

    asyncio.run(main())
    assert metric("task_locks_held", lock="pool") == 0
    assert acquisitions(metric, "pool", "acquired") == 1


def test_an_election_leader_is_acquired_then_released(
    redis_url: str, metric: Value, seen: list[LockEvent]
) -> None:
    leader = Election("beat", ttl=5, backend=redis_url).campaign(timeout=0)
    with pytest.raises(LockHeld):
        Election("beat", ttl=5, backend=redis_url, identity="other").campaign(timeout=0)
    assert metric("task_locks_held", lock="election") == 1
    leader.resign()
    assert metric("task_locks_held", lock="election") == 0
    assert acquisitions(metric, "election", "acquired") == 1
    assert acquisitions(metric, "election", "conflict") == 0  # a follower is routine
    assert [e.kind for e in seen if e.kind != "renewed"] == ["acquired", "released"]


# -- the task-locks CLI ----------------------------------------------------------------


def test_the_cli_run_reports_exit_policy_conflicts(
    redis_url: str, metric: Value, seen: list[LockEvent], capsys: pytest.CaptureFixture[str]
) -> None:
    from task_locks.cli import main

    assert main(["run", "nightly:1", "--url", redis_url, "--", sys.executable, "-c", ""]) == 0
    with Lock("nightly:1", ttl=5, backend=redis_url):
        assert main(["run", "nightly:1", "--url", redis_url, "--", "true"]) == 75
    assert acquisitions(metric, "nightly", "acquired") == 2
    assert acquisitions(metric, "nightly", "conflict") == 1
    assert metric("task_locks_held", lock="nightly") == 0
    assert [e.policy for e in seen if e.kind == "conflict"] == ["exit"]


# -- lost leases: reasons, and logged once ---------------------------------------------


def test_a_force_release_is_a_forced_loss_logged_once(
    redis_url: str, metric: Value, caplog: pytest.LogCaptureFixture
) -> None:
    lease = Lock("sync:2", ttl=5, backend=redis_url).acquire(timeout=0)
    assert get_backend(redis_url).force_release("sync:2")
    with pytest.raises(NotOwned):
        lease.release()
    assert metric("task_locks_lost_total", lock="sync", reason="forced") == 1
    assert metric("task_locks_held", lock="sync") == 0
    assert len(loss_records(caplog, "sync:2")) == 1


def test_a_lost_lease_in_a_failing_block_is_logged_once(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(RuntimeError), Lock("sync:3", ttl=5, backend=redis_url):
        assert get_backend(redis_url).force_release("sync:3")
        raise RuntimeError("the block failed")
    assert len(loss_records(caplog, "sync:3")) == 1


@pytest.mark.parametrize("body_fails", [False, True])
def test_a_lost_lease_under_locked_is_logged_once(
    redis_url: str, caplog: pytest.LogCaptureFixture, body_fails: bool
) -> None:
    @locked("job:{n}", ttl=5, backend=redis_url)
    def job(n: int) -> None:
        assert get_backend(redis_url).force_release(f"job:{n}")
        if body_fails:
            raise RuntimeError("the body failed")

    with pytest.raises(RuntimeError if body_fails else LockLost):
        job(4)
    assert len(loss_records(caplog, "job:4")) == 1


def test_a_renew_false_lease_held_past_its_ttl_is_a_deadline_loss(
    redis_url: str, metric: Value
) -> None:
    lease = Lock("sync:5", ttl=0.3, backend=redis_url, renew=False).acquire(timeout=0)
    # The lost flag turns true at the deadline by itself; the watch reports it just after.
    wait_until(
        lambda: metric("task_locks_lost_total", lock="sync", reason="deadline") == 1,
        2,
        "the loss at the deadline",
    )
    assert lease.lost.is_set()
    assert metric("task_locks_held", lock="sync") == 0


def test_an_unreachable_backend_fails_renewals_then_loses_the_lease(
    redis_factory: Callable[..., RedisServer],
    metric: Value,
    seen: list[LockEvent],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = redis_factory()
    lease = Lock("flaky:1", ttl=1.5, backend=server.url(socket_timeout=0.2)).acquire(timeout=0)
    server.pause()  # SIGSTOP: renewals time out
    try:
        wait_until(
            lambda: metric("task_locks_lost_total", lock="flaky", reason="unreachable") == 1,
            5,
            "the lease to be lost",
        )
    finally:
        server.resume()
    assert lease.lost.is_set()
    failed = [e for e in seen if e.kind == "renewal_failed"]
    assert failed and all(e.name == "flaky:1" and e.reason for e in failed)
    assert metric("task_locks_held", lock="flaky") == 0
    losses = loss_records(caplog, "flaky:1")
    assert len(losses) == 1 and "unreachable" in losses[0]


# -- a slow renewal --------------------------------------------------------------------


@pytest.fixture
def link(redis_server: RedisServer, redis_url: str) -> Iterator[Proxy]:
    hub = ProxyHub()
    yield hub.proxy(redis_server.port)
    hub.close()


def test_a_slow_renewal_is_reported_late(
    link: Proxy, seen: list[LockEvent], caplog: pytest.LogCaptureFixture
) -> None:
    from task_locks.watchdog import RENEWAL_LATE_FRACTION

    ttl = 1.5
    lease = Lock("slow:1", ttl=ttl, backend=f"redis://127.0.0.1:{link.port}/0").acquire(2)
    lease.renew()  # the script is loaded now: one round trip per renewal (no NOSCRIPT)
    link.latency(reply_delay=0.5)  # > a quarter of the TTL, well inside it
    try:
        wait_until(
            lambda: events.flush(1.0) and any(e.kind == "renewal_late" for e in seen),
            3 * ttl,
            "a late renewal",
        )
    finally:
        link.heal()
    assert lease.held
    late = next(e for e in seen if e.kind == "renewal_late")
    assert late.name == "slow:1" and late.duration is not None
    assert late.duration > RENEWAL_LATE_FRACTION * ttl
    assert any("renewing lock 'slow:1' took" in r.getMessage() for r in caplog.records)
    started = time.monotonic()
    lease.release()
    assert time.monotonic() - started < 2


def test_a_lost_leadership_is_logged_once_naming_the_candidate(
    redis_url: str, metric: Value, caplog: pytest.LogCaptureFixture
) -> None:
    election = Election("beat", ttl=1.2, backend=redis_url, identity="node-a")
    leader = election.campaign(timeout=0)
    assert get_backend(redis_url).force_release(leader.lease.name)
    wait_until(
        lambda: metric("task_locks_lost_total", lock="election", reason="forced") == 1,
        3,
        "the renewal to find the term over",
    )
    leader.resign()  # already over: nothing more to say
    losses = loss_records(caplog, leader.lease.name)
    assert len(losses) == 1 and "candidate node-a" in losses[0], losses
    assert not [r for r in caplog.records if "lost term" in r.getMessage()]


def test_a_garbage_collected_lease_is_a_dropped_loss(redis_url: str, metric: Value) -> None:
    Lock("sync:6", ttl=0.6, backend=redis_url).acquire(timeout=0)  # dropped at once
    gc.collect()
    wait_until(
        lambda: metric("task_locks_lost_total", lock="sync", reason="dropped") == 1,
        3,
        "the renewer to find the lease gone",
    )
    assert metric("task_locks_held", lock="sync") == 0


# -- prometheus_client multiprocess mode (prefork workers) ------------------------------

HOLDER = """
import sys
from task_locks import Lock, events, metrics
metrics.install()
lease = Lock(sys.argv[2], ttl=10, backend=sys.argv[1]).acquire(timeout=5)
assert events.flush(5.0)
print("held", flush=True)
sys.stdin.readline()
lease.release()
assert events.flush(5.0)
"""


def test_multiprocess_mode_sums_the_held_leases_of_live_workers(
    redis_url: str, tmp_path: Path
) -> None:
    import os
    import subprocess

    from prometheus_client import multiprocess

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", HOLDER, redis_url, f"mp:{i}"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]

    def value(name: str, **labels: str) -> float:
        registry = prometheus_client.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
        return registry.get_sample_value(name, labels) or 0.0

    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline().strip() == "held"
        assert value("task_locks_held", lock="mp") == 2
        for child in children:
            child.communicate("\n", timeout=10)
            assert child.returncode == 0
            multiprocess.mark_process_dead(child.pid, str(tmp_path))  # a worker's exit hook
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.communicate()
    assert value("task_locks_held", lock="mp") == 0
    assert value("task_locks_acquisitions_total", lock="mp", outcome="acquired") == 2
    assert value("task_locks_hold_seconds_count", lock="mp") == 2
