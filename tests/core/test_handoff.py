"""A blocked waiter is woken by the release, not by polling."""

from __future__ import annotations

import statistics
import time

from servers import wait_until

from .support import SyncDriver, blocked_clients

HANDOFFS = 20


def test_blocked_waiter_gets_the_lock_within_milliseconds_of_release(
    driver: SyncDriver, redis_url: str, record_property
) -> None:
    holder = driver.acquire("handoff", backend=redis_url, ttl=10)
    latencies = []
    for _ in range(HANDOFFS):
        waiter = driver.start_acquire("handoff", timeout=5, backend=redis_url, ttl=10)
        wait_until(lambda: blocked_clients(redis_url) >= 1, 5, "the waiter to block in BLPOP")
        released_at = time.perf_counter()
        holder.release()
        holder, granted_at = waiter.result(timeout=5)
        latencies.append(granted_at - released_at)
    holder.release()

    median = statistics.median(latencies)
    record_property("handoff_median_ms", round(median * 1000, 3))
    print(
        f"\n[{driver.mode}] hand-off over {HANDOFFS}: median {median * 1000:.2f} ms, "
        f"max {max(latencies) * 1000:.2f} ms"
    )
    # A sanity bound, not a benchmark (bench/ measures speed): the lock's TTL is 10 s, so
    # anything but a wake-up by the release would take seconds.
    assert median < 0.010
