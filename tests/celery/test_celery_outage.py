"""The lock service is down: real workers, a lock server of their own
that the tests stop and start (password-protected, so the logs can be checked for it).

A run whose acquire meets ``BackendUnavailable`` fails at once by default
(``lock_unavailable="fail"``) or, with ``lock_unavailable="retry"``, is retried as
Celery's ``autoretry_for`` would (backoff, ``max_retries``) and runs once the server is
back. A worker started while its lock server is down says so, once, in its log.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from servers import RedisServer, wait_until

pytestmark = pytest.mark.slow

PASSWORD = "s3cret-pw"
WARNING = "is unreachable at worker start"


@pytest.fixture(scope="module")
def lock_server() -> Iterator[RedisServer]:
    """Not started: the worker below starts while it is down."""
    server = RedisServer(extra=["--requirepass", PASSWORD])
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="module")
def outage_worker(cluster: Any, lock_server: RedisServer) -> Iterator[Any]:
    url = f"redis://:{PASSWORD}@127.0.0.1:{lock_server.port}/0?socket_timeout=1"
    options = ["-P", "threads", "-c", "2", "-Q", "tl_outage"]
    with cluster.running([("outage", options, {"TL_OUTAGE_LOCKS": url})]) as started:
        yield started[0]


def run(cluster: Any, task_name: str) -> tuple[Any, str]:
    key = f"k{uuid.uuid4().hex[:10]}"
    log = f"log:{key}"
    task = getattr(cluster.tasks, task_name)
    return task.apply_async((key, log), queue="tl_outage"), log


def test_a_worker_started_while_its_lock_server_is_down_warns_once(
    outage_worker: Any, lock_server: RedisServer
) -> None:
    text = wait_until(
        lambda: WARNING in (found := outage_worker.log.read_text()) and found,
        10,
        "the start-up warning",
    )
    lines = [line for line in text.splitlines() if WARNING in line]
    assert len(lines) == 1, lines  # one line per unreachable backend; the others answer
    assert f"redis://:***@127.0.0.1:{lock_server.port}/0" in lines[0]
    assert PASSWORD not in text


def test_by_default_a_run_that_cannot_take_its_lock_fails_at_once(
    cluster: Any, outage_worker: Any
) -> None:
    result, log = run(cluster, "outage_fail_task")
    wait_until(lambda: result.state == "FAILURE", 15, "the run to fail")
    assert type(result.result).__name__ == "BackendUnavailable"
    assert cluster.store.llen(log) == 0  # the body never ran without its lock


def test_retry_gives_up_after_max_retries_with_celerys_backoff(
    cluster: Any, outage_worker: Any
) -> None:
    """``retry_backoff=True``, ``retry_backoff_max=1``, ``max_retries=2``, no jitter: two
    retries a second apart, then the run fails with the lock service's error."""
    result, log = run(cluster, "outage_limited_task")
    wait_until(lambda: result.state == "FAILURE", 20, "the retries to run out")
    assert type(result.result).__name__ == "BackendUnavailable"
    retries = [
        line
        for line in outage_worker.log.read_text().splitlines()
        if result.id in line and "Retry in 1s" in line
    ]
    assert len(retries) == 2, retries
    assert cluster.store.llen(log) == 0


def test_retry_runs_the_task_once_the_lock_server_is_back(
    cluster: Any, outage_worker: Any, lock_server: RedisServer, intervals: Any
) -> None:
    result, log = run(cluster, "outage_retry_task")
    wait_until(lambda: result.state == "RETRY", 15, "a retry")
    lock_server.start()
    try:
        assert result.get(timeout=20) == "ran"
        runs = intervals(log)
        assert len(runs) == 1 and runs[0]["attempt"] >= 1, runs
    finally:
        lock_server.kill()
