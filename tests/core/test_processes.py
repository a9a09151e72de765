"""Holders in other processes, paused or killed, and a forked child of a holder."""

from __future__ import annotations

import os
import time

from servers import wait_until

from .support import SyncDriver, blocked_clients, holder_token, lock_fields


def test_paused_holder_cannot_release_the_next_holders_lock(
    driver: SyncDriver, children, redis_url: str
) -> None:
    ttl = 0.6
    first = children(redis_url, "paused", ttl, driver.mode)
    first_fence = first.call("acquire")["fence"]
    first.stop()  # SIGSTOP: no renewals, the TTL runs out

    second = driver.acquire("paused", timeout=5, backend=redis_url, ttl=10)
    assert second.fence > first_fence

    first.cont()
    answer = first.call("release")
    assert answer["error"] == "NotOwned", answer
    assert "paused" in answer["message"]
    # The stale release changed nothing: the second holder still holds.
    assert holder_token(redis_url, "paused") == second.token
    assert second.held
    second.check()
    assert first.call("check")["error"] == "LockLost"
    second.release()


def test_killed_holder_frees_the_lock_within_one_ttl(
    driver: SyncDriver, children, redis_url: str
) -> None:
    ttl = 1.0
    child = children(redis_url, "killed", ttl, driver.mode)
    child.call("acquire")
    child.kill()
    killed_at = time.monotonic()
    handle = driver.acquire("killed", timeout=3 * ttl, backend=redis_url, ttl=5)
    freed_after = time.monotonic() - killed_at
    print(f"\n[{driver.mode}] lock free {freed_after * 1000:.0f} ms after SIGKILL (ttl {ttl} s)")
    assert freed_after <= ttl * 1.1, f"lock freed {freed_after:.3f}s after SIGKILL"
    handle.release()


def test_renewed_lease_outlives_five_ttls_and_hands_over_at_once(
    driver: SyncDriver, children, redis_url: str
) -> None:
    ttl = 0.3
    child = children(redis_url, "long", ttl, driver.mode)
    fence = child.call("acquire")["fence"]
    started = time.monotonic()
    while time.monotonic() - started < 6 * ttl:
        assert driver.try_acquire("long", backend=redis_url, ttl=5) is None
        time.sleep(ttl / 3)  # sampling the lock over time, not synchronising
    state = child.call("state")
    assert state["held"] and not state["lost"], state
    stored = lock_fields(redis_url, "long")
    assert int(stored["fence"]) == fence
    assert int(stored["renewals"]) >= 5

    waiter = driver.start_acquire("long", timeout=5, backend=redis_url, ttl=5)
    wait_until(lambda: blocked_clients(redis_url) >= 1, 5, "the waiter to block")
    released_at = time.perf_counter()
    assert child.call("release") == {"ok": True}
    handle, granted_at = waiter.result(timeout=5)
    assert granted_at - released_at < 0.1
    assert handle.fence > fence
    handle.release()


def test_forked_child_does_not_renew_or_release_parent_lease(
    driver: SyncDriver, children, redis_url: str
) -> None:
    ttl = 0.6
    parent = children(redis_url, "forked", ttl, driver.mode)
    fence = parent.call("acquire")["fence"]
    answer = parent.call("fork")
    assert answer.get("ok"), answer
    report = answer["grandchild"]
    parent.grandchildren.append(report["pid"])
    # The child sees the inherited lease as not held, and its release was a no-op.
    assert report["held"] is False
    assert report["check"] == "LockLost"
    assert int(lock_fields(redis_url, "forked")["fence"]) == fence

    parent.stop()  # only the forked child runs now: nobody may renew the parent's lease
    stopped_at = time.monotonic()
    handle = driver.acquire("forked", timeout=3 * ttl, backend=redis_url, ttl=5)
    assert time.monotonic() - stopped_at <= ttl * 1.1
    os.kill(report["pid"], 0)  # the forked child is alive (and running) all along
    # Its own watchdog (thread, or task in its own loop) works: it renews the child's
    # own lock, and only that one.
    assert report["scheduled"] == 1
    assert int(lock_fields(redis_url, "forked:own")["renewals"]) >= 1
    handle.release()


def test_paused_holder_learns_of_the_loss_by_itself(
    driver: SyncDriver, children, redis_url: str
) -> None:
    """After SIGCONT the holder's watchdog marks the lease lost, before any release."""
    ttl = 0.5
    child = children(redis_url, "resumed", ttl, driver.mode)
    child.call("acquire")
    child.stop()
    wait_until(lambda: holder_token(redis_url, "resumed") is None, 2, "the TTL to end")
    child.cont()
    state = wait_until(
        lambda: (s := child.call("state"))["lost"] and s, ttl, "the watchdog to notice"
    )
    assert state["held"] is False
    assert "gone" in state["lost_reason"] or "TTL" in state["lost_reason"]


def test_memory_locks_are_per_process_as_the_readme_says(children) -> None:
    """The README's memory:// row, "it breaks when two processes": a second process takes
    the very name this one holds, each from its own memory. (Why memory:// is for tests,
    examples and single-process tools only.)"""
    from task_locks import Lock

    mine = Lock("per-process", ttl=10, backend="memory://").acquire(timeout=0)
    other = children("memory://", "per-process", 10, "sync")
    answer = other.call("acquire")  # at once: its memory has no holder
    assert "error" not in answer and answer["fence"] >= 1, answer
    assert mine.held  # each process believes it holds the lock
    other.call("release")
    mine.release()
