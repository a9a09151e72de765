"""etcd: leases, revisions and a 3-node cluster losing its leader (acceptance 3 of issue 5)."""

from __future__ import annotations

import base64
import json
import time
import urllib.request

import pytest
from servers import EtcdCluster, EtcdServer

from task_locks import BackendUnavailable, Lock, LockHeld, NotOwned, get_backend
from task_locks.backends.etcd import EtcdBackend


def gateway(member: EtcdServer, path: str, body: dict[str, object]) -> dict[str, object]:
    """A raw v3 gateway call, to look at (or poke) the server behind the backend's back."""
    request = urllib.request.Request(
        f"{member.client_url}/v3/{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=5) as answer:
        return json.loads(answer.read())  # type: ignore[no-any-return]


def live_leases(member: EtcdServer) -> set[str]:
    return {lease["ID"] for lease in gateway(member, "lease/leases", {}).get("leases", [])}  # type: ignore[union-attr]


def test_leader_killed_while_held_the_holder_keeps_it_or_is_told(
    etcd_cluster: EtcdCluster,
) -> None:
    url = etcd_cluster.url(timeout=1)
    ttl = 2.0
    lease = Lock("leader-kill", ttl=ttl, backend=url).acquire(timeout=5)
    renewals_before = lease.renewals
    etcd_cluster.leader().kill()

    rival = Lock("leader-kill", ttl=ttl, backend=url)
    until = time.monotonic() + 2 * ttl
    while time.monotonic() < until:
        try:
            taken = rival.acquire(timeout=0)
        except (LockHeld, BackendUnavailable):
            taken = None
        if taken is not None:
            assert not lease.held, "a second client acquired while the holder still held"
            taken.release()
            break
        time.sleep(0.1)  # sampling the lock over time, not synchronising

    new_leader = etcd_cluster.leader()
    if lease.held:  # kept it: renewals went on through the election, and etcd agrees
        assert lease.renewals > renewals_before
        holder = get_backend(url).holder("leader-kill")
        assert holder is not None and holder.fence == lease.fence
        lease.release()
    else:  # or it was told, loudly
        assert lease.lost.is_set(), "neither held nor marked lost"
    assert new_leader.proc is not None and new_leader.proc.poll() is None


def test_unrenewed_lease_is_not_granted_early_across_a_leader_change(
    etcd_cluster: EtcdCluster,
) -> None:
    url = etcd_cluster.url(timeout=1)
    ttl = 2.0
    started = time.monotonic()
    dead = Lock("stale", ttl=ttl, backend=url, renew=False).acquire(timeout=5)
    etcd_cluster.leader().kill()

    granted = None
    while granted is None and time.monotonic() - started < 10 * ttl:
        try:
            granted = Lock("stale", ttl=ttl, backend=url).acquire(timeout=1)
        except (LockHeld, BackendUnavailable):
            pass
    assert granted is not None, "the lock never became free"
    assert time.monotonic() - started >= ttl, "granted before the holder's lease ran out"
    assert granted.fence > dead.fence
    granted.release()


def test_failed_acquire_revokes_its_lease_at_once(etcd_cluster: EtcdCluster) -> None:
    url = etcd_cluster.url()
    member = etcd_cluster[0]
    assert live_leases(member) == set()
    holder = Lock("leases", ttl=30, backend=url).acquire(timeout=0)
    held = live_leases(member)
    assert len(held) == 1
    for _ in range(3):
        assert Lock("leases", ttl=30, backend=url).try_acquire() is None
    assert live_leases(member) == held
    holder.release()
    assert live_leases(member) == set()


def test_keepalive_alone_is_not_proof_of_ownership(etcd_cluster: EtcdCluster) -> None:
    backend = get_backend(etcd_cluster.url())
    assert isinstance(backend, EtcdBackend)
    lease = Lock("proof", ttl=30, backend=backend, renew=False).acquire(timeout=0)
    # Delete the key but leave its lease alive: a keep-alive still succeeds.
    key = base64.b64encode(b"task_locks/proof").decode()
    assert gateway(etcd_cluster[1], "kv/deleterange", {"key": key}).get("deleted") == "1"
    with pytest.raises(NotOwned):
        lease.renew()
    assert lease.lost.is_set()


def test_a_dead_endpoint_is_skipped(etcd_cluster: EtcdCluster) -> None:
    url = etcd_cluster.url(timeout=1)
    etcd_cluster[0].kill()  # the first endpoint in the URL
    backend = get_backend(url)
    lease = Lock("failover", ttl=5, backend=url).acquire(timeout=5)
    assert [h.name for h in backend.holders()] == ["failover"]
    lease.renew()
    lease.release()
    assert backend.holders() == []


def test_fence_is_the_keys_create_revision(etcd_cluster: EtcdCluster) -> None:
    lease = Lock("revision", ttl=5, backend=etcd_cluster.url()).acquire(timeout=0)
    key = base64.b64encode(b"task_locks/revision").decode()
    kvs = gateway(etcd_cluster[2], "kv/range", {"key": key})["kvs"]
    assert int(kvs[0]["create_revision"]) == lease.fence  # type: ignore[index]
    lease.release()
