"""A ``redis://`` URL straight to a single-shard Redis Cluster (every hash slot on one
node: a managed "cluster mode" endpoint), with the options whose run checks more than its
own key (``limit`` > 1, ``"wait"``, ``"retry"``).

The backend learns that it talks to a cluster node only when a script is refused
CROSSSLOT. The run check of those options names keys in other hash slots (the
semaphore's slots, ``<key>#task:<id>``), so it cannot be one script there: the run must
then take the ``#task:`` lock as on ``redis+cluster://``, not fail. Runs in-process
(``apply``: Celery's tracer) on a real redis-server in cluster mode.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from servers import RedisServer, free_port, wait_until

from task_locks.celery import singleton_task


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("run-check-slots", set_as_current=False)
    app.conf.update(task_always_eager=False, task_ignore_result=True)
    yield app
    app.close()


@pytest.fixture(scope="module")
def shard() -> Iterator[RedisServer]:
    """One redis-server in cluster mode owning all 16384 hash slots."""
    node = RedisServer(
        extra=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
               "--cluster-port", str(free_port())]
    ).start()  # fmt: skip
    client = redis.Redis(port=node.port)
    client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    wait_until(lambda: client.cluster("info").get("cluster_state") == "ok", 30, "cluster ok")
    client.close()
    yield node
    node.cleanup()


def node_url(node: RedisServer) -> str:
    """A plain URL to the node, with a prefix of its own (a fresh backend, which has not
    yet met a CROSSSLOT refusal)."""
    return f"redis://127.0.0.1:{node.port}/0?prefix=slots{uuid.uuid4().hex[:6]}:"


@pytest.mark.parametrize(
    "options",
    [
        {"on_conflict": "wait", "wait_timeout": 5},
        {"limit": 3},
        {"on_conflict": "retry"},
        {"on_conflict": "wait", "wait_timeout": 5, "is_async": True},
    ],
    ids=["wait", "limit3", "retry", "wait-async"],
)
def test_the_first_run_on_a_plain_url_to_a_cluster_node_runs(
    app: Celery, shard: RedisServer, options: dict[str, Any]
) -> None:
    key = f"slots-{uuid.uuid4().hex[:8]}"
    url = node_url(shard)
    ran: list[int] = []
    options = dict(options)
    if options.pop("is_async", False):

        @singleton_task(app=app, name=f"t.{uuid.uuid4().hex}", key=key, backend=url, **options)
        async def task() -> None:
            ran.append(1)

    else:

        @singleton_task(app=app, name=f"t.{uuid.uuid4().hex}", key=key, backend=url, **options)
        def task() -> None:
            ran.append(1)

    first = task.apply(task_id=str(uuid.uuid4()))
    assert first.state == "SUCCESS", first.result
    second = task.apply(task_id=str(uuid.uuid4()))
    assert second.state == "SUCCESS", second.result
    assert ran == [1, 1]
