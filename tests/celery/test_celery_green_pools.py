"""gevent and eventlet pools: real ``-P gevent -c 30`` and
``-P eventlet -c 30`` workers on the Redis broker.

Under both, the renewal watchdog (an OS thread elsewhere) is a greenlet of the worker's
hub, as are the task bodies: it renews as long as the bodies yield (I/O, sleeps). So:

- twenty concurrent runs with a 1 s TTL, each running 2 s (several renewals), keep every
  lease, and two copies of a key never overlap (the second is skipped);
- a body that blocks the hub in one C call for longer than its TTL stops every renewal
  of that worker: the lock expires on the server meanwhile (another process takes it),
  and the run is told: ``lease.held`` is False once the call returns, and the run ends
  as its ``on_lost`` says: ``FAILURE`` with ``LockLost`` (``"interrupt"``, ``"fail"``),
  or (``"ignore"``) the body's own result with the loss logged at WARNING; never
  ``SUCCESS`` as if it had been exclusive throughout.
"""

from __future__ import annotations

import itertools
import uuid
from collections import defaultdict
from typing import Any

import pytest
from servers import wait_until

from task_locks import get_backend
from task_locks.celery import Skipped
from task_locks.types import Owner

pytestmark = pytest.mark.slow

POOLS = ["gevent", "eventlet"]
KEYS = 10


def _worker(request: pytest.FixtureRequest, pool: str) -> Any:
    return request.getfixturevalue(f"{pool}_worker")


@pytest.mark.parametrize("pool", POOLS)
def test_concurrent_runs_with_short_ttls_keep_their_leases_and_never_overlap(
    cluster: Any, request: pytest.FixtureRequest, pool: str, key: str, intervals: Any
) -> None:
    _worker(request, pool)
    task, log = cluster.tasks.short_ttl_task, f"log:{key}"
    keys = [f"{key}-{n}" for n in range(KEYS)]
    results = [
        task.apply_async((k, log, 2.0), queue=f"tl_{pool}") for k in keys for _copy in range(2)
    ]
    wait_until(
        lambda: all(r.state in ("SUCCESS", "FAILURE") for r in results),
        30,
        "every run to end",
    )
    states = [r.state for r in results]
    assert "FAILURE" not in states, [r.result for r in results if r.state == "FAILURE"]
    runs = intervals(log)
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for result, run_key in zip(results, [k for k in keys for _copy in range(2)], strict=True):
        by_key[run_key] += [r for r in runs if r["task_id"] == result.id]
    for run_key, key_runs in by_key.items():
        assert key_runs, f"no run of {run_key}"
        ordered = sorted(key_runs, key=lambda r: r["start"])
        for before, after in itertools.pairwise(ordered):
            assert after["start"] >= before["end"], f"two runs of {run_key} overlapped"
    kept = intervals(log + ":kept")
    assert len(kept) == len(runs) >= KEYS
    assert all(k["held"] and not k["lost"] for k in kept), kept
    skipped = [r for r in results if isinstance(r.result, Skipped)]
    assert len(skipped) == 2 * KEYS - len(runs)


HUB_BLOCKING = {
    "interrupt": "hub_blocking_task",
    "fail": "hub_blocking_fail",
    "ignore": "hub_blocking_ignore",
}


@pytest.mark.parametrize("on_lost", ["interrupt", "fail", "ignore"])
@pytest.mark.parametrize("pool", POOLS)
def test_a_body_blocking_the_hub_past_its_ttl_is_reported_lost(
    cluster: Any, request: pytest.FixtureRequest, pool: str, on_lost: str, key: str,
    intervals: Any,
) -> None:  # fmt: skip
    worker = _worker(request, pool)
    log, name = f"log:{key}", f"t:{key}"
    task = getattr(cluster.tasks, HUB_BLOCKING[on_lost])
    result = task.apply_async((key, log, 150_000_000), queue=f"tl_{pool}")
    wait_until(lambda: intervals(log), 20, "the run to start")
    backend = get_backend(cluster.locks_url)
    thief = str(uuid.uuid4())
    wait_until(
        lambda: backend.acquire(name, thief, 30_000, Owner(task_id="thief")).acquired,
        10,
        "the run's lock to expire while its body blocks the hub",
    )
    during = len(intervals(log)) == 1  # "call ended" is recorded after the C call
    try:
        wait_until(lambda: result.ready(), 20, "the run to end")
        assert during, "the C call ended before its lock expired: it proves nothing"
        ended = [r for r in intervals(log) if r.get("event") == "call ended"]
        assert all(r["held"] is False for r in ended), ended  # the body could see it too
        if on_lost == "ignore":  # the body's result (it saw the loss), the loss logged
            assert result.state == "SUCCESS" and result.result is False
            wait_until(
                lambda: any(
                    "WARNING" in line and repr(name) in line and "lost" in line
                    for line in worker.tail(400).splitlines()
                ),
                10,
                "the worker to log the loss",
            )
        else:  # the documented end state, whichever of the watch and the release saw it
            assert result.state == "FAILURE"
            assert type(result.result).__name__ == "LockLost", repr(result.result)
            assert f"lock {name!r} was lost while the task ran" in str(result.result)
            if on_lost == "fail":
                assert ended and "finished without exclusivity" in str(result.result)
        holder = backend.holder(name)
        assert holder is not None and holder.token == thief  # never released from under it
    finally:
        backend.release(name, thief)
