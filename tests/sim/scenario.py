"""Seeded schedules of the real lock code, a Jepsen-style checker, replay and shrinking.

``generate(seed)`` derives everything from ``random.Random(seed)``: the protocol (Redis
with the client or the server hand-off), the clients' programs (acquire with a TTL and
a timeout, hold while writing to a fenced register, maybe ``renew(ttl=...)``, release),
message delays, and the faults (a request or reply lost, delayed, or its connection reset
before or after the server applied it, which makes redis-py resend it; partitions; client
pauses; clients killed; monotonic clock rates and forward jumps; wall clock jumps; the
server's clock stepped back; a restart without persistence; a Sentinel failover to a
replica that lags; operator force releases; a lane renewal lost, or delayed past its
timeout, and then the holder's ``renew(ttl=LONGER)`` sent as soon as it failed).

``run(scenario)`` plays it in the simulated world (:mod:`tests.sim.world`) and checks
after every step:

- *lease agrees with server*: a lease that says ``held`` has its token on the server,
  with a server expiry no earlier than the lease's local deadline;
- *exclusion*: never two clients whose leases of one name both say ``held``;
- *fences*: each grant's fence is above the previous grant's for that name; the fenced
  register never accepts a write of an older grant after a newer one's;
- *reports*: a release that returned normally removed its token on the server (by this
  client's call), one that raised ``NotOwned`` did not; a force release that said "freed"
  freed the holder the operator saw, one that said "changed hands" freed nothing;
- *expiry*: no key without a TTL;
- *renewal*: a lease at its local deadline had a renewal tried in the last 2/3 of its TTL
  (unless the lane's call for it still waits for its answer), and no lease is renewed
  back to back;
- *liveness* (schedules without faults): a lock that became free while clients waited
  for it is taken within a wake-up bound, and no waiter gives up on a lock that was free
  longer than that during its wait.

Leases the server lost for documented reasons are exempt from the first two: a restart
without persistence or a failover (README: Redis breaks there), and an operator's force
release of that token (the fenced register
still guards those). Faults kept out of every schedule, because the README's safety
table assumes they do not happen: a server clock stepped forward, a client monotonic
clock running slow, and a backward server clock step together with a restart or a
failover (the fence counter is lost, and the clock went back).

``shrink(scenario)`` removes faults greedily while the run still fails; ``story``
replays a scenario with every client and server step written out with its time.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import logging
import random
import sys
import threading
import time as real_time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import greenlet

from task_locks.backends.redis import RedisBackend
from task_locks.backends.redis_scripts import record_fields
from task_locks.election import Election
from task_locks.election import lock_name as election_lock_name
from task_locks.errors import BackendUnavailable, LockError, LockHeld, LockLost, NotOwned
from task_locks.lock import Lock
from task_locks.semaphore import Semaphore
from task_locks.types import slot_name

from . import redlock_world
from .world import Client, Net, Patches, Server, Sim, SimRedis, Violation, leasing_module

#: redis / redis-handoff: ``Lock`` with the client hand-off (``?handoff=client``) / the
#: server hand-off (the default); redis-mixed: both on one name (odd clients on the
#: client hand-off's URL: their releases leave tombstones with the
#: server hand-off's waiters still queued); semaphore:
#: ``Semaphore`` (its slots are locks); election: ``Election`` (its term is a fence);
#: etcd: ``Lock`` on the etcd backend over the etcd model (:mod:`tests.sim.etcd_world`);
#: redlock: ``Lock`` on Redlock over 3 or 5 modelled masters (:mod:`tests.sim.redlock_world`).
#: sql: ``Lock`` on ``django://`` over the PostgreSQL model (:mod:`tests.sim.sql_world`),
#: sql-semaphore and sql-election: ``Semaphore`` and ``Election`` there.
PROTOCOLS = (
    "redis", "redis-handoff", "semaphore", "election", "redis-mixed", "etcd", "redlock",
    "sql", "sql-semaphore", "sql-election", "celery", "celery-both",
)  # fmt: skip
#: The front end of a protocol on another backend (else the protocol's name is its own).
FRONT_ENDS = {"sql-semaphore": "semaphore", "sql-election": "election"}
#: celery, celery-both: singleton tasks on a modelled broker (:mod:`tests.sim.celery_world`).
CELERY = ("celery", "celery-both")
NAMES = ("job", "report")
SEMAPHORE = "pool"
ELECTION = "leader"
#: Free time at the server a waiter may sleep through before it must have the lock:
#: the longest pause (the unknown-TTL poll), a server tick, and round trips.
LIVENESS_SLACK = 0.75
#: How long a run goes on after the last program ended (leases left held stay checked).
TAIL = 1.0


@dataclass(frozen=True)
class Fault:
    kind: str
    client: int = 0
    at: float = 0.0
    amount: float = 0.0
    detail: str = ""

    def describe(self) -> str:
        who = "operator" if self.client < 0 else f"client{self.client}"
        if self.kind == "lose_renew":
            return f"{who}'s renew() call: {self.detail}"
        if self.kind == "lose_lane":
            return (
                f"{who}'s first lane renewal from {self.at * 1000:.0f} ms on: {self.detail} "
                f"{self.amount or ''}"
            ).strip()
        if self.kind == "late_lane":
            return (
                f"{who}'s lane renewal just before its renew(ttl=...): {self.detail} "
                f"{self.amount:g}; the renew() right after that renewal failed"
            )
        if self.kind == "msg":
            return f"{who}'s request #{int(self.at)}: {self.detail} {self.amount or ''}".strip()
        if self.kind in ("restart", "failover", "clock_step"):
            return f"server {self.kind} at {self.at * 1000:.0f} ms ({self.amount:g})"
        return f"{who} {self.kind} at {self.at * 1000:.0f} ms ({self.amount:g}) {self.detail}"


@dataclass(frozen=True)
class Iteration:
    name: str
    ttl: float
    timeout: float
    hold: float
    writes: int
    renew_at: float | None  # fraction of the hold, or None
    renew_ttl: float | None
    release: bool
    #: Seconds its ``on_lost`` callback takes (an alert over HTTP...); 0: none.
    on_lost: float = 0.0


@dataclass(frozen=True)
class Scenario:
    seed: int
    protocol: str
    programs: tuple[tuple[Iteration, ...], ...]
    rates: tuple[float, ...]
    faults: tuple[Fault, ...]
    delay: tuple[float, float]
    socket_timeout: float
    limit: int = 1
    #: Redlock: each master's clock rate (one per master).
    masters: tuple[float, ...] = ()
    #: celery protocols: the task's options, broker and workers (``celery_world``)
    celery: Any = None

    @property
    def lock_names(self) -> tuple[str, ...]:
        """The names of the locks the front end takes (a semaphore's slots...)."""
        return lock_names(self.protocol, self.limit)

    @property
    def fair(self) -> bool:
        return not self.faults


#: Schedules call ``renew(ttl=...)`` with this set (``generate(renew_ttl=False)`` turns it
#: off for one call). Its findings: the longer-TTL race (fixed in the lease); a lease rightly
#: lost behind a ``renew(ttl=0.1)`` slower than its TTL, which the checker's renewal rule
#: counted as "no renewal tried" while the lane's call waited for its answer (the rule's
#: fix); a ``renew()`` whose reply was lost keeping the next renewal due, so the lane
#: renewed back to back (fixed in the lease's schedule).
RENEW_WITH_TTL = True
#: Schedules give leases slow ``on_lost`` callbacks with this set (the shrunk finding of a
#: callback run on the lane passes in ``test_simulation.py``).
SLOW_ON_LOST = True


def front(protocol: str) -> str:
    return FRONT_ENDS.get(protocol, protocol)


def lock_names(protocol: str, limit: int) -> tuple[str, ...]:
    if protocol in CELERY:
        from .celery_world import celery_lock_names

        return celery_lock_names(limit)
    if front(protocol) == "semaphore":
        return tuple(slot_name(SEMAPHORE, i) for i in range(limit))
    if front(protocol) == "election":
        return (election_lock_name(ELECTION),)
    return NAMES


def generate(
    seed: int,
    protocol: str | None = None,
    renew_ttl: bool | None = None,
    slow_on_lost: bool | None = None,
) -> Scenario:
    rng = random.Random(seed)
    with_ttl = RENEW_WITH_TTL if renew_ttl is None else renew_ttl
    slow = SLOW_ON_LOST if slow_on_lost is None else slow_on_lost
    protocol = protocol or PROTOCOLS[seed % len(PROTOCOLS)]
    if protocol in CELERY:
        from .celery_world import generate as generate_celery

        return generate_celery(seed, protocol)  # type: ignore[no-any-return]
    clients = rng.choice((2, 2, 3, 3, 4))
    limit = rng.choice((1, 2, 3)) if front(protocol) == "semaphore" else 1
    if front(protocol) == "semaphore":
        names: tuple[str, ...] = (SEMAPHORE,)
    elif front(protocol) == "election":
        names = (ELECTION,)
    else:
        names = NAMES[: rng.choice((1, 1, 2))]
    programs = []
    for _ in range(clients):
        program = []
        for _ in range(rng.choice((1, 2, 2, 3))):
            ttl = rng.choice((0.3, 0.5, 1.0, 2.0))
            renew = rng.random() < 0.3
            program.append(
                Iteration(
                    name=rng.choice(names),
                    ttl=ttl,
                    timeout=rng.choice((0.0, 0.2, 1.0, 3.0, 6.0)),
                    hold=rng.choice((0.0, 0.05, 0.3, 1.0)) * ttl * rng.choice((1, 2, 4)),
                    writes=rng.choice((0, 1, 3)),
                    renew_at=rng.random() if renew else None,
                    # whole milliseconds: see KNOWN_FINDINGS (a TTL is sent truncated to ms)
                    renew_ttl=_renew_ttl(rng, ttl) if renew and with_ttl else None,
                    release=rng.random() < 0.9,
                    on_lost=rng.choice((0.0, 0.5, 3.0)) if slow else 0.0,
                )
            )
        programs.append(tuple(program))
    rates = tuple(1.0 + rng.choice((0.0, 0.0, 1e-4, 1e-3)) for _ in range(clients))
    faults: list[Fault] = []
    horizon = 3.0
    if rng.random() < 0.8:
        for _ in range(rng.choice((1, 2, 3, 5))):
            faults.append(_fault(rng, clients, lock_names(protocol, limit), horizon))
    for who, program in enumerate(programs):  # a renew() whose request is lost
        if any(step.renew_at is not None for step in program) and rng.random() < 0.3:
            faults.append(
                Fault("lose_renew", who, 0.0, 0.0, rng.choice(("drop_request", "drop_reply")))
            )
    # A lane renewal lost on its way (or its reply), for clients that take one lease after
    # another: the lane must not wait for it before renewing the next (drawn from a stream
    # of its own, so the rest of each schedule is what it was before this fault existed).
    # Only in schedules with faults already: fair ones (liveness is checked there) stay.
    lanes = random.Random(seed * 104_729 + 17)
    for who, program in enumerate(programs):
        extends = any(step.renew_ttl is not None for step in program)
        if faults and (len(program) > 1 or extends) and lanes.random() < 0.4:
            # (a request delayed past the socket timeout still lands, after later calls)
            detail = lanes.choice(("drop_request", "drop_reply", "delay_request"))
            amount = lanes.choice((1.0, 3.0)) if detail == "delay_request" else 0.0
            faults.append(Fault("lose_lane", who, lanes.random() * horizon, amount, detail))
    # A lane renewal delayed past its timeout, and the holder's renew(ttl=LONGER) sent
    # as soon as that renewal failed: the late request lands after the extension and
    # cuts the server's expiry back (the long run's seed 44632 met this by chance, once in
    # tens of thousands of schedules). Its own stream again: the rest stays as it was.
    late = random.Random(seed * 130_363 + 29)
    for who, plan in enumerate(programs):
        longer = any(s.renew_ttl is not None and s.renew_ttl > s.ttl for s in plan)
        if faults and longer and late.random() < 0.5:
            faults.append(
                Fault("late_lane", who, 0.0, late.choice((0.5, 1.0, 3.0)), "delay_request")
            )
    kinds = {f.kind for f in faults}
    if kinds & {"restart", "failover"} and "clock_step" in kinds:  # see the module docstring
        faults = [f for f in faults if f.kind != "clock_step"]
    delay = rng.choice(((0.0001, 0.001), (0.0005, 0.005), (0.001, 0.05)))
    scenario = Scenario(
        seed=seed,
        protocol=protocol,
        programs=tuple(programs),
        rates=rates,
        faults=tuple(faults),
        delay=delay,
        socket_timeout=rng.choice((0.5, 1.0, 5.0)),
        limit=limit,
    )
    return redlock_world.adapt(scenario) if protocol == "redlock" else scenario


def _renew_ttl(rng: random.Random, ttl: float) -> float | None:
    # Whole milliseconds: a TTL is sent truncated to ms while the lease counts with the
    # float (a finding: ttl=0.3/3 is sent as 99 ms and counted as 99.99 ms).
    return rng.choice((None, round(ttl / 3, 3), round(ttl * 3, 3)))


def _fault(rng: random.Random, clients: int, names: tuple[str, ...], horizon: float) -> Fault:
    kind = rng.choice(
        ("msg", "msg", "msg", "msg", "pause", "partition", "kill", "jump", "wall_jump",
         "restart", "failover", "clock_step", "force", "force")
    )  # fmt: skip
    client = rng.randrange(clients)
    at = rng.random() * horizon
    if kind == "msg":
        detail = rng.choice(
            ("drop_request", "drop_reply", "reset_before", "reset_after", "delay_request",
             "delay_reply")
        )  # fmt: skip
        amount = rng.choice((0.05, 0.3, 1.0, 3.0)) if detail.startswith("delay") else 0.0
        return Fault("msg", client, float(rng.randrange(1, 30)), amount, detail)
    if kind in ("pause", "partition"):
        return Fault(kind, client, at, rng.choice((0.05, 0.3, 1.0, 2.5)))
    if kind == "jump":
        return Fault(kind, client, at, rng.choice((0.1, 1.0, 5.0)))
    if kind == "wall_jump":
        return Fault(kind, client, at, rng.choice((-30.0, -1.0, 1.0, 30.0)))
    if kind == "restart":
        return Fault(kind, 0, at, rng.choice((0.0, 0.1, 1.0)))
    if kind == "failover":  # the replica's replication lag
        return Fault(kind, 0, at, rng.choice((0.0, 0.01, 0.1, 0.5)))
    if kind == "clock_step":
        return Fault(kind, 0, at, -rng.choice((0.001, 0.5, 5.0)))
    if kind == "force":  # an operator forcing the name free, once or again and again
        return Fault(kind, -1, at, rng.choice((1.0, 3.0, 10.0, 30.0)), rng.choice(names))
    return Fault(kind, client, at)


# -- the run ---------------------------------------------------------------------------


@dataclass
class Grant:
    name: str
    token: str
    fence: int
    order: int
    epoch: int


@dataclass
class Held:
    client: Client
    lease: Any
    grant_epoch: int
    #: Its grant was popped after an operator had force-released it: a lease handed out
    #: for a lock already taken back must never say held (no exemption for it).
    forced_before: bool = False


@dataclass
class Outcome:
    violation: str | None
    steps: int
    story: list[str] = field(default_factory=list)


class LateLane:
    """A "late_lane" fault at work. Armed by its holder at its ``renew(ttl=...)``, it
    delays the request of the lane's next renewal of that lease; the holder waits (at
    most two TTLs) until that call has its answer (a timeout), then renews."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault
        self.lease: Any = None  # armed: the holder's lease
        self.client: Any = None
        self.next_call = False  # the lane is sending a renewal of it
        self.applied = False  # that call's request carries the fault
        self.done = False  # and the call has its answer
        self.waiter: greenlet.greenlet | None = None

    def ready(self) -> bool:
        return self.done


def _among(lease: Any, leases: list[Any]) -> bool:
    return any(x is lease for x in leases)


class Checker:
    def __init__(self, sim: Sim, server: Server, backend: RedisBackend, scenario: Scenario) -> None:
        self.sim = sim
        self.server = server
        self.backend = backend
        self.fair = scenario.fair
        names = scenario.lock_names
        self.limit = scenario.limit if front(scenario.protocol) == "semaphore" else len(names)
        names = scenario.lock_names
        self.keys = {name: backend._key(name) for name in names}
        self.current: dict[str, str | None] = dict.fromkeys(names)
        self.current_fence: dict[str, str | None] = {}
        self.terms: dict[tuple[str, int], str] = {}  # (name, term) -> the one it made leader
        self.grants: dict[tuple[str, str], Grant] = {}
        self.last_fence: dict[str, int] = {}
        self.order = 0
        #: (token, fence) -> who removed that grant (a client's name, "expiry"): by grant,
        #: not token, since a retried acquire may take the lock again with its token
        self.removed_by: dict[tuple[str, int], str] = {}
        #: a grant taken over under a new token with its fence -> the grant it became
        self.passed_on: dict[tuple[str, int], tuple[str, int]] = {}
        self.forced: set[str] = set()
        self.stale: set[str] = set()
        self.releasing: set[str] = set()
        self.expiry: dict[str, float | None] = {}  # the holder's server expiry (sim time)
        self.finished: Callable[[Client], None] = lambda client: None
        #: Per lease, by name and token (not ``id``: a lease its holder dropped is freed,
        #: and a later one at its address would inherit its entries).
        self.renewed_at: dict[tuple[str, str], float] = {}
        #: lease -> the renewal lane's calls carrying it that wait for an answer
        self.lane_calls: dict[tuple[str, str], int] = {}
        #: lease -> its last lane renewal's send; a lane -> its calls back to back
        self.lane_last: dict[tuple[str, str], float] = {}
        self.lane_streak: dict[int, int] = {}
        self._parsed: dict[str, dict[str, str]] = {}
        #: client index -> how its next explicit renew() is lost (fault "lose_renew")
        self.lose_renew: dict[int, str] = {}
        #: client index -> the fault "lose_lane" planned for its next lane renewal
        self.lose_lane: dict[int, Fault] = {}
        #: client index -> its "late_lane" fault
        self.late_lane: dict[int, LateLane] = {}
        self.net: Net | None = None
        self.granted_at: dict[tuple[str, str], float] = {}
        #: Clients paused, killed or whose clock jumped: their renewals may lapse.
        self.unsteady = {f.client for f in scenario.faults if f.kind in ("pause", "kill", "jump")}
        self.leases: list[Held] = []
        self.register = names[0]  # the fenced register guards the first name
        self.register_fence = -1
        self.register_order = -1
        # held intervals per name, for liveness: [start, end]
        self.held_since: dict[str, float | None] = dict.fromkeys(names)
        self.free_since: dict[str, float] = dict.fromkeys(names, 0.0)
        self.free_windows: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        #: name -> the clients inside an acquire of it, and since when
        self.waiting: dict[str, dict[Client, float]] = {n: {} for n in names}

    def fail(self, text: str) -> None:
        raise Violation(f"at {self.sim.now * 1000:.3f} ms: {text}")

    # after every server command ---------------------------------------------------------
    def observe(self, conn: Any, command: tuple[Any, ...]) -> None:
        model = self.server.model
        who = "restart" if conn is None else conn.client.name
        if command[0] == "CLOCK":
            for name, key in self.keys.items():
                if self.current[name] is not None:
                    self.expiry[name] = self._expiry_sim(key)
            return
        if command[0] == "FAILOVER":  # the replica's holders: old grants, not new ones
            for name, key in self.keys.items():
                fields = record_fields(model.get_value(key)) or {}
                token = fields.get("token")
                self.current[name] = token
                self.current_fence[name] = fields.get("fence") if token is not None else None
                self.expiry[name] = self._expiry_sim(key) if token is not None else None
                if token is not None:  # held again (on the promoted replica)
                    self.removed_by.pop((token, int(fields["fence"])), None)
                    # nor passed on (a Celery take-over the replica had not seen: seed 124547)
                    self.passed_on.pop((token, int(fields["fence"])), None)
                    self.forced.discard(token)
                    # an old grant (of the epoch before): a lease from it is exempt
                    fence = int(fields["fence"])
                    self.grants[(name, token)] = Grant(
                        name, token, fence, self.order, self.server.epoch - 1
                    )
            return
        if str(command[0]).upper() in ("LPOP", "BLPOP") and ":grant:" in str(command[1]):
            token = str(command[1]).rsplit(":grant:", 1)[1]
            if token in self.forced:  # a grant popped after its lock was taken back
                self.stale.add(token)
        for name, key in self.keys.items():
            fields = self._fields(model.get_value(key))
            token = fields.get("token")
            self.track(name, token, fields.get("fence") if token is not None else None, who)
            self._counted(key)
        if not model.data.keys() <= model.expires.keys():
            for key in model.data:
                if key not in model.expires:
                    self.fail(f"key {key!r} has no expiry")

    def track(self, name: str, token: str | None, fence_text: str | None, who: str) -> None:
        """The server's holder of ``name`` is now ``token`` (fence ``fence_text``): note a
        new grant (its fence above the last), and who removed the one before."""
        key = self.keys[name]
        before = self.current[name]
        before_fence = self.current_fence.get(name)
        # The same token with a new fence is a new grant (its first one expired).
        if token == before and fence_text == self.current_fence.get(name):
            if token is not None:
                self.expiry[name] = self._expiry_sim(key)
            return
        self.current[name] = token
        self.current_fence[name] = fence_text
        # A Celery run taking its publish-time lock over in one server step (the run
        # check) keeps that lock's fence under the run's own token: one grant, passed on.
        taken_over = before is not None and token is not None and before_fence == fence_text
        if taken_over:
            self.passed_on[(before, int(before_fence or 0))] = (token, int(fence_text or 0))
        elif before is not None:
            expiry = self.expiry.get(name)
            expired = expiry is not None and expiry <= self.sim.now
            if before_fence is not None:
                self.removed_by.setdefault(
                    (before, int(before_fence)), "expiry" if expired else who
                )
            if who.startswith("operator"):
                self.forced.add(before)
            self._free(name, expiry if expired else None)
        if token is not None:
            fence = int(fence_text or 0)
            last = self.last_fence.get(name)
            # A restart that brings a grant back as it was (etcd renews every lease when a
            # leader is promoted, one that expired meanwhile too: seed 485681) grants
            # nothing new.
            grant = self.grants.get((name, token))
            back = who == "restart" and grant is not None and grant.fence == fence
            if last is not None and fence <= last and not taken_over and not back:
                self.fail(f"{name!r}: fence {fence} granted after fence {last}")
            self.last_fence[name] = fence
            self.order += 1
            self.forced.discard(token)
            self.stale.discard(token)
            self.grants[(name, token)] = Grant(name, token, fence, self.order, self.server.epoch)
            self.expiry[name] = self._expiry_sim(key)
            self._taken(name)

    def _fields(self, value: Any) -> dict[str, str]:
        """``record_fields`` of a lock's value, remembered (most commands leave it as it
        was, and the checker reads it after each one)."""
        if type(value) is not str:
            return record_fields(value) or {}
        fields = self._parsed.get(value)
        if fields is None:
            if len(self._parsed) > 256:
                self._parsed.clear()
            fields = self._parsed[value] = record_fields(value) or {}
        return fields

    def _free(self, name: str, since: float | None = None) -> None:
        self.held_since[name] = None
        self.free_since[name] = self.sim.now if since is None else since

    def _taken(self, name: str) -> None:
        start = self.free_since[name]
        self.free_windows[name].append((start, self.sim.now))
        self.held_since[name] = self.sim.now
        self._starved(name)

    def _starved(self, name: str) -> None:
        """Fair schedules: a lock that became free while clients waited for it is taken
        within :data:`LIVENESS_SLACK` (by one of them, or anyone)."""
        if not self.fair:
            return
        since = self.free_since[name]
        # the clients that have been waiting since before it became free, still waiting
        waited = [c for c, began in self.waiting[name].items() if began <= since]
        free = self.sim.now - since
        if waited and free > LIVENESS_SLACK:
            who = ", ".join(sorted(c.name for c in waited))
            self.fail(f"{name!r} was free for {free * 1000:.0f} ms while {who} waited for it")

    def waits(self, client: Client, names: tuple[str, ...], waiting: bool) -> None:
        for name in names:
            if waiting:
                self.waiting[name][client] = self.sim.now
            else:
                self.waiting[name].pop(client, None)

    def _alive(self, key: Any) -> bool:
        return bool(self.server.model._alive(key))

    def _counted(self, key: str) -> None:
        """A lock's record (held or a tombstone) counts at least its live server hand-off
        waiters: its taker drops no place in line of its own when it counts none, and one
        left would be granted the lock later, with nobody to pop the grant."""
        model = self.server.model
        data, expires, now = model.data, model.expires, model.now_ms()

        def live(k: str) -> bool:  # as the model's _alive, without deleting what expired
            when = expires.get(k)
            return k in data and (when is None or now <= when)

        queue = key + ":queue"
        if not live(queue) or not live(key) or type(data[key]) is not str:
            return
        raw = data[key]
        waiters = raw[1:].split("|", 1)[0] if raw[:1] == "r" else self._fields(raw).get("waiters")
        queued = [member for member in data[queue] if live(f"{key}:wait:{member}")]
        if len(queued) > int(waiters or 0):
            self.fail(
                f"{key!r} counts {waiters} waiters, but {len(queued)} are queued: "
                + ", ".join(sorted(queued))
            )

    def _expiry_sim(self, key: Any) -> float | None:
        when = self.server.model.expires.get(key)
        if when is None:
            return None
        # Gone once the server's millisecond clock passes ``when``: at when + 1 ms.
        return ((when + 1) * 1000 - 1_700_000_000_000_000 - self.server.clock_offset_us) / 1e6

    # after every step ------------------------------------------------------------------
    def step(self) -> None:
        if self.fair:
            waiting = self.waiting
            for name, since in self.held_since.items():
                if since is None and waiting[name]:
                    self._starved(name)
        leases = self.leases
        if not leases:
            return
        # lazily expired keys: let the checker see expiry as Redis would at this moment
        current = self.current
        for name, key in self.keys.items():
            token = current[name]
            if token is not None and not self._alive(key):
                current[name] = None
                fence_text = self.current_fence.get(name)
                if fence_text is not None:
                    self.removed_by.setdefault((token, int(fence_text)), "expiry")
                self._free(name)
        holders: dict[str, Held] = {}
        sim = self.sim
        epoch = self.server.epoch
        done = False
        for held in leases:
            client = held.client
            lease = held.lease
            if client.dead or lease._released or lease.lost._set:
                done = True  # never held again
                continue
            previous, sim.active = sim.active, client
            alive = lease.held
            sim.active = previous
            if not alive:
                continue
            token = lease.token
            if held.grant_epoch != epoch or (token in self.forced and not held.forced_before):
                continue  # lost by the server for a documented reason
            if token in self.releasing:
                continue  # its holder stopped acting on it when it called release()
            name = lease.name
            if current[name] != token:
                self.fail(
                    f"{client.name}'s lease of {name!r} (fence {lease.fence}) says held, but "
                    f"the server's holder is {self._who(name)}"
                )
            expiry = self._expiry_sim(self.keys[name])
            deadline = client.sim_time_of(lease._expires_mono)
            if expiry is not None and deadline > expiry + 1e-6:
                self.fail(
                    f"{client.name}'s lease of {name!r} counts until {deadline * 1000:.3f} ms, "
                    f"the server expires it at {expiry * 1000:.3f} ms"
                )
            if name in holders:
                other = holders[name]
                self.fail(f"two holders of {name!r}: {other.client.name} and {client.name}")
            holders[name] = held
        if len(holders) > self.limit:
            self.fail(f"{len(holders)} permits held at once, the limit is {self.limit}")
        if done:
            self.leases = [
                h for h in leases if not (h.client.dead or h.lease._released or h.lease.lost._set)
            ]

    def _who(self, name: str) -> str:
        token = self.current[name]
        if token is None:
            return "nobody"
        for held in self.leases:
            if held.lease.token == token:
                return f"{held.client.name} (fence {held.lease.fence})"
        return f"token {token[:8]}"

    # client reports ---------------------------------------------------------------------
    def granted(self, client: Client, lease: Any) -> None:
        grant = self.grants.get((lease.name, lease.token))
        epoch = grant.epoch if grant else -1
        if grant is None:
            self.fail(f"{client.name} got a lease of {lease.name!r} the server never granted")
        if grant.fence != lease.fence:
            self.fail(f"{client.name}'s lease has fence {lease.fence}, the grant {grant.fence}")
        leader = self.terms.setdefault((lease.name, lease.fence), client.name)
        if leader != client.name:
            self.fail(
                f"term {lease.fence} of {lease.name!r} has two leaders: {leader}, {client.name}"
            )
        self.leases.append(Held(client, lease, epoch, lease.token in self.stale))
        self.granted_at[(lease.name, lease.token)] = self.sim.now

    def write(self, client: Client, lease: Any) -> None:
        grant = self.grants[(lease.name, lease.token)]
        if lease.fence < self.register_fence:
            return  # refused: stale
        if grant.order < self.register_order and lease.name == self.register:
            self.fail(
                f"the fenced register accepted {client.name}'s write (fence {lease.fence}, "
                f"grant #{grant.order}) after grant #{self.register_order}'s"
            )
        if lease.name == self.register:
            self.register_fence, self.register_order = lease.fence, grant.order
        self.sim.say(client.name, f"writes the fenced register with fence {lease.fence}")

    def released(self, client: Client, lease: Any, ok: bool) -> None:
        grant = self.grants.get((lease.name, lease.token))
        if grant is not None and grant.epoch != self.server.epoch:
            return  # the server restarted since: its tombstone of the release is gone too
        if grant is not None and grant.fence != lease.fence:
            # The token was granted again after this lease's grant: a failover to a lagging
            # replica brought its old queue entry back, and a release handed the lock on to
            # it (seed 71019). The release removed that grant, which no lease knew of.
            return
        by = self.removed_by.get((lease.token, lease.fence))
        if by == "restart":
            return  # the server lost that grant (the token may hold a later one now)
        if ok and by != client.name and lease.token not in self.forced:
            self.fail(f"{client.name}'s release of {lease.name!r} said released; {by} removed it")
        if not ok and by == client.name:
            self.fail(f"{client.name}'s release of {lease.name!r} said not owned; it removed it")

    def forced_release(
        self, operator: Client, token: str, fence: int, ok: bool, epoch: int
    ) -> None:
        if epoch != self.server.epoch:
            return  # the server restarted during the call: its tombstone is gone too
        seen = (token, fence)
        while seen in self.passed_on:  # the grant it saw, as taken over since
            seen = self.passed_on[seen]
        by = self.removed_by.get(seen)
        if ok and by != operator.name:
            self.fail(
                f"{operator.name}'s force release said it freed the holder it saw; {by} removed it"
            )
        if not ok and by == operator.name:
            self.fail(
                f"{operator.name}'s force release said the lock changed hands, but it freed the holder"
            )

    # the renewal schedule -------------------------------------------------------------
    def renew_sent(self, leases: list[Any]) -> None:
        for lease in leases:
            self.renewed_at[(lease.name, lease.token)] = self.sim.now

    def lane_sent(self, leases: list[Any]) -> None:
        """A renewal lane's call: it waits for its answer (see :meth:`deadline`), and
        follows the schedule: a lane whose calls come three times in a row with every
        lease in them renewed again within a twentieth of its TTL (one extra call may
        follow a failure; a retry waits a tenth; a lease due soon rides along with a
        call) renews back to back, a storm of calls against the server."""
        self.renew_sent(leases)
        for late in self.late_lane.values():
            if late.lease is not None and not late.next_call and _among(late.lease, leases):
                late.next_call = True
        now = self.sim.now
        early = bool(leases)
        for lease in leases:
            key = (lease.name, lease.token)
            self.lane_calls[key] = self.lane_calls.get(key, 0) + 1
            early = early and now - self.lane_last.get(key, -1.0) < lease.ttl / 20
            self.lane_last[key] = now
        lane = id(leases[0].backend) if leases else 0
        streak = self.lane_streak.get(lane, 0) + 1 if early else 0
        self.lane_streak[lane] = streak
        if streak >= 3:
            names = ", ".join(sorted({repr(lease.name) for lease in leases}))
            self.fail(f"the lane renewed {names} {streak + 1} times back to back")

    def lane_call(self, client: Client) -> None:
        """A lane's call is about to go out: the fault "lose_lane" (or "late_lane") makes
        it its request."""
        late = self.late_lane.get(client.index)
        if late is not None and late.next_call and not late.applied and self.net is not None:
            late.applied = True
            fault = late.fault
            self.net.faults[(client.index, client.requests + 1)] = (fault.detail, fault.amount)
            return
        planned = self.lose_lane.get(client.index)
        if planned is not None and self.sim.now >= planned.at and self.net is not None:
            del self.lose_lane[client.index]
            self.net.faults[(client.index, client.requests + 1)] = (planned.detail, planned.amount)

    def lane_answered(self, leases: list[Any]) -> None:
        for lease in leases:
            self.lane_calls[(lease.name, lease.token)] -= 1
        for late in self.late_lane.values():
            if late.applied and not late.done and _among(late.lease, leases):
                late.done = True
                # (woken from the event loop, not from inside the lane's call)
                self.sim.at(self.sim.now, functools.partial(late.client.wake, late))

    def extend_after_a_late_renewal(self, client: Client, lease: Any, step: Iteration) -> None:
        """The fault "late_lane": before its ``renew(ttl=LONGER)``, the holder waits for
        the lane's next renewal of ``lease`` (its request delayed) to time out."""
        late = self.late_lane.get(client.index)
        if late is None or late.lease is not None or not (step.renew_ttl or 0) > step.ttl:
            return
        if not any(h.lease is lease for h in self.leases):
            return
        late.lease, late.client = lease, client
        self.sim.say(client.name, "waits for the lane's next renewal (its request delayed)")
        client.wait(late, late.ready, 2 * step.ttl)

    def deadline(self, client: Client, lease: Any) -> None:
        """A lease reached its local deadline: a renewal must have been tried in the last
        2/3 of its TTL (it is due every third), unless the client was stopped or its clock
        jumped (a failed ``renew(ttl=SHORTER)`` that left the next renewal on the old TTL's
        schedule was found this way).

        Not when the renewal lane's own call for this lease is still waiting for its
        answer: the lane tried, and the network is slower than what is left of the TTL
        (a ``renew(ttl=0.1)`` over 50 ms links, twice as long with a NOSCRIPT round
        trip). The lease must then be lost at its deadline, and it is. Its holder's own
        ``renew()`` in flight is no excuse: the lane must go on renewing beside it.
        """
        if client.index in self.unsteady or lease._released or lease.token in self.releasing:
            return  # (a lease being released is renewed no more)
        key = (lease.name, lease.token)
        if self.lane_calls.get(key, 0) > 0:
            return
        now, ttl = self.sim.now, lease.ttl
        last = self.renewed_at.get(key, self.granted_at.get(key, now))
        if last < now - 0.7 * ttl - 1e-6:
            self.fail(
                f"{client.name}'s lease of {lease.name!r} reached its deadline with no renewal "
                f"tried for {(now - last) * 1000:.0f} ms (TTL {ttl:g} s)"
            )

    def gave_up(self, client: Client, name: str, start: float) -> None:
        if not self.fair:
            return
        now = self.sim.now
        windows = list(self.free_windows[name])
        if self.held_since[name] is None:
            windows.append((self.free_since[name], now))
        for a, b in windows:
            free = min(b, now) - max(a, start)
            if free > LIVENESS_SLACK:
                self.fail(
                    f"{client.name} gave up on {name!r} although it was free for "
                    f"{free * 1000:.0f} ms of its wait"
                )


def _url(scenario: Scenario, client: int = 0) -> str:
    if scenario.protocol == "redlock":
        return redlock_world.url(scenario)
    if scenario.protocol.startswith("sql"):
        return f"django://sim?timeout={scenario.socket_timeout}&prefix=sim_"
    if scenario.protocol == "etcd":
        members = "sim-a:2379,sim-b:2379,sim-c:2379"  # three members, one store
        return f"etcd://{members}?timeout={scenario.socket_timeout}&prefix=sim/"
    # An election's lock goes through the server hand-off (its queue and grants); the
    # others name their mode, since the server hand-off is the default.
    handoff = scenario.protocol in ("redis-handoff", "election") or (
        scenario.protocol == "redis-mixed" and client % 2 == 0
    )
    hand = "&handoff=server" if handoff else "&handoff=client"
    return f"redis://sim:6379/0?socket_timeout={scenario.socket_timeout}{hand}"


_prototypes: dict[str, RedisBackend] = {}


def _backend(url: str, client: Client, server: Server, net: Net, timeout: float) -> RedisBackend:
    """A client's own ``RedisBackend`` for ``url`` over the simulated network.

    Copied from one made per URL (making a redis-py client reads package metadata, a
    large share of a short run), with its own riders and the simulated client."""
    if url.startswith("etcd"):
        from .etcd_world import etcd_backend

        return etcd_backend(url, client, server, net, timeout)  # type: ignore[arg-type]
    if url.startswith("redlock"):
        return redlock_world.redlock_backend(url, client, server, net, timeout)  # type: ignore[arg-type]
    if url.startswith("django"):
        from .sql_world import sql_backend

        return sql_backend(url, client, server, net, timeout)  # type: ignore[arg-type]
    prototype = _prototypes.get(url)
    if prototype is None:
        prototype = _prototypes[url] = RedisBackend(url)
    backend = copy.copy(prototype)
    backend._riders = []
    backend._riders_guard = threading.Lock()
    backend._client_guard = threading.Lock()
    backend._sync_client = SimRedis(client, server, net, timeout)
    return backend


_patches = Patches()


def run(scenario: Scenario, record: bool = False) -> Outcome:
    modules = len(sys.modules)
    outcome = _run_alone(scenario, record)
    if len(sys.modules) != modules:
        # A module imported during the run (the first etcd run imports its backend) read
        # the real clock there: the run again, as every later run of the seed goes.
        outcome = _run_alone(scenario, record)
    return outcome


def _run_alone(scenario: Scenario, record: bool) -> Outcome:
    """One run, shielded from what ran before it in the process."""
    sim = Sim(scenario.seed, record)
    # No cyclic collection during a run: the lane's queue holds leases weakly, so a
    # collection freeing a dropped lease mid-run (at a moment that depends on what ran
    # before in the process) changed what the run did, and a seed found in a long run
    # did not replay alone.
    collecting = gc.isenabled()
    gc.disable()
    _patches.install(sim)
    # The lock's warnings (late renewals, lost leases) are the story's, not the log's.
    logging.disable(logging.WARNING)
    try:
        return _run(sim, scenario)
    finally:
        logging.disable(logging.NOTSET)
        _patches.uninstall()
        if collecting:
            gc.enable()


def _run(sim: Sim, scenario: Scenario) -> Outcome:
    if scenario.protocol in CELERY:
        from .celery_world import run_celery

        return run_celery(sim, scenario)  # type: ignore[no-any-return]
    checker_class: type[Checker] = Checker
    if scenario.protocol == "etcd":
        from .etcd_world import EtcdSimServer, etcd_checker

        server: Any = EtcdSimServer(sim)
        checker_class = etcd_checker(Checker)
    elif scenario.protocol == "redlock":
        server = redlock_world.RedlockWorld(sim, scenario)
        checker_class = redlock_world.redlock_checker(Checker)
    elif scenario.protocol.startswith("sql"):
        from .sql_world import install, sql_checker

        server = install(sim, _patches)
        checker_class = sql_checker(Checker)
    else:
        server = Server(sim)
    net = Net(sim, scenario.delay)
    url = _url(scenario)
    clients = [Client(sim, i, rate) for i, rate in enumerate(scenario.rates)]
    operators = [Client(sim, -1 - i) for i in range(len(scenario.faults))]
    operator = operators[0] if operators else Client(sim, -1)
    probe = _backend(url, operator, server, net, 5.0)
    checker = checker_class(sim, server, probe, scenario)
    server.observe = checker.observe
    checker.net = net
    sim.on_renew, sim.on_deadline = checker.lane_sent, checker.deadline
    sim.on_renewed, sim.on_lane_call = checker.lane_answered, checker.lane_call
    violation: list[str] = []

    for fault, operator_n in zip(scenario.faults, operators, strict=True):
        _plan_fault(sim, server, net, clients, operator_n, fault, url, checker)
    running = set(clients)

    def finished(client: Client) -> None:
        running.discard(client)
        if not running:  # the leases left unreleased are checked a while longer
            sim.stop_at = min(sim.stop_at, sim.now + TAIL)

    leasing = leasing_module()

    def worker(client: Client, backend: RedisBackend, program: Any, scenario: Scenario) -> None:
        try:
            if leasing is None:  # the lease before its injected runtime: patched threads
                _worker(client, backend, program, checker, scenario)
            else:
                with leasing.use_runtime(client.runtime):
                    _worker(client, backend, program, checker, scenario)
        finally:
            finished(client)

    checker.finished = finished

    for client, program in zip(clients, scenario.programs, strict=True):
        backend = _backend(
            _url(scenario, client.index), client, server, net, scenario.socket_timeout
        )
        client.spawn(lambda c=client, b=backend, p=program: worker(c, b, p, scenario))

    sim.after_step = checker.step
    try:
        sim.run(until=60.0)
    except Violation as exc:
        violation.append(str(exc))
    finally:
        for client in (*clients, *operators):
            client.dead = True
    if violation:
        sim.say("checker", "VIOLATION " + violation[0])
    return Outcome(violation[0] if violation else None, sim.steps, sim.story)


def _plan_fault(
    sim: Sim,
    server: Server,
    net: Net,
    clients: list[Client],
    operator: Client,
    fault: Fault,
    url: str,
    checker: Checker,
) -> None:
    kind = fault.kind
    if isinstance(server, redlock_world.RedlockWorld) and server.plan(fault):
        return  # a fault of one Redlock master
    target = clients[fault.client] if 0 <= fault.client < len(clients) else None
    if kind == "msg":
        net.faults[(fault.client, int(fault.at))] = (fault.detail, fault.amount)
    elif kind == "partition":
        net.partitions.setdefault(fault.client, []).append((fault.at, fault.at + fault.amount))
        sim.at(
            fault.at, lambda: sim.say(f"client{fault.client}", f"partitioned for {fault.amount} s")
        )
    elif kind == "pause" and target is not None:

        def pause() -> None:
            sim.say(target.name, f"paused (SIGSTOP/GC) for {fault.amount * 1000:.0f} ms")
            target.paused_until = max(target.paused_until, sim.now + fault.amount)

        sim.at(fault.at, pause)
    elif kind == "kill" and target is not None:

        def kill() -> None:
            sim.say(target.name, "killed")
            target.dead = True
            checker.finished(target)

        sim.at(fault.at, kill)
    elif kind == "jump" and target is not None:

        def jump() -> None:
            sim.say(target.name, f"monotonic clock jumps {fault.amount:+g} s")
            target.mono_offset += fault.amount

        sim.at(fault.at, jump)
    elif kind == "wall_jump" and target is not None:

        def wall_jump() -> None:
            sim.say(target.name, f"wall clock jumps {fault.amount:+g} s")
            target.wall_offset += fault.amount

        sim.at(fault.at, wall_jump)
    elif kind == "lose_renew" and target is not None:
        checker.lose_renew[target.index] = fault.detail
    elif kind == "lose_lane" and target is not None:
        checker.lose_lane[target.index] = fault
    elif kind == "late_lane" and target is not None:
        checker.late_lane[target.index] = LateLane(fault)
    elif kind == "restart":
        sim.at(fault.at, lambda: server.restart(fault.amount))
    elif kind == "failover":
        replica: list[Any] = []
        sim.at(max(0.0, fault.at - fault.amount), lambda: replica.append(server.snapshot()))
        sim.at(fault.at, lambda: server.failover(replica[0], fault.amount))
    elif kind == "clock_step":
        sim.at(fault.at, lambda: server.step_clock(int(fault.amount * 1_000_000)))
    elif kind == "force":
        backend = _backend(url, operator, server, net, 5.0)
        times = max(1, int(fault.amount))
        operator.spawn(
            lambda: _operator(operator, backend, fault.detail, checker, times), when=fault.at
        )


def _operator(
    client: Client, backend: RedisBackend, name: str, checker: Checker, times: int
) -> None:
    for _ in range(times):
        _force_once(client, backend, name, checker)
        client.sleep(0.005 + 0.045 * client.rng.random())


def _force_once(client: Client, backend: RedisBackend, name: str, checker: Checker) -> None:
    try:
        holder = backend.holder(name)
        if holder is None:
            client.sim.say(client.name, f"sees {name!r} free")
            return
        client.sim.say(client.name, f"sees {name!r} held (fence {holder.fence}); force-releases")
        epoch = checker.server.epoch
        ok = backend.force_release(name, fence=holder.fence)
    except LockError as exc:
        client.sim.say(client.name, f"force release failed: {exc}")
        return
    client.sim.say(client.name, "freed it" if ok else "the lock changed hands: nothing freed")
    checker.forced_release(client, holder.token, holder.fence, ok, epoch)


def _take(client: Client, backend: RedisBackend, step: Iteration, scenario: Scenario) -> Any:
    """The front end's acquire: a lock's lease, a semaphore's permit, a leader's lease."""
    on_lost = None
    if step.on_lost:

        def on_lost(_: Any) -> None:  # runs wherever the lease calls it back
            client.sim.say(client.name, f"on_lost callback ({step.on_lost:g} s)")
            client.sleep(step.on_lost)

    if front(scenario.protocol) == "semaphore":
        semaphore = Semaphore(
            step.name,
            scenario.limit,
            step.ttl,
            backend=backend,
            timeout=step.timeout,
            on_lost=on_lost,
        )
        return semaphore.acquire()
    if front(scenario.protocol) == "election":
        election = Election(
            step.name,
            step.ttl,
            backend=backend,
            identity=client.name,
            timeout=step.timeout,
            on_lost=on_lost,
        )
        return election.campaign().lease
    lock = Lock(step.name, step.ttl, backend=backend, timeout=step.timeout, on_lost=on_lost)
    return lock.acquire()


def _names_of(scenario: Scenario, name: str) -> tuple[str, ...]:
    """The lock names an acquire of ``name`` waits for (a semaphore: every slot)."""
    if front(scenario.protocol) in ("semaphore", "election"):
        return scenario.lock_names
    return (name,)


def _worker(
    client: Client, backend: RedisBackend, program: Any, checker: Checker, scenario: Scenario
) -> None:
    sim = client.sim
    for step in program:
        start = sim.now
        sim.say(client.name, f"acquire {step.name!r} ttl {step.ttl} timeout {step.timeout}")
        names = _names_of(scenario, step.name)
        checker.waits(client, names, True)
        try:
            lease = _take(client, backend, step, scenario)
        except LockHeld:
            sim.say(client.name, "gave up (LockHeld)")
            if front(scenario.protocol) != "semaphore":  # (a free slot is not a free semaphore)
                checker.gave_up(client, names[0], start)
            continue
        except LockError as exc:
            sim.say(client.name, f"acquire failed: {type(exc).__name__}")
            continue
        finally:
            checker.waits(client, names, False)
        sim.say(client.name, f"holds {lease.name!r} fence {lease.fence}")
        checker.granted(client, lease)
        _hold(client, lease, step, checker)
        if not step.release:
            continue
        checker.releasing.add(lease.token)
        try:
            lease.release()
        except NotOwned:
            sim.say(client.name, "release: NotOwned")
            checker.released(client, lease, False)
        except BackendUnavailable as exc:
            sim.say(client.name, f"release unknown: {exc.__class__.__name__}")
        except LockLost:
            sim.say(client.name, "release: LockLost")
        else:
            if lease._released:
                sim.say(client.name, "released")
                checker.released(client, lease, True)


def _hold(client: Client, lease: Any, step: Iteration, checker: Checker) -> None:
    sim = client.sim
    pieces = max(1, step.writes)
    renew_piece = None if step.renew_at is None else int(step.renew_at * pieces)
    for piece in range(pieces):
        client.sleep(step.hold / pieces)
        if renew_piece == piece:
            checker.extend_after_a_late_renewal(client, lease, step)
            sim.say(client.name, f"renew(ttl={step.renew_ttl})")
            checker.renew_sent([lease])
            lose = checker.lose_renew.pop(client.index, None)
            if lose is not None:  # this call's first request (by number) is lost
                checker.net.faults[(client.index, client.requests + 1)] = (lose, 0.0)
            try:
                lease.renew(ttl=step.renew_ttl)
            except LockError as exc:
                sim.say(client.name, f"renew: {type(exc).__name__}")
        if step.writes:
            try:
                lease.check()
            except LockLost:
                sim.say(client.name, "check(): lost")
                return
            checker.write(client, lease)


# -- replay, shrink, many seeds -----------------------------------------------------------


def _smaller(scenario: Scenario) -> Iterator[Scenario]:
    """Each schedule one choice smaller: a fault fewer, then an iteration fewer."""
    faults = scenario.faults
    for index in range(len(faults)):
        yield replace(scenario, faults=faults[:index] + faults[index + 1 :])
    for who, program in enumerate(scenario.programs):
        for index in range(len(program) if len(program) > 1 else 0):
            programs = list(scenario.programs)
            programs[who] = program[:index] + program[index + 1 :]
            yield replace(scenario, programs=tuple(programs))


def shrink(scenario: Scenario, budget: int = 200) -> Scenario:
    """Greedy delta debugging: take the first smaller schedule that still fails, again
    and again, until none does (or the budget of runs is spent)."""
    tries = 0
    while tries < budget:
        for candidate in _smaller(scenario):
            tries += 1
            if run(candidate).violation:
                scenario = candidate
                break
            if tries >= budget:
                return scenario
        else:
            return scenario
    return scenario


def describe(scenario: Scenario) -> list[str]:
    lines = [
        f"seed {scenario.seed}: {scenario.protocol}, {len(scenario.programs)} clients, "
        f"delays {scenario.delay[0] * 1000:g}-{scenario.delay[1] * 1000:g} ms, "
        f"socket_timeout {scenario.socket_timeout} s"
    ]
    if scenario.celery is not None:
        from .celery_world import describe as describe_celery

        lines += describe_celery(scenario)
    for who, program in enumerate(() if scenario.celery is not None else scenario.programs):
        rate = scenario.rates[who]
        steps = "; ".join(
            f"{s.name} ttl {s.ttl} timeout {s.timeout} hold {s.hold:.3g}"
            + (f" renew(ttl={s.renew_ttl})" if s.renew_at is not None else "")
            + ("" if s.release else " no release")
            for s in program
        )
        lines.append(f"  client{who} (clock rate {rate:g}): {steps}")
    for fault in scenario.faults:
        lines.append(f"  fault: {fault.describe()}")
    return lines


def story(scenario: Scenario) -> tuple[str | None, list[str]]:
    outcome = run(scenario, record=True)
    return outcome.violation, [*describe(scenario), "", *outcome.story]


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Many runs in a row: the cyclic collector less often (a run makes tens of thousands
    of short-lived objects; at the default threshold the collector took about a tenth
    of the time), and the objects alive before them (modules, the Lua runtime) out of
    its way."""
    gc.collect()
    gc.freeze()
    threshold = gc.get_threshold()
    gc.set_threshold(50_000, 20, 100)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def explore(seeds: range, protocol: str | None = None) -> tuple[list[int], int, float]:
    """Run every seed; the failing ones, the steps run, the seconds taken."""
    failing: list[int] = []
    steps = 0
    start = real_time.perf_counter()
    with fewer_collections():
        for seed in seeds:
            outcome = run(generate(seed, protocol))
            steps += outcome.steps
            if outcome.violation:
                failing.append(seed)
    return failing, steps, real_time.perf_counter() - start


assert greenlet  # imported for its side effect on the world's tasks
