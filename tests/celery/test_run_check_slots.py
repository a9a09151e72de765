"""A ``redis://`` URL straight to a Redis Cluster node, with the options whose run checks
more than its own key (``limit`` > 1, ``"wait"``, ``"retry"``, ``lock_on="both"``).

The backend learns that it talks to a cluster node only when a script is refused
CROSSSLOT. The run check of those options names keys in other hash slots (the
semaphore's slots, ``<key>#task:<id>``), so it cannot be one script there: the run must
then take the ``#task:`` lock as on ``redis+cluster://``, not fail. Runs in-process
(``apply``: Celery's tracer) on a real three-node cluster.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from servers import RedisClusterNodes

from task_locks.celery import singleton_task


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("run-check-slots", set_as_current=False)
    app.conf.update(task_always_eager=False, task_ignore_result=True)
    yield app
    app.close()


def node_url(cluster: RedisClusterNodes, key: str) -> str:
    """A plain URL to the node owning ``key``'s lock, with a prefix of its own (a fresh
    backend, which has not yet met a CROSSSLOT refusal)."""
    client = redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    prefix = f"slots{uuid.uuid4().hex[:6]}:"
    owner = client.get_node_from_key(f"{prefix}{{{key}}}")
    client.close()
    return f"redis://127.0.0.1:{owner.port}/0?prefix={prefix}"


@pytest.mark.parametrize(
    "options",
    [{"on_conflict": "wait", "wait_timeout": 5}, {"limit": 3}, {"on_conflict": "retry"}],
    ids=["wait", "limit3", "retry"],
)
def test_the_first_run_on_a_plain_url_to_a_cluster_node_runs(
    app: Celery, redis_cluster: RedisClusterNodes, options: dict[str, Any]
) -> None:
    key = f"slots-{uuid.uuid4().hex[:8]}"
    url = node_url(redis_cluster, key)
    ran: list[int] = []

    @singleton_task(app=app, key=key, backend=url, **options)
    def task() -> None:
        ran.append(1)

    first = task.apply(task_id=str(uuid.uuid4()))
    assert first.state == "SUCCESS", first.result
    second = task.apply(task_id=str(uuid.uuid4()))
    assert second.state == "SUCCESS", second.result
    assert ran == [1, 1]
