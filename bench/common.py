"""Shared by the benchmark modules: what each mode measures, and small statistics."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
# bench/'s scripts run as `python bench/X.py` (their own folder first on sys.path) and
# start their servers with the tests' harness, tests/servers.py: this is the one place
# that puts tests/ on the path, so a script imports common before servers.
sys.path.insert(0, str(ROOT / "tests"))


@contextmanager
def redis_at(url: str | None) -> Iterator[str]:
    """``url``, or (``None``) the URL of a redis-server of its own for the block: a
    script's ``--redis-url`` default."""
    if url is not None:
        yield url
        return
    from servers import RedisServer

    server = RedisServer().start()
    try:
        yield server.url()
    finally:
        server.cleanup()


# The least a cycle with task-locks' guarantees asks of the server, with no lock code:
# the acquire reads the record, takes a fence by the fence rule (the server's clock in
# microseconds, and the database's counter: increasing across a restart that lost the
# counter and across the clock stepping back) and writes the record with its owner; the
# release reads the record and leaves a tombstone naming the release (the exact answer to
# a resent release). The same commands as ours and a record of our layout
# (``h<token>|<fence>|<renewals>|<acquired ms>|<waiters>|<release id>|<owner JSON>``,
# then ``r<waiters>|<release id>``), in two scripts: ``workers.FencedFloor`` sends them
# uncontended, ``celery_bench``'s ``plain+floor`` task once per run.
# KEYS[1] the record, KEYS[2] the fence counter; ARGV token, ttl ms, owner JSON, the
# counter's ttl ms. Returns the fence, or 0 if the lock is held.
FLOOR_ACQUIRE = """
local held = redis.call('get', KEYS[1])
if held and string.sub(held, 1, 1) == 'h' then return 0 end
local now = redis.call('time')
local us = tonumber(now[1]) * 1000000 + tonumber(now[2])
local last = tonumber(redis.call('set', KEYS[2], string.format('%.0f', us), 'px', ARGV[4],
  'get') or '0')
local fence = us
if last >= us then
  fence = last + 1
  redis.call('set', KEYS[2], string.format('%.0f', fence), 'px', ARGV[4])
end
local acquired = string.format('%.0f', tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000))
redis.call('set', KEYS[1], 'h' .. ARGV[1] .. '|' .. string.format('%.0f', fence) .. '|0|' ..
  acquired .. '|0||' .. ARGV[3], 'px', ARGV[2])
return fence
"""
# KEYS[1] the record; ARGV token, release id. Returns 1 if released, 0 if not ours.
FLOOR_RELEASE = """
local held = redis.call('get', KEYS[1])
if not held or string.sub(held, 1, #ARGV[1] + 2) ~= 'h' .. ARGV[1] .. '|' then return 0 end
redis.call('set', KEYS[1], 'r0|' .. ARGV[2], 'px', 60000)
return 1
"""


def floor_owner() -> str:
    """An owner record of the form ours has (``Owner.to_json``: host, pid, thread)."""
    return json.dumps(
        {"host": os.uname().nodename, "pid": os.getpid(), "thread": threading.current_thread().name}
    )


#: The floor's fence counter and its TTL (ours keeps one per database, a week).
FLOOR_COUNTER = "bench:floor:fence"
FLOOR_COUNTER_TTL_MS = 7 * 86_400_000


def floor_acquire_args(key: str, token: str, ttl_ms: int, owner: str) -> tuple[Any, ...]:
    """``FLOOR_ACQUIRE``'s ``EVALSHA`` arguments after the SHA: key count, KEYS, ARGV."""
    return (2, key, FLOOR_COUNTER, token, ttl_ms, owner, FLOOR_COUNTER_TTL_MS)


PEER_VENV = BENCH / ".peers"


#: PyPI distributions measured from the peers' venv; redis-py's Lock runs in ``.venv``.
PEERS = ("python-redis-lock", "pottery", "sherlock", "celery-singleton", "celery-once")


#: Which adapter (bench/workers.py) measures which peer distribution.
PEER_ADAPTERS = {
    "python-redis-lock": "python-redis-lock",
    "pottery": "pottery",
    "sherlock": "sherlock",
}


FLOOR = "our client (.venv)"


PEER_FLOOR = "peers' client (.peers)"


TTL = 30.0  # long enough that no renewal or expiry happens inside a latency sample


@dataclass
class Plan:
    mode: str
    rounds: int  # uncontended rounds (each runs every subject once, rotated)
    cycles: int  # acquire+release cycles per subject per round
    procs: tuple[int, ...]
    holds: tuple[float, ...]
    contention_seconds: float
    contention_rounds: int
    target_rounds: int  # rounds for the cells the targets read (TARGET_CELLS)
    leases: tuple[int, ...]
    renew_ttl: float
    renew_periods: float
    block_seconds: float = 0.5  # cap per subject per round, so slow backends stay cheap
    #: Unique-name cycles per library whose leftovers the footprint cell counts
    #: (``--footprint-cycles`` overrides), and the locks it holds at once.
    footprint_cycles: int = 100_000
    footprint_live: int = 10_000
    other_backends: bool = True  # redlock:// and etcd:// on servers of their own
    celery: bool = True
    libraries: tuple[str, ...] = (
        "task-locks",
        "task-locks-client",
        "redis-py",
        "python-redis-lock",
    )
    #: (procs, hold) cells beyond the procs x holds grid; outside the lock is 2 x hold.
    extra_cells: tuple[tuple[int, float], ...] = ((4, 0.0), (4, 0.0002))

    def cells(self) -> list[tuple[int, float]]:
        """Every (procs, hold) cell of the run, in order, without repeats."""
        grid = [(n, hold) for hold in self.holds for n in self.procs]
        return list(dict.fromkeys([*grid, *self.extra_cells]))


#: The contention workloads of the hand-off targets (procs, hold; outside = 2 x hold), read by the targets
#: and so measured over ``Plan.target_rounds``: hold 0, hold 0.2 ms / 0.4 ms outside,
#: hold 1 ms / 2 ms outside, all at 4 processes.
TARGET_CELLS = ((4, 0.0), (4, 0.0002), (4, 0.001))


PLANS = {
    "full": Plan(
        "full", 15, 300, (2, 4, 8), (0.0, 0.001, 0.01), 1.5, 2, 4, (100, 1000, 10000), 3.0, 3
    ),
    "quick": Plan(
        "quick",
        5,
        150,
        (2, 4, 8),
        (0.001,),
        1.0,
        1,
        2,
        (100, 1000),
        1.5,
        2,
        block_seconds=0.25,
        footprint_cycles=10_000,
        footprint_live=2_000,
    ),
    "smoke": Plan(
        "smoke",
        2,
        40,
        (2,),
        (0.001,),
        0.4,
        1,
        1,
        (100,),
        1.5,
        1.5,
        block_seconds=0.2,
        footprint_cycles=300,
        footprint_live=100,
        other_backends=False,
        celery=False,
        libraries=("task-locks", "task-locks-client", "redis-py"),
        extra_cells=(),
    ),
}


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (p99 of 4,000 samples is the 40th largest)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[index]


def summary_us(samples_ns: Sequence[float]) -> dict[str, float]:
    return {
        "median_us": quantile(samples_ns, 0.5) / 1000,
        "p99_us": quantile(samples_ns, 0.99) / 1000,
        "n": len(samples_ns),
    }


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or a != a or b != b:
        return None
    return a / b


def fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def pg_floor_us(floor: dict[str, Any]) -> float:
    """The django:// floor in µs: timed as one call where the run has it, else (results
    from before it was) the sum of its parts timed apart."""
    if "floor_us" in floor:
        return float(floor["floor_us"])
    return float(floor["select1x2_us"] + floor["durable_write_us"])
