"""Two holders never overlap; fences only go up, even across a restart."""

from __future__ import annotations

from itertools import pairwise

import redis

from task_locks.backends.redis_scripts import counter_key

from .holder import hammer_async, hammer_sync
from .support import SyncDriver

ITERATIONS = 30
LOCAL_WORKERS = 4
PROCESSES = 2
WORKERS_PER_PROCESS = 2


def test_threads_and_processes_never_overlap(driver: SyncDriver, children, redis_url: str) -> None:
    """A non-atomic GET-then-SET counter inside the critical section ends exact.

    Local workers are threads (``Lock``) or tasks (``AsyncLock``); the other processes
    run the same critical section with the same kind of lock, all at once.
    """
    name, counter = "hammer", "hammer:counter"
    processes = [children(redis_url, name, 10, driver.mode) for _ in range(PROCESSES)]
    for process in processes:
        process.send("hammer", counter=counter, n=ITERATIONS, workers=WORKERS_PER_PROCESS)
    hammer = hammer_sync if driver.mode == "sync" else hammer_async
    local_faults = driver.call(hammer, redis_url, name, counter, ITERATIONS, LOCAL_WORKERS)
    answers = [process.answer(timeout=120) for process in processes]

    expected = ITERATIONS * (LOCAL_WORKERS + PROCESSES * WORKERS_PER_PROCESS)
    assert int(redis.Redis.from_url(redis_url).get(counter) or 0) == expected
    # Every holder saw a fence greater than the previous holder's: no overlap, in order.
    assert local_faults == 0
    assert [a.get("faults") for a in answers] == [0] * PROCESSES, answers


def test_fence_increases_over_1000_acquisitions_and_across_restart(
    driver: SyncDriver, redis_factory
) -> None:
    server = redis_factory()
    url = server.url()
    fences = []
    for _ in range(1000):
        handle = driver.acquire("fenced", timeout=0, backend=url, ttl=5)
        fences.append(handle.fence)
        handle.release()
    assert all(later > earlier for earlier, later in pairwise(fences))

    server.restart()  # no persistence: the fence counter is gone
    assert not redis.Redis(port=server.port).exists(counter_key("task_locks:"))
    handle = driver.acquire("fenced", timeout=0, backend=url, ttl=5)
    assert handle.fence > fences[-1]
    handle.release()
