"""Where an uncontended cycle's client CPU goes, layer by layer, in one process.

Four subjects take turns in alternating blocks on one ``redis-server`` (started here
unless ``--redis-url``), each timed by this process's CPU per acquire+release cycle:

- ``Lock`` cycle: ``Lock(...).acquire().release()`` with the defaults (server hand-off);
- backend calls only: the same two requests through the backend's public calls
  (``enqueue`` and ``release``), no ``Lock``, plan or lease;
- floor: the same commands as two bare scripts through redis-py (``common.FLOOR_ACQUIRE``,
  ``FLOOR_RELEASE``: what ``make bench`` calls the fenced floor);
- ``Lock`` cycle on ``memory://``: the lock layers with no I/O at all.

The first minus the second is what ``Lock``, its acquire plan and the lease cost per
cycle; the second minus the third, the backend's own shaping of the requests. Pin it to
one CPU (``taskset -c 1``) so that the server runs on the other.

    taskset -c 1 .venv/bin/python bench/layers.py
"""

from __future__ import annotations

import argparse
import gc
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # this checkout's task_locks

from common import redis_at  # noqa: E402
from workers import FencedFloor  # noqa: E402

from task_locks import Lock, get_backend  # noqa: E402
from task_locks.owner import current_owner  # noqa: E402


def subjects(url: str) -> dict[str, Callable[[], None]]:
    backend = get_backend(url)
    lock = Lock("bench:layers:lock", ttl=30, backend=backend)
    owner = current_owner()
    floor = FencedFloor(url, "bench:layers:floor", 30)
    memory = Lock("bench:layers:memory", ttl=30, backend="memory://")

    def backend_calls() -> None:
        token = secrets.token_hex(16)
        if backend.enqueue("bench:layers:backend", token, 30_000, owner, 0).fence is None:  # type: ignore[attr-defined]
            raise RuntimeError("bench:layers:backend is held")
        backend.release("bench:layers:backend", token)

    def floor_cycle() -> None:
        floor.acquire()
        floor.release()

    return {
        "Lock cycle (redis, defaults)": lambda: lock.acquire().release(),
        "backend calls only": backend_calls,
        "floor: two bare scripts": floor_cycle,
        "Lock cycle (memory://)": lambda: memory.acquire().release(),
    }


def measure(url: str, rounds: int, block: int) -> dict[str, float]:
    """Median over ``rounds`` of each subject's CPU µs per cycle, in blocks of ``block``."""
    calls = subjects(url)
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        for _ in range(200):
            call()
    gc.disable()
    try:
        for _ in range(rounds):
            for name, call in calls.items():
                start = time.process_time_ns()
                for _ in range(block):
                    call()
                cpu[name].append((time.process_time_ns() - start) / block / 1000)
    finally:
        gc.enable()
    return {name: statistics.median(values) for name, values in cpu.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block", type=int, default=400, help="cycles per block")
    parser.add_argument("--redis-url", help="an existing server (default: start one)")
    args = parser.parse_args()
    with redis_at(args.redis_url) as url:
        result = measure(url, args.rounds, args.block)
    lock, calls = result["Lock cycle (redis, defaults)"], result["backend calls only"]
    print("| subject | client CPU µs per cycle (median of rounds) |\n|---|---:|")
    for name, value in result.items():
        print(f"| {name} | {value:.1f} |")
    print(
        f"\nLock, plan and lease: {lock - calls:.1f} µs of CPU per cycle above the backend's calls."
    )


if __name__ == "__main__":
    main()
