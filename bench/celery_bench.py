"""Celery throughput: ``@singleton_task`` (distinct keys) against a plain task, one worker.

Each variant gets its own ``celery worker`` (solo pool: one process, so the lock's two
round trips per task weigh as much as they ever can) on its own queue, and a driver
process that publishes N tasks as fast as it can and waits until the worker has run
them all (every task increments one Redis counter). Throughput = N / (first publish to
last completion). Variants take turns, in rotated rounds, so machine drift hits all.

Variants: ``plain`` (``@app.task``), ``singleton_task`` (ours, ``key="bench:{i}"``,
run-time lock), and, when ``bench/.peers`` has them, ``celery-singleton`` and
``celery-once`` (both lock at publish and unlock when the task ends). Results are not
stored (``task_ignore_result``) for any variant, which makes the ratio stricter. And
``plain+floor``, not a library: a plain task that also sends the one round trip a run
lock with our guarantees needs, as two bare scripts (the floor of any lock taken in the
worker: no lock code).

Duplicate suppression: after the throughput rounds, a burst of identical calls
(``--burst-calls``, default 200, same argument) is published as fast as possible to one
worker per library (threads pool, 4 threads, so duplicates can meet while one runs; the
task sleeps ``BURST_HOLD`` s). Reported per library: calls accepted by the publisher
(the rest were dropped as duplicates at publish), how many ran, and how many were
delivered but not run (skipped by a run-time lock). Ours runs three ways:
``on_conflict="skip"`` with the default run-time lock (drops only overlapping runs),
``lock_on="enqueue"`` (one queued message per key; the key frees when it starts) and
``lock_on="both"`` (one queued-or-running).

    .venv/bin/python bench/celery_bench.py              # its own redis-server, N=1000
    .venv/bin/python bench/celery_bench.py --n 200 --rounds 1

``bench/run.py`` calls :func:`run` and reads ``throughput`` (tasks/s per variant) and
``burst`` (duplicate suppression per library).
This file is also the worker's app module (``celery -A celery_bench worker``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis
from celery import Celery, signals
from common import redis_at

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
VARIANTS = ("plain", "plain+floor", "singleton_task", "celery-singleton", "celery-once")
#: Duplicate-suppression workers: variant -> what the results call it.
BURST_VARIANTS = {
    "burst-skip": "singleton_task (skip, run-time lock)",
    "burst-enqueue": 'singleton_task (lock_on="enqueue")',
    "burst-both": 'singleton_task (lock_on="both")',
    "burst-celery-singleton": "celery-singleton",
    "burst-celery-once": "celery-once (graceful)",
}
PEER_VARIANTS = {
    "celery-singleton": "celery_singleton",
    "celery-once": "celery_once",
    "burst-celery-singleton": "celery_singleton",
    "burst-celery-once": "celery_once",
}
#: Seconds each burst task runs (sleeps), so identical calls overlap on 4 threads.
BURST_HOLD = 0.05
BURST_THREADS = 4

BROKER = os.environ.get("TL_BENCH_BROKER", "redis://127.0.0.1:6379/10")
LOCKS = os.environ.get("TL_BENCH_LOCKS", "redis://127.0.0.1:6379/11")
VARIANT = os.environ.get("TL_BENCH_VARIANT", "plain")

app = Celery("celery_bench", broker=BROKER)
app.conf.update(
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_default_queue=f"bench_{VARIANT}",
)
counter = redis.Redis.from_url(LOCKS)


def _done() -> None:
    counter.incr(f"bench:done:{VARIANT}")


def _burst_ran() -> None:
    time.sleep(BURST_HOLD)
    counter.incr(f"bench:burst:ran:{VARIANT}")


def _define_burst(variant: str) -> Any:
    """The burst task of ``variant``: one key for every call (the argument is the same)."""
    if variant in ("burst-skip", "burst-enqueue", "burst-both"):
        from task_locks.celery import singleton_task

        lock_on = variant.removeprefix("burst-").replace("skip", "run")

        @singleton_task(
            app=app, name=f"bench.{variant}", key="burst:{i}", ttl=30, backend=LOCKS,
            lock_on=lock_on, on_conflict="skip",
        )  # fmt: skip
        def ours(i: str) -> None:
            _burst_ran()

        return ours
    if variant == "burst-celery-singleton":
        from celery_singleton import Singleton

        app.conf.singleton_backend_url = LOCKS

        @app.task(name=f"bench.{variant}", base=Singleton)
        def peer_singleton(i: str) -> None:
            _burst_ran()

        return peer_singleton
    if variant == "burst-celery-once":
        from celery_once import QueueOnce

        app.conf.ONCE = {
            "backend": "celery_once.backends.Redis",
            "settings": {"url": LOCKS, "default_timeout": 60},
        }

        @app.task(name=f"bench.{variant}", base=QueueOnce, once={"graceful": True})
        def peer_once(i: str) -> None:
            _burst_ran()

        return peer_once
    raise ValueError(f"unknown variant {variant!r}")


def _define_floor() -> Any:
    """Not a library: the floor of a lock taken in the worker with task-locks' guarantees.

    A plain task that also sends, in its run, the one round trip a run lock needs: the
    fenced acquire of its key (``common.FLOOR_ACQUIRE``), with the previous run's
    release (``FLOOR_RELEASE``) ahead of it on the same connection, as ours carries it.
    No lock code: two scripts in one redis-py pipeline."""
    from common import FLOOR_ACQUIRE, FLOOR_RELEASE, floor_acquire_args, floor_owner

    locks = redis.Redis.from_url(LOCKS)
    acquire_sha, release_sha = locks.script_load(FLOOR_ACQUIRE), locks.script_load(FLOOR_RELEASE)
    previous: list[Any] = []  # the last run's key, token and release id

    @app.task(name="bench.plain_floor")
    def plain_floor(i: str) -> None:
        pipe = locks.pipeline(transaction=False)
        if previous:
            pipe.evalsha(release_sha, 1, *previous)
        token = secrets.token_hex(16)
        owner = floor_owner()  # ours reads the running thread's name per acquire too
        pipe.evalsha(acquire_sha, *floor_acquire_args(f"bench:{i}", token, 30_000, owner))
        if not pipe.execute()[-1]:
            raise RuntimeError(f"plain+floor: bench:{i} is held")
        previous[:] = [f"bench:{i}", token, secrets.token_hex(8)]
        _done()

    return plain_floor


def _define(variant: str) -> Any:
    """The task of ``variant`` (imports only that variant's library)."""
    if variant in BURST_VARIANTS:
        return _define_burst(variant)
    if variant == "plain":

        @app.task(name="bench.plain")
        def plain(i: str) -> None:
            _done()

        return plain
    if variant == "plain+floor":
        return _define_floor()
    if variant == "singleton_task":
        from task_locks.celery import singleton_task

        @singleton_task(
            app=app, name="bench.singleton_task", key="bench:{i}", ttl=30, backend=LOCKS
        )
        def single(i: str) -> None:
            _done()

        return single
    if variant == "celery-singleton":
        from celery_singleton import Singleton

        app.conf.singleton_backend_url = LOCKS

        @app.task(name="bench.celery_singleton", base=Singleton)
        def peer_singleton(i: str) -> None:
            _done()

        return peer_singleton
    if variant == "celery-once":
        from celery_once import QueueOnce

        app.conf.ONCE = {
            "backend": "celery_once.backends.Redis",
            "settings": {"url": LOCKS, "default_timeout": 60},
        }

        @app.task(name="bench.celery_once", base=QueueOnce)
        def peer_once(i: str) -> None:
            _done()

        return peer_once
    raise ValueError(f"unknown variant {variant!r}")


task = _define(VARIANT)


def _finished(**_: Any) -> None:
    """Every delivery a burst worker finished, run or skipped (the burst's end marker)."""
    counter.incr(f"bench:burst:finished:{VARIANT}")


if VARIANT in BURST_VARIANTS:  # only there: a receiver would cost the throughput workers
    signals.task_postrun.connect(_finished, weak=False)


# -- driver: runs in the variant's interpreter, prints one JSON line ---------------------------


def drive(n: int, tag: str, timeout: float = 120.0) -> dict[str, Any]:
    done_key = f"bench:done:{VARIANT}"
    counter.set(done_key, 0)
    start = time.perf_counter()
    for i in range(n):
        task.delay(f"{tag}-{i}")
    published = time.perf_counter() - start
    deadline = time.monotonic() + timeout
    while int(counter.get(done_key) or 0) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{VARIANT}: only {counter.get(done_key)} of {n} ran in {timeout}s")
        time.sleep(0.005)
    elapsed = time.perf_counter() - start
    return {"variant": VARIANT, "n": n, "seconds": elapsed, "publish_seconds": published,
            "rate": n / elapsed}  # fmt: skip


def drive_burst(n: int, tag: str, timeout: float = 60.0) -> dict[str, Any]:
    """Publish ``n`` identical calls at once; wait until every accepted one was delivered."""
    ran_key, finished_key = f"bench:burst:ran:{VARIANT}", f"bench:burst:finished:{VARIANT}"
    counter.delete(ran_key, finished_key)
    start = time.perf_counter()
    accepted: set[str] = set()
    for _ in range(n):
        handle = task.delay(f"same-{tag}")
        # A duplicate returns the queued task's handle (ours, celery-singleton) or one
        # without an id (celery-once, graceful).
        if handle is not None and handle.id is not None:
            accepted.add(handle.id)
    published = time.perf_counter() - start
    deadline = time.monotonic() + timeout
    while int(counter.get(finished_key) or 0) < len(accepted):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{VARIANT}: {counter.get(finished_key)} of {len(accepted)} delivered in {timeout}s"
            )
        time.sleep(0.01)
    ran = int(counter.get(ran_key) or 0)
    return {
        "variant": VARIANT,
        "calls": n,
        "accepted": len(accepted),
        "dropped_at_publish": n - len(accepted),
        "ran": ran,
        "skipped_at_run": len(accepted) - ran,
        "publish_seconds": published,
        "seconds": time.perf_counter() - start,
    }


# -- orchestration: workers, rounds, summary ---------------------------------------------------


def _python_for(variant: str, peers_python: str | None) -> str | None:
    if variant not in PEER_VARIANTS:
        return sys.executable
    if not peers_python or not Path(peers_python).exists():
        return None
    probe = subprocess.run(
        [peers_python, "-c", f"import kombu.transport.redis, {PEER_VARIANTS[variant]}"],
        capture_output=True,
    )
    return peers_python if probe.returncode == 0 else None


def _env(variant: str, broker: str, locks: str) -> dict[str, str]:
    return {
        **os.environ,
        "TL_BENCH_BROKER": broker,
        "TL_BENCH_LOCKS": locks,
        "TL_BENCH_VARIANT": variant,
        "PYTHONPATH": os.pathsep.join([str(BENCH), str(ROOT)]),
        "PYTHONWARNINGS": "ignore",
    }


def _start_worker(python: str, variant: str, broker: str, locks: str, log_dir: Path) -> Any:
    log = log_dir / f"celery-bench-{variant}.log"
    pool = ["-P", "threads", "-c", str(BURST_THREADS)] if variant in BURST_VARIANTS else [
        "-P", "solo"]  # fmt: skip
    proc = subprocess.Popen(
        [python, "-m", "celery", "-A", "celery_bench", "worker", *pool, "-l", "WARNING",
         "-Q", f"bench_{variant}", "-n", f"bench-{variant}@%h", "--logfile", str(log),
         "--without-gossip", "--without-mingle", "--without-heartbeat"],
        cwd=BENCH, env=_env(variant, broker, locks), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    return proc


def _wait_consuming(
    client: redis.Redis, variant: str, procs: dict[str, Any], timeout: float
) -> None:
    """Ready when the worker has bound its queue (kombu records the binding in Redis)."""
    deadline = time.monotonic() + timeout
    while not client.exists("_kombu.binding.bench_" + variant):
        if procs[variant].poll() is not None:
            raise RuntimeError(f"celery worker for {variant} exited")
        if time.monotonic() > deadline:
            raise TimeoutError(f"celery worker for {variant} not ready after {timeout}s")
        time.sleep(0.05)
    time.sleep(0.5)  # the binding is written just before the consumer starts polling


def _drive(
    python: str, variant: str, broker: str, locks: str, n: int, tag: str, mode: str = "--drive"
) -> dict[str, Any]:
    out = subprocess.run(
        [python, str(BENCH / "celery_bench.py"), mode, "--n", str(n), "--tag", tag],
        cwd=BENCH, env=_env(variant, broker, locks), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"driver for {variant} failed:\n{out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _db_url(redis_url: str, db: int) -> str:
    """The same server, database ``db`` (the runner flushes its own databases)."""
    from urllib.parse import urlsplit, urlunsplit

    return urlunsplit(urlsplit(redis_url)._replace(path=f"/{db}", query=""))


def _stop(procs: dict[str, Any]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    for proc in procs.values():
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def measure_burst(
    broker: str, locks: str, peers_python: str | None, calls: int, log_dir: Path, log: Any
) -> dict[str, Any]:
    """Duplicate suppression: ``calls`` identical calls per library, one worker each."""
    client = redis.Redis.from_url(broker)
    pythons = {v: _python_for(v, peers_python) for v in BURST_VARIANTS}
    available = [v for v in BURST_VARIANTS if pythons[v]]
    procs: dict[str, Any] = {}
    results: dict[str, dict[str, Any]] = {}
    try:
        for variant in available:
            python = pythons[variant]
            assert python is not None
            procs[variant] = _start_worker(python, variant, broker, locks, log_dir)
        for variant in available:
            _wait_consuming(client, variant, procs, 60)
        for variant in available:
            python = pythons[variant]
            assert python is not None
            sample = _drive(python, variant, broker, locks, calls, "burst", "--drive-burst")
            label = BURST_VARIANTS[variant]
            results[label] = sample
            log(f"celery burst: {label:38} {sample['accepted']:4} of {calls} accepted, "
                f"{sample['ran']:4} ran, {sample['skipped_at_run']:4} skipped at run")  # fmt: skip
    finally:
        _stop(procs)
    return {
        "calls": calls,
        "hold_seconds": BURST_HOLD,
        "pool": f"threads x{BURST_THREADS}",
        "variants": results,
        "not_measured": [BURST_VARIANTS[v] for v in BURST_VARIANTS if v not in available],
    }


def run(
    redis_url: str,
    quick: bool = False,
    peers_python: str | None = None,
    peers: Any = None,
    n: int = 1000,
    rounds: int | None = None,
    burst_calls: int = 200,
    log: Any = print,
) -> dict[str, Any]:
    """Measure every available variant; ``throughput`` maps variant -> median tasks/s.

    ``burst`` holds the duplicate-suppression measurement (:func:`measure_burst`).
    """
    rounds = rounds or (3 if quick else 5)
    broker, locks = _db_url(redis_url, 10), _db_url(redis_url, 11)
    client = redis.Redis.from_url(broker)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    pythons = {v: _python_for(v, peers_python) for v in VARIANTS}
    available = [v for v in VARIANTS if pythons[v]]
    procs: dict[str, Any] = {}
    samples: dict[str, list[dict[str, Any]]] = {v: [] for v in available}
    try:
        for variant in available:
            python = pythons[variant]
            assert python is not None
            procs[variant] = _start_worker(python, variant, broker, locks, log_dir)
        for variant in available:
            _wait_consuming(client, variant, procs, 60)
        for variant in available:  # warm-up: imports, connections, Lua script cache
            python = pythons[variant]
            assert python is not None
            _drive(python, variant, broker, locks, max(20, n // 20), "warm")
        for number in range(rounds):
            order = available[number % len(available) :] + available[: number % len(available)]
            for variant in order:
                python = pythons[variant]
                assert python is not None
                cpu_before = _cpu_seconds(procs[variant].pid)
                sample = _drive(python, variant, broker, locks, n, f"r{number}")
                sample["worker_cpu_us_per_task"] = (
                    (_cpu_seconds(procs[variant].pid) - cpu_before) / n * 1e6
                )
                samples[variant].append(sample)
                log(f"celery bench round {number + 1}/{rounds}: {variant:16} "
                    f"{sample['rate']:8.0f} tasks/s, worker CPU "
                    f"{sample['worker_cpu_us_per_task']:5.0f} us/task")  # fmt: skip
    finally:
        _stop(procs)
    burst = measure_burst(broker, locks, peers_python, burst_calls, log_dir, log)
    throughput = {v: statistics.median(s["rate"] for s in samples[v]) for v in available}
    cpu = {v: statistics.median(s["worker_cpu_us_per_task"] for s in samples[v]) for v in available}
    # Plain and ours ran back to back in every round: the median of per-round ratios
    # cancels most of the drift a loaded machine adds.
    paired = [
        ours["rate"] / plain["rate"]
        for ours, plain in zip(samples["singleton_task"], samples["plain"], strict=True)
    ]
    return {
        "n": n,
        "rounds": rounds,
        "pool": "solo",
        "throughput": throughput,
        "ratio_singleton_to_plain": statistics.median(paired),
        "round_ratios": paired,
        "worker_cpu_us_per_task": cpu,
        "loadavg": os.getloadavg(),
        "samples": samples,
        "not_measured": [v for v in VARIANTS if v not in available],
        "burst": burst,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--drive-burst", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="t", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=1000, help="tasks per round (default 1000)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--burst-calls", type=int, default=200, help="identical calls per burst")
    parser.add_argument("--redis-url", help="an existing server (default: start one)")
    parser.add_argument("--peers-python", default=str(BENCH / ".peers" / "bin" / "python"))
    args = parser.parse_args()
    if args.drive:
        print(json.dumps(drive(args.n, args.tag)))
        return
    if args.drive_burst:
        print(json.dumps(drive_burst(args.n, args.tag)))
        return
    with redis_at(args.redis_url) as url:
        result = run(
            url,
            peers_python=args.peers_python,
            n=args.n,
            rounds=args.rounds,
            burst_calls=args.burst_calls,
        )
    print(f"\n{result['n']} tasks per round, {result['rounds']} rounds, one solo worker each")
    for variant, rate in result["throughput"].items():
        cpu = result["worker_cpu_us_per_task"][variant]
        print(f"  {variant:16} {rate:8.0f} tasks/s (median), worker CPU {cpu:5.0f} us/task")
    for variant in result["not_measured"]:
        print(f"  {variant:16} not measured (not installed in {args.peers_python})")
    rounds = ", ".join(f"{r:.2f}" for r in result["round_ratios"])
    print(f"singleton_task / plain throughput: {result['ratio_singleton_to_plain']:.2f}x "
          f"(median of per-round ratios {rounds}; target >= 0.85x); "
          f"load average {result['loadavg'][0]:.1f}")  # fmt: skip
    burst = result["burst"]
    print(f"\nduplicate suppression: {burst['calls']} identical calls, worker pool "
          f"{burst['pool']}, each run {burst['hold_seconds']}s")  # fmt: skip
    for label, sample in burst["variants"].items():
        print(f"  {label:38} {sample['accepted']:4} accepted, {sample['ran']:4} ran, "
              f"{sample['skipped_at_run']:4} skipped at run")  # fmt: skip
    for label in burst["not_measured"]:
        print(f"  {label:38} not measured (not installed in {args.peers_python})")


if __name__ == "__main__":
    main()
