"""etcd: leases, revisions and a 3-node cluster losing its leader."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from chaoskit.proxy import ProxyHub
from servers import EtcdCluster, EtcdServer

from task_locks import BackendUnavailable, Lock, LockHeld, NotOwned, get_backend
from task_locks.backends.etcd import MAX_LEASE_SECONDS, EtcdBackend
from task_locks.errors import InvalidArgument
from task_locks.types import Owner


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


def settled_leases(member: EtcdServer, expected: set[str], timeout: float = 5.0) -> set[str]:
    """The live leases once they are ``expected`` (or at ``timeout``): a released key's
    lease, or a refused acquire's, is revoked by the backend's revoker thread, just after
    the call returns."""
    deadline = time.monotonic() + timeout
    while (leases := live_leases(member)) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return leases


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


def test_without_a_majority_locks_are_unavailable_and_the_holder_is_told(
    etcd_cluster: EtcdCluster,
) -> None:
    """The README's etcd row: with two of three members stopped (SIGSTOP: no majority, so
    no leader), an acquire fails with ``BackendUnavailable`` (never a grant, never a wait
    past its timeout), and the holder, whose renewals go unanswered, is marked lost at its
    local deadline. Once the members come back, the lock is taken again with a higher
    fence, after the holder's lease ran out."""
    url = etcd_cluster.url(timeout=1)
    ttl = 2.0
    lease = Lock("majority", ttl=ttl, backend=url).acquire(timeout=5)
    leader = etcd_cluster.leader()
    stopped = [leader, next(m for m in etcd_cluster if m is not leader)]
    for member in stopped:
        member.pause()
    try:
        for name in ("majority", "another-name"):
            started = time.monotonic()
            with pytest.raises(BackendUnavailable):
                Lock(name, ttl=ttl, backend=url).acquire(timeout=0.5)
            assert time.monotonic() - started < 10, "the acquire outlived its bounds"
        assert lease.lost.wait(2 * ttl), "no majority, yet the holder was never told"
        assert not lease.held
    finally:
        for member in stopped:
            member.resume()
    etcd_cluster.leader(timeout=20)
    again = Lock("majority", ttl=ttl, backend=url).acquire(timeout=15)
    assert again.fence > lease.fence
    again.release()


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


def test_failed_acquire_and_release_revoke_their_leases(etcd_cluster: EtcdCluster) -> None:
    url = etcd_cluster.url()
    member = etcd_cluster[0]
    assert live_leases(member) == set()
    holder = Lock("leases", ttl=30, backend=url).acquire(timeout=0)
    held = live_leases(member)
    assert len(held) == 1
    for _ in range(3):
        assert Lock("leases", ttl=30, backend=url).try_acquire() is None
    assert settled_leases(member, held) == held
    holder.release()
    assert settled_leases(member, set()) == set()


def test_close_sends_the_queued_revokes_first(etcd_node: EtcdServer) -> None:
    """The revokes go out after the releases answer; closing the backend sends every one
    still queued before its HTTP sessions close, so nothing is left to live out its TTL."""
    backend = EtcdBackend(etcd_node.url())
    assert live_leases(etcd_node) == set()
    for number in range(20):
        assert backend.release(f"q{number}", "tok") is False  # nothing held: no lease
        assert backend.acquire(f"q{number}", "tok", 60_000, Owner()).fence is not None
        assert backend.release(f"q{number}", "tok") is True
    backend.close()
    assert live_leases(etcd_node) == set()


def test_the_revoker_thread_ends_with_its_backend(etcd_node: EtcdServer) -> None:
    import gc
    import threading

    backend = EtcdBackend(etcd_node.url(prefix=f"gone-{uuid.uuid4().hex}/"))
    backend.acquire("x", "tok", 30_000, Owner())
    backend.release("x", "tok")
    name = f"task-locks-revoker {backend.server}"
    assert any(thread.name == name for thread in threading.enumerate())
    assert settled_leases(etcd_node, set()) == set()  # revoked; none left for other tests
    del backend
    gc.collect()
    deadline = time.monotonic() + 5
    while any(thread.name == name for thread in threading.enumerate()):
        assert time.monotonic() < deadline, "the revoker outlived its backend"
        time.sleep(0.02)


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


# -- the backend contract (same-token acquire, fence-checked force release), TTLs -----------


@pytest.fixture(scope="module")
def etcd_node() -> Iterator[EtcdServer]:
    """One member is enough for the contract: these tests cut no links."""
    if shutil.which("etcd") is None:
        pytest.skip("no etcd binary (scripts/install-servers.sh installs etcd-server)")
    server = EtcdServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def node_backend(etcd_node: EtcdServer) -> EtcdBackend:
    backend = get_backend(etcd_node.url(prefix=f"contract-{uuid.uuid4().hex[:8]}/"))
    assert isinstance(backend, EtcdBackend)
    return backend


def lock_key(backend: EtcdBackend, member: EtcdServer, name: str) -> dict[str, Any] | None:
    key = base64.b64encode(backend.prefix + name.encode()).decode()
    kvs = gateway(member, "kv/range", {"key": key}).get("kvs", [])
    return kvs[0] if kvs else None  # type: ignore[index,no-any-return]


def lease_ttl(member: EtcdServer, lease: int | str) -> int:
    return int(gateway(member, "lease/timetolive", {"ID": int(lease)}).get("TTL", 0))  # type: ignore[call-overload]


def test_same_token_acquire_keeps_the_fence_and_resets_ttl_and_owner(
    node_backend: EtcdBackend, etcd_node: EtcdServer
) -> None:
    first = node_backend.acquire("again", "tok", 30_000, Owner(host="queued", pid=1))
    assert first.fence is not None
    old_lease = lock_key(node_backend, etcd_node, "again")["lease"]  # type: ignore[index]

    again = node_backend.acquire("again", "tok", 3_000, Owner(host="running", pid=2))
    assert again.fence == first.fence
    kv = lock_key(node_backend, etcd_node, "again")
    assert kv is not None and int(kv["create_revision"]) == first.fence
    assert 0 < lease_ttl(etcd_node, kv["lease"]) <= 3, "the TTL was not reset to ttl_ms"
    holder = node_backend.holder("again")
    assert holder is not None and holder.owner.host == "running" and holder.token == "tok"
    # The old lease no longer carries the key: it was revoked, nothing leaks.
    assert str(old_lease) not in live_leases(etcd_node)
    assert live_leases(etcd_node) == {str(kv["lease"])}
    # And the lock goes on as one: renew and release work on the new lease.
    assert node_backend.renew("again", "tok", 3_000)
    assert node_backend.release("again", "tok")
    assert lock_key(node_backend, etcd_node, "again") is None
    assert settled_leases(etcd_node, set()) == set()


def test_same_token_acquire_from_another_client_takes_over_the_same_lock(
    node_backend: EtcdBackend, etcd_node: EtcdServer
) -> None:
    """A publish-time lock becoming the run lock in another process: one lock, one fence."""
    fence = node_backend.acquire("handover", "tok", 2_000, Owner(host="publisher")).fence
    worker = EtcdBackend(node_backend.url)
    assert worker.acquire("handover", "tok", 30_000, Owner(host="worker")).fence == fence
    kv = lock_key(node_backend, etcd_node, "handover")
    assert kv is not None and lease_ttl(etcd_node, kv["lease"]) > 2
    assert node_backend.acquire("handover", "other", 2_000, Owner()).fence is None
    assert worker.release("handover", "tok")
    worker.close()


def test_force_release_with_a_fence_frees_only_that_holder(
    node_backend: EtcdBackend, etcd_node: EtcdServer
) -> None:
    seen = node_backend.acquire("forced", "first", 30_000, Owner()).fence
    assert seen is not None
    assert node_backend.force_release("forced", seen) is True
    assert lock_key(node_backend, etcd_node, "forced") is None
    assert live_leases(etcd_node) == set(), "the freed holder's lease was not revoked"

    # The lock changed hands after the operator looked: the old fence frees nothing.
    now = node_backend.acquire("forced", "second", 30_000, Owner()).fence
    assert now is not None and now > seen
    kv = lock_key(node_backend, etcd_node, "forced")
    assert node_backend.force_release("forced", seen) is False
    assert lock_key(node_backend, etcd_node, "forced") == kv
    assert live_leases(etcd_node) == {str(kv["lease"])}, "a lease revoked without a delete"  # type: ignore[index]
    assert node_backend.force_release("never-held", 1) is False
    assert node_backend.force_release("forced") is True  # fence=None: whoever holds it
    assert live_leases(etcd_node) == set()


def test_aforce_release_takes_the_fence_too(node_backend: EtcdBackend) -> None:
    fence = node_backend.acquire("async-forced", "tok", 30_000, Owner()).fence
    assert fence is not None
    assert asyncio.run(node_backend.aforce_release("async-forced", fence + 1)) is False
    assert asyncio.run(node_backend.aforce_release("async-forced", fence)) is True


def test_a_ttl_beyond_etcds_longest_lease_is_refused_and_writes_nothing(
    node_backend: EtcdBackend, etcd_node: EtcdServer
) -> None:
    # etcd refuses a grant above MaxLeaseTTL ("too large lease TTL"): check the constant.
    with pytest.raises(urllib.error.HTTPError):
        gateway(etcd_node, "lease/grant", {"TTL": MAX_LEASE_SECONDS + 1})
    granted = gateway(etcd_node, "lease/grant", {"TTL": MAX_LEASE_SECONDS})
    gateway(etcd_node, "lease/revoke", {"ID": int(granted["ID"])})  # type: ignore[call-overload]

    with pytest.raises(InvalidArgument, match="longest lease"):
        node_backend.acquire("huge", "tok", (MAX_LEASE_SECONDS + 1) * 1000, Owner())
    with pytest.raises(InvalidArgument):  # refused here, or by the TTL's validation first
        Lock("huge", ttl=1e16, backend=node_backend).acquire(timeout=0)
    assert lock_key(node_backend, etcd_node, "huge") is None
    assert live_leases(etcd_node) == set()


def test_a_year_long_ttl_is_a_real_lease(node_backend: EtcdBackend, etcd_node: EtcdServer) -> None:
    """The longest TTL the library accepts (a year) fits etcd's lease, whole."""
    year = 365 * 24 * 3600
    assert node_backend.acquire("yearly", "tok", year * 1000, Owner()).fence is not None
    kv = lock_key(node_backend, etcd_node, "yearly")
    assert kv is not None and year - 60 < lease_ttl(etcd_node, kv["lease"]) <= year
    assert node_backend.release("yearly", "tok")


def test_a_renewal_batch_is_bounded_by_its_timeout_not_the_request_timeout(
    etcd_node: EtcdServer,
) -> None:
    """The renewal lane bounds each batch by its leases' nearest deadline. With the
    server gone silent (a blackholed proxy), one batch must end within that bound, not
    after the URL's per-request ``timeout`` (5 s here): otherwise one lost reply would
    hold the lane, and every other lease on it would lapse unrenewed meanwhile (the
    simulator found it: a 0.3 s lease behind a renewal whose reply was lost)."""
    from chaoskit.proxy import ProxyHub

    from task_locks.types import RenewItem

    hub = ProxyHub()
    try:
        proxy = hub.proxy(etcd_node.port)
        url = f"etcd://127.0.0.1:{proxy.port}?timeout=5&prefix=bound-{uuid.uuid4().hex[:6]}/"
        backend = EtcdBackend(url)
        token = uuid.uuid4().hex
        assert backend.acquire("bounded", token, 10_000, Owner(host="h", pid=1)).acquired
        proxy.blackhole()
        started = time.monotonic()
        with pytest.raises(BackendUnavailable):
            backend.renew_many([RenewItem("bounded", token, 10_000)], timeout=0.3)
        took = time.monotonic() - started
        assert took < 2.0, f"the batch took {took:.1f}s: bounded by the request timeout"
        proxy.heal()
        assert backend.release("bounded", token)
    finally:
        hub.close()


def test_the_environment_is_read_once_per_endpoint_not_per_request(
    etcd_node: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy named by the environment still applies (NO_PROXY too), read when the
    endpoint's session is made: requests would read it again on every call otherwise."""
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "")
    proxied = EtcdBackend("etcd://127.0.0.1:2")
    session = proxied.transport().session
    assert session.trust_env is False
    assert session.proxies.get("http") == "http://127.0.0.1:9"
    proxied.close()

    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    direct = EtcdBackend(etcd_node.url())
    assert "http" not in direct.transport().session.proxies
    monkeypatch.delenv("HTTP_PROXY")  # read already: the session keeps what it saw
    lease = Lock("env-once", ttl=5, backend=direct, renew=False).acquire(timeout=5)
    lease.release()
    direct.close()


def test_a_wait_whose_watch_answers_after_its_timeout_ends_quietly(
    etcd_node: EtcdServer,
) -> None:
    """A waiter's watch whose response headers come after the wait's own (short) read
    timeout: the gateway sends them with the watch's first message, which a loaded
    server may send late. The wait ends at its timeout like any wait nobody woke, with
    no error (CI once saw such a wait raise ``BackendUnavailable``). Every reply through
    the proxy comes 0.8 s late; the wait is 0.2 s."""
    prefix = f"watch-{uuid.uuid4().hex[:8]}/"
    held = Lock("slow-watch", ttl=10, backend=etcd_node.url(prefix=prefix)).acquire(timeout=0)
    hub = ProxyHub()
    proxy = hub.proxy(etcd_node.port)
    waiter = EtcdBackend(f"etcd://127.0.0.1:{proxy.port}?prefix={prefix}&timeout=3")
    try:
        proxy.latency(0.8)
        started = time.monotonic()
        waiter.wait_release("slow-watch", 0.2)  # a read (0.8 s late), then the watch
        took = time.monotonic() - started
        assert took < 0.8 + 0.2 + 1.5, f"the wait took {took:.2f}s"
        assert held.held
    finally:
        waiter.close()  # its own, not the process's shared one: nothing left on the proxy
        hub.close()
    held.release()
