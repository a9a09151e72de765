"""The simulated world: virtual time, clients as greenlets, a network, a Redis server.

Everything runs in one thread. Each simulated client process is a set of greenlets
running the *production* code (``Lock.acquire``, ``Lease.renew``/``release``, the
renewal lane's ``ThreadLane._renew``, ``RedisBackend``'s request shaping, NOSCRIPT
fallback, riders and reply parsing) unchanged. The seam is the redis-py client: each
client's ``RedisBackend`` is given a :class:`SimRedis` in place of its ``redis.Redis``,
which sends each command over the simulated network and parks the calling greenlet
until the reply (or the socket timeout, or a reset) comes. redis-py's own behaviour
that matters here is reproduced: one immediate retry of a command or pipeline after a
connection error (its ``Retry(NoBackoff(), 1)`` as the backend configures it), none
after a timeout, a connection dropped after a timeout (its late reply never read).

Time. ``time`` is replaced in every ``task_locks`` module by :class:`SimTime`: the
calling client's own clocks (``monotonic`` runs at the client's rate and may jump
forward; ``time`` may jump either way), and ``sleep`` parks the greenlet. The server's
clock (its ``TIME`` and key expiry) is virtual time plus its own offset, which may be
stepped. Tokens and release ids come from each client's own seeded stream
(``secrets`` is replaced the same way), so a seed replays exactly.

Threads. The lease's renewal lane and deadline watch are threads in production; here
(:class:`SimRuntime`) the lane is a greenlet per client driving the production
``RenewalQueue`` as ``ThreadLane`` does, each renewal call in a greenlet of its own (the
thread lane's ``_call``, bounded by ``watchdog.MAX_CALLS_IN_FLIGHT``), and the deadline
watch is the production ``DeadlineHeap`` woken by events at the local deadlines.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import random
import secrets
import sys
import threading
import time as real_time
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import greenlet
import redis.exceptions as rex
from redis._parsers.base import BaseParser

from task_locks import events, watchdog

from .redis_model import RedisModel, ReplyError, Status

#: Redis's timer: blocked clients' timeouts are looked at every 100 ms (hz 10).
SERVER_TICK = 0.1


class Event:
    __slots__ = ("action", "cancelled")

    def __init__(self, action: Callable[[], None]) -> None:
        self.action = action
        self.cancelled = False


class Violation(AssertionError):
    """A checker found a broken invariant."""


class Sim:
    """Virtual time and the event loop; ``story`` collects a readable trace if asked."""

    def __init__(self, seed: int, record: bool = False) -> None:
        self.seed = seed
        self.now = 0.0
        self._heap: list[tuple[float, int, Event]] = []
        self._seq = itertools.count()
        self.root = greenlet.getcurrent()
        self.active: Client | None = None
        self.record = record
        self.story: list[str] = []
        self.steps = 0
        self.stop_at = float("inf")
        #: Clients a request of which reached a server after they were killed.
        self.posthumous: set[str] = set()
        #: Told of each renewal call sent (its leases), and of each lease whose local
        #: deadline passed (before the lease hears of it): the checker's hooks.
        self.on_renew: Callable[[list[Any]], None] = lambda leases: None
        #: Told when a renewal lane's call (``on_renew``'s leases) has its answer.
        self.on_renewed: Callable[[list[Any]], None] = lambda leases: None
        #: Told just before a lane's call sends its request (the client's next request).
        self.on_lane_call: Callable[[Client], None] = lambda client: None
        self.on_deadline: Callable[[Client, Any], None] = lambda client, lease: None
        self.after_step: Callable[[], None] | None = None

    def say(self, who: str, text: str) -> None:
        if self.record:
            self.story.append(f"{self.now * 1000:10.3f} ms  {who:9} {text}")

    def at(self, when: float, action: Callable[[], None]) -> Event:
        event = Event(action)
        now = self.now
        heapq.heappush(self._heap, (when if when > now else now, next(self._seq), event))
        return event

    def run(self, until: float) -> None:
        """Run events in time order until ``until`` (or :attr:`stop_at`, if sooner)."""
        heap, pop, after = self._heap, heapq.heappop, self.after_step
        self.stop_at = until
        steps = self.steps
        try:
            while heap:
                when, _, event = pop(heap)
                if event.cancelled:
                    continue
                if when > self.stop_at:
                    break
                self.now = when
                event.action()
                steps += 1
                if after is not None:
                    after()
        finally:
            self.steps = steps


class Client:
    """One simulated process: its clocks, RNG streams, greenlets and pauses."""

    def __init__(self, sim: Sim, index: int, rate: float = 1.0) -> None:
        self.sim = sim
        self.index = index
        self.name = f"operator{-index}" if index < 0 else f"client{index}"
        self.rate = rate
        self.mono_offset = 1000.0 + index
        self.wall_offset = 1_700_000_000.0
        self.rng = random.Random(sim.seed * 7919 + index)
        self.paused_until = 0.0
        self.dead = False
        self.requests = 0  # how many request messages this client has sent
        self.schedule = watchdog.Schedule()
        self.lane: SimLane | None = None
        self.watch = SimWatch(self)
        self._runtime: SimRuntime | None = None
        #: Resumes due while paused, by greenlet (see :meth:`_resume`).
        self._deferred: dict[greenlet.greenlet, Any] | None = None

    # clocks ------------------------------------------------------------------------
    def monotonic(self) -> float:
        return self.mono_offset + self.sim.now * self.rate

    def wall(self) -> float:
        return self.wall_offset + self.sim.now * self.rate

    def sim_time_of(self, mono: float) -> float:
        return (mono - self.mono_offset) / self.rate

    #: ``time()`` and ``monotonic()``: the client is the ``leasing.Clock`` of its leases.
    time = wall

    # where its leases are renewed and watched -----------------------------------------
    def renewer(self) -> _Renewer:
        """``thread_renewer()`` of the lease before its injected runtime."""
        if self.lane is None:
            self.lane = SimLane(self)
        return _Renewer(self.lane)

    @property
    def runtime(self) -> SimRuntime:
        """Its ``leasing.LeaseRuntime`` (made on first use)."""
        if self._runtime is None:
            self._runtime = SimRuntime(self)
        return self._runtime

    # greenlets ---------------------------------------------------------------------
    def spawn(self, function: Callable[[], None], when: float | None = None) -> None:
        def body(_: Any = None) -> None:
            try:
                function()
            except greenlet.GreenletExit:
                pass

        task = greenlet.greenlet(body, parent=self.sim.root)
        self.resume_at(self.sim.now if when is None else when, task, None)

    def resume_at(self, when: float, task: greenlet.greenlet, value: Any) -> Event:
        return self.sim.at(when, functools.partial(self._resume, task, value))

    def _resume(self, task: greenlet.greenlet, value: Any) -> None:
        if self.dead or task.dead:
            return
        if self.paused_until > self.sim.now:
            # A paused process runs nothing; what became due meanwhile resumes each
            # greenlet once when the pause ends, with the first value: a timeout and a
            # wake-up both due during a pause are one return from a wait, as a thread's.
            # (Each used to be resumed apart, the second reaching the greenlet wherever it
            # parked next: a Celery worker slot took it for a delivery.)
            if self._deferred is None:
                self._deferred = {}
                self.sim.at(self.paused_until, self._unpause)
            self._deferred.setdefault(task, value)
            return
        previous, self.sim.active = self.sim.active, self
        try:
            task.switch(value)
        finally:
            self.sim.active = previous

    def _unpause(self) -> None:
        deferred, self._deferred = self._deferred, None
        for task, value in (deferred or {}).items():
            self._resume(task, value)  # (deferred again if the pause was extended)

    def park(self) -> Any:
        """Give control back to the event loop until someone resumes this greenlet."""
        outcome = self.sim.root.switch()
        if isinstance(outcome, _Raise):
            raise outcome.error
        return outcome

    def sleep(self, seconds: float) -> None:
        self.resume_at(self.sim.now + max(0.0, seconds) / self.rate, greenlet.getcurrent(), None)
        self.park()

    def wait(self, on: Any, ready: Callable[[], object], seconds: float) -> bool:
        """Park the calling greenlet until ``ready()``, or until ``seconds`` have passed on
        this client's clock (a socket's read timeout); whether it is ready. While parked,
        ``on.waiter`` is the greenlet: whoever makes it ready calls :meth:`wake` with ``on``."""
        if ready():
            return True
        deadline = self.monotonic() + seconds
        me = greenlet.getcurrent()
        while True:
            left = deadline - self.monotonic()
            if left <= 0:
                return False
            on.waiter = me
            timer = self.resume_at(self.sim.now + left / self.rate, me, None)
            self.park()
            timer.cancelled = True
            on.waiter = None
            if ready():
                return True

    def wake(self, on: Any) -> None:
        """Resume the greenlet parked in :meth:`wait` on ``on``, if one is."""
        waiter = on.waiter
        if waiter is not None:
            on.waiter = None
            self._resume(waiter, None)


class _Raise:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


# -- the production modules' time and secrets -------------------------------------------


class SimTime:
    """Stands in for the ``time`` module inside ``task_locks``: the active client's clocks.

    Only for the simulation's own thread: any other thread of the process (a test's
    leftover renewal thread, the event hub) keeps the real clock."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.thread = threading.get_ident()

    def monotonic(self) -> float:
        if threading.get_ident() != self.thread:
            return real_time.monotonic()
        client = self.sim.active
        return self.sim.now if client is None else client.monotonic()

    perf_counter = monotonic

    def time(self) -> float:
        if threading.get_ident() != self.thread:
            return real_time.time()
        client = self.sim.active
        return 1_700_000_000.0 + self.sim.now if client is None else client.wall()

    def sleep(self, seconds: float) -> None:
        client = self.sim.active
        if threading.get_ident() != self.thread or client is None:
            real_time.sleep(seconds)
            return
        client.sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(real_time, name)


class SimSecrets:
    """Stands in for ``secrets``: tokens from the active client's own stream."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.thread = threading.get_ident()

    def token_hex(self, nbytes: int = 32) -> str:
        if threading.get_ident() != self.thread:
            return secrets.token_hex(nbytes)
        client = self.sim.active
        rng = client.rng if client is not None else random.Random(self.sim.seed)
        return f"{rng.getrandbits(nbytes * 8):0{nbytes * 2}x}"


class SimRandom:
    """Stands in for ``random`` (a semaphore's slot order): the active client's stream."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.thread = threading.get_ident()

    def __getattr__(self, name: str) -> Any:
        if threading.get_ident() != self.thread:
            return getattr(random, name)
        client = self.sim.active
        rng = client.rng if client is not None else random.Random(self.sim.seed)
        return getattr(rng, name)


class Patches:
    """Swap ``time``, ``secrets`` and the lease's thread factories inside ``task_locks``."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []
        self._seen = 0
        self._found: list[tuple[Any, str, Any]] = []

    def install(self, sim: Sim) -> None:
        import task_locks.lock as lock_module

        fakes = {"time": SimTime(sim), "secrets": SimSecrets(sim), "random": SimRandom(sim)}
        for module, attribute, real in self._targets():
            self._saved.append((module, attribute, real))
            setattr(module, attribute, fakes[attribute])
        # Each run its own registry of held leases (keyed by the backend's id: a lease of
        # an earlier run, not yet collected, would be taken for one of this run's holders
        # when a backend here reuses its backend's address).
        self._saved.append((lock_module, "_held_by", lock_module._held_by))
        lock_module._held_by = {}
        # No lock events: nothing here reads them, and their dispatcher is a thread of its
        # own (it took a share of the run's time, and logged after the run had ended).
        self._saved.append((events._hub, "wanted", events._hub.wanted))
        events._hub.wanted = frozenset()

        def renewer() -> Any:
            assert sim.active is not None
            return sim.active.renewer()

        def watch() -> Any:
            assert sim.active is not None
            return sim.active.watch

        for attribute, fake in (("thread_renewer", renewer), ("deadline_watch", watch)):
            if hasattr(lock_module, attribute):  # the lease before its runtime (leasing)
                self._saved.append((lock_module, attribute, getattr(lock_module, attribute)))
                setattr(lock_module, attribute, fake)

    def _targets(self) -> list[tuple[Any, str, Any]]:
        """Each ``task_locks`` module's ``time`` and ``secrets`` (looked up again only
        when modules were imported since)."""
        if self._seen != len(sys.modules):
            self._seen = len(sys.modules)
            reals = (
                ("time", real_time),
                ("secrets", sys.modules["secrets"]),
                ("random", sys.modules["random"]),
            )
            self._found = [
                (module, attribute, real)
                for name, module in list(sys.modules.items())
                if name.startswith("task_locks") and module is not None
                for attribute, real in reals
                if getattr(module, attribute, None) is real
            ]
        return self._found

    def uninstall(self) -> None:
        while self._saved:
            module, attribute, value = self._saved.pop()
            setattr(module, attribute, value)


# -- the lease's renewal lane and deadline watch, on virtual time -------------------------


class SimLane:
    """One client's renewal lane: the production Schedule and ``ThreadLane._renew``, in a
    greenlet that sleeps until the next due lease (the thread loop's condition wait)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.schedule = client.schedule
        self._task: greenlet.greenlet | None = None
        self._timer: Event | None = None
        self._sleeper: greenlet.greenlet | None = None
        self._wake_at = float("inf")
        self.busy = False

    # what a lease calls (watchdog.Lane)
    def add(self, lease: Any) -> None:
        due = watchdog.next_renewal(lease, self.client.monotonic())
        self.schedule.add(lease, due)
        if self._task is None:
            self.client.spawn(self._loop)
            self._task = object()  # type: ignore[assignment]
        elif not self.busy and due < self._wake_at:
            self._wake(due)

    def remove(self, lease: Any) -> None:
        self.schedule.remove(lease)

    def idle(self) -> bool:
        return not len(self.schedule)

    def _wake(self, due: float) -> None:
        task = self._sleeper
        if task is None:  # not started yet: it reads the schedule when it starts
            return
        if self._timer is not None:
            self._timer.cancelled = True
        self._wake_at = due
        self._timer = self.client.resume_at(self.client.sim_time_of(due), task, None)

    def _loop(self) -> None:
        self._sleeper = greenlet.getcurrent()
        while not self.client.dead:
            now = self.client.monotonic()
            due = self.schedule.next_due()
            if due is None or due > now:
                self._wake_at = float("inf") if due is None else due
                if due is not None:
                    self._timer = self.client.resume_at(
                        self.client.sim_time_of(due), self._sleeper, None
                    )
                self.client.park()
                continue
            self.busy = True
            try:
                for backend, leases in self.schedule.take_due(now).items():
                    self.client.sim.on_renew(leases)
                    watchdog.ThreadLane._renew(self, backend, leases)  # type: ignore[arg-type]
            finally:
                self.busy = False


class SimWatch:
    """The deadline watch: an event at each watched lease's local deadline."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def add(self, lease: Any) -> None:
        client = self.client

        def check() -> None:
            if not lease._watched or lease._released:
                return
            if client.monotonic() < lease._expires_mono:  # renewed since
                client.sim.at(client.sim_time_of(lease._expires_mono), check)
                return
            client.sim.on_deadline(client, lease)
            client.spawn(lease._deadline_passed)

        client.sim.at(client.sim_time_of(lease._expires_mono), check)

    def remove(self, lease: Any) -> None:
        pass  # the event finds the lease unwatched


class SimRuntime:
    """A client's ``task_locks.leasing.LeaseRuntime``: its clock, one renewal lane driven
    by the production ``RenewalQueue``, the deadline watch by ``DeadlineHeap``, and user
    callbacks in greenlets of their own (never on the lane or the watch)."""

    key = None

    def __init__(self, client: Client) -> None:
        from task_locks import leasing

        self.leasing = leasing
        self.client = client
        self.clock = client
        self.queue = leasing.RenewalQueue(client, wake=self._wake_lane)
        self.heap = leasing.DeadlineHeap(wake=self._wake_watch)
        self._lane: greenlet.greenlet | None = None
        self._lane_timer: Event | None = None
        self._lane_busy = False
        self._calls = 0  # the lane's renewal calls in flight
        self._lane_waits: greenlet.greenlet | None = None
        self._watch_timer: Event | None = None
        self._watch_at = float("inf")

    # LeaseRuntime
    def schedule(self, lease: Any, asynchronous: bool) -> SimRuntime:
        self.queue.add(lease)
        if self._lane is None:
            self._lane = greenlet.greenlet(self._lane_loop, parent=self.client.sim.root)
            self.client.resume_at(self.client.sim.now, self._lane, None)
        return self

    def watch(self, lease: Any) -> None:
        self.heap.add(lease)

    def unwatch(self, lease: Any) -> None:
        self.heap.remove(lease)

    def run_callback(self, lease: Any, callback: Callable[[], object]) -> None:
        self.client.spawn(callback)

    # Lane
    def add(self, lease: Any, due: float | None = None, earlier_only: bool = False) -> None:
        self.queue.add(lease, due, earlier_only)

    def remove(self, lease: Any) -> None:
        self.queue.remove(lease)

    def idle(self) -> bool:
        return not len(self.queue)

    # the lane: the thread lane's loop, on virtual time
    def _wake_lane(self, due: float) -> None:
        if self._lane is None or self._lane_busy or self._lane.dead:
            return
        if self._lane_timer is not None:
            self._lane_timer.cancelled = True
        self._lane_timer = self.client.resume_at(self.client.sim_time_of(due), self._lane, None)

    def _lane_loop(self, _: Any = None) -> None:
        self.leasing.mark_driver()
        client = self.client
        while not client.dead:
            now = client.monotonic()
            due = self.queue.next_due()
            if due is None or due > now:
                if due is not None:
                    self._wake_lane(due)
                client.park()
                continue
            self._lane_busy = True
            try:
                for backend, leases in self.queue.take_due(now).items():
                    batch = self.queue.start(backend, leases)
                    if batch is None:
                        continue
                    # (A lane without the bound waited for each call: as if it were 1.)
                    while self._calls >= getattr(watchdog, "MAX_CALLS_IN_FLIGHT", 1):
                        self._lane_waits = greenlet.getcurrent()
                        client.park()
                    # The thread lane's _call: the call in a task of its own.
                    self._calls += 1
                    client.sim.on_renew(batch.leases)
                    client.spawn(lambda b=batch: self._answer(b))
            finally:
                self._lane_busy = False

    def _answer(self, batch: Any) -> None:
        """The thread lane's ``_answer``: one call and its answers applied."""
        self.leasing.mark_driver()
        results: Any
        self.client.sim.on_lane_call(self.client)
        try:
            results = batch.backend.renew_many(batch.items, timeout=batch.timeout)
        except Exception as exc:
            results = exc
        self.client.sim.on_renewed(batch.leases)
        try:
            self.queue.complete(batch, results)
        finally:
            del results  # an error's traceback holds this frame: no cycle
            self._calls -= 1
            waiting, self._lane_waits = self._lane_waits, None
            if waiting is not None:
                self.client.resume_at(self.client.sim.now, waiting, None)

    # the deadline watch
    def _wake_watch(self, when: float) -> None:
        if when >= self._watch_at:
            return
        if self._watch_timer is not None:
            self._watch_timer.cancelled = True
        self._watch_at = when
        self._watch_timer = self.client.sim.at(self.client.sim_time_of(when), self._look)

    def _look(self) -> None:
        self._watch_at, self._watch_timer = float("inf"), None
        expired = self.heap.expired(self.client.monotonic())
        for lease in expired:
            self.client.sim.on_deadline(self.client, lease)
        if expired:

            def mark() -> None:
                self.leasing.mark_driver()
                for lease in expired:
                    lease._deadline_passed()

            self.client.spawn(mark)
        following = self.heap.next_deadline()
        if following is not None:
            self._wake_watch(following)


class _Renewer:
    def __init__(self, lane: SimLane) -> None:
        self.lane = lane

    def add(self, lease: Any) -> SimLane:
        self.lane.add(lease)
        return self.lane


def leasing_module() -> Any:
    """``task_locks.leasing`` where the lease takes an injected runtime, else ``None``."""
    try:
        from task_locks import leasing
    except ImportError:
        return None
    return leasing if hasattr(leasing, "use_runtime") else None


# -- the network and the server --------------------------------------------------------


class Net:
    """Message delays and the faults the scenario planned for given request numbers."""

    def __init__(self, sim: Sim, delay: tuple[float, float]) -> None:
        self.sim = sim
        self.low, self.high = delay
        self.rng = random.Random(sim.seed * 31 + 5)
        #: (client index, request number) -> fault kind and its amount
        self.faults: dict[tuple[int, int], tuple[str, float]] = {}
        #: client index -> [(start, end)] during which its messages are lost
        self.partitions: dict[int, list[tuple[float, float]]] = {}

    def delay(self) -> float:
        return self.low + (self.high - self.low) * self.rng.random()

    def cut(self, client: Client, when: float) -> bool:
        spans = self.partitions.get(client.index)
        return spans is not None and any(a <= when < b for a, b in spans)


class Server:
    """One redis-server: the model, its clock, connections, blocked clients, restarts."""

    def __init__(self, sim: Sim, name: str = "redis") -> None:
        self.sim = sim
        self.name = name
        self.clock_offset_us = 0
        self.model = RedisModel(self.now_us)
        self.epoch = 0  # restarts so far
        self.down_until = -1.0
        self.blocked: deque[tuple[Conn, list[str], float, int]] = deque()
        self.observe: Callable[[Conn | None, tuple[Any, ...]], None] | None = None
        self._tick_event: Event | None = None
        self.conns: list[Conn] = []

    def now_us(self) -> int:
        return 1_700_000_000_000_000 + int(self.sim.now * 1_000_000) + self.clock_offset_us

    def up(self) -> bool:
        return self.sim.now >= self.down_until

    def restart(self, downtime: float, quiet: bool = False) -> None:
        if not quiet:
            self.sim.say(self.name, f"RESTART without persistence (down {downtime * 1000:.0f} ms)")
        self.model.restart()
        self.epoch += 1
        self.down_until = self.sim.now + downtime
        self.blocked.clear()
        conns, self.conns = self.conns, []
        for conn in conns:
            conn._reset()
        if self.observe is not None:
            self.observe(None, ("RESTART",))

    def snapshot(self) -> tuple[dict[str, Any], dict[str, int]]:
        """The keyspace as a replica has it (values copied, expiry times absolute)."""
        data = {k: v if isinstance(v, str) else type(v)(v) for k, v in self.model.data.items()}
        return data, dict(self.model.expires)

    def failover(self, replica: tuple[dict[str, Any], dict[str, int]], lag: float) -> None:
        """Sentinel promotes a replica that was ``lag`` behind: the writes of that last
        stretch are lost, every connection is reset, the script cache is the replica's
        (empty: scripts replicate as their effects)."""
        self.sim.say(self.name, f"FAILOVER to a replica {lag * 1000:.0f} ms behind")
        self.restart(0.0, quiet=True)
        self.model.data, self.model.expires = replica
        if self.observe is not None:
            self.observe(None, ("FAILOVER",))

    def step_clock(self, delta_us: int) -> None:
        self.sim.say(self.name, f"clock steps {delta_us / 1000:+.1f} ms")
        self.clock_offset_us += delta_us
        if self.observe is not None:  # expiry times (server clock) move in virtual time
            self.observe(None, ("CLOCK",))

    def execute(self, conn: Conn, command: tuple[Any, ...]) -> Any:
        reply = self.model.execute(command)
        if self.sim.record:
            self.sim.say(self.name, f"{_describe(command)} -> {_short(reply)}")
        if self.observe is not None:
            self.observe(conn, command)
        if self.model.pushed:
            self._serve_blocked()
        return reply

    # BLPOP --------------------------------------------------------------------------
    def blpop(self, conn: Conn, keys: list[str], timeout: float, epoch: int) -> Any:
        for key in keys:
            value = self.model.pop_first(key)
            if value is not None:
                return [key, value]
        deadline = self.sim.now + timeout
        self.blocked.append((conn, keys, deadline, epoch))
        self._ensure_tick()
        return _BLOCKED

    def _serve_blocked(self) -> None:
        pushed, self.model.pushed = self.model.pushed, set()
        for entry in list(self.blocked):
            conn, keys, _, _ = entry
            for key in keys:
                if key in pushed:
                    value = self.model.pop_first(key)
                    if value is not None:
                        self.blocked.remove(entry)
                        if self.observe is not None:
                            self.observe(conn, ("BLPOP", key))
                        conn.server_reply([key, value])
                        break

    def _ensure_tick(self) -> None:
        if self._tick_event is None:
            phase = SERVER_TICK - (self.sim.now % SERVER_TICK)
            self._tick_event = self.sim.at(self.sim.now + phase, self._tick)

    def _tick(self) -> None:
        self._tick_event = None
        for entry in list(self.blocked):
            conn, _, deadline, _ = entry
            if deadline <= self.sim.now:
                self.blocked.remove(entry)
                conn.server_reply(None)
        if self.blocked:
            self._tick_event = self.sim.at(self.sim.now + SERVER_TICK, self._tick)

    def drop_blocked(self, conn: Conn) -> None:
        for entry in list(self.blocked):
            if entry[0] is conn:
                self.blocked.remove(entry)


_BLOCKED = object()


def _describe(command: tuple[Any, ...]) -> str:
    from task_locks.backends.redis_scripts import SCRIPTS

    words = [str(x) for x in command]
    if words[0].upper() in ("EVALSHA", "EVAL"):
        which = next((n for n, s in SCRIPTS.sha.items() if s == words[1]), None)
        if which is None:
            which = next((n for n, s in SCRIPTS.source.items() if s == words[1]), "script")
        count = int(words[2])
        keys = words[3 : 3 + count]
        args = [a if len(a) < 40 else a[:12] + "..." for a in words[3 + count :]]
        return f"{words[0].upper()} {which} {keys[0] if keys else ''} {' '.join(args)}"
    return " ".join(w if len(w) < 60 else w[:20] + "..." for w in words)


def _short(reply: Any) -> str:
    text = repr(reply)
    return text if len(text) < 120 else text[:117] + "..."


class Conn:
    """One TCP connection of a client to the server (FIFO both ways)."""

    def __init__(self, client: Client, server: Server, net: Net) -> None:
        self.client = client
        self.server = server
        self.net = net
        self.broken = False
        self.epoch = server.epoch
        self.timeout = 5.0
        self.default_timeout = 5.0
        self._last_arrival = 0.0
        self._last_reply = 0.0
        self.replies: deque[Any] = deque()
        self.waiter: greenlet.greenlet | None = None
        self._pending = 0
        server.conns.append(self)

    def send(self, commands: list[tuple[Any, ...]]) -> None:
        """Send ``commands`` (one request message: a pipeline); raises ConnectionError if
        the connection is reset before it leaves (the server restarted)."""
        client, sim = self.client, self.client.sim
        if self.broken or self.epoch != self.server.epoch or not self.server.up():
            self.broken = True
            raise rex.ConnectionError("Connection reset by peer (simulated)")
        client.requests += 1
        number = client.requests
        fault = self.net.faults.get((client.index, number))
        self._pending += len(commands)
        kind, amount = fault if fault else ("", 0.0)
        if fault:
            sim.say(client.name, f"request #{number}: fault {kind} {amount or ''}")
        if kind == "reset_before":
            self.broken = True
            self._pending = 0
            raise rex.ConnectionError("Connection reset by peer (simulated, before sending)")
        arrival = sim.now + self.net.delay() + (amount if kind == "delay_request" else 0.0)
        arrival = max(arrival, self._last_arrival)
        self._last_arrival = arrival
        lost = kind == "drop_request" or self.net.cut(client, sim.now)
        if lost:
            sim.say(client.name, f"request #{number} lost")
            return
        reply_fault = kind if kind in ("drop_reply", "reset_after", "delay_reply") else ""
        sim.at(arrival, lambda: self._arrive(commands, reply_fault, amount, number))

    def _arrive(self, commands: list[tuple[Any, ...]], fault: str, amount: float, n: int) -> None:
        server = self.server
        if self.epoch != server.epoch or not server.up():
            return  # the connection died with the server
        for command in commands:
            if str(command[0]).upper() == "BLPOP":
                reply = server.blpop(self, list(command[1:-1]), float(command[-1]), self.epoch)
                if reply is _BLOCKED:
                    self._reply_fault = (fault, amount, n)
                    continue
            else:
                if self.client.dead:  # a killed process's request still on the network
                    self.client.sim.posthumous.add(self.client.name)
                reply = server.execute(self, command)
            self._send_reply(reply, fault, amount, n)

    def server_reply(self, reply: Any) -> None:
        """A blocked command's reply (BLPOP served or timed out)."""
        fault, amount, n = getattr(self, "_reply_fault", ("", 0.0, 0))
        self._send_reply(reply, fault, amount, n)

    def _send_reply(self, reply: Any, fault: str, amount: float, n: int) -> None:
        sim, client = self.client.sim, self.client
        if fault == "drop_reply" or self.net.cut(client, sim.now):
            sim.say(client.name, f"reply to #{n} lost")
            return
        if fault == "reset_after":
            sim.say(client.name, f"connection reset after #{n} was applied")
            sim.at(sim.now + self.net.delay(), self._reset)
            return
        arrival = sim.now + self.net.delay() + (amount if fault == "delay_reply" else 0.0)
        arrival = max(arrival, self._last_reply)
        self._last_reply = arrival
        sim.at(arrival, lambda: self._deliver(reply))

    def _deliver(self, reply: Any) -> None:
        if self.broken:
            return
        self.replies.append(reply)
        self.client.wake(self)

    def _reset(self) -> None:
        self.broken = True
        self.client.wake(self)

    def _readable(self) -> bool:
        return bool(self.replies) or self.broken or self.epoch != self.server.epoch

    def read(self) -> Any:
        """The next reply, waiting at most the socket timeout (on the client's clock)."""
        client = self.client
        if not self.replies:
            ready = client.wait(self, self._readable, self.timeout)
            if not self.replies:
                self.broken = True  # (after a timeout redis-py disconnects: no late reply)
                self.server.drop_blocked(self)
                if ready:
                    raise rex.ConnectionError("Connection reset by peer (simulated)")
                client.sim.say(client.name, "socket timeout")
                raise rex.TimeoutError("Timeout reading from socket (simulated)")
        self._pending -= 1
        return self.replies.popleft()


# -- the redis-py stand-in ------------------------------------------------------------


def _to_py(reply: Any) -> Any:
    """A model reply as redis-py (bytes, no decoding) hands it over."""
    if isinstance(reply, Status):
        return str(reply).encode()
    if isinstance(reply, str):
        return reply.encode()
    if isinstance(reply, list):
        return [_to_py(x) for x in reply]
    if isinstance(reply, ReplyError):
        return BaseParser.parse_error(reply.message)
    return reply


class SimPool:
    """``connection_pool`` for ``_send_bounded``: hands out raw connections."""

    def __init__(self, owner: SimRedis) -> None:
        self.owner = owner

    def get_connection(self, *args: Any) -> SimConnection:
        return SimConnection(self.owner._connect())

    def release(self, connection: Any) -> None:
        pass


class SimConnection:
    """A redis-py ``Connection`` look-alike over one :class:`Conn`.

    It carries commands, not bytes: its encoder names no encoding hiredis packs, so
    the backend's packer (``redis_clients._pack``) hands them to :meth:`pack_commands`.
    """

    encoder = SimpleNamespace(encoding="simulated", encoding_errors="strict")

    def __init__(self, conn: Conn) -> None:
        self.conn = conn
        self.socket_timeout = conn.default_timeout

    def update_current_socket_timeout(self, timeout: float) -> None:
        self.conn.timeout = self.conn.default_timeout if timeout == -1 else timeout

    def pack_commands(self, commands: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        return list(commands)

    def send_packed_command(self, commands: list[tuple[Any, ...]]) -> None:
        self.conn.send(commands)

    def read_response(self) -> Any:
        reply = _to_py(self.conn.read())
        if isinstance(reply, rex.ResponseError):
            try:
                raise reply
            finally:
                del reply  # (see execute_command)
        return reply

    def disconnect(self) -> None:
        self.conn.broken = True


class SimPipeline:
    def __init__(self, owner: SimRedis) -> None:
        self.owner = owner
        self.commands: list[tuple[Any, ...]] = []

    def execute_command(self, *args: Any) -> SimPipeline:
        self.commands.append(args)
        return self

    def hgetall(self, key: str) -> SimPipeline:
        return self.execute_command("HGETALL", key)

    def pttl(self, key: str) -> SimPipeline:
        return self.execute_command("PTTL", key)

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        replies = self.owner._roundtrip(self.commands)
        out = []
        for command, reply in zip(self.commands, replies, strict=True):
            if isinstance(reply, rex.ResponseError) and raise_on_error:
                raise reply
            out.append(_callback(command, reply))
        return out


def _callback(command: tuple[Any, ...], reply: Any) -> Any:
    """redis-py's response callbacks, for the commands the backend reads."""
    name = str(command[0]).upper()
    if name == "HGETALL" and isinstance(reply, list):
        return dict(zip(reply[::2], reply[1::2], strict=True))
    return reply


class SimRedis:
    """What ``RedisBackend`` uses of ``redis.Redis``, over the simulated network.

    A pool of connections per client: a call takes an idle one (or opens one), so the
    lane's renewal and the main greenlet's release travel on different connections and
    can overtake each other, as on a real pool.
    """

    def __init__(self, client: Client, server: Server, net: Net, socket_timeout: float) -> None:
        self.client = client
        self.server = server
        self.net = net
        self.socket_timeout = socket_timeout
        self._idle: list[Conn] = []
        self.connection_pool = SimPool(self)

    def _connect(self) -> Conn:
        while self._idle:
            conn = self._idle.pop()
            if not conn.broken and conn.epoch == self.server.epoch:
                return conn
        if not self.server.up():
            raise rex.ConnectionError("Error 111 connecting: Connection refused (simulated)")
        conn = Conn(self.client, self.server, self.net)
        conn.timeout = conn.default_timeout = self.socket_timeout
        return conn

    def _attempt(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        conn = self._connect()
        conn.send(commands)
        replies = [_to_py(conn.read()) for _ in commands]
        self._idle.append(conn)
        return replies

    def _roundtrip(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send and read, with redis-py's one retry after a connection error."""
        try:
            return self._attempt(commands)
        except rex.ConnectionError:
            self.client.sim.say(self.client.name, "redis-py retries after a connection error")
            return self._attempt(commands)

    def execute_command(self, *args: Any) -> Any:
        (reply,) = self._roundtrip([args])
        if isinstance(reply, rex.ResponseError):
            try:
                raise reply
            finally:
                # A frame of its own traceback holding the error is a reference cycle:
                # garbage for the collector (a NOSCRIPT is raised in most runs).
                del reply
        return _callback(args, reply)

    def evalsha(self, sha: str, numkeys: int, *rest: Any) -> Any:
        return self.execute_command("EVALSHA", sha, numkeys, *rest)

    def eval(self, source: str, numkeys: int, *rest: Any) -> Any:
        return self.execute_command("EVAL", source, numkeys, *rest)

    def pipeline(self, transaction: bool = False) -> SimPipeline:
        return SimPipeline(self)

    def blpop(self, keys: list[str], timeout: float) -> Any:
        # redis-py's socket timeout stays the pool's; the backend keeps the block shorter.
        return self.execute_command("BLPOP", *keys, timeout)

    def lpop(self, key: str) -> Any:
        return self.execute_command("LPOP", key)

    def hgetall(self, key: str) -> Any:
        return self.execute_command("HGETALL", key)

    def pttl(self, key: str) -> Any:
        return self.execute_command("PTTL", key)

    def scan_iter(self, match: str = "*", count: int = 0, _type: str | None = None) -> Any:
        args: list[Any] = ["SCAN", 0, "MATCH", match]
        if _type:
            args += ["TYPE", _type]
        _, keys = self.execute_command(*args)
        return iter(keys)

    def close(self) -> None:
        self._idle.clear()
