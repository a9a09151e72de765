"""The simulated world's etcd: the model of :mod:`tests.sim.etcd_model` on virtual time,
reached over the simulated network through etcd3gw's HTTP session.

The seam is the ``requests.Session`` that ``etcd3gw.Etcd3Client`` posts through: each
client's ``EtcdBackend`` (its acquire, same-token takeover, relet, renewals, token-checked
release and force release, its watch for a release) runs unchanged, and
:class:`SimEtcdSession` carries each post over :class:`~tests.sim.world.Net` with the
scenario's faults, parking the calling greenlet until the answer (or the read timeout,
or a reset) comes:

- a request lost, or its connection reset before it left: the server never sees it (a
  reset raises ``requests.ConnectionError``, which the backend, unable to tell, treats as
  "may have been applied"); a reply lost or its connection reset after the server applied
  it: the client's read times out (``ReadTimeout``, which etcd3gw turns into its
  ``ConnectionTimeoutError``) or is reset; delays on either leg; a partition loses both;
- a ``/watch`` answers its headers and the "created" line at once, then streams the
  key's events from its start revision as they happen (one line each), until the read
  timeout ends the stream as a real one does ("Read timed out");
- the member's restart keeps its store (etcd persists), is unreachable for its downtime,
  breaks the open watch streams, and renews every lease's TTL when it comes back (etcd's
  lessor does so on promotion); a "failover" of one member is the same restart; the
  server clock does not matter (etcd's leases run on its monotonic clock).

A lease ends exactly at its deadline, by an event the server schedules for the earliest
one (the model's earliest expiry, the one hardest on a holder), and its keys' deletion
reaches the watchers then.
"""

from __future__ import annotations

import json as jsonlib
from collections.abc import Callable, Iterator
from typing import Any

import greenlet
import requests

from .etcd_model import EtcdModel, ModelResponse, _b64, _int, _unb64
from .world import Client, Event, Net, Sim


class EtcdSimServer:
    """One etcd member on virtual time: the model, watches, expiry, restarts."""

    name = "etcd"

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.model = EtcdModel(lambda: sim.now)
        #: etcd keeps its store across a restart: nothing the checker exempts changes.
        self.epoch = 0
        self.restarts = 0
        self.down_until = -1.0
        self.observe: Callable[[Any, tuple[Any, ...]], None] | None = None
        self.watches: list[SimWatchStream] = []
        self._expiry: Event | None = None
        self._expiry_at = float("inf")

    def up(self) -> bool:
        return self.sim.now >= self.down_until

    # requests ------------------------------------------------------------------------
    def execute(self, client: Client, path: str, payload: dict[str, Any]) -> tuple[int, Any]:
        status, body = self.model.handle(path, payload)
        if self.sim.record:
            self.sim.say(self.name, f"{_describe(path, payload)} -> {status} {_short(body)}")
        self._changed(client)
        return status, body

    def _changed(self, who: Client | None) -> None:
        if self.observe is not None:
            self.observe(who, ("ETCD",))
        for stream in list(self.watches):
            stream.deliver()
        self._schedule_expiry()

    def _schedule_expiry(self) -> None:
        soonest = min((lease.expires_at for lease in self.model.leases.values()), default=None)
        if soonest is None or soonest >= self._expiry_at:
            return
        if self._expiry is not None:
            self._expiry.cancelled = True
        self._expiry_at = soonest
        self._expiry = self.sim.at(max(soonest, self.sim.now), self._expire)

    def _expire(self) -> None:
        self._expiry, self._expiry_at = None, float("inf")
        if not self.up():
            return  # reschedules when it comes back
        before = self.model.revision
        self.model.expire()
        if self.model.revision != before and self.sim.record:
            self.sim.say(self.name, "a lease ended: its key is deleted")
        self._changed(None)

    def register(self, stream: SimWatchStream) -> None:
        self.watches.append(stream)
        stream.deliver()

    # faults --------------------------------------------------------------------------
    def restart(self, downtime: float, quiet: bool = False) -> None:
        if not quiet:
            self.sim.say(self.name, f"RESTART, store kept (down {downtime * 1000:.0f} ms)")
        self.restarts += 1
        self.down_until = self.sim.now + downtime
        streams, self.watches = self.watches, []
        for stream in streams:
            stream.reset()

        def back() -> None:
            self.model.restart()  # every lease's TTL renewed on promotion
            self._expiry_at = float("inf")
            self._changed(None)

        self.sim.at(self.down_until, back)

    def snapshot(self) -> None:
        return None

    def failover(self, replica: Any, lag: float) -> None:
        self.sim.say(self.name, "leader change: a restart with the store kept")
        self.restart(0.0, quiet=True)

    def step_clock(self, delta_us: int) -> None:
        self.sim.say(self.name, f"clock steps {delta_us / 1000:+.1f} ms (leases: monotonic)")


class _Pending:
    """One request in flight: who waits for it, and its answer once it arrives."""

    __slots__ = ("answer", "error", "waiter")

    def __init__(self) -> None:
        self.waiter: greenlet.greenlet | None = None
        self.answer: Any = None
        self.error: BaseException | None = None

    def ready(self) -> bool:
        return self.answer is not None or self.error is not None


class SimEtcdSession:
    """The ``requests.Session`` of one client's etcd3gw client, over the simulated net."""

    def __init__(self, client: Client, server: EtcdSimServer, net: Net, timeout: float) -> None:
        self.client, self.server, self.net = client, server, net
        self.timeout = timeout
        self.headers: dict[str, Any] = {}

    def post(
        self, url: str, json: Any = None, timeout: Any = None, stream: bool = False, **_: Any
    ) -> Any:
        path = "/" + url.split("/v3/", 1)[1].lstrip("/")
        read_timeout = timeout[1] if isinstance(timeout, tuple) else timeout or self.timeout
        client, sim = self.client, self.client.sim
        if not self.server.up():
            raise requests.ConnectionError(
                "Failed to establish a new connection: [Errno 111] Connection refused (simulated)"
            )
        client.requests += 1
        number = client.requests
        fault = self.net.faults.get((client.index, number))
        kind, amount = fault if fault else ("", 0.0)
        if fault:
            sim.say(client.name, f"request #{number}: fault {kind} {amount or ''}")
        if kind == "reset_before":
            raise requests.ConnectionError("Connection reset by peer (simulated, before sending)")
        pending = _Pending()
        arrival = sim.now + self.net.delay() + (amount if kind == "delay_request" else 0.0)
        if kind == "drop_request" or self.net.cut(client, sim.now):
            sim.say(client.name, f"request #{number} lost")
        else:
            reply_fault = kind if kind in ("drop_reply", "reset_after", "delay_reply") else ""
            payload = jsonlib.loads(jsonlib.dumps(json or {}))  # what the wire carries

            def arrive() -> None:
                if not self.server.up():
                    self._answer(pending, "reset_after", 0.0, number, None)
                    return
                if path == "/watch":
                    answer: Any = SimWatchStream(self, payload.get("create_request", {}))
                else:
                    status, body = self.server.execute(client, path, payload)
                    answer = ModelResponse(status, body)
                self._answer(pending, reply_fault, amount, number, answer)

            sim.at(arrival, arrive)
        answer = self._wait(pending, float(read_timeout))
        if isinstance(answer, SimWatchStream):
            answer.open(float(read_timeout))
        return answer

    def _answer(
        self, pending: _Pending, fault: str, amount: float, number: int, answer: Any
    ) -> None:
        sim, client = self.client.sim, self.client
        if fault == "drop_reply" or self.net.cut(client, sim.now):
            sim.say(client.name, f"reply to #{number} lost")
            if isinstance(answer, SimWatchStream):
                answer.reset()
            return
        if fault == "reset_after":
            sim.say(client.name, f"connection reset after #{number} was applied")
            pending.error = requests.ConnectionError(
                "('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))"
            )
        else:
            pending.answer = answer
        delay = self.net.delay() + (amount if fault == "delay_reply" else 0.0)
        sim.at(sim.now + delay, lambda: client.wake(pending))

    def _wait(self, pending: _Pending, read_timeout: float) -> Any:
        """The answer, waiting at most ``read_timeout`` on the client's clock."""
        client = self.client
        if not client.wait(pending, pending.ready, read_timeout):
            client.sim.say(client.name, "read timeout")
            raise requests.exceptions.ReadTimeout("Read timed out. (simulated)")
        if pending.error is not None:
            raise pending.error
        return pending.answer

    def close(self) -> None:
        pass


class SimWatchStream:
    """A ``/watch`` response: the created line, then the key's events as they happen."""

    status_code = 200
    reason = "OK"
    text = ""

    def __init__(self, session: SimEtcdSession, create: dict[str, Any]) -> None:
        self.session = session
        self.key = _unb64(create.get("key"))
        self.start = _int(create.get("start_revision")) or session.server.model.revision + 1
        skip = {"NOPUT": "PUT", "NODELETE": "DELETE"}
        self.dropped = {skip[f] for f in create.get("filters", []) if f in skip}
        self.lines: list[bytes] = [_line({"created": True})]
        self.broken = False
        self.closed = False
        self.read_timeout = 0.0
        self.waiter: greenlet.greenlet | None = None
        session.server.register(self)

    def deliver(self) -> None:
        """Queue the events after what was sent already, and wake the reader (over the net)."""
        if self.broken or self.closed:
            return
        events = [
            e
            for e in self.session.server.model.events_since(self.key, self.start)
            if e.kind not in self.dropped
        ]
        if not events:
            return
        self.start = events[-1].revision + 1
        result = {"events": [{"type": e.kind, "kv": {"key": _b64(e.key)}} for e in events]}
        line = _line(result)
        sim, client = self.session.client.sim, self.session.client
        if self.session.net.cut(client, sim.now):
            self.reset()  # the stream's connection is lost with the partition
            return
        sim.at(sim.now + self.session.net.delay(), lambda: self._arrive(line))

    def _arrive(self, line: bytes) -> None:
        if self.broken or self.closed:
            return
        self.lines.append(line)
        self.session.client.wake(self)

    def reset(self) -> None:
        self.broken = True
        self.session.client.wake(self)

    def _readable(self) -> bool:
        return bool(self.lines) or self.broken

    def open(self, read_timeout: float) -> None:
        self.read_timeout = read_timeout

    def raise_for_status(self) -> None:
        pass

    def json(self) -> dict[str, Any]:
        return {}

    def iter_lines(self) -> Iterator[bytes]:
        client = self.session.client
        while True:
            while self.lines:
                yield self.lines.pop(0)
            if self.broken:
                raise requests.exceptions.ChunkedEncodingError("stream reset (simulated)")
            # Each line restarts the read timeout, as a socket read does.
            if not client.wait(self, self._readable, self.read_timeout):
                raise requests.ConnectionError("Read timed out. (simulated)")

    def close(self) -> None:
        self.closed = True
        if self in self.session.server.watches:
            self.session.server.watches.remove(self)


def _line(result: dict[str, Any]) -> bytes:
    return jsonlib.dumps({"result": result}, separators=(",", ":")).encode()


def _describe(path: str, payload: dict[str, Any]) -> str:
    if path == "/kv/txn":
        ops = [next(iter(op)) for op in payload.get("success", [])]
        compares = [f"{c.get('target', 'VERSION')}" for c in payload.get("compare", [])]
        return f"txn if {'+'.join(compares) or 'always'} then {'+'.join(ops) or 'nothing'}"
    if "ID" in payload:
        return f"{path} {str(payload['ID'])[-4:]}"
    return f"{path} {_unb64(payload.get('key')).decode(errors='replace')}"


def _short(body: Any) -> str:
    text = jsonlib.dumps(body)
    return text if len(text) < 100 else text[:97] + "..."


# -- the checker's view of etcd, and a client's backend -------------------------------


def etcd_checker(base: type) -> type:
    """The scenario's checker (``base``), reading the holder of each name from the model:
    the token in the key's value, its create revision the fence, its lease's deadline
    the server's expiry; every key must be on a lease that exists."""

    class EtcdChecker(base):  # type: ignore[misc, valid-type]
        def observe(self, conn: Any, command: tuple[Any, ...]) -> None:
            model: EtcdModel = self.server.model
            who = "restart" if conn is None else conn.name
            for name, key in self.keys.items():
                kv = model.kv.get(key)
                token = fence = None
                if kv is not None:
                    try:
                        token = jsonlib.loads(kv.value).get("token")
                    except ValueError:
                        token = None
                    fence = str(kv.create_revision) if token is not None else None
                self.track(name, token, fence, who)
            for key, kv in model.kv.items():
                if not kv.lease or kv.lease not in model.leases:
                    self.fail(f"key {key!r} is on no lease: it would never expire")

        def _alive(self, key: Any) -> bool:
            lease = self._lease(key)
            # A member that is down expires nothing, and renews every TTL when it is back.
            return lease is not None and (lease.expires_at > self.sim.now or not self.server.up())

        def _expiry_sim(self, key: Any) -> float | None:
            lease = self._lease(key)
            return None if lease is None or not self.server.up() else lease.expires_at

        def _lease(self, key: Any) -> Any:
            model: EtcdModel = self.server.model
            kv = model.kv.get(key)
            return model.leases.get(kv.lease) if kv is not None else None

    return EtcdChecker


_prototypes: dict[str, Any] = {}


def etcd_backend(url: str, client: Client, server: EtcdSimServer, net: Net, timeout: float) -> Any:
    """A client's own ``EtcdBackend`` for ``url``, its one endpoint's etcd3gw client posting
    through a :class:`SimEtcdSession` (copied from one made per URL, as the Redis ones)."""
    import copy
    import os
    import threading

    import etcd3gw

    from task_locks.backends.etcd import EtcdBackend

    prototype = _prototypes.get(url)
    if prototype is None:
        prototype = _prototypes[url] = EtcdBackend(url)
    backend = copy.copy(prototype)
    backend._guard = threading.Lock()
    backend._held, backend._seen = {}, {}
    # Every endpoint is a member of one cluster: one linearizable store behind each, so a
    # request whose reply was lost is retried on the next member and may find its own write.
    backend._clients = [
        etcd3gw.Etcd3Client(
            host=host,
            port=port,
            timeout=backend.timeout,
            api_path="/v3/",
            session=SimEtcdSession(client, server, net, timeout),  # type: ignore[arg-type]
        )
        for host, port in backend.endpoints
    ]
    backend._current = 0
    backend._pid = os.getpid()
    # A lease the backend no longer needs (a released key's, a refused acquire's) is
    # revoked by a thread of its own in production; here at once, in the caller's step,
    # so the run stays deterministic. Nothing can attach a key to such a lease again, so
    # revoking it later is the same as revoking it now.
    backend._revoke_later = backend._revoke_quietly
    return backend
