"""What a Redis lock leaves in the server: one key while held, a short tombstone after.

The fence counter is the only state that outlives a release: one for the database (one
per hash slot on a cluster, so a script's keys share a slot), whatever the number of
names or runs; the waiters' signal is written only when someone waits.
"""

from __future__ import annotations

import redis
from servers import RedisClusterNodes

from task_locks import Lock, get_backend
from task_locks.backends.redis_scripts import SLOTS, counter_key, key_slot, slot_tag


def test_every_slot_has_a_counter_tag_in_that_slot() -> None:
    assert all(key_slot(slot_tag(slot)) == slot for slot in range(SLOTS))
    assert all("{" not in slot_tag(s) and "}" not in slot_tag(s) for s in range(SLOTS))


def test_released_names_leave_only_expiring_tombstones_and_slot_counters(
    redis_url: str,
) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    backend = get_backend(redis_url)
    names = [f"layout:{i}" for i in range(300)]
    for name in names:
        with Lock(name, ttl=30, backend=backend, renew=False).acquire(timeout=0):
            assert client.keys(f"task_locks:{{{name}}}*") == [f"task_locks:{{{name}}}"]
    left = set(client.scan_iter(match="task_locks:*"))
    tombstones = {f"task_locks:{{{name}}}" for name in names}
    # One counter; no :signal (nobody waited), no per-name :fence or :released.
    assert left == tombstones | {counter_key("task_locks:")}
    assert all(0 < client.pttl(key) <= 60_000 for key in tombstones)
    assert all(client.get(key).startswith("r") for key in tombstones)


def test_a_plain_url_to_a_cluster_node_names_counters_by_slot(
    redis_cluster: RedisClusterNodes,
) -> None:
    """A ``redis://`` URL straight to a cluster node: the first acquire is refused
    CROSSSLOT before it runs (the database's counter is in another slot), and is sent
    again with its slot's counter, as every later one is."""
    first = redis_cluster.nodes[0]
    node = redis.RedisCluster(host="127.0.0.1", port=first.port)
    name = "layout:node"
    owner = node.get_node_from_key(f"task_locks:{{{name}}}")
    plain = get_backend(f"redis://127.0.0.1:{owner.port}/0")
    with Lock(name, ttl=5, backend=plain, renew=False).acquire(timeout=0) as lease:
        assert plain.holder(name).fence == lease.fence  # type: ignore[union-attr]
    assert node.exists(counter_key("task_locks:", name))
    node.close()


def test_the_signal_is_written_only_when_someone_waited(redis_url: str) -> None:
    """The client hand-off (``handoff=client``): a release pushes the signal a counted
    waiter BLPOPs, and only then."""
    client = redis.Redis.from_url(redis_url)
    backend = get_backend(redis_url + "?handoff=client")
    lease = Lock("layout:signal", ttl=30, backend=backend, renew=False).acquire(timeout=0)
    lease.release()
    assert not client.exists("task_locks:{layout:signal}:signal")
    lease = Lock("layout:signal", ttl=30, backend=backend, renew=False).acquire(timeout=0)
    assert Lock("layout:signal", ttl=30, backend=backend).try_acquire() is None  # one waiter
    lease.release()
    assert client.llen("task_locks:{layout:signal}:signal") == 1
    assert 0 < client.pttl("task_locks:{layout:signal}:signal") <= 5_000  # socket_timeout


def test_the_server_handoff_leaves_nothing_of_a_try_that_did_not_wait(redis_url: str) -> None:
    """The default hand-off: a try that cannot wait is not queued, so the release finds
    nobody to grant or wake, and leaves only its tombstone."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    backend = get_backend(redis_url)
    assert backend.server_handoff
    lease = Lock("layout:tried", ttl=30, backend=backend, renew=False).acquire(timeout=0)
    assert Lock("layout:tried", ttl=30, backend=backend).try_acquire() is None
    lease.release()
    assert client.keys("task_locks:{layout:tried}*") == ["task_locks:{layout:tried}"]
