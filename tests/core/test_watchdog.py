"""The renewal watchdog: loss detection, outages, batching, idling, max_hold."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import redis
from servers import wait_until

from task_locks import Lock, LockLost, NotOwned, events, get_backend, notices, watchdog
from task_locks.backends.redis_scripts import record_fields

from .support import SyncDriver, holder_token, lock_fields


def renewer_threads(url: str = "") -> list[threading.Thread]:
    """The renewal threads (one per backend lane) of the backend at ``url`` (all: "")."""
    backend = get_backend(url) if url else None
    server = f"{backend.server} #{id(backend):x}" if backend else ""
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith(f"task-locks-renewer {server}") and t.is_alive()
    ]


def warnings_about(caplog: pytest.LogCaptureFixture, name: str, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING
        and r.name.startswith("task_locks")
        and repr(name) in r.getMessage()
        and text in r.getMessage()
    ]


def test_lost_token_sets_lost_raises_calls_back_and_warns(
    driver: SyncDriver,
    redis_url: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The renewal's path: no release notice may get there first (that path is
    # tests/core/test_release_notices.py's).
    monkeypatch.setattr(notices, "listen", lambda lease: None)
    caplog.set_level(logging.INFO, logger="task_locks")
    called: list[Any] = []
    if driver.mode == "async":

        async def on_lost(lease: Any) -> None:  # an async callback runs on the lease's loop
            called.append(lease)

    else:

        def on_lost(lease: Any) -> None:
            called.append(lease)

    ttl = 0.6
    handle = driver.acquire("stolen", backend=redis_url, ttl=ttl, on_lost=on_lost)
    assert get_backend(redis_url).force_release("stolen")  # the token is gone
    wait_until(handle.lost.is_set, ttl, "the watchdog to notice the lost token")
    with pytest.raises(LockLost, match="'stolen' was lost"):
        handle.check()
    assert not handle.held
    wait_until(lambda: called, 2, "the on_lost callback")
    assert called == [handle.lease]
    assert events.flush(5.0)  # logging is a subscriber of the event stream
    assert warnings_about(caplog, "stolen", "lost: renewal found the lock's token gone")
    with pytest.raises(NotOwned):
        handle.release()


def test_connection_errors_are_retried_until_expiry_then_lost(
    driver: SyncDriver, redis_factory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="task_locks")
    server = redis_factory()
    ttl, socket_timeout = 1.5, 0.25
    handle = driver.acquire("flaky", backend=server.url(socket_timeout=socket_timeout), ttl=ttl)
    acquired_at = time.monotonic()
    server.pause()
    wait_until(handle.lost.is_set, ttl + 2 * socket_timeout + 1, "the lease to be lost")
    lost_after = time.monotonic() - acquired_at
    server.resume()
    assert events.flush(5.0)  # logging is a subscriber of the event stream
    # Retried while time remained; given up only when the lease was about to expire.
    retries = [r for r in caplog.records if "'flaky' failed, will retry" in r.getMessage()]
    assert len(retries) >= 2
    assert lost_after >= ttl * 0.85
    # lost.is_set() turns true at the deadline by itself; the watch logs a moment later.
    wait_until(
        lambda: warnings_about(caplog, "flaky", "unreachable until the TTL ran out"),
        1,
        "the loss to be logged",
    )
    with pytest.raises(LockLost):
        handle.check()


def test_short_outage_is_ridden_out(
    driver: SyncDriver, redis_factory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="task_locks")
    server = redis_factory()
    url = server.url(socket_timeout=0.2)
    handle = driver.acquire("blip", backend=url, ttl=1.5)
    server.pause()
    wait_until(
        lambda: any("'blip' failed, will retry" in r.getMessage() for r in caplog.records),
        3,
        "a failed renewal",
    )
    renewals = handle.renewals
    server.resume()
    wait_until(lambda: handle.renewals > renewals, 1.5, "a renewal after the outage")
    assert not handle.lost.is_set()
    handle.check()
    assert holder_token(url, "blip") == handle.token
    handle.release()


@pytest.mark.slow
def test_ten_thousand_leases_are_renewed_in_batches_by_one_thread(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    count, ttl = 10_000, 3.0
    backend = get_backend(redis_url)
    batches: list[tuple[int, float]] = []
    renew_many = backend.renew_many

    def counting_renew_many(items: Any, timeout: float | None = None) -> list[bool]:
        started = time.perf_counter()
        result = renew_many(items, timeout)
        batches.append((len(items), time.perf_counter() - started))
        return result

    # A spy, not a fake: the real renew_many runs against the real server.
    monkeypatch.setattr(backend, "renew_many", counting_renew_many)
    threads_before = set(threading.enumerate())
    leases = [Lock(f"many:{i}", ttl=ttl, backend=backend).acquire(timeout=0) for i in range(count)]
    wait_until(lambda: all(lease.renewals for lease in leases), 2 * ttl, "one renewal of each")

    assert len(renewer_threads(redis_url)) == 1
    # At most one renewal thread (one backend: one lane), the threads of its calls in
    # flight (a call is sent beside the lane), the process's deadline watch and the
    # backend's one release-notice listener.
    started = [t.name.split(" ")[0] for t in set(threading.enumerate()) - threads_before]
    assert set(started) <= {
        "task-locks-renewer", "task-locks-renewal", "task-locks-deadlines", "task-locks-notices"
    }  # fmt: skip
    assert started.count("task-locks-notices") <= 1
    renewed = sum(size for size, _ in batches)
    assert renewed >= count
    assert len(batches) <= 50, f"{len(batches)} round trips for {renewed} renewals"
    with redis.Redis.from_url(redis_url) as client:
        pipe = client.pipeline(transaction=False)
        for i in range(count):
            pipe.get(f"task_locks:{{many:{i}}}")
        records = [record_fields(value) or {} for value in pipe.execute()]
        assert all(int(record.get("renewals", 0)) >= 1 for record in records)
    largest = max(batches)
    print(
        f"\n10,000 leases: {len(batches)} renew_many calls, largest {largest[0]} leases "
        f"in {largest[1] * 1000:.1f} ms"
    )
    for lease in leases:
        lease.release()


def test_last_lease_stopped_leaves_no_renewal_thread(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watchdog, "IDLE_EXIT", 0.2)
    lease = Lock("idle", ttl=0.3, backend=redis_url).acquire(timeout=0)
    wait_until(lambda: lease.renewals, 1, "a renewal")
    assert len(renewer_threads(redis_url)) == 1
    lease.release()
    cpu_before = time.process_time()
    wait_until(lambda: not renewer_threads(redis_url), 3, "the idle renewal thread to exit")
    assert time.process_time() - cpu_before < 0.2  # it waited; it did not spin
    # The next lease starts a renewal thread again.
    lease = Lock("idle", ttl=0.3, backend=redis_url).acquire(timeout=0)
    wait_until(lambda: lease.renewals, 1, "a renewal by a new thread")
    lease.release()


def test_a_lease_released_before_its_renewal_wakes_no_thread(redis_url: str) -> None:
    """A busy acquire/release loop: each lease is due for renewal (and its deadline) long
    after it is released, so neither the renewal lane's thread nor the deadline watch is
    woken for it (a wake-up is a thread switch per cycle). Counted, not timed."""
    lock = Lock("wakeups", ttl=30, backend=get_backend(redis_url))
    lock.acquire(timeout=0).release()  # starts both threads, asleep until due

    def wakeups() -> int:
        lanes = watchdog.thread_renewer().lanes.all()
        return watchdog.deadline_watch().wakeups + sum(lane.wakeups for lane in lanes)

    before = wakeups()
    for _ in range(100):
        lock.acquire(timeout=0).release()
    # Their own timers may fire once or twice meanwhile (an idle exit check); a wake-up
    # per acquire would make 100 or more.
    assert wakeups() - before <= 3


def test_idle_renewal_thread_does_not_spin(redis_url: str) -> None:
    lease = Lock("idle:cpu", ttl=0.3, backend=redis_url).acquire(timeout=0)
    lease.release()
    cpu_before = time.process_time()
    time.sleep(0.5)  # measuring idle CPU over a period, not synchronising
    assert time.process_time() - cpu_before < 0.05


def test_max_hold_marks_lost_and_releases(
    driver: SyncDriver, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    max_hold = 0.3
    # max_hold counts from the send time of the acquire, which a loaded machine can
    # make slow: bound it from below by the call's start, from above by its return.
    started = time.monotonic()
    handle = driver.acquire("bounded", backend=redis_url, ttl=2, max_hold=max_hold)
    acquired_at = time.monotonic()
    wait_until(handle.lost.is_set, 2, "max_hold to end the lease")
    lost_at = time.monotonic()
    assert lost_at - started >= max_hold * 0.9
    assert lost_at - acquired_at < max_hold + 0.25
    assert "max_hold" in (handle.lost_reason or "")
    assert handle.renewals <= 1  # nothing renewed it in a rush before the deadline
    wait_until(lambda: holder_token(redis_url, "bounded") is None, 1, "the release")
    other = driver.acquire("bounded", timeout=0, backend=redis_url, ttl=2)
    other.release()
    assert events.flush(5.0)
    assert warnings_about(caplog, "bounded", "max_hold exceeded")


def test_renewals_are_recorded_on_the_server(driver: SyncDriver, redis_url: str) -> None:
    handle = driver.acquire("counted", backend=redis_url, ttl=0.3)
    wait_until(lambda: handle.renewals >= 3, 2, "three renewals")
    assert int(lock_fields(redis_url, "counted")["renewals"]) >= 3
    handle.release()


def test_a_slow_on_lost_callback_holds_up_no_other_lease(redis_url: str) -> None:
    """``on_lost`` runs off the renewal lane (and off the deadline watch).

    The callback of a force-released lease blocks (an alert over a dead HTTP link) for
    longer than another lease's TTL; that other lease, on the same backend and so the same
    renewal lane, goes on being renewed."""
    release_callback = threading.Event()
    ran_on: list[str] = []

    def slow_alert(lease: Any) -> None:
        ran_on.append(threading.current_thread().name)
        release_callback.wait(5)

    ttl = 0.6
    doomed = Lock("slow-callback", ttl=ttl, backend=redis_url, on_lost=slow_alert).acquire(0)
    healthy = Lock("bystander", ttl=ttl, backend=redis_url).acquire(timeout=0)
    try:
        assert get_backend(redis_url).force_release("slow-callback")
        wait_until(lambda: ran_on, 2, "the on_lost callback to start")
        renewals = healthy.renewals
        end = time.monotonic() + 3 * ttl
        while time.monotonic() < end:  # the callback is still blocked all along
            assert healthy.held, f"lost behind a slow callback: {healthy.lost_reason}"
            time.sleep(0.02)
        assert healthy.renewals >= renewals + 3
        assert doomed.lost.is_set()
        assert not ran_on[0].startswith(("task-locks-renewer", "task-locks-deadlines"))
        # A deadline the watch marks: its callback too goes behind the slow one, off the watch.
        watched = Lock("unrenewed", ttl=0.3, backend=redis_url, renew=False, on_lost=ran_on.append)
        unrenewed = watched.acquire(timeout=0)
        wait_until(unrenewed.lost.is_set, 1, "the unrenewed lease's deadline")
        assert healthy.held
    finally:
        release_callback.set()
        healthy.release()
    wait_until(lambda: len(ran_on) == 2, 2, "the second callback, after the slow one")
    assert ran_on[1] is unrenewed
