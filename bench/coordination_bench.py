"""Coordination primitives: what a semaphore permit and a leader hand-over cost.

Targets (issue 9), checked from the same run:

- semaphore acquire+release (limit 3, uncontended) at most 1.5x our lock's cycle;
- leader hand-over after a clean resign under 10 ms on loopback: the time from
  ``resign()`` returning in the leader to ``campaign()`` returning in the candidate
  that was blocked in it (woken by the release, no polling).

It starts its own ``redis-server`` unless ``--url`` names a backend (any URL works:
``etcd://...``, ``memory://``). Lock and semaphore cycles alternate sample by sample, so
that drift on the machine lands on both alike.

    .venv/bin/python bench/coordination_bench.py [--url URL] [--cycles 5000] [--handovers 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from servers import RedisServer  # noqa: E402  (tests/servers.py: the tests' own harness)

from task_locks import Election, Lock, Semaphore, close_all, get_backend  # noqa: E402

TTL = 30.0  # no renewal or expiry inside a sample


def paired_us(
    first: Callable[[], None], second: Callable[[], None], cycles: int
) -> tuple[float, float]:
    """Median microseconds of one call of each, over ``cycles`` alternated samples.

    Alternating sample by sample lands any drift of the machine on both alike.
    """
    one, two = [], []
    for _ in range(cycles):
        started = time.perf_counter()
        first()
        middle = time.perf_counter()
        second()
        two.append(time.perf_counter() - middle)
        one.append(middle - started)
    return statistics.median(one) * 1e6, statistics.median(two) * 1e6


def lock_cycle(url: str) -> Callable[[], None]:
    lock = Lock(f"bench-lock-{uuid.uuid4().hex[:6]}", ttl=TTL, backend=url)

    def run() -> None:
        lock.acquire(timeout=0).release()

    return run


def semaphore_cycle(url: str, limit: int = 3, taken: int = 0) -> Callable[[], None]:
    """A permit's cycle, with ``taken`` of the ``limit`` permits held by others throughout."""
    semaphore = Semaphore(f"bench-sem-{uuid.uuid4().hex[:6]}", limit=limit, ttl=TTL, backend=url)
    held = [semaphore.acquire(timeout=0) for _ in range(taken)]

    def run(held: list[object] = held) -> None:  # keeps the others' permits referenced
        semaphore.acquire(timeout=0).release()

    return run


def handovers_ms(url: str, rounds: int) -> list[float]:
    """Resign-to-elected latency, the candidate blocked in ``campaign()`` beforehand."""
    name = f"bench-election-{uuid.uuid4().hex[:6]}"
    backend = get_backend(url)
    candidates = [Election(name, ttl=TTL, backend=url, identity=f"c{i}") for i in range(2)]
    results: list[float] = []
    leader, waiter = candidates
    leader.campaign(timeout=5)
    for _ in range(rounds):
        elected_at: list[float] = []
        waiting = threading.Event()
        original_wait = backend.wait

        def spied_wait(
            lock_name: str,
            timeout: float,
            waiting: threading.Event = waiting,
            original_wait: Callable[[str, float], None] = original_wait,
        ) -> None:
            waiting.set()
            original_wait(lock_name, timeout)

        backend.wait = spied_wait  # type: ignore[method-assign]  # to know it is blocked

        def campaign(candidate: Election = waiter, out: list[float] = elected_at) -> None:
            candidate.campaign(timeout=10)
            out.append(time.perf_counter())

        thread = threading.Thread(target=campaign)
        thread.start()
        if not waiting.wait(5):
            raise SystemExit("the candidate never blocked in campaign()")
        time.sleep(0.005)  # let it settle into the blocking read
        backend.wait = original_wait  # type: ignore[method-assign]
        resigned = time.perf_counter()
        leader.resign()
        thread.join(10)
        results.append((elected_at[0] - resigned) * 1000)
        leader, waiter = waiter, leader
    leader.resign()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="backend URL (default: a redis-server of our own)")
    parser.add_argument("--cycles", type=int, default=5000, help="lock/semaphore sample pairs")
    parser.add_argument("--handovers", type=int, default=50)
    args = parser.parse_args()

    server = None
    url = args.url
    if url is None:
        server = RedisServer().start()
        url = server.url()
    try:
        lock, semaphore = lock_cycle(url), semaphore_cycle(url)
        paired_us(lock, semaphore, 200)  # warm up connections and scripts
        lock_us, semaphore_us = paired_us(lock, semaphore, args.cycles)
        ratio = semaphore_us / lock_us
        _, crowded_us = paired_us(lock, semaphore_cycle(url, taken=2), args.cycles // 5)
        handover = sorted(handovers_ms(url, args.handovers))
        median_ms = statistics.median(handover)
        p95_ms = handover[min(len(handover) - 1, int(len(handover) * 0.95))]
    finally:
        close_all()
        if server is not None:
            server.cleanup()

    rows = [
        ("lock acquire+release (median)", f"{lock_us:.0f} us", "", ""),
        (
            "semaphore(limit=3) acquire+release",
            f"{semaphore_us:.0f} us",
            "<= 1.5x lock",
            f"{ratio:.2f}x {'ok' if ratio <= 1.5 else 'MISSED'}",
        ),
        ("  the same, 2 of 3 permits taken by others", f"{crowded_us:.0f} us", "", ""),
        (
            "leader hand-over after resign (median)",
            f"{median_ms:.2f} ms",
            "< 10 ms",
            "ok" if median_ms < 10 else "MISSED",
        ),
        ("leader hand-over after resign (p95)", f"{p95_ms:.2f} ms", "", ""),
        ("leader hand-over after resign (max)", f"{handover[-1]:.2f} ms", "", ""),
    ]
    print(f"backend: {url if server is None else 'redis (own redis-server on loopback)'}")
    widths = [
        max(len(str(r[i])) for r in [("measure", "value", "target", "result"), *rows])
        for i in range(4)
    ]
    for row in [("measure", "value", "target", "result"), *rows]:
        print(" | ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
