"""etcd under transport faults: the etcd row of the transport fault matrix.

A real 3-member etcd cluster; the client under test reaches the first member through
the chaoskit TCP proxy and the other two directly, as ``etcd://proxy,b,c``. A hook on
the client's real HTTP session aims one fault at exactly one gateway request of the
operation under test (the first request to that path), so the fault hits that request
and its reply only, and the client's own retry on the next endpoint is exercised:

- ``drop_request``: the request never reaches the server (the client times out);
- ``drop_reply``: the server applies it, the reply is lost (the client times out);
- ``reset``: the server applies it, the connection is reset as the reply comes back;
- ``delay_reply``: the server applies it, the reply arrives after the lock's TTL (the
  client's timeout is longer than the TTL in this cell);
- ``late_request``: the request is held past the client's timeout, so the client's
  retry on another endpoint lands first and the original lands afterwards.

After each cell, with the server read directly (never through the proxy): never two
holders; a lease the client reports held is held on the server (our token, our
fence); a release, renew or force release reports what the server did, or raises
:class:`BackendUnavailable` when it cannot know; fences never go backwards; every
key has a live lease (an expiry).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import shutil
import threading
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from chaoskit.proxy import Proxy, ProxyHub, _Link, _rst
from servers import EtcdCluster, EtcdServer, wait_until

from task_locks import BackendUnavailable, Lease, Lock, LockLost, NotOwned
from task_locks.backends.etcd import EtcdBackend
from task_locks.lock import FORCED_REASON
from task_locks.types import Owner, RunCheck

#: The lock's TTL in every cell: etcd's floor with the test cluster's 500 ms elections.
TTL = 1.0
#: The client's per-request timeout: a lost reply costs this much.
TIMEOUT = 0.3
#: How long a ``late_request`` is held: past the client's timeout, so its retry wins.
LATE = 0.6
#: How late a ``delay_reply`` arrives: past the TTL (the client waits longer than this).
DELAYED = TTL + 0.3
#: How long a test waits for etcd to answer the faulted request (a Raft write on a loaded
#: machine can take seconds; every wait is bounded all the same).
SETTLE = 20.0

FAULTS = ["drop_request", "drop_reply", "reset", "delay_reply", "late_request"]


class _Flight:
    """The fault riding on one proxied connection (sticky: the client drops the link)."""

    def __init__(self) -> None:
        self.fault: str | None = None
        self.answered = asyncio.Event()


class FaultProxy(Proxy):
    """The chaoskit proxy with one more control: a fault aimed at the request in flight.

    :func:`aim_fault` arms it around exactly one call of the client; every chunk the
    client sends while armed takes the fault, and so does that request's reply.
    """

    def __init__(self, hub: ProxyHub, target_port: int) -> None:
        super().__init__(hub, target_port)
        self.armed: str | None = None
        self.delay = 0.0
        #: Set when the faulted request's fate is sealed (dropped, or answered by etcd).
        self.settled = threading.Event()
        #: Set when a request reached the proxy while it was armed: the fault took hold.
        self.took = threading.Event()

    def arm(self, fault: str | None, delay: float = 0.0) -> None:
        if fault is not None:
            self.settled.clear()
            self.took.clear()
        self.delay = delay
        self.armed = fault

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            _rst(writer)
            return
        link = _Link(writer, up_writer)
        flight = _Flight()
        self._links.add(link)
        link.tasks = [
            asyncio.ensure_future(self._requests(reader, up_writer, flight)),
            asyncio.ensure_future(self._replies(up_reader, writer, flight, link)),
        ]
        await asyncio.gather(*link.tasks, return_exceptions=True)
        self._links.discard(link)
        for side in (writer, up_writer):
            with contextlib.suppress(Exception):
                side.close()

    async def _requests(
        self, reader: asyncio.StreamReader, upstream: asyncio.StreamWriter, flight: _Flight
    ) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                if flight.fault is None and self.armed is not None:
                    flight.fault = self.armed
                    flight.answered.clear()
                    self.took.set()
                if flight.fault == "drop_request":
                    self.settled.set()
                    continue
                if flight.fault == "late_request":
                    await asyncio.sleep(self.delay)
                upstream.write(data)
                await upstream.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            # The client hung up (it timed out). Keep etcd's side open until it has
            # answered: a gateway that sees the connection close may cancel the request.
            if flight.fault not in (None, "drop_request"):
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(flight.answered.wait(), SETTLE)
            with contextlib.suppress(Exception):
                upstream.close()

    async def _replies(
        self,
        reader: asyncio.StreamReader,
        client: asyncio.StreamWriter,
        flight: _Flight,
        link: _Link,
    ) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                fault = flight.fault
                if fault in ("drop_reply", "late_request"):
                    flight.answered.set()
                    self.settled.set()
                    continue
                if fault == "reset":
                    flight.answered.set()
                    self.settled.set()
                    link.reset()
                    return
                if fault == "delay_reply":
                    await asyncio.sleep(self.delay)
                client.write(data)
                await client.drain()
                if fault == "delay_reply":  # delivered: later requests on this link pass
                    flight.fault = None
                    flight.answered.set()
                    self.settled.set()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                client.write_eof()


def aim_fault(
    backend: EtcdBackend, proxy: FaultProxy, path: str, fault: str, delay: float = 0.0
) -> dict[str, bool]:
    """Aim ``fault`` at the first ``path`` request ``backend`` sends to its first endpoint.

    A hook on the client's real ``requests`` session (the request itself is real, and so
    is the fault: the proxy does it). Returns a dict whose ``fired`` says it happened,
    and whose ``elsewhere`` says that request went to another endpoint instead (the
    backend moved on after an earlier call failed there: a loaded machine's timeout).
    """
    clients = backend._client_list()
    session = clients[0].session
    real = session.post
    state = {"fired": False, "elsewhere": False}
    for other in clients[1:]:
        _note_elsewhere(other.session, path, state)

    def post(url: str, *args: Any, **kwargs: Any) -> Any:
        if state["fired"] or not url.endswith(path):
            return real(url, *args, **kwargs)
        state["fired"] = True
        proxy.arm(fault, delay)
        try:
            return real(url, *args, **kwargs)
        finally:
            proxy.arm(None)

    session.post = post  # type: ignore[method-assign]
    return state


def _note_elsewhere(session: Any, path: str, state: dict[str, bool]) -> None:
    real = session.post

    def post(url: str, *args: Any, **kwargs: Any) -> Any:
        if not state["fired"] and url.endswith(path):
            state["elsewhere"] = True
        return real(url, *args, **kwargs)

    session.post = post


def _unsettled(proxy: FaultProxy) -> str:
    """Why a faulted request never settled: etcd never answered it, or (a call that failed
    before its request reached the proxy, its retry not armed) the fault never took hold."""
    if proxy.took.is_set():
        return f"etcd never answered the faulted request in {SETTLE} s"
    return "the armed call's request never reached the proxy: the fault never took hold"


def gateway(member: EtcdServer, path: str, body: dict[str, object]) -> dict[str, Any]:
    """A raw v3 gateway call straight to a member (never through the proxy)."""
    request = urllib.request.Request(
        f"{member.client_url}/v3/{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=5) as answer:
        return json.loads(answer.read())  # type: ignore[no-any-return]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass
class Rig:
    """One cell's world: the faulty client, a direct client, and the server's truth."""

    cluster: EtcdCluster
    proxy: FaultProxy
    prefix: str

    def url(self, *, proxied: bool, timeout: float = TIMEOUT) -> str:
        members = self.cluster.members
        ports = ([self.proxy.port] if proxied else [members[0].port]) + [
            m.port for m in members[1:]
        ]
        hosts = ",".join(f"127.0.0.1:{port}" for port in ports)
        return f"etcd://{hosts}?timeout={timeout}&prefix={self.prefix}"

    def backend(self, *, proxied: bool, timeout: float = TIMEOUT) -> EtcdBackend:
        return EtcdBackend(self.url(proxied=proxied, timeout=timeout))

    def key(self, name: str) -> dict[str, Any] | None:
        """The lock's key as etcd has it now (a linearizable read on member 1)."""
        kvs = gateway(self.cluster[1], "kv/range", {"key": _b64((self.prefix + name).encode())})
        found = kvs.get("kvs", [])
        return found[0] if found else None

    def token_of(self, kv: dict[str, Any] | None) -> str | None:
        if kv is None:
            return None
        return str(json.loads(base64.b64decode(kv["value"])).get("token"))

    def check_expiries(self) -> None:
        """Nothing left without an expiry: every key carries a lease that is alive."""
        start = (self.prefix).encode()
        end = start[:-1] + bytes([start[-1] + 1])
        kvs = gateway(self.cluster[1], "kv/range", {"key": _b64(start), "range_end": _b64(end)})
        for kv in kvs.get("kvs", []):
            key = base64.b64decode(kv["key"])
            lease = int(kv.get("lease", 0))
            assert lease, f"key {key!r} has no lease"
            ttl = int(gateway(self.cluster[1], "lease/timetolive", {"ID": lease}).get("TTL", 0))
            assert ttl <= TTL + 1, f"key {key!r} lives {ttl}s"
            # TTL -1: expired, its revocation pending (the leader sweeps every 500 ms)
            if ttl < 0:
                name = key[len(self.prefix) :].decode()
                wait_until(lambda name=name: self.key(name) is None, 3, f"{name!r} to expire")

    def check_held(self, lease: Lease, rival: Lock) -> None:
        """If the client says ``lease`` is held, etcd agrees and nobody else can take it.

        The server is read first and the client asked after: etcd's lease never ends
        before the client's deadline, so a lease still held after the read was held
        during it.
        """
        kv = self.key(lease.name)
        taken = rival.try_acquire()
        if not lease.held:
            if taken is not None:
                taken.release()
            return
        assert taken is None, (
            f"two holders: the rival got fence {taken.fence} while fence {lease.fence} "
            "is reported held"
        )
        assert kv is not None, "reported held, but etcd has no key"
        assert self.token_of(kv) == lease.token, "reported held, but etcd has another token"
        assert int(kv["create_revision"]) == lease.fence, "reported held with another fence"


@pytest.fixture(scope="module")
def cluster() -> Iterator[EtcdCluster]:
    if shutil.which("etcd") is None:
        pytest.skip("no etcd binary (scripts/install-servers.sh installs etcd-server)")
    started = EtcdCluster(3).start()
    yield started
    started.cleanup()


@pytest.fixture(scope="module")
def proxy(cluster: EtcdCluster) -> Iterator[FaultProxy]:
    hub = ProxyHub()
    faulty = FaultProxy(hub, cluster[0].port)
    hub.call(faulty._start())
    hub.proxies.append(faulty)
    yield faulty
    hub.close()


@pytest.fixture
def rig(cluster: EtcdCluster, proxy: FaultProxy) -> Iterator[Rig]:
    proxy.arm(None)
    yield Rig(cluster, proxy, f"faults-{uuid.uuid4().hex[:8]}/")
    proxy.arm(None)


# -- a fault aimed at the request in flight, reproduced ---------------------------------------


def test_acquire_whose_reply_is_lost_is_retried_and_really_held(rig: Rig) -> None:
    """The acquire transaction is applied, its reply lost: the retry must keep the lock."""
    backend = rig.backend(proxied=True)
    fired = aim_fault(backend, rig.proxy, "/kv/txn", "drop_reply")
    lease = Lock("lost-reply", ttl=30, backend=backend, renew=False).acquire(timeout=5)
    assert fired["fired"], "the fault never hit the acquire transaction"
    assert rig.proxy.settled.wait(SETTLE), _unsettled(rig.proxy)

    kv = rig.key("lost-reply")
    assert kv is not None, "acquire() returned a lease, but etcd has no key"
    assert rig.token_of(kv) == lease.token
    assert int(kv["create_revision"]) == lease.fence
    rival = Lock("lost-reply", ttl=30, backend=rig.backend(proxied=False, timeout=2.0))
    assert rival.try_acquire() is None, "a second client acquired the lock at once"
    lease.release()
    assert rig.key("lost-reply") is None


@pytest.mark.parametrize("fault", ["drop_reply", "reset"])
def test_a_runs_take_over_whose_reply_is_lost_is_its_own_lock(rig: Rig, fault: str) -> None:
    """A Celery run's acquire (its run check, taking the publish-time lock over under the
    run's own token) is applied, its reply lost: the retry on the next endpoint finds
    the run's own write and keeps it, never refused as a copy of itself."""
    direct = rig.backend(proxied=False, timeout=2.0)
    name = f"run-{fault}"
    queued = direct.acquire(name, "publish-token", 30_000, Owner(task_id="t-1"))
    assert queued.fence is not None
    backend = rig.backend(proxied=True)
    fired = aim_fault(backend, rig.proxy, "/kv/txn", fault)
    run = RunCheck("t-1", (name,), take_over="publish-token")
    result = backend.acquire_run(name, "run-token", 30_000, Owner(task_id="t-1"), run)
    assert fired["fired"], "the fault never hit the acquire transaction"
    assert result.fence == queued.fence, f"not the run's own lock: {result}"
    assert rig.token_of(rig.key(name)) == "run-token"
    copy = direct.acquire_run(name, "a-copy", 30_000, Owner(task_id="t-1"), run)
    assert copy.fence is None and run.is_copy(copy), "a copy of the message ran too"
    assert direct.release(name, "run-token")


# -- the fault matrix ------------------------------------------------------------------------

#: Every gateway request each operation makes (force release with the operator's fence).
TARGETS = [
    ("acquire", "/lease/grant"),
    ("acquire", "/kv/txn"),
    ("acquire_held", "/kv/txn"),  # the lock is someone else's: refused, theirs untouched
    ("renew", "/lease/keepalive"),
    ("renew", "/kv/txn"),
    ("release", "/kv/txn"),
    ("release", "/lease/revoke"),
    ("force_release", "/kv/txn"),
    ("force_release", "/lease/revoke"),
    ("holders", "/kv/range"),
    ("holders", "/lease/timetolive"),
]


def _outcome(call: Callable[[], object]) -> str:
    """What the client was told: a value, the lock was not ours, or cannot know."""
    try:
        return repr(call())
    except NotOwned:  # the server said it is not ours
        return "not-owned"
    except LockLost:  # the lease had already run out on the client
        return "lost-locally"
    except BackendUnavailable:
        return "unavailable"


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize(("operation", "path"), TARGETS, ids=[f"{o}{p}" for o, p in TARGETS])
def test_fault_matrix(rig: Rig, operation: str, path: str, fault: str) -> None:
    timeout = DELAYED + 1.0 if fault == "delay_reply" else TIMEOUT
    delay = {"delay_reply": DELAYED, "late_request": LATE}.get(fault, 0.0)
    client = rig.backend(proxied=True, timeout=timeout)
    direct = rig.backend(proxied=False, timeout=2.0)  # no fault here: patient
    name = "cell"
    rival = Lock(name, ttl=TTL, backend=direct)
    fences: list[int] = []

    def granted(lease: Lease) -> Lease:
        assert not fences or lease.fence > fences[-1], f"fence {lease.fence} after {fences}"
        fences.append(lease.fence)
        return lease

    fired: dict[str, bool]
    subject: Lease | None
    told = ""
    if operation == "acquire":
        fired = aim_fault(client, rig.proxy, path, fault, delay)
        lease = granted(Lock(name, ttl=TTL, backend=client, renew=False).acquire(timeout=5))
        # Every cell leaves two endpoints up: the acquire must end up really held.
        subject = lease
    elif operation == "acquire_held":
        subject = granted(Lock(name, ttl=TTL, backend=direct, renew=False).acquire(timeout=2))
        fired = aim_fault(client, rig.proxy, path, fault, delay)
        told = _outcome(Lock(name, ttl=TTL, backend=client, renew=False).try_acquire)
        assert told == "None", f"try_acquire of a held lock answered {told}"
    elif operation in ("renew", "release"):
        lease = granted(Lock(name, ttl=TTL, backend=client, renew=False).acquire(timeout=2))
        fired = aim_fault(client, rig.proxy, path, fault, delay)
        told = _outcome(lease.renew if operation == "renew" else lease.release)
        kv = rig.key(name)
        ours = kv is not None and rig.token_of(kv) == lease.token
        if operation == "renew":
            # Renewed: held unless the TTL has run out since; not owned: etcd agrees.
            assert told in ("None", "not-owned", "lost-locally", "unavailable"), told
            if told == "not-owned":
                assert not ours, "renew said the lock was not ours, but etcd still has it ours"
            if told == "lost-locally":
                # A reply after the lease's local deadline (a delayed one, or a retry on
                # another endpoint on a loaded machine: the TTL is 1 s) is not trusted: the
                # lease counts as lost although etcd kept it. The safe side, never two
                # holders; but only ever past that deadline.
                assert not lease.held, "renew raised LockLost, but the lease counts as held"
                assert FORCED_REASON not in (lease.lost_reason or ""), lease.lost_reason
        else:
            # The lock was ours when release was sent: "not ours" would be a wrong answer.
            assert told in ("None", "unavailable"), f"release answered {told}"
            if told == "None":
                assert not ours, "release reported success, but the key is still ours"
        subject = lease if operation == "renew" else None  # a released lease is not relied on
    else:  # operator calls on a lock held by someone else
        subject = granted(Lock(name, ttl=TTL, backend=direct, renew=False).acquire(timeout=2))
        fired = aim_fault(client, rig.proxy, path, fault, delay)
        if operation == "force_release":
            told = _outcome(lambda: client.force_release(name, subject.fence))
            assert told in ("True", "unavailable"), f"force release answered {told}"
            kv = rig.key(name)
            # The holder learns of a force release at its next renewal (as in production).
            renewed = _outcome(subject.renew)
            if told == "True":
                assert kv is None or int(kv["create_revision"]) != subject.fence
                # Refused by etcd, or found lost locally (a reply delayed past its deadline).
                assert renewed in ("not-owned", "lost-locally"), renewed
        else:
            try:
                listed = client.holders()
            except BackendUnavailable:
                listed = None
            if listed is not None:
                assert [(h.name, h.fence, h.token) for h in listed] == [
                    (name, subject.fence, subject.token)
                ]
    # A released key's lease is revoked by the backend's revoker thread, after release()
    # returned: that request may not have been sent yet (CI failed on it). Any other
    # path's request was sent in the call, and this returns at once. A release whose own
    # delete failed (on a loaded machine, past its 0.3 s timeout: CI failed on it too)
    # queues no revoke, since the key may still be on that lease: its fault never fires.
    # So may a request the backend sent to another endpoint, after an earlier call timed
    # out at the first (CI failed on it): the fault was never applied.
    if not (operation == "release" and path == "/lease/revoke" and told == "unavailable"):
        wait_until(lambda: fired["fired"] or fired["elsewhere"], SETTLE, f"the fault to hit {path}")
        if fired["fired"] and fault in ("drop_reply", "reset", "late_request"):
            assert rig.proxy.settled.wait(SETTLE), _unsettled(rig.proxy)
    if subject is not None:
        rig.check_held(subject, rival)
    rig.check_expiries()
    # Fences never go backwards: the next holder's fence is above every earlier one.
    if subject is not None and subject.held:
        with contextlib.suppress(NotOwned, BackendUnavailable):
            subject.release()
    after = Lock(name, ttl=TTL, backend=direct).acquire(timeout=2 * TTL + 2)
    granted(after)
    after.release()
    rig.check_expiries()
