"""The simulated world's Redlock: N independent Redis masters, and the production
``RedlockBackend`` fanning out to them as greenlets.

Each master is a :class:`~tests.sim.world.Server` of its own (the production Lua over the
Redis model, with its own clock, restarts without persistence, ``INFO server`` with a
``run_id`` that changes at each restart), reached over the simulated network. A client's
``RedlockBackend`` runs unchanged above its masters' ``RedisBackend`` (``_MasterBackend``):
the fan-out (``_fan_out``), the per-(name, token) call chain of each master (``_submit``),
the counting of votes, validity, drift, fence sync, restart quarantine, force release
and the signal waits. Only its I/O is the simulation's:

- each master's redis-py client is a :class:`~tests.sim.world.SimRedis` whose new
  connections first run the production connect hook (``_sync_hook``: ``INFO server``,
  then ``_Master.observe``), as redis-py's ``redis_connect_func`` does;
- the backend's thread pool is a :class:`SimExecutor` (each call a greenlet of the
  client, at most ``8 x masters`` at once, the rest queued, as the pool's threads are),
  and the ``threading.Event`` the fan-out waits on is a :class:`SimEvent` on the client's
  clock (the module's ``threading`` is a shim that hands one out only inside a run).

Faults per master (:class:`MasterFault`): a restart without persistence (at most a
minority of the masters per schedule), a SIGSTOP-like pause (commands wait, the clock
and expiry go on), a partition of the master from every client, its clock stepped back
(one master per schedule), and a clock rate of its own (within the drift factor). The
client-side faults of every protocol (lost, delayed, reset requests and replies to
whichever master they go to, client partitions, pauses, kills, clock rates and jumps,
operator force releases) apply too.

What the docs say breaks Redlock stays out of the schedules: a master's clock stepping
forward or drifting past ``drift_factor``, restarts whose quarantine does not cover
every process's TTL (the URL's ``restart_delay`` is the longest TTL a schedule uses,
``renew(ttl=...)`` included: README's safety table, docs/backends/redlock.md), more than
a minority of the masters restarting, and a client's monotonic clock jumping forward in a
schedule with a restart (the quarantine is timed on it: a clock far past the drift factor).

The checker (:func:`redlock_checker`) reads the holder of a name as the token a majority
of the masters hold (alive, on each master's clock): a lease that says ``held`` must
have its token on a majority of masters with expiry no earlier than its local deadline,
counting a restarted master while its quarantine lasts past that deadline (it can vote
for nobody); fences must grow in grant order (the order majorities formed) and each
lease's fence be one its granting masters handed out; a release that said released must
have deleted its token on a majority of masters (and one that said not owned must not);
a force release that said it freed the holder must have broken the holder's majority, or
deleted a copy while a majority may have kept it, or have met a master that did not
answer (the backend can only guess then); one that said the lock changed hands must not
have deleted it on a majority.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import random
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import greenlet
import redis.exceptions as rex

import task_locks.backends.redlock as redlock_module
from task_locks.backends.redlock import RedlockBackend

from .world import (
    Client,
    Conn,
    Net,
    Server,
    Sim,
    SimConnection,
    SimPool,
    SimRedis,
    _describe,
    _short,
    _to_py,
)

#: The server clock's origin (as :class:`~tests.sim.world.Server`'s).
BASE_US = 1_700_000_000_000_000
#: How long the masters have been up when a run starts (no first-sight quarantine).
UPTIME = 1000.0
PROTOCOL = "redlock"


@dataclass(frozen=True)
class MasterFault:
    """A fault of one master (``client`` is the master's index)."""

    kind: str
    client: int = 0
    at: float = 0.0
    amount: float = 0.0
    detail: str = ""

    def describe(self) -> str:
        what = self.kind.removeprefix("master_")
        return f"master{self.client} {what} at {self.at * 1000:.0f} ms ({self.amount:g})"


# -- generation ----------------------------------------------------------------------------


def adapt(scenario: Any) -> Any:
    """A generated schedule made Redlock's: 3 or 5 masters with clock rates, and the
    server faults turned into faults of single masters (from a stream of its own, so the
    rest of the schedule is what :func:`~tests.sim.scenario.generate` drew)."""
    from .scenario import Fault

    rng = random.Random(scenario.seed * 7_368_787 + 23)
    count = 5 if rng.random() < 0.3 else 3
    minority = (count - 1) // 2
    masters = tuple(
        rng.choice((1.0, 1.0, 1.0 + 1e-4, 1.0 + 1e-3, 1.0 - 1e-3)) for _ in range(count)
    )
    faults: list[Any] = []
    restarted: set[int] = set()
    stepped: set[int] = set()
    for fault in scenario.faults:
        master = rng.randrange(count)
        kind = fault.kind
        if kind == "restart":
            if master not in restarted and len(restarted) >= minority:
                continue  # more than a minority restarting: documented to break it
            restarted.add(master)
            faults.append(MasterFault("master_restart", master, fault.at, fault.amount))
        elif kind == "failover":  # independent masters have no replicas: a pause instead
            amount = rng.choice((0.05, 0.3, 1.0, 2.5))
            faults.append(MasterFault("master_pause", master, fault.at, amount))
        elif kind == "clock_step":
            if stepped and master not in stepped:
                continue  # the masters' clocks must agree (one master's step only)
            stepped.add(master)
            faults.append(MasterFault("master_clock_step", master, fault.at, fault.amount))
        elif kind == "partition" and rng.random() < 0.5:
            faults.append(MasterFault("master_partition", master, fault.at, fault.amount))
        else:
            faults.append(fault)
    if faults and rng.random() < 0.5:  # one more master fault, of any kind
        kind = rng.choice(
            ("master_restart", "master_pause", "master_partition", "master_clock_step")
        )
        master = rng.randrange(count)
        if kind == "master_restart":
            amount = rng.choice((0.0, 0.1, 1.0))
            allowed = master in restarted or len(restarted) < minority
        elif kind == "master_clock_step":
            amount = -rng.choice((0.001, 0.5, 5.0))
            allowed = not stepped or master in stepped
        else:
            amount, allowed = rng.choice((0.05, 0.3, 1.0, 2.5)), True
        if allowed:
            faults.append(MasterFault(kind, master, rng.random() * 3.0, amount))
    if faults and rng.random() < 0.5:
        # A failed try's undo delayed past the node timeout (it lands after later calls),
        # or an operator forcing a name free again and again while holders come and go.
        if rng.random() < 0.5:
            who = rng.randrange(len(scenario.programs))
            number = float(rng.randrange(2, 40))
            faults.append(Fault("msg", who, number, rng.choice((0.5, 1.0, 2.0)), "delay_request"))
        else:
            name = rng.choice(scenario.lock_names)
            faults.append(Fault("force", -1, rng.random() * 3.0, 30.0, name))
    if _no_fence_sync(scenario.seed):
        # Without fence sync the fences are the masters' clocks: monotonic while they
        # agree (the docs' promise), so here they do (seed 52999: 2 ms apart after 2 s).
        masters = (1.0,) * count
        faults = [f for f in faults if f.kind != "master_clock_step"]
    if any(f.kind == "master_restart" for f in faults):
        # A restarted master's quarantine is timed on each client's monotonic clock: one
        # that jumps forward ends it early (a clock far outside the drift factor).
        faults = [f for f in faults if f.kind != "jump"]
    # A client clock running slow, within the drift factor (the lease counts with it).
    rates = tuple(0.999 if rng.random() < 0.2 else rate for rate in scenario.rates)
    return replace(scenario, masters=masters, faults=tuple(faults), rates=rates)


def _no_fence_sync(seed: int) -> bool:
    return seed % 4 == 3


def url(scenario: Any) -> str:
    """The masters, a node timeout after the scenario's socket timeout (and its links),
    and a ``restart_delay`` covering every TTL the schedule uses (as the docs ask)."""
    count = len(scenario.masters) or 3
    hosts = ",".join(f"m{i}:6379" for i in range(count))
    # A node timeout above a new connection's three round trips (INFO, NOSCRIPT, EVAL):
    # shorter ones leave copies of every try behind on slow links, which delay the next
    # acquire by their TTL (documented), and fair schedules are to be live.
    node_timeout = max(
        {0.5: 0.1, 1.0: 0.25}.get(scenario.socket_timeout, 0.5), 8 * scenario.delay[1]
    )
    ttls = [s.ttl for p in scenario.programs for s in p]
    ttls += [s.renew_ttl for p in scenario.programs for s in p if s.renew_ttl]
    delay = max(ttls, default=1.0)
    # Fence sync off in a quarter of the schedules: each master keeps its own counter.
    sync = "&fence_sync=0" if _no_fence_sync(scenario.seed) else ""
    return f"redlock://{hosts}/0?node_timeout={node_timeout}&restart_delay={delay}{sync}"


# -- the masters -------------------------------------------------------------------------


class RedlockMaster(Server):
    """One master: its clock (rate, steps), ``INFO server``, pauses and restarts."""

    def __init__(self, sim: Sim, index: int, rate: float) -> None:
        self.rate = rate
        self.index = index
        super().__init__(sim, f"master{index}")
        self.paused_until = -1.0
        self.up_at = -UPTIME  # sim time it (re)started
        self.restarted_at = -UPTIME  # sim time it went down for its last restart
        self.started_us = self.now_us() - int(UPTIME * 1_000_000)
        self.spans: list[tuple[float, float]] = []
        #: client name -> when a call of it last went unanswered here (timeout, reset)
        self.unanswered: dict[str, float] = {}
        #: client name -> its calls here still waiting for a reply (the backend may have
        #: stopped waiting for them: node_timeout is shorter than the socket timeout)
        self.calling: dict[str, int] = {}

    def now_us(self) -> int:
        return BASE_US + int(self.sim.now * self.rate * 1_000_000) + self.clock_offset_us

    def info(self) -> str:
        run_id = hashlib.sha1(f"{self.name}:{self.epoch}".encode()).hexdigest()
        uptime = max(0, (self.now_us() - self.started_us) // 1_000_000)
        return (
            f"# Server\r\nredis_version:7.2.0\r\nrun_id:{run_id}\r\nuptime_in_seconds:{uptime}\r\n"
        )

    def execute(self, conn: Conn, command: tuple[Any, ...]) -> Any:
        if str(command[0]).upper() == "INFO":
            reply = self.info()
            self.sim.say(
                self.name, f"INFO server -> run {self.epoch}, up {reply.split(':')[-1].strip()} s"
            )
            return reply
        reply = self.model.execute(command)
        if self.sim.record:  # (who sent it: a story with many masters needs it)
            self.sim.say(self.name, f"{conn.client.name}: {_describe(command)} -> {_short(reply)}")
        if self.observe is not None:
            self.observe(conn, command)
        if self.model.pushed:
            self._serve_blocked()
        return reply

    def restart(self, downtime: float, quiet: bool = False) -> None:
        self.paused_until = -1.0
        super().restart(downtime, quiet)
        self.restarted_at = self.sim.now
        self.up_at = self.sim.now + downtime
        self.started_us = self.now_us() + int(downtime * self.rate * 1_000_000)

    def pause(self, seconds: float) -> None:
        self.sim.say(self.name, f"paused (SIGSTOP) for {seconds * 1000:.0f} ms")
        self.paused_until = max(self.paused_until, self.sim.now + seconds)

    def paused(self) -> bool:
        return self.paused_until > self.sim.now

    def _tick(self) -> None:
        if self.paused():  # a stopped server times out no blocked client
            self._tick_event = self.sim.at(self.paused_until, self._tick)
            return
        super()._tick()

    def quarantine_until(self, restart_delay: float) -> float:
        """Until when (sim time) no client counts this master's vote after its restart
        (a client whose clock runs fast by the drift allowed counts it a little sooner)."""
        return self.up_at + restart_delay * 0.998


class MasterNet(Net):
    """The network to one master: the run's delays and planned faults, and the master's
    own partitions on top of each client's."""

    def __init__(self, base: Net, master: RedlockMaster) -> None:
        self.sim = base.sim
        self.low, self.high = base.low, base.high
        self.rng = base.rng
        self.faults = base.faults
        self.partitions = base.partitions
        self.master = master

    def cut(self, client: Client, when: float) -> bool:
        if any(a <= when < b for a, b in self.master.spans):
            return True
        return super().cut(client, when)


class MasterConn(Conn):
    """A connection to a master: commands reaching a stopped master wait for it."""

    def _arrive(self, commands: list[tuple[Any, ...]], fault: str, amount: float, n: int) -> None:
        server = self.server
        if isinstance(server, RedlockMaster) and server.paused() and self.epoch == server.epoch:
            self.client.sim.at(
                server.paused_until, lambda: self._arrive(commands, fault, amount, n)
            )
            return
        super()._arrive(commands, fault, amount, n)


class MasterConnection(SimConnection):
    """redis-py's ``Connection`` as ``_sync_hook`` and ``block_on_signal`` use it."""

    def __init__(self, conn: Conn) -> None:
        super().__init__(conn)
        self._ready: deque[Any] = deque()

    def on_connect(self) -> None:
        pass

    def send_command(self, *args: Any) -> None:
        self.conn.send([args])

    def can_read(self, timeout: float = 0) -> bool:
        if self._ready:
            return True
        saved = self.conn.timeout
        self.conn.timeout = timeout
        try:
            self._ready.append(self.conn.read())
        except rex.TimeoutError:
            return False
        finally:
            self.conn.timeout = saved
        return True

    def read_response(self) -> Any:
        if not self._ready:
            return super().read_response()
        reply = _to_py(self._ready.popleft())
        if isinstance(reply, rex.ResponseError):
            raise reply
        return reply


class MasterPool(SimPool):
    def get_connection(self, *args: Any) -> MasterConnection:
        return MasterConnection(self.owner._connect())

    def release(self, connection: Any) -> None:
        conn = connection.conn
        if not conn.broken and conn.epoch == self.owner.server.epoch and not conn.replies:
            self.owner._idle.append(conn)


class MasterRedis(SimRedis):
    """One master's redis-py client: each new connection runs the backend's connect hook."""

    def __init__(
        self, client: Client, master: RedlockMaster, net: Net, timeout: float, backend: Any
    ) -> None:
        super().__init__(client, master, net, timeout)
        self.backend = backend
        self.connection_pool = MasterPool(self)

    def _roundtrip(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        name = self.client.name
        calling = self.server.calling
        calling[name] = calling.get(name, 0) + 1
        try:
            return super()._roundtrip(commands)
        except (rex.ConnectionError, rex.TimeoutError):
            self.server.unanswered[name] = self.client.sim.now
            raise
        finally:
            calling[name] -= 1

    def _connect(self) -> Conn:
        while self._idle:
            conn = self._idle.pop()
            if not conn.broken and conn.epoch == self.server.epoch:
                return conn
        if not self.server.up():
            raise rex.ConnectionError("Error 111 connecting: Connection refused (simulated)")
        conn = MasterConn(self.client, self.server, self.net)
        conn.timeout = conn.default_timeout = self.socket_timeout
        self.backend._sync_hook(MasterConnection(conn))  # INFO server, then observe
        return conn


# -- the fan-out's threads, on virtual time ------------------------------------------------


class SimEvent:
    """``threading.Event`` for greenlets: ``wait`` parks on the waiter's clock."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self._flag = False
        self._waiters: list[list[Any]] = []

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True
        waiters, self._waiters = self._waiters, []
        for entry in waiters:
            self.sim.at(self.sim.now, functools.partial(_wake, entry))

    def clear(self) -> None:
        self._flag = False

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        client = self.sim.active
        assert client is not None
        entry = [client, greenlet.getcurrent(), True]
        self._waiters.append(entry)
        if timeout is not None:
            when = self.sim.now + max(0.0, timeout) / client.rate
            self.sim.at(when, lambda: _wake(entry))
        client.park()
        if entry in self._waiters:
            self._waiters.remove(entry)
        return self._flag


def _wake(entry: list[Any]) -> None:
    """Resume a parked waiter once (the set and the timeout may both come)."""
    client, task, waiting = entry
    if waiting:
        entry[2] = False
        client._resume(task, None)


class SimExecutor:
    """The backend's thread pool: each call a greenlet of the client, at most
    ``max_workers`` running (the rest wait their turn, as on the pool's queue)."""

    def __init__(self, client: Client, max_workers: int) -> None:
        self.client = client
        self.max_workers = max_workers
        self._running = 0
        self._queue: deque[Callable[[], None]] = deque()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()

        def body() -> None:
            try:
                if not future.set_running_or_notify_cancel():
                    return
                try:
                    result = fn(*args)
                except Exception as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            finally:
                self._running -= 1
                if self._queue and not self.client.dead:
                    self._running += 1
                    self.client.spawn(self._queue.popleft())

        if self._running < self.max_workers:
            self._running += 1
            self.client.spawn(body)
        else:
            self._queue.append(body)
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        self._queue.clear()


class _Threading:
    """The redlock module's ``threading``: a :class:`SimEvent` inside a run's client."""

    sim: Sim | None = None
    thread = threading.get_ident()

    def Event(self) -> Any:
        sim = self.sim
        if sim is not None and sim.active is not None and threading.get_ident() == self.thread:
            return SimEvent(sim)
        return threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(threading, name)


_threading = _Threading()
redlock_module.threading = _threading  # type: ignore[attr-defined, assignment]


# -- the world the scenario sees -------------------------------------------------------


class RedlockWorld:
    """The masters as the scenario's ``server``: faults of single masters are planned
    here (:meth:`plan`); nothing the checker exempts changes (``epoch`` stays 0)."""

    name = "redlock"
    epoch = 0

    def __init__(self, sim: Sim, scenario: Any) -> None:
        self.sim = sim
        rates = scenario.masters or (1.0, 1.0, 1.0)
        self.masters = [RedlockMaster(sim, i, rate) for i, rate in enumerate(rates)]
        self.quorum = len(self.masters) // 2 + 1
        options = url(scenario)
        self.restart_delay = float(options.split("restart_delay=")[1].split("&")[0])
        self.node_timeout = float(options.split("node_timeout=")[1].split("&")[0])
        self._nets: dict[int, tuple[Net, list[MasterNet]]] = {}
        self._observe: Callable[..., None] | None = None
        _threading.sim = sim
        _threading.thread = threading.get_ident()

    def up(self) -> bool:
        return True

    @property
    def observe(self) -> Callable[..., None] | None:
        return self._observe

    @observe.setter
    def observe(self, function: Callable[..., None] | None) -> None:
        self._observe = function
        for master in self.masters:
            master.observe = (
                None
                if function is None
                else lambda conn, command, m=master.index: function(conn, command, m)
            )

    def nets(self, base: Net) -> list[MasterNet]:
        known = self._nets.get(id(base))
        if known is None or known[0] is not base:
            known = self._nets[id(base)] = (base, [MasterNet(base, m) for m in self.masters])
        return known[1]

    def plan(self, fault: Any) -> bool:
        """Plan a master's fault; ``False``: not one (the scenario plans it)."""
        if not fault.kind.startswith("master_"):
            return False
        sim, master = self.sim, self.masters[fault.client % len(self.masters)]
        kind, at, amount = fault.kind, fault.at, fault.amount
        if kind == "master_restart":
            sim.at(at, lambda: master.restart(amount))
        elif kind == "master_pause":
            sim.at(at, lambda: master.pause(amount))
        elif kind == "master_partition":
            master.spans.append((at, at + amount))
            sim.at(
                at, lambda: sim.say(master.name, f"partitioned from every client for {amount} s")
            )
        elif kind == "master_clock_step":
            sim.at(at, lambda: master.step_clock(int(amount * 1_000_000)))
        return True


_prototypes: dict[str, RedlockBackend] = {}


def redlock_backend(
    url_: str, client: Client, world: RedlockWorld, net: Net, timeout: float
) -> Any:
    """A client's own ``RedlockBackend`` over the world's masters (copied from one made
    per URL, as the Redis ones; each master's ``_MasterBackend`` copied with it)."""
    prototype = _prototypes.get(url_)
    if prototype is None:
        prototype = _prototypes[url_] = RedlockBackend(url_)
    backend = copy.copy(prototype)
    backend._pool = SimExecutor(client, min(64, 8 * len(prototype.masters)))  # type: ignore[assignment]
    backend._pool_pid = os.getpid()
    backend._pool_lock = threading.Lock()
    backend._chain_lock = threading.Lock()
    backend._chains = {}
    backend._achains = {}
    backend._background = set()
    backend._holding = {}
    backend._unsettled = {}
    backend._straggling = {}
    backend._longest_ttl = 0.0
    masters = []
    nets = world.nets(net)
    for proto, world_master, master_net in zip(prototype.masters, world.masters, nets, strict=True):
        master = copy.copy(proto)
        master.redlock = backend
        master.run_id = None
        master.vote_after = 0.0
        master.down_until = 0.0
        node = copy.copy(proto.backend)
        node.master = master
        node._riders = []
        node._riders_guard = threading.Lock()
        node._client_guard = threading.Lock()
        node._sync_client = MasterRedis(
            client, world_master, master_net, prototype.node_timeout, node
        )
        master.backend = node
        masters.append(master)
    backend.masters = masters
    return backend


# -- the checker ------------------------------------------------------------------------


def redlock_checker(base: type) -> type:
    """The scenario's checker (``base``) with a quorum of masters as the server."""
    from .scenario import Grant, Held

    class RedlockChecker(base):  # type: ignore[misc]
        def __init__(self, sim: Sim, world: RedlockWorld, probe: Any, scenario: Any) -> None:
            super().__init__(sim, world, probe.masters[0].backend, scenario)
            self.world = world
            self.quorum = world.quorum
            self.key_names = {key: name for name, key in self.keys.items()}
            count = len(world.masters)
            #: name -> per master: (token, fence, expiry in the master's ms) or None
            self.copies: dict[str, list[tuple[str, int, int] | None]] = {
                name: [None] * count for name in self.keys
            }
            #: (name, token) -> every fence a master handed out to that token
            self.fences_of: dict[tuple[str, str], set[int]] = {}
            self.by_token: dict[str, Any] = {}
            #: token -> who deleted a live copy of it on which masters, when
            self.deleted: dict[str, dict[str, dict[int, float]]] = {}
            #: token -> when its latest majority formed; when its holder began to release it
            self.granted_time: dict[str, float] = {}
            self.release_began: dict[str, float] = {}
            checker = self

            class Releasing(set):  # type: ignore[type-arg]
                def add(self, token: str) -> None:
                    checker.release_began[token] = checker.sim.now
                    super().add(token)

            self.releasing = Releasing()
            #: (token, who) that deleted a copy of it while a majority of masters may have
            #: kept it (a live copy, or a restart quarantine: a copy forgotten there)
            self.while_held: set[tuple[str, str]] = set()
            #: name -> (grant order, fence, client) of each lease reported
            self.lease_fences: dict[str, list[tuple[int, int, str]]] = {n: [] for n in self.keys}
            #: name -> until when (sim time) its majority stands if no copy changes
            self.stable: dict[str, float] = dict.fromkeys(self.keys, -1.0)

        # the masters' copies ----------------------------------------------------------
        def _live(self, master: int, copy_: tuple[str, int, int] | None) -> bool:
            if copy_ is None:
                return False
            return self.world.masters[master].model.now_ms() <= copy_[2]

        def _copy_expiry(self, master: int, copy_: tuple[str, int, int]) -> float:
            m = self.world.masters[master]
            return ((copy_[2] + 1) * 1000 - BASE_US - m.clock_offset_us) / (m.rate * 1e6)

        def _quarantined(self, master: int) -> bool:
            """Down for a restart or in its quarantine after: its answers count for no one
            (a copy it lacks may be one it forgot)."""
            m = self.world.masters[master]
            return m.restarted_at <= self.sim.now < m.quarantine_until(self.world.restart_delay)

        def _majority(self, name: str) -> str | None:
            """The token a majority of the masters that vote hold, if any; notes until when
            (sim time) the answer stands unless a master's copy changes (:attr:`stable`)."""
            counts: dict[str, int] = {}
            now, until = self.sim.now, float("inf")
            restart_delay = self.world.restart_delay
            for m, c in enumerate(self.copies[name]):
                master = self.world.masters[m]
                quarantine = master.quarantine_until(restart_delay)
                if master.up_at <= now < quarantine:
                    until = min(until, quarantine)
                elif c is not None and self._live(m, c):
                    counts[c[0]] = counts.get(c[0], 0) + 1
                    until = min(until, self._copy_expiry(m, c))
            self.stable[name] = until - 1e-6
            return next((t for t, n in counts.items() if n >= self.quorum), None)

        def observe(self, conn: Any, command: tuple[Any, ...], master: int | None = None) -> None:
            if master is None:
                return
            for name in self.keys:  # what time did to the copies since the last look
                if self.sim.now >= self.stable[name]:
                    self._settle(name, "expiry")
            model = self.world.masters[master].model
            who = "restart" if conn is None else conn.client.name
            for name, key in self.keys.items():
                fields = self._fields(model.get_value(key))
                token = fields.get("token")
                before = self.copies[name][master]
                if before is not None and before[0] != token and self._live(master, before):
                    # (on any master: one whose restart quarantine ends during the call
                    # counts for the caller, and the copy it deletes there is real)
                    self.deleted.setdefault(before[0], {}).setdefault(who, {})[master] = (
                        self.sim.now
                    )
                    may_hold = sum(
                        1
                        for m, c in enumerate(self.copies[name])
                        if (c is not None and c[0] == before[0] and self._live(m, c))
                        or self._quarantined(m)
                    )
                    if may_hold >= self.quorum:  # while a majority of masters may keep it
                        self.while_held.add((before[0], who))
                if who.startswith("operator") and before is not None and before[0] != token:
                    # A force release that reached only some masters takes the lock back
                    # all the same (the holder hears of it when it renews).
                    self.forced.add(before[0])
                if token is None or "fence" not in fields:
                    self.copies[name][master] = None
                else:
                    fence = int(fields["fence"])
                    when = model.expires.get(key)
                    self.copies[name][master] = (token, fence, -1 if when is None else when)
                    self.fences_of.setdefault((name, token), set()).add(fence)
                self._settle(name, who)
            for key in model.data:
                if key not in model.expires:
                    self.fail(f"key {key!r} has no expiry on master{master}")

        def _settle(self, name: str, who: str) -> None:
            token = self._majority(name)
            before = self.current[name]
            if token == before:
                return
            if before is not None:
                order = self.current_fence.get(name)
                if order is not None:
                    self.removed_by.setdefault((before, int(order)), who)
                if who.startswith("operator"):
                    self.forced.add(before)
                self._free(name)
            self.current[name] = token
            self.current_fence[name] = None
            if token is not None:
                self.order += 1
                self.current_fence[name] = str(self.order)
                fence = max(self.fences_of.get((name, token), {0}))
                grant = Grant(name, token, fence, self.order, 0)
                self.grants[(name, token)] = self.by_token[token] = grant
                self.removed_by.pop((token, self.order), None)
                self.granted_time[token] = self.sim.now
                if not any(h.lease.token == token for h in self.leases):
                    # (a straggler grant of a lease taken back does not give it back)
                    self.forced.discard(token)
                self.stale.discard(token)
                self._taken(name)

        def _alive(self, key: Any) -> bool:
            name = self.key_names[key]
            token = self.current[name]
            return token is not None and self._majority(name) == token

        def _support(self, name: str, token: str, deadline: float) -> int:
            """Masters that keep ``token``'s lock until ``deadline``: a live copy expiring
            no sooner, or a restarted master whose quarantine lasts that long."""
            count = 0
            for m, c in enumerate(self.copies[name]):
                master = self.world.masters[m]
                if (
                    c is not None
                    and c[0] == token
                    and self._live(m, c)
                    and self._copy_expiry(m, c) >= deadline - 1e-6
                ):
                    count += 1
                elif master.quarantine_until(self.world.restart_delay) >= deadline:
                    count += 1
            return count

        # after every step -------------------------------------------------------------
        def step(self) -> None:
            if self.fair:
                for name, since in self.held_since.items():
                    if since is None and self.waiting[name]:
                        self._starved(name)
            if not self.leases:
                return
            for name in self.keys:
                if self.sim.now >= self.stable[name]:
                    self._settle(name, "expiry")
            holders: dict[str, Any] = {}
            sim = self.sim
            done = False
            for held in self.leases:
                client, lease = held.client, held.lease
                if client.dead or lease._released or lease.lost._set:
                    done = True
                    continue
                previous, sim.active = sim.active, client
                try:
                    alive = lease.held
                    deadline = client.sim_time_of(lease._expires_mono)
                finally:
                    sim.active = previous
                if not alive:
                    continue
                if lease.token in self.forced and not held.forced_before:
                    continue  # an operator took it back
                if lease.token in self.releasing:
                    continue
                name = lease.name
                support = self._support(name, lease.token, deadline)
                if support < self.quorum:
                    self.fail(
                        f"{client.name}'s lease of {name!r} (fence {lease.fence}) counts until "
                        f"{deadline * 1000:.3f} ms, but only {support} of "
                        f"{len(self.world.masters)} masters keep it that long "
                        f"(the majority's holder is {self._who(name)})"
                    )
                other = holders.get(name)
                if other is not None:
                    self.fail(f"two holders of {name!r}: {other.client.name} and {client.name}")
                holders[name] = held
            if done:
                self.leases = [
                    h
                    for h in self.leases
                    if not (h.client.dead or h.lease._released or h.lease.lost._set)
                ]

        # client reports ---------------------------------------------------------------
        def granted(self, client: Client, lease: Any) -> None:
            name, token = lease.name, lease.token
            grant = self.grants.get((name, token))
            if grant is None and self._support(name, token, self.sim.now) >= self.quorum:
                # Granted by masters of which one restarted since (the client learns it at
                # its next connection there): a lock no one else can take in the meantime.
                self.order += 1
                grant = Grant(name, token, lease.fence, self.order, 0)
                self.grants[(name, token)] = self.by_token[token] = grant
            if grant is None:
                self.fail(f"{client.name} got a lease of {name!r} no majority ever granted")
            if lease.fence not in self.fences_of.get((name, token), set()):
                self.fail(
                    f"{client.name}'s lease has fence {lease.fence}, which no master handed "
                    f"out to it ({sorted(self.fences_of.get((name, token), set()))})"
                )
            for order, fence, who in self.lease_fences[name]:
                if (order < grant.order) != (fence < lease.fence):
                    self.fail(
                        f"{name!r}: {client.name}'s fence {lease.fence} (grant #{grant.order}) "
                        f"against {who}'s fence {fence} (grant #{order})"
                    )
            self.lease_fences[name].append((grant.order, lease.fence, client.name))
            self.leases.append(Held(client, lease, 0, token in self.stale))
            self.granted_at[id(lease)] = self.sim.now

        def released(self, client: Client, lease: Any, ok: bool) -> None:
            """A release that said released deleted its token on a majority of masters
            (by this call: live copies, or a resent call's tombstone); one that said not
            owned did not (a majority of masters answered that the token was not theirs)."""
            grant = self.grants.get((lease.name, lease.token))
            if grant is None or self.removed_by.get((lease.token, grant.order)) == "restart":
                return
            began = self.release_began.get(lease.token, 0.0)
            mine = sum(
                t >= began for t in self.deleted.get(lease.token, {}).get(client.name, {}).values()
            )
            if ok and mine < self.quorum and lease.token not in self.forced:
                self.fail(
                    f"{client.name}'s release of {lease.name!r} said released; it deleted its "
                    f"token on {mine} of {len(self.world.masters)} masters"
                )
            if not ok and mine >= self.quorum:
                self.fail(
                    f"{client.name}'s release of {lease.name!r} said not owned; it deleted its "
                    f"token on {mine} of {len(self.world.masters)} masters"
                )

        def forced_release(
            self, operator: Client, token: str, fence: int, ok: bool, epoch: int
        ) -> None:
            """A force release that said it freed the holder it saw broke that holder's
            majority, or deleted its token on a majority, or at least one copy while a
            majority may have kept it (the holder's own release or expiry may race it, and
            with replies lost or masters in quarantine it can only guess); one that said
            the lock changed hands deleted it on no majority."""
            grant = self.by_token.get(token)
            by = None if grant is None else self.removed_by.get((token, grant.order))
            if by == "restart":
                return
            since = self.granted_time.get(token, 0.0)
            mine = sum(
                t >= since for t in self.deleted.get(token, {}).get(operator.name, {}).values()
            )
            took_part = (token, operator.name) in self.while_held
            # A master that did not answer the call may have held it: the backend guesses.
            span = 2 * self.world.node_timeout + 0.1
            # So may one in its restart quarantine during the call, whatever it answered
            # (seed 127206).
            guessed = mine > 0 and any(
                m.unanswered.get(operator.name, -1.0) >= self.sim.now - span
                or m.calling.get(operator.name, 0) > 0
                or (
                    m.restarted_at <= self.sim.now
                    and m.quarantine_until(self.world.restart_delay) >= self.sim.now - span
                )
                for m in self.world.masters
            )
            if ok and by != operator.name and mine < self.quorum and not (took_part or guessed):
                self.fail(
                    f"{operator.name}'s force release said it freed the holder it saw; "
                    f"{by or 'nobody'} broke that holder's majority"
                )
            if not ok and mine >= self.quorum:
                self.fail(
                    f"{operator.name}'s force release said the lock changed hands, but it "
                    f"deleted the holder's token on {mine} masters"
                )

    return RedlockChecker
