"""Coordination primitives: what a semaphore permit and a leader hand-over cost.

Targets of elections and semaphores, checked from the same run:

- semaphore acquire+release (limit 3, uncontended) at most 1.5x our lock's cycle;
- leader hand-over after a clean resign under 10 ms on loopback: the time from
  ``resign()`` returning in the leader to ``campaign()`` returning in the candidate
  that was blocked in it (woken by the release, no polling).

It starts its own ``redis-server`` unless ``--url`` names a backend (any URL works:
``etcd://...``, ``memory://``). Lock and semaphore cycles alternate sample by sample, so
that drift on the machine lands on both alike.

    .venv/bin/python bench/coordination_bench.py [--url URL] [--cycles 5000] [--handovers 50]
    .venv/bin/python bench/coordination_bench.py --quick      # a few seconds

``bench/run.py`` calls :func:`run` (``{"markdown": ..., "targets": [...], ...}``, plus a
``"status"`` when the measurement failed) and folds the Markdown into
``bench/results.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

from common import redis_at

from task_locks import Election, Lock, Semaphore, close_all, get_backend

TTL = 30.0  # no renewal or expiry inside a sample
#: (lock/semaphore sample pairs, hand-overs) per mode.
COUNTS = {"full": (5000, 50), "quick": (1000, 20)}
SEMAPHORE_TARGET = 1.5  # semaphore cycle / lock cycle, at most
HANDOVER_TARGET_MS = 10.0  # median resign -> elected, under


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
        # The candidate blocks in the server hand-off's ``await_grant`` (the default where
        # the backend has one) or in ``wait_release``: spy on both, to know it is blocked.
        originals = {
            method: getattr(backend, method)
            for method in ("wait_release", "await_grant")
            if hasattr(backend, method)
        }

        def spied(
            original: Callable[..., Any], waiting: threading.Event = waiting
        ) -> Callable[..., Any]:
            def wait(*args: Any) -> Any:
                waiting.set()
                return original(*args)

            return wait

        for method, original in originals.items():
            setattr(backend, method, spied(original))

        def campaign(candidate: Election = waiter, out: list[float] = elected_at) -> None:
            candidate.campaign(timeout=10)
            out.append(time.perf_counter())

        thread = threading.Thread(target=campaign)
        thread.start()
        if not waiting.wait(5):
            raise RuntimeError("the candidate never blocked in campaign()")
        time.sleep(0.005)  # let it settle into the blocking read
        for method in originals:
            delattr(backend, method)  # the class's own method again
        resigned = time.perf_counter()
        leader.resign()
        thread.join(10)
        results.append((elected_at[0] - resigned) * 1000)
        leader, waiter = waiter, leader
    leader.resign()
    return results


def measure(url: str, cycles: int, handovers: int) -> dict[str, Any]:
    """Every figure, in microseconds / milliseconds, from one backend URL."""
    lock, semaphore = lock_cycle(url), semaphore_cycle(url)
    paired_us(lock, semaphore, 200)  # warm up connections and scripts
    lock_us, semaphore_us = paired_us(lock, semaphore, cycles)
    _, crowded_us = paired_us(lock, semaphore_cycle(url, taken=2), max(1, cycles // 5))
    handover = sorted(handovers_ms(url, handovers))
    return {
        "cycles": cycles,
        "handovers": handovers,
        "lock_us": lock_us,
        "semaphore_us": semaphore_us,
        "semaphore_ratio": semaphore_us / lock_us,
        "crowded_semaphore_us": crowded_us,
        "handover_median_ms": statistics.median(handover),
        "handover_p95_ms": handover[min(len(handover) - 1, int(len(handover) * 0.95))],
        "handover_max_ms": handover[-1],
    }


def targets(figures: dict[str, Any]) -> list[dict[str, Any]]:
    ratio, handover = figures["semaphore_ratio"], figures["handover_median_ms"]
    return [
        {
            "what": "semaphore(limit=3) cycle / lock cycle (median)",
            "value": ratio,
            "threshold": SEMAPHORE_TARGET,
            "verdict": "PASS" if ratio <= SEMAPHORE_TARGET else "MISS",
        },
        {
            "what": "leader hand-over after a clean resign (median, ms)",
            "value": handover,
            "threshold": HANDOVER_TARGET_MS,
            "verdict": "PASS" if handover < HANDOVER_TARGET_MS else "MISS",
        },
    ]


def table(figures: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """``(measure, value, target, result)`` rows, for the terminal and for Markdown."""
    verdicts = {t["what"]: t["verdict"] for t in targets(figures)}
    ratio = figures["semaphore_ratio"]
    return [
        ("lock acquire+release (median)", f"{figures['lock_us']:.0f} µs", "", ""),
        (
            "semaphore(limit=3) acquire+release (median)",
            f"{figures['semaphore_us']:.0f} µs",
            f"<= {SEMAPHORE_TARGET}x lock",
            f"{ratio:.2f}x {verdicts['semaphore(limit=3) cycle / lock cycle (median)']}",
        ),
        (
            "semaphore cycle, 2 of 3 permits taken by others",
            f"{figures['crowded_semaphore_us']:.0f} µs",
            "",
            "",
        ),
        (
            "leader hand-over after resign (median)",
            f"{figures['handover_median_ms']:.2f} ms",
            f"< {HANDOVER_TARGET_MS:g} ms",
            verdicts["leader hand-over after a clean resign (median, ms)"],
        ),
        ("leader hand-over after resign (p95)", f"{figures['handover_p95_ms']:.2f} ms", "", ""),
        ("leader hand-over after resign (max)", f"{figures['handover_max_ms']:.2f} ms", "", ""),
    ]


def markdown(figures: dict[str, Any], where: str) -> str:
    lines = [
        f"On {where}: {figures['cycles']} alternated lock/semaphore sample pairs (limit 3, "
        f"uncontended), {figures['handovers']} hand-overs from `resign()` returning to the "
        "blocked candidate's `campaign()` returning.",
        "",
        "| measure | value | target | result |",
        "|---|---:|---|---|",
    ]
    lines += [f"| {' | '.join(row)} |" for row in table(figures)]
    return "\n".join(lines)


def run(
    quick: bool = False,
    url: str | None = None,
    cycles: int | None = None,
    handovers: int | None = None,
) -> dict[str, Any]:
    """Measure on ``url`` (default: a redis-server of our own); ``bench/run.py`` calls it.

    Never raises: a failure comes back as ``{"status": "failed: ...", "markdown": ...}``.
    """
    default_cycles, default_handovers = COUNTS["quick" if quick else "full"]
    cycles, handovers = cycles or default_cycles, handovers or default_handovers
    where = f"`{url}`" if url is not None else "redis (its own redis-server on loopback)"
    try:
        with redis_at(url) as reached:
            try:
                figures = measure(reached, cycles, handovers)
            finally:
                close_all()  # before its server stops
    except Exception as exc:
        status = f"failed: {type(exc).__name__}: {exc}"
        return {"status": status, "markdown": status, "traceback": traceback.format_exc()}
    return {
        **figures,
        "backend": where,
        "targets": targets(figures),
        "markdown": markdown(figures, where),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="backend URL (default: a redis-server of our own)")
    parser.add_argument("--quick", action="store_true", help="fewer samples: a few seconds")
    parser.add_argument("--cycles", type=int, default=None, help="lock/semaphore sample pairs")
    parser.add_argument("--handovers", type=int, default=None)
    args = parser.parse_args()
    result = run(args.quick, args.url, args.cycles, args.handovers)
    if "status" in result:
        print(result["traceback"], file=sys.stderr)
        raise SystemExit(result["status"])
    print(f"backend: {result['backend']}")
    header = ("measure", "value", "target", "result")
    rows = [header, *table(result)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print(" | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
