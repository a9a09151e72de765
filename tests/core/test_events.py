"""The event stream: subscribers off the critical path, bounded, never failing a lock."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence

import pytest

from task_locks import BackendUnavailable, Lock, LockHeld, NotOwned, events, get_backend
from task_locks.events import LockEvent


@pytest.fixture(autouse=True)
def _no_subscribers() -> Iterator[None]:
    yield
    for subscription in events.subscriptions():
        if subscription is not events.logging_subscription:  # logging stays
            subscription.close()
    assert events.flush(5.0)


def test_subscribers_get_the_kinds_they_asked_for() -> None:
    seen: list[LockEvent] = []
    batches: list[Sequence[LockEvent]] = []
    events.subscribe(seen.append, {"acquired", "lost"})
    events.subscribe(batches.append, batch=True)
    events.emit(events.Acquired(name="sync:1", backend="redis://h", fence=7, waited=0.25))
    events.emit(events.Released(name="sync:1", held=1.5))
    events.emit(
        events.Lost(
            name="sync:1",
            reason=events.LostReason.FORCED,
            message="renewal found the lock's token gone",
        )
    )
    assert events.flush(5.0)
    assert [(e.kind, e.name) for e in seen] == [("acquired", "sync:1"), ("lost", "sync:1")]
    assert seen[0].fence == 7 and seen[0].waited == 0.25 and seen[0].family == "sync"
    assert [e.kind for batch in batches for e in batch] == ["acquired", "released", "lost"]


def test_unknown_kinds_are_refused_at_subscribe() -> None:
    with pytest.raises(ValueError, match=r"unknown lock event kind\(s\) \['aquired'\]"):
        events.subscribe(print, {"aquired"})


def test_without_subscribers_emit_starts_nothing() -> None:
    before = {t.name for t in threading.enumerate()}
    events.emit(events.Acquired(name="x"))
    assert "task-locks-events" not in {t.name for t in threading.enumerate()} - before
    assert not events.wanted("acquired")


def test_a_slow_subscriber_never_blocks_a_lock_and_drops_are_counted() -> None:
    release = threading.Event()
    entered = threading.Event()

    def stuck(event: LockEvent) -> None:
        entered.set()
        release.wait(30)

    events.subscribe(stuck, {"acquired"})
    try:
        events.emit(events.Acquired(name="first"))
        assert entered.wait(5), "the dispatcher never delivered"
        before = events.dropped()
        extra = 25
        # The dispatcher is stuck inside the subscriber with the first event (it counts
        # until delivered): the queue fills, then drops. Every emit returns (a blocking
        # one would hang this test until its timeout).
        for index in range(events.QUEUE_SIZE - 1 + extra):
            events.emit(events.Acquired(name=f"n:{index}"))
        assert events.dropped() - before == extra
    finally:
        release.set()
    assert events.flush(10.0)


def test_a_failing_subscriber_is_logged_and_others_still_get_events(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[str] = []

    def broken(event: LockEvent) -> None:
        raise RuntimeError("subscriber bug")

    events.subscribe(broken, name="broken")
    events.subscribe(lambda e: seen.append(e.name))
    events.emit(events.Conflict(name="a", policy="skip"))
    assert events.flush(5.0)
    assert seen == ["a"]
    assert "lock event subscriber broken failed" in caplog.text


def test_a_forked_child_keeps_the_subscriptions_with_a_dispatcher_of_its_own() -> None:
    read, write = os.pipe()

    def to_parent(event: LockEvent) -> None:
        os.write(write, f"{os.getpid()}:{event.name}\n".encode())

    events.subscribe(to_parent, {"acquired"})
    events.emit(events.Acquired(name="parent"))
    assert events.flush(5.0)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            events.emit(events.Acquired(name="child"))
            os._exit(0 if events.flush(5.0) else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    os.close(write)
    with os.fdopen(read) as lines:
        got = lines.read().split()
    assert os.waitstatus_to_exitcode(status) == 0
    assert got == [f"{os.getpid()}:parent", f"{pid}:child"]


def test_prometheus_metrics_use_the_name_family_not_the_name() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from task_locks import metrics

    registry = prometheus_client.CollectorRegistry()
    metrics.install(registry)
    try:
        events.emit(events.Acquired(name="sync:1", waited=0.2))
        events.emit(events.Acquired(name="sync:2", waited=0.0))
        events.emit(events.Conflict(name="sync:3", policy="skip", waited=0.0001, timeout=0))
        events.emit(events.Conflict(name="sync:3", policy="raise", waited=2.0, timeout=2.0))
        events.emit(events.Error(name="report", reason="unavailable"))
        events.emit(events.Released(name="sync:1", held=3.0))
        events.emit(
            events.Lost(
                name="sync:2",
                held=1.0,
                reason=events.LostReason.MAX_HOLD,
                message="max_hold exceeded",
            )
        )
        events.emit(events.Renewed(name="sync:1", backend="redis://127.0.0.1:1/0", duration=0.002))
        assert events.flush(5.0)
        value = registry.get_sample_value
        assert value("task_locks_acquisitions_total", {"lock": "sync", "outcome": "acquired"}) == 2
        assert value("task_locks_acquisitions_total", {"lock": "sync", "outcome": "conflict"}) == 1
        assert value("task_locks_acquisitions_total", {"lock": "sync", "outcome": "timeout"}) == 1
        assert value("task_locks_acquisitions_total", {"lock": "report", "outcome": "error"}) == 1
        assert value("task_locks_held", {"lock": "sync"}) == 0
        assert value("task_locks_hold_seconds_count", {"lock": "sync"}) == 2
        assert value("task_locks_wait_seconds_sum", {"lock": "sync"}) == pytest.approx(2.2001)
        assert value("task_locks_lost_total", {"lock": "sync", "reason": "max_hold"}) == 1
        assert value("task_locks_renewal_seconds_count", {"backend": "redis"}) == 1
        labels = {
            s.labels.get("lock")
            for m in registry.collect()
            for s in m.samples
            if s.name.startswith("task_locks_")
        }
        assert labels <= {None, "sync", "report"}
    finally:
        metrics.uninstall(registry)


def test_every_lock_operation_reports_one_event(redis_url: str) -> None:
    seen: list[LockEvent] = []
    events.subscribe(seen.append)
    with events.context(policy="skip", detail="nightly job"):
        lease = Lock("report:7", ttl=5, backend=redis_url).acquire(timeout=0)
        assert Lock("report:7", ttl=5, backend=redis_url).try_acquire() is None
    lease.release()
    lost = Lock("report:8", ttl=5, backend=redis_url, renew=False).acquire(timeout=0)
    get_backend(redis_url).force_release("report:8", lost.fence)
    with pytest.raises(NotOwned):
        lost.release()
    with pytest.raises(BackendUnavailable):
        Lock("report:9", ttl=5, backend="redis://127.0.0.1:1/0").acquire(timeout=0)
    assert events.flush(5.0)
    kinds = [(e.kind, e.name) for e in seen if e.kind != "renewed"]
    assert kinds == [
        ("acquired", "report:7"),
        ("conflict", "report:7"),
        ("released", "report:7"),
        ("acquired", "report:8"),
        ("lost", "report:8"),
        ("error", "report:9"),
    ]
    acquired, conflict, released, _, lost_event, error = (e for e in seen if e.kind != "renewed")
    assert acquired.fence == lease.fence and acquired.detail == "nightly job"
    assert acquired.owner is not None and acquired.waited is not None
    assert conflict.policy == "skip" and conflict.fence == lease.fence
    assert released.held is not None and released.detail == "nightly job"
    assert (
        lost_event.reason == events.LostReason.FORCED
        and "token was gone" in lost_event.message
        and lost_event.fence == lost.fence
    )
    assert "127.0.0.1:1" in error.backend and error.reason


def test_an_election_follower_reports_no_conflicts(redis_url: str) -> None:
    from task_locks import Election

    seen: list[LockEvent] = []
    events.subscribe(seen.append, {"conflict"})
    leader = Election("beat", ttl=5, backend=redis_url).campaign(timeout=0)
    with pytest.raises(LockHeld):
        Election("beat", ttl=5, backend=redis_url, identity="other").campaign(timeout=0)
    leader.resign()
    assert events.flush(5.0)
    assert seen == []
