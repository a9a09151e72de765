"""Celery in the simulation: a modelled broker and worker processes that run the real
singleton-task code for each message, checked for "a message never runs twice at once
and is never lost".

What is real. Each message is run by Celery's own tracer (``celery.app.trace.build_tracer``:
what a solo worker calls per message, with ``task_prerun``/``task_postrun`` and the
library's receivers in ``task_locks.celery.signals``), which calls the production
``SingletonTask.__call__``: the run's plan (run lock with the task id as owner, the
redelivered-copy check and its watch, ``on_conflict`` skip/retry/wait/raise, the run
guard where the options need one, the take-over of the publish-time lock for
``lock_on="both"``, the lock renewed by the lease's lane while the body runs, ``on_lost``
through ``RunWatch``, the release in the plan's ``finally`` or the deferred release
through the production ``Releaser``). Publishes go through ``task.apply_async`` and the
production publish guard (``lock_on="enqueue"``/``"both"``), which wraps the app's
``send_task_message``; ``self.retry()`` publishes the same way. The locks are the
simulated Redis of :mod:`tests.sim.world` (the production Lua), each process with its own
``RedisBackend``. The tasks are ``@singleton_task`` definitions, one per ``lock_on``,
``limit`` and ``ignore_result``; a schedule's other options are set on the task class, as
Celery's own option attributes are.

What is modelled. The broker (:class:`Broker`): a FIFO of messages with ids, acked when
a worker takes them (``acks_late=False``) or when the tracer returns (``acks_late``);
a Redis broker's visibility timeout puts a delivery that is still unacked back in the
queue, marked redelivered (the run may still be going on), a RabbitMQ broker puts a
killed worker's unacked deliveries back at once; ETAs (retries' countdowns) are held by
the broker until due. A worker (:class:`Worker`) is one process with one or two
execution slots (greenlets: the pool), its own releaser (the production ``Releaser``
class over greenlet stand-ins for its lock, condition and thread) and its own lease
runtime; a kill is SIGKILL of the whole worker (no ``finally`` runs, nothing is acked).
The body is the sim's: it sleeps (in pieces), checks its lease and writes the fenced
register; ``on_lost="interrupt"`` reaches it as on the gevent pool (the production
``RunWatch`` with the world as its hub: the interrupt is thrown in at the body's next
sleep). Not modelled: prefork children and the main process's recovery of a killed
child (``SingletonRequest``), prefetching, beat ticks, ``async def`` tasks.

The checks, besides :class:`tests.sim.scenario.Checker`'s on every run lock:

- *one run per task id*: never two bodies of one task id whose leases both say held
  (the lock per key is the checker's exclusion rule);
- *documented outcomes* (docs/celery.md): a body that returned ends ``SUCCESS`` with its
  result, unless its lease was known lost when it returned (then ``FAILURE`` with
  ``LockLost``, or ``SUCCESS`` with ``on_lost="ignore"``), the same with or without a
  stored result; a body that raised ends ``FAILURE``; a run that did not run its body is
  ``IGNORED`` (a copy of its own task id), ``RETRY`` (``"retry"``), or ``SUCCESS`` with
  a ``Skipped`` / ``FAILURE`` with ``DuplicateTask`` or ``LockHeld`` as ``on_conflict`` and
  ``skip_as`` say, naming a holder that is another task id; or ``FAILURE`` with
  ``BackendUnavailable`` / ``LockLost``;
- *never lost*: when the broker has nothing left, every task id with a message accepted
  has a delivery that ended ready (``SUCCESS``/``FAILURE``), unless a delivery of it was
  acked early by a worker that was then killed (Celery's at-most-once), a copy was
  refused while the server lost or an operator freed the lock it watched or the server's
  clock stepped (documented limits), or its delivery was put back (a visibility timeout)
  while its run went on, the copy was refused, and then that run's worker was killed:
  the broker no longer has the message and the refused copy was acknowledged (a limit
  of refusing copies, left open);
- *publish de-duplication* (``"both"``): a publish is dropped only as a duplicate of a
  task id that is queued or running, or ended less than a run-lock TTL ago.
"""

from __future__ import annotations

import contextlib
import datetime as real_dt
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, NoReturn

import greenlet

# Every module of the package the runs use is imported before a run swaps the clocks
# of ``task_locks`` modules (one imported during a run would keep the real ones).
import task_locks.celery
import task_locks.celery.interrupt
import task_locks.celery.publish
import task_locks.celery.redelivery
import task_locks.celery.registry
import task_locks.celery.releaser
import task_locks.celery.signals
import task_locks.celery.task
import task_locks.peers  # noqa: F401
from task_locks.celery import SingletonTask
from task_locks.errors import BackendUnavailable, LockError, LockHeld, LockLost

from .world import Client, Event, Sim, _Raise

#: run: ``lock_on="run"`` (limit 1 or 2); celery-both: ``lock_on="both"`` (some
#: ``"enqueue"``), the publish-time lock taken over by the run.
CELERY_PROTOCOLS = ("celery", "celery-both")
KEYS = ("job", "report")
#: Seconds a publish-time lock lasts: longer than any schedule, so a lock left behind is seen.
ENQUEUE_TTL = 30.0
#: Seconds the broker takes to hand a message to a free slot.
BROKER_DELAY = (0.0005, 0.003)


@dataclass(frozen=True)
class CeleryOptions:
    """The task's options, the broker and the workers of one celery schedule."""

    lock_on: str = "run"
    on_conflict: str = "skip"
    limit: int = 1
    ttl: float = 1.0
    on_lost: str = "interrupt"
    skip_as: str = "success"
    acks_late: bool = True
    ignore_result: bool = True
    wait_timeout: float | None = 1.0
    retry_countdown: float = 0.2
    max_retries: int = 3
    #: a run whose acquire gets no answer: "fail", or "retry" (0.3 s apart)
    lock_unavailable: str = "fail"
    #: ``PeerCheckedTask``: the run also waits out an old library's key ``lock:<key>``
    #: (fault "peer" sets it)
    peers: bool = False
    #: "redis" (visibility timeout) or "rabbitmq" (a dead worker's messages back at once)
    broker: str = "redis"
    visibility_timeout: float = 2.0
    #: how many of the scenario's clients publish (the rest are workers)
    publishers: int = 1
    concurrency: int = 1

    def describe(self) -> str:
        text = (
            f"lock_on={self.lock_on} on_conflict={self.on_conflict} limit={self.limit} "
            f"ttl={self.ttl} on_lost={self.on_lost} skip_as={self.skip_as} "
            f"acks_late={self.acks_late} ignore_result={self.ignore_result}"
        )
        if self.on_conflict == "wait":
            text += f" wait_timeout={self.wait_timeout}"
        if self.on_conflict == "retry":
            text += f" retry_countdown={self.retry_countdown} max_retries={self.max_retries}"
        if self.lock_unavailable != "fail":
            text += f" lock_unavailable={self.lock_unavailable!r}"
        if self.peers:
            text += " base=PeerCheckedTask (peer key lock:<key>)"
        broker = self.broker
        if broker == "redis":
            broker += f" (visibility timeout {self.visibility_timeout} s)"
        return f"{text}; broker {broker}; {self.concurrency} slot(s) per worker"


def celery_lock_names(limit: int) -> tuple[str, ...]:
    from task_locks.types import slot_name

    if limit == 1:
        return KEYS
    return tuple(slot_name(key, i) for key in KEYS for i in range(limit))


# -- schedules --------------------------------------------------------------------------


def generate(seed: int, protocol: str) -> Any:
    """A celery schedule: publishers' programs (each publish an ``Iteration``: ``name`` the
    key, ``timeout`` the pause before it, ``hold`` the body's seconds, ``writes`` its
    fenced writes, ``release=False`` the same task id as the publish before it), the
    workers, the task's options and the faults."""
    from .scenario import Fault, Iteration, Scenario, _fault

    rng = random.Random(seed * 7_368_787 + 11)
    both = protocol == "celery-both"
    lock_on = rng.choice(("both", "both", "both", "enqueue")) if both else "run"
    limit = rng.choice((1, 1, 1, 2)) if lock_on == "run" else 1
    ttl = rng.choice((0.3, 0.5, 1.0, 2.0))
    options = CeleryOptions(
        lock_on=lock_on,
        on_conflict=rng.choice(("skip", "skip", "retry", "wait", "raise")),
        limit=limit,
        ttl=ttl,
        on_lost=rng.choice(("interrupt", "interrupt", "fail", "ignore")),
        skip_as=rng.choice(("success", "success", "failure")),
        acks_late=rng.random() < 0.75,
        ignore_result=rng.random() < 0.6,
        wait_timeout=rng.choice((0.2, 1.0, 3.0)),
        retry_countdown=rng.choice((0.05, 0.2, 0.5)),
        max_retries=rng.choice((1, 3, 5)),
        broker=rng.choice(("redis", "redis", "rabbitmq")),
        visibility_timeout=rng.choice((0.3, 1.0, 3.0, 10.0)),
        publishers=rng.choice((1, 1, 2)),
        concurrency=rng.choice((1, 1, 2)),
    )
    # (its own stream: the rest of each schedule is what it was before this option)
    extra = random.Random(seed * 7_368_787 + 13)
    options = replace(
        options,
        lock_unavailable=extra.choice(("fail", "fail", "retry")),
        # A timeout shorter than the watch a copy may keep (one TTL) redelivers each
        # watching copy again: a storm of copies (Celery formats a traceback for each
        # refusal, the bulk of a run's time) that real visibility timeouts (an hour) never see.
        visibility_timeout=max(options.visibility_timeout, 1.5 * ttl),
        peers=limit == 1 and extra.random() < 0.3,
    )
    workers = rng.choice((1, 2, 2, 3))
    names = KEYS[: rng.choice((1, 1, 2))]
    programs: list[tuple[Iteration, ...]] = []
    for _ in range(options.publishers):
        program = []
        for index in range(rng.choice((1, 2, 3, 4))):
            program.append(
                Iteration(
                    name=rng.choice(names),
                    ttl=ttl,
                    timeout=rng.choice((0.0, 0.01, 0.1, 0.5, 1.0)),
                    hold=rng.choice((0.0, 0.05, 0.3, 1.0)) * ttl * rng.choice((1, 2, 4)),
                    writes=rng.choice((0, 1, 3)),
                    renew_at=None,
                    renew_ttl=None,
                    release=not (index and rng.random() < 0.2),
                )
            )
        programs.append(tuple(program))
    if options.peers:  # a late publish: is the key free again once the peer key is gone?
        late = Iteration(names[0], ttl, 3.0, 0.05, 0, None, None, True)
        programs[0] = (*programs[0], late)
    programs += [()] * workers
    clients = len(programs)
    rates = tuple(1.0 + rng.choice((0.0, 0.0, 1e-4, 1e-3)) for _ in range(clients))
    lock_names = celery_lock_names(limit)
    faults: list[Fault] = []
    horizon = 3.0
    if rng.random() < 0.8:
        for _ in range(rng.choice((1, 2, 3, 5))):
            kind = rng.random()
            if kind < 0.15:  # the broker puts a delivery back (a visibility timeout...)
                faults.append(
                    Fault("redeliver", 0, rng.random() * horizon, float(rng.randrange(1, 6)))
                )
            elif kind < 0.25:  # the broker delivers a message twice (at least once)
                faults.append(Fault("duplicate", 0, 0.0, float(rng.randrange(1, 6))))
            elif kind < 0.45:  # a worker killed (SIGKILL: the whole worker)
                who = rng.randrange(options.publishers, clients)
                faults.append(Fault("kill", who, rng.random() * horizon))
            else:
                faults.append(_fault(rng, clients, lock_names, horizon))
    if options.peers:  # an old library's process holds the key's peer key a while
        for _ in range(extra.choice((1, 1, 2))):  # early: later publishes meet what it left
            hold = extra.choice((0.05, 0.3, 1.0, 2.0))
            faults.append(Fault("peer", 0, extra.random(), hold, extra.choice(names)))
    kinds = {f.kind for f in faults}
    if kinds & {"restart", "failover"} and "clock_step" in kinds:
        faults = [f for f in faults if f.kind != "clock_step"]
    return Scenario(
        seed=seed,
        protocol=protocol,
        programs=tuple(programs),
        rates=rates,
        faults=tuple(faults),
        delay=rng.choice(((0.0001, 0.001), (0.0005, 0.005), (0.001, 0.05))),
        socket_timeout=rng.choice((0.5, 1.0, 5.0)),
        limit=limit,
        celery=options,
    )


def describe(scenario: Any) -> list[str]:
    options: CeleryOptions = scenario.celery
    lines = [f"  task: {options.describe()}"]
    for who, program in enumerate(scenario.programs):
        if who >= options.publishers:
            lines.append(f"  client{who}: a worker")
            continue
        steps = "; ".join(
            f"after {s.timeout:g} s publish {s.name!r} (body {s.hold:.3g} s, {s.writes} writes)"
            + ("" if s.release else " with the previous task id again")
            for s in program
        )
        lines.append(f"  client{who} publishes: {steps}")
    return lines


# -- the app and its tasks (one per process, one task per option set) ---------------------

_app: Any = None
_tasks: dict[tuple[str, int, bool, bool], tuple[Any, Any]] = {}
#: The world of the run in progress (the sender, the descriptors and the patches ask it).
_world: CeleryWorld | None = None


def _sim_send(producer: Any, name: str, message: Any, **options: Any) -> None:
    """The app's ``send_task_message`` under the publish guard: into the modelled broker."""
    assert _world is not None
    _world.broker.publish(name, message, options)


def _the_app() -> Any:
    global _app
    if _app is None:
        from celery import Celery

        _app = Celery("sim", broker="memory://", backend="cache+memory://", set_as_current=False)
        # No producer pool: a schedule that ends with a publisher inside apply_async never
        # gives its producer back, and a bounded pool shared by every schedule of the process
        # then blocks a later publish for real (about one in 5,000 Celery schedules leaks).
        _app.conf.update(
            task_serializer="json",
            result_serializer="json",
            task_acks_late=False,
            broker_pool_limit=0,
        )
        # Countdowns (retries) count from the publishing client's wall clock.
        _app.now = lambda: real_dt.datetime.fromtimestamp(  # type: ignore[method-assign]
            _wall(), tz=real_dt.UTC
        )
        _app.amqp.send_task_message = _sim_send  # the publish guard stands in front of it
    return _app


def _wall() -> float:
    """The simulated wall clock while a schedule plays; the real one outside it.

    The app outlives the runs, and may be the process's ``current_app`` afterwards: Celery
    beat's persistent schedule, reloaded from its shelve, loses its entries' app and asks
    ``current_app`` for the time. A beat test run after a Celery schedule in the same
    process then saw 2023 and found nothing due (its first-tick flake)."""
    world = _world
    if world is None:
        return time.time()
    client = world.sim.active
    return client.wall() if client is not None else 1_700_000_000.0


class _ClientBackend:
    """``lock_backend`` of the sim's tasks: the calling process's own ``RedisBackend``."""

    def __get__(self, task: Any, owner: Any = None) -> Any:
        if task is None or _world is None:
            return None
        return _world.backend_of(_world.sim.active)


class _PeerClient:
    """What ``PeerKeys`` uses of a ``redis.Redis``: the calling process's simulated one."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis

    @contextlib.contextmanager
    def pipeline(self, transaction: bool = False) -> Iterator[Any]:
        yield self.redis.pipeline(transaction)

    def close(self) -> None:
        pass


class _ClientPeers:
    """``lock_peers`` of a ``PeerCheckedTask``: ``lock:<name>`` on the calling process's
    Redis connection (the old library's keys live on the lock server)."""

    def __get__(self, task: Any, owner: Any = None) -> Any:
        if task is None or _world is None:
            return None
        from task_locks.peers import PeerKeys

        backend = _world.backend_of(_world.sim.active)
        return PeerKeys(_PeerClient(backend._sync_client), "lock:{name}")  # type: ignore[arg-type]


def _task(options: CeleryOptions) -> tuple[Any, Any]:
    """The singleton task for ``options`` and its tracer.

    One task per process for each ``lock_on``, ``limit`` and ``ignore_result`` (what the
    task's definition and Celery's tracer read once); the other options are the task
    class's attributes, which the run reads as it goes, set here for each schedule
    (defining a task and its tracer per schedule took most of a short run's time).
    """
    shape = (options.lock_on, options.limit, options.ignore_result, options.peers)
    found = _tasks.get(shape)
    if found is None:
        found = _tasks[shape] = _define(options, len(_tasks))
    task = found[0]
    for attribute, value in (
        ("lock_ttl", options.ttl),
        ("on_conflict", options.on_conflict),
        ("wait_timeout", options.wait_timeout),
        ("retry_countdown", options.retry_countdown),
        ("on_lost", options.on_lost),
        ("skip_as", options.skip_as),
        ("acks_late", options.acks_late),
        ("max_retries", options.max_retries),
        ("lock_unavailable", options.lock_unavailable),
    ):
        setattr(type(task), attribute, value)
    return found


def _define(options: CeleryOptions, number: int) -> tuple[Any, Any]:
    from celery.app.trace import build_tracer

    from task_locks.celery import singleton_task
    from task_locks.celery.peers import PeerCheckedTask

    app = _the_app()

    def body(self: Any, key: str, hold: float, writes: int) -> Any:
        assert _world is not None
        return _world.body(self.request, hold, writes)

    body.__name__ = f"body_{number}"
    task = singleton_task(
        body,
        app=app,
        name=f"sim.celery.{number}",
        bind=True,
        key="{key}",
        lock_on=options.lock_on,
        limit=options.limit,
        ignore_result=options.ignore_result,
        enqueue_ttl=ENQUEUE_TTL,
        default_retry_delay=0.3,
        base=PeerCheckedTask if options.peers else SingletonTask,
    )
    task = app.tasks[task.name]  # (the decorator's proxy, evaluated: finalizes the app)
    type(task).lock_backend = _ClientBackend()
    if options.peers:
        type(task).lock_peers = _ClientPeers()
    tracer = build_tracer(task.name, task, app=app, hostname="sim", eager=False)
    return task, tracer


# -- greenlet stand-ins for a process's threads ---------------------------------------------


class SimLock:
    """A lock no greenlet ever waits for: the code holding it never parks, except in
    :meth:`SimCondition.wait`, which lets it go."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return True

    def release(self) -> None:
        pass

    def __enter__(self) -> bool:
        return True

    def __exit__(self, *exc: object) -> None:
        pass


class SimCondition:
    """``threading.Condition`` for greenlets of one client: ``wait`` parks until notified or
    until its timeout on the client's clock."""

    def __init__(self, lock: Any = None) -> None:
        self._waiters: list[tuple[Client, greenlet.greenlet, Event | None]] = []

    def __enter__(self) -> bool:
        return True

    def __exit__(self, *exc: object) -> None:
        pass

    def wait(self, timeout: float | None = None) -> bool:
        assert _world is not None
        client = _world.sim.active
        assert client is not None
        me = greenlet.getcurrent()
        timer = None
        if timeout is not None:
            timer = client.resume_at(client.sim.now + max(0.0, timeout) / client.rate, me, None)
        entry = (client, me, timer)
        self._waiters.append(entry)
        try:
            client.park()
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)
            if timer is not None:
                timer.cancelled = True
        return True

    def notify(self, n: int = 1) -> None:
        for _ in range(min(n, len(self._waiters))):
            client, task, timer = self._waiters.pop(0)
            if timer is not None:
                timer.cancelled = True
            client.resume_at(client.sim.now, task, None)

    def notify_all(self) -> None:
        self.notify(len(self._waiters))


class SimThread:
    def __init__(self, target: Callable[[], None], name: str = "", daemon: bool = True) -> None:
        self.target = target

    def start(self) -> None:
        assert _world is not None and _world.sim.active is not None
        _world.sim.active.spawn(self.target)

    def is_alive(self) -> bool:
        return True


class SimThreading:
    """The ``threading`` of the releaser and the run registry: greenlets are threads."""

    Lock = SimLock
    Condition = SimCondition
    Thread = SimThread

    @staticmethod
    def get_ident() -> int:
        return id(greenlet.getcurrent())

    def __getattr__(self, name: str) -> Any:
        return getattr(threading, name)


class SimDatetimeModule:
    """``datetime`` of the publish guard: ``now()`` is the publishing client's wall clock."""

    class datetime(real_dt.datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:  # type: ignore[override]
            moment = real_dt.datetime.fromtimestamp(_wall(), tz=real_dt.UTC)
            return moment.astimezone(tz) if tz is not None else moment.replace(tzinfo=None)

    def __getattr__(self, name: str) -> Any:
        return getattr(real_dt, name)


class _ActiveReleaser:
    """``releaser`` in the task, the publish guard and the signals: the calling process's."""

    def __getattr__(self, name: str) -> Any:
        assert _world is not None
        return getattr(_world.releaser_of(_world.sim.active), name)


class SimGreen:
    """What ``RunWatch`` keeps of a body run in a greenlet (the gevent pool's path): the
    interrupt is thrown in at the body's next sleep."""

    def __init__(self, world: CeleryWorld, run: Run) -> None:
        self.world = world
        self.run = run

    def throw(self, error: BaseException) -> None:
        run = self.run
        run.pending = error
        if run.sleeping is not None:  # wake the body's sleep now, with the error
            timer, task = run.sleeping
            timer.cancelled = True
            run.sleeping = None
            run.client.resume_at(run.client.sim.now, task, _Raise(error))


def _greenlet() -> Any:
    world = _world
    if world is None:
        return None
    run = world.in_body.get(id(greenlet.getcurrent()))
    return run.green if run is not None else None


def _throw_green(green: Any, throw: Callable[[], None]) -> None:
    """The hub's next turn: an event now on the body's client."""
    client = green.run.client

    def turn() -> None:
        previous, client.sim.active = client.sim.active, client
        try:
            throw()
        finally:
            client.sim.active = previous

    client.sim.at(client.sim.now, turn)


class Patched:
    """Module attributes swapped for the run (put back after)."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, attribute: str, value: Any) -> None:
        self._saved.append((owner, attribute, getattr(owner, attribute)))
        setattr(owner, attribute, value)

    def undo(self) -> None:
        while self._saved:
            owner, attribute, value = self._saved.pop()
            setattr(owner, attribute, value)


def _install(patched: Patched) -> None:
    from task_locks.celery import interrupt, publish, registry, signals
    from task_locks.celery import releaser as releaser_module
    from task_locks.celery import task as task_module

    active = _ActiveReleaser()
    for module in (task_module, publish, signals):
        patched.set(module, "releaser", active)
    patched.set(releaser_module, "threading", SimThreading())
    patched.set(registry, "threading", SimThreading())
    patched.set(publish, "dt", SimDatetimeModule())
    patched.set(interrupt, "_greenlet", _greenlet)
    patched.set(interrupt, "_throw_green", _throw_green)
    if task_module._DropQueued is not _WatchedDrop:
        _WatchedDrop.original = task_module._DropQueued
    patched.set(task_module, "_DropQueued", _WatchedDrop)


class _WatchedDrop:
    """The task's free of its publish-time lock, telling the checker of one that failed
    (its request or reply lost: the lock keeps the key until enqueue_ttl)."""

    original: Any = None  # the task module's own, set when the patch is installed

    def __init__(self, backend: Any, name: str, token: str) -> None:
        self.drop = self.original(backend, name, token)

    def run(self) -> bool:
        try:
            return self.drop.run()
        except LockError:
            assert _world is not None
            _world.checker.unfreed.add(self.drop.token)
            raise

    async def arun(self) -> bool:
        try:
            return await self.drop.arun()
        except LockError:
            assert _world is not None
            _world.checker.unfreed.add(self.drop.token)
            raise


# -- the broker -------------------------------------------------------------------------


@dataclass
class Message:
    number: int  # in the order the broker accepted it (faults name it)
    task_id: str
    name: str
    key: str
    args: tuple[Any, ...]
    headers: dict[str, Any]
    publisher: str
    at: float


@dataclass
class Delivery:
    message: Message
    redelivered: bool
    worker: Worker | None = None
    at: float = 0.0
    acked: bool = False
    #: put back by a visibility timeout (or a redelivery): its ack is no longer the broker's
    restored: bool = False
    #: ...while its worker was alive: its copy may be refused, and then the message lives
    #: on only in that run (a kill of that worker loses it: a limit of the design)
    restored_running: bool = False
    timer: Event | None = None
    outcome: str = ""  # the tracer's state, "killed", or "" while it runs


class Broker:
    """The queue, the unacked deliveries and their redelivery (see the module doc)."""

    def __init__(self, world: CeleryWorld) -> None:
        self.world = world
        self.sim = world.sim
        self.options = world.options
        self.rng = random.Random(world.sim.seed * 613 + 1)
        self.queue: deque[Delivery] = deque()
        self.messages: list[Message] = []
        self.unacked: list[Delivery] = []
        #: deliveries waiting for their ETA (a retry's countdown)
        self.delayed: list[Delivery] = []
        self.idle: deque[tuple[Worker, greenlet.greenlet]] = deque()
        self.waiting_eta = 0
        #: acked early, on their way to a worker slot
        self.in_transit: list[Delivery] = []
        self.duplicates: set[int] = set()

    def publish(self, name: str, message: Any, options: dict[str, Any]) -> None:
        headers, _properties, body, _event = message
        headers = {**headers, **(options.get("headers") or {})}
        client = self.sim.active
        who = client.name if client is not None else "?"
        args = tuple(body[0] or ())
        number = len(self.messages) + 1
        msg = Message(number, headers["id"], name, args[0], args, headers, who, self.sim.now)
        self.messages.append(msg)
        self.world.checker.accepted(msg)
        retries = headers.get("retries") or 0
        self.sim.say(
            "broker", f"message #{number}: {msg.task_id} key {msg.key!r} retries {retries}"
        )
        delay = 0.0
        eta = headers.get("eta")
        if eta and client is not None:
            when = real_dt.datetime.fromisoformat(str(eta)).timestamp()
            delay = max(0.0, when - client.wall())
        copies = 2 if number in self.duplicates else 1
        for copy in range(copies):
            delivery = Delivery(msg, redelivered=False)
            if delay > 0:
                self.waiting_eta += 1
                self.delayed.append(delivery)
                self.sim.at(self.sim.now + delay, lambda d=delivery: self._due(d))
            else:
                self._enqueue(delivery)
            if copy:
                self.sim.say("broker", f"message #{number} duplicated (at least once)")

    def _due(self, delivery: Delivery) -> None:
        self.waiting_eta -= 1
        self.delayed.remove(delivery)
        self._enqueue(delivery)

    def _enqueue(self, delivery: Delivery) -> None:
        self.queue.append(delivery)
        self._dispatch()

    def _dispatch(self) -> None:
        while self.queue and self.idle:
            worker, slot = self.idle.popleft()
            if worker.client.dead:
                continue
            delivery = self.queue.popleft()
            delivery.worker = worker
            delivery.at = self.sim.now
            options = self.options
            if options.acks_late:
                self.unacked.append(delivery)
                if options.broker == "redis":
                    delivery.timer = self.sim.at(
                        self.sim.now + options.visibility_timeout,
                        lambda d=delivery: self.restore(d),
                    )
            else:  # acked as the worker takes it (Celery's default)
                delivery.acked = True
                self.in_transit.append(delivery)
            delay = BROKER_DELAY[0] + (BROKER_DELAY[1] - BROKER_DELAY[0]) * self.rng.random()
            worker.client.resume_at(self.sim.now + delay, slot, delivery)

    def take(self, worker: Worker) -> Delivery:
        """A worker slot waits for its next delivery."""
        self.idle.append((worker, greenlet.getcurrent()))
        self._dispatch()
        delivery: Delivery = worker.client.park()
        if delivery in self.in_transit:
            self.in_transit.remove(delivery)
        return delivery

    def ack(self, delivery: Delivery) -> None:
        delivery.acked = True
        if delivery in self.unacked:
            self.unacked.remove(delivery)
        if delivery.timer is not None:
            delivery.timer.cancelled = True
        self.world.maybe_done()

    def restore(self, delivery: Delivery, why: str = "visibility timeout") -> None:
        """Put an unacked delivery back in the queue, marked redelivered."""
        if delivery.acked or delivery not in self.unacked:
            return
        self.unacked.remove(delivery)
        if delivery.timer is not None:
            delivery.timer.cancelled = True
        delivery.restored = True
        worker = delivery.worker
        delivery.restored_running = worker is not None and not worker.client.dead
        self.sim.say("broker", f"message #{delivery.message.number} redelivered ({why})")
        self._enqueue(Delivery(delivery.message, redelivered=True))

    def redeliver(self, number: int) -> None:
        """Fault: the broker puts message ``number``'s unacked delivery back now."""
        for delivery in list(self.unacked):
            if delivery.message.number == number:
                self.restore(delivery, "redelivery fault")

    def worker_died(self, worker: Worker) -> None:
        for delivery in list(self.unacked):
            if delivery.worker is worker and self.options.broker == "rabbitmq":
                self.restore(delivery, "its worker's connection closed")
        self.idle = deque(entry for entry in self.idle if entry[0] is not worker)
        for delivery in self.in_transit:
            if delivery.worker is worker:  # acked early, never reached its slot: at most once
                self.world.checker.acked_then_killed.add(delivery.message.task_id)
        self.in_transit = [d for d in self.in_transit if d.worker is not worker]
        self.world.maybe_done()

    def busy(self) -> bool:
        return bool(self.queue or self.unacked or self.waiting_eta or self.in_transit)


# -- the workers ------------------------------------------------------------------------


@dataclass
class Run:
    """One delivery's run in a worker slot: the body's progress, for the checker."""

    client: Client
    delivery: Delivery
    task_id: str
    green: Any = None
    lease: Any = None
    body_started: bool = False
    body_returned: bool = False
    body_raised: bool = False
    lost_at_end: bool = False
    ended: bool = False
    sleeping: tuple[Event, greenlet.greenlet] | None = None
    pending: BaseException | None = None
    #: the server's epoch and the operators' force releases when it began
    epoch: int = 0
    forced: int = 0
    clock: int = 0
    #: it ended FAILURE with BackendUnavailable: the lock the service did not answer for
    unanswered: str | None = None
    key: str = ""
    at: float = 0.0  # when the worker took it
    #: its locks were taken away while it ran (restart, failover, force release), or the
    #: server's clock stepped (the expiry a redelivered copy watches moves)
    taken_away: bool = False


class Worker:
    def __init__(self, world: CeleryWorld, client: Client) -> None:
        self.world = world
        self.client = client
        self.running: dict[int, Run] = {}

    def slot(self) -> None:
        from .world import leasing_module

        leasing = leasing_module()
        assert leasing is not None
        with leasing.use_runtime(self.client.runtime):
            while not self.client.dead:
                delivery = self.world.broker.take(self)
                self.process(delivery)

    def process(self, delivery: Delivery) -> None:
        world, sim, message = self.world, self.world.sim, delivery.message
        tracer = world.tracer
        request = {
            **message.headers,
            "delivery_info": {
                "redelivered": delivery.redelivered,
                "exchange": "",
                "routing_key": "celery",
                "priority": 0,
            },
            "hostname": f"{self.client.name}@sim",
            "correlation_id": message.task_id,
            "reply_to": None,
            "is_eager": False,
        }
        sim.say(
            self.client.name,
            f"runs message #{message.number} ({message.task_id}"
            f"{', redelivered' if delivery.redelivered else ''})",
        )
        checker = world.checker
        run = Run(
            self.client,
            delivery,
            message.task_id,
            epoch=checker.server.epoch,
            forced=checker.force_count,
            clock=checker.server.clock_offset_us,
            key=message.key,
            at=sim.now,
        )
        me = id(greenlet.getcurrent())
        self.running[me] = run
        world.runs.append(run)
        try:
            traced = tracer(message.task_id, list(message.args), {}, request)
        finally:
            self.running.pop(me, None)
            world.in_body.pop(me, None)
        if world.checker.violation is not None:
            raise world.checker.violation
        info = traced.info
        state = "SUCCESS" if info is None else info.state
        result = traced.retval if info is None else info.retval
        run.ended = True
        if state == "FAILURE" and isinstance(result, BackendUnavailable):
            run.unanswered = result.name or ""
        server = checker.server
        run.taken_away = (run.epoch, run.forced, run.clock) != (
            server.epoch,
            checker.force_count,
            server.clock_offset_us,
        )
        delivery.outcome = state
        sim.say(self.client.name, f"message #{message.number}: {state} {_short(result)}")
        world.checker.ended(run, state, result)
        if not delivery.acked:
            world.broker.ack(delivery)


def _quietly(call: Callable[[], Any]) -> None:
    try:
        call()
    except Exception:  # (a lost request or reply: the old library's concern)
        pass


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 100 else text[:97] + "..."


# -- the world --------------------------------------------------------------------------


class CeleryWorld:
    def __init__(self, sim: Sim, scenario: Any, checker: Any, backends: dict[int, Any]) -> None:
        self.sim = sim
        self.scenario = scenario
        self.options: CeleryOptions = scenario.celery
        self.checker = checker
        self.backends = backends
        self.task, self.tracer = _task(self.options)
        self.broker = Broker(self)
        self.workers: dict[int, Worker] = {}
        self.releasers: dict[int, Any] = {}
        self.runs: list[Run] = []
        #: id(slot greenlet) -> its run, while a body runs there
        self.in_body: dict[int, Run] = {}
        #: the publishers still publishing
        self.publishing: set[int] = set()
        #: a simulated redis-py client for a client (an old library's process)
        self.redis_for: Callable[[Client], Any] = lambda client: None
        self.done = False

    def backend_of(self, client: Client | None) -> Any:
        assert client is not None
        return self.backends[client.index]

    def releaser_of(self, client: Client | None) -> Any:
        from task_locks.celery.releaser import Releaser

        assert client is not None
        found = self.releasers.get(client.index)
        if found is None:  # a process's own releaser (its lock, condition, thread: greenlets)
            found = self.releasers[client.index] = Releaser.__new__(Releaser)
            found._reset()
        return found

    # the body of every message
    def body(self, request: Any, hold: float, writes: int) -> Any:
        from task_locks.celery import current_lease

        me = greenlet.getcurrent()
        client = self.sim.active
        assert client is not None
        worker = self.workers[client.index]
        run = worker.running[id(me)]
        run.green = SimGreen(self, run)
        self.in_body[id(me)] = run
        lease = current_lease()  # None: lock_on="enqueue" runs without a lock
        run.lease = lease
        run.body_started = True
        fence = f" (fence {lease.fence})" if lease is not None else ""
        self.sim.say(client.name, f"body of {run.task_id} starts{fence}")
        self.checker.body_started(run)
        try:
            pieces = max(1, writes)
            for _ in range(pieces):
                self._sleep(run, hold / pieces)
                if writes and lease is not None:
                    lease.check()
                    self.checker.write(client, lease)
        except BaseException:
            run.body_raised = True
            self.sim.say(client.name, f"body of {run.task_id} raised")
            raise
        finally:
            self.in_body.pop(id(me), None)
            # The body is over: nothing acts on the lock any more (its release follows).
            if lease is not None:
                self.checker.releasing.add(lease.token)
        run.body_returned = True
        run.lost_at_end = lease is not None and lease.lost.is_set()
        self.sim.say(
            client.name,
            f"body of {run.task_id} returns{' (its lease known lost)' if run.lost_at_end else ''}",
        )
        return ["done", run.task_id]

    def _sleep(self, run: Run, seconds: float) -> None:
        """The body's sleep: where an interrupt is thrown in (see :class:`SimGreen`)."""
        client = run.client
        if run.pending is not None:
            error, run.pending = run.pending, None
            raise error
        me = greenlet.getcurrent()
        timer = client.resume_at(client.sim.now + max(0.0, seconds) / client.rate, me, None)
        run.sleeping = (timer, me)
        try:
            client.park()
        finally:
            run.sleeping = None
            run.pending = None

    # the publishers
    def publisher(self, client: Client, program: Any) -> None:
        from .world import leasing_module

        leasing = leasing_module()
        assert leasing is not None
        previous: tuple[str, Any] | None = None
        try:
            with leasing.use_runtime(client.runtime):
                for index, step in enumerate(program):
                    client.sleep(step.timeout)
                    if step.release or previous is None:
                        previous = (f"{client.name}-{index}", step)
                    # (a publish again of the message before: its id and its arguments)
                    self._publish(client, previous[1], previous[0])
        finally:
            self.stopped_publishing(client)

    def stopped_publishing(self, client: Client) -> None:
        self.publishing.discard(client.index)
        self.maybe_done()

    def _publish(self, client: Client, step: Any, task_id: str) -> None:
        from task_locks.celery import DuplicateTask
        from task_locks.errors import LockError

        sim = self.sim
        sim.say(client.name, f"publishes {task_id} key {step.name!r}")
        before = len(self.broker.messages)
        self.checker.publish_began[client.index] = sim.now
        try:
            handle = self.task.apply_async((step.name, step.hold, step.writes), task_id=task_id)
        except DuplicateTask as exc:
            holder = exc.holder.owner.task_id if exc.holder is not None else None
            sim.say(client.name, f"publish of {task_id} dropped: a duplicate of {holder}")
            self.checker.dropped(client, task_id, step.name, holder)
            return
        except LockError as exc:
            sim.say(client.name, f"publish of {task_id} failed: {type(exc).__name__}")
            if isinstance(exc, BackendUnavailable):
                self.checker.unanswered_publishes[(step.name, task_id)] = client
            return
        if len(self.broker.messages) == before:
            sim.say(client.name, f"publish of {task_id} dropped: {handle.id} is queued")
            self.checker.dropped(client, task_id, step.name, handle.id)

    def peer_holds(self, client: Client, fault: Any) -> None:
        """An old library's process takes the peer key of ``fault.detail`` (SET NX PX)."""
        key, ms = f"lock:{fault.detail}", int(fault.amount * 1000)
        self.sim.say(client.name, f"an old library takes {key!r} for {ms} ms")
        if self.checker.peer_taken_at is None:
            self.checker.peer_taken_at = self.sim.now
        redis = self.redis_for(client)
        client.spawn(
            lambda: _quietly(lambda: redis.execute_command("SET", key, "x", "PX", ms, "NX"))
        )

    def maybe_done(self) -> None:
        if self.publishing or self.broker.busy():
            return
        if any(not run.ended and not run.client.dead for run in self.runs):
            return
        if not self.done:
            self.done = True
            self.sim.stop_at = min(self.sim.stop_at, self.sim.now + 1.0)


def latest_token(messages: list[Message]) -> str | None:
    """The publish-time token of the newest of ``messages``."""
    from task_locks.celery._common import TOKEN_HEADER

    newest = max(messages, key=lambda message: message.number)
    return newest.headers.get(TOKEN_HEADER)  # type: ignore[no-any-return]


def _forget_runs() -> None:
    """Drop what process-wide state kept of a run's greenlets: Celery's task and request
    stacks (keyed by greenlet) and the live-lease registry still name the runs that were
    killed or cut off, and would keep their whole world alive."""
    from celery._state import _task_stack

    from task_locks.celery.registry import live_leases

    main = greenlet.getcurrent()
    for stack in (_task_stack, *(task.request_stack for task, _ in _tasks.values())):
        storage = stack._local.__storage__
        for key in [key for key in storage if key is not main]:
            del storage[key]
    live_leases.pop_all()


def run_celery(sim: Sim, scenario: Any) -> Any:
    """Play a celery schedule (see :func:`tests.sim.scenario.run`); its Outcome."""
    global _world
    from .scenario import Outcome, _backend, _plan_fault, _url
    from .world import Net, Server, SimRedis

    server = Server(sim)
    net = Net(sim, scenario.delay)
    url = _url(scenario)
    options: CeleryOptions = scenario.celery
    clients = [Client(sim, i, rate) for i, rate in enumerate(scenario.rates)]
    operators = [Client(sim, -1 - i) for i in range(len(scenario.faults))]
    operator = operators[0] if operators else Client(sim, -1)
    probe = _backend(url, operator, server, net, 5.0)
    checker = CeleryChecker(sim, server, probe, scenario)
    server.observe = checker.observe
    checker.net = net
    sim.on_renew, sim.on_deadline = checker.lane_sent, checker.deadline
    sim.on_renewed, sim.on_lane_call = checker.lane_answered, checker.lane_call
    backends = {c.index: _backend(url, c, server, net, scenario.socket_timeout) for c in clients}
    world = CeleryWorld(sim, scenario, checker, backends)
    world.redis_for = lambda client: SimRedis(client, server, net, 5.0)
    checker.world = world
    patched = Patched()
    _world = world
    _install(patched)
    violation: list[str] = []
    try:
        checker.finished = lambda client: None
        for fault, operator_n in zip(scenario.faults, operators, strict=True):
            if fault.kind == "redeliver":
                sim.at(fault.at, lambda n=int(fault.amount): world.broker.redeliver(n))
                continue
            if fault.kind == "duplicate":
                world.broker.duplicates.add(int(fault.amount))
                continue
            if fault.kind == "peer":
                sim.at(fault.at, lambda f=fault, o=operator_n: world.peer_holds(o, f))
                continue
            _plan_fault(sim, server, net, clients, operator_n, fault, url, checker)
            if fault.kind == "kill" and fault.client >= options.publishers:
                dead = clients[fault.client]
                sim.at(fault.at, lambda c=dead: world.broker.worker_died(world.workers[c.index]))
            elif fault.kind == "kill":
                sim.at(fault.at, lambda c=clients[fault.client]: world.stopped_publishing(c))
        for client, program in zip(clients, scenario.programs, strict=True):
            if client.index < options.publishers:
                world.publishing.add(client.index)
                client.spawn(lambda c=client, p=program: world.publisher(c, p))
            else:
                worker = world.workers[client.index] = Worker(world, client)
                for _ in range(options.concurrency):
                    client.spawn(worker.slot)
        sim.after_step = checker.step
        try:
            sim.run(until=60.0)
            checker.final()
        except Violation as exc:
            violation.append(str(exc))
        finally:
            for client in (*clients, *operators):
                client.dead = True
    finally:
        patched.undo()
        _world = None
        _forget_runs()
    if violation:
        sim.say("checker", "VIOLATION " + violation[0])
    return Outcome(violation[0] if violation else None, sim.steps, sim.story)


# -- the checker ------------------------------------------------------------------------

from .scenario import Checker  # noqa: E402  (scenario imports this module lazily)
from .world import Violation  # noqa: E402


class CeleryChecker(Checker):
    """The lock checker on every run lock, plus the Celery promises (module doc)."""

    world: CeleryWorld

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bodies: list[Run] = []
        #: task id -> the messages of it the broker accepted
        self.task_ids: dict[str, list[Message]] = {}
        #: task id -> when it ended ready last
        self.ready_at: dict[str, float] = {}
        #: how many times an operator's force release freed a lock so far
        self.force_count = 0
        self.violation: Violation | None = None
        #: message number -> the server's epoch, force releases, clock when accepted
        self.snapshots: dict[int, tuple[int, int, int]] = {}
        #: when an old library first took a peer key (fault "peer"), if it did
        self.peer_taken_at: float | None = None
        #: client index -> when its publish now under way began (one at a time each)
        self.publish_began: dict[int, float] = {}
        #: publish-time tokens a run's free of its publish-time lock got no answer for
        self.unfreed: set[str] = set()
        #: (key, task id) -> the publisher, for publishes whose lock call got no answer
        self.unanswered_publishes: dict[tuple[str, str], Client] = {}
        #: task ids of deliveries acked early whose worker died before they reached a slot
        self.acked_then_killed: set[str] = set()

    def track(self, name: str, token: str | None, fence_text: str | None, who: str) -> None:
        if who.startswith("operator") and self.current.get(name) not in (None, token):
            self.force_count += 1
        super().track(name, token, fence_text, who)

    def fail(self, text: str) -> NoReturn:
        """Raise the violation, and keep it: one raised inside a run is caught by Celery's
        tracer (the worker raises it again when the tracer returns)."""
        try:
            super().fail(text)
        except Violation as exc:
            if self.violation is None:
                self.violation = exc
            raise
        raise AssertionError("unreachable")

    def granted(self, client: Client, lease: Any) -> None:
        """A redelivered copy may take over, with the same token and fence (``"both"``),
        the lock of a run whose worker was killed: a second leader of that term only
        while the first lives."""
        term = (lease.name, lease.fence)
        leader = self.terms.get(term)
        if leader is not None and any(
            w.client.dead and w.client.name == leader for w in self.world.workers.values()
        ):
            del self.terms[term]
        super().granted(client, lease)

    def accepted(self, message: Message) -> None:
        self.task_ids.setdefault(message.task_id, []).append(message)
        self.snapshots[message.number] = self._snapshot()

    def _snapshot(self) -> tuple[int, int, int]:
        server = self.server
        return server.epoch, self.force_count, server.clock_offset_us

    def _one_queued(self, run: Run) -> None:
        """``lock_on="enqueue"``: at most one queued message per key; ``"both"``: at most
        one queued or taking its publish-time lock over (docs/celery.md, "Locking at
        publish"). Judged when a message's body starts: no other publish of its key was
        accepted since it was, before its run began (``"enqueue"``) or before this body
        (``"both"``). Not after the server lost or an operator freed that lock or its
        clock stepped, nor for a message a delivery of which ended already (a failed
        take-over frees the lock) or whose worker was killed, stopped or cut off."""
        options, message = self.world.options, run.delivery.message
        if options.lock_on == "run" or message.headers.get("retries"):
            return
        if self.snapshots.get(message.number) != self._snapshot():
            return
        runs = [r for r in self.world.runs if r.delivery.message is message]
        if any(r.ended or r.client.dead or r.client.index in self.unsteady for r in runs):
            return
        if any(r.delivery.restored for r in runs):
            return  # put back while a run of it went on (which may have freed its lock)
        until = min(r.at for r in runs) if options.lock_on == "enqueue" else self.sim.now
        for other in self.world.broker.messages:
            if other.key != message.key or other.task_id == message.task_id:
                continue
            if other.headers.get("retries") or not message.at < other.at <= until:
                continue
            if options.peers and self.peer_taken_at is not None and self.peer_taken_at < other.at:
                # Open finding (seed 11723), the publish-side face of seed 691's: a "both"
                # run's PeerCheckedLock met an old library's key that came after its first
                # look, and gave way by releasing what it took, its message's publish lock
                # taken over; until its run acquires again, a publish of the key is accepted.
                continue
            self.fail(
                f"{other.publisher}'s publish of {other.task_id} was accepted at "
                f"{other.at * 1000:.3f} ms while message #{message.number} "
                f"({message.task_id}) of key {message.key!r} was queued (it ran from "
                f"{until * 1000:.3f} ms)"
            )

    def body_started(self, run: Run) -> None:
        self._one_queued(run)
        if run.lease is None:
            return  # lock_on="enqueue": the run holds no lock
        self.granted(run.client, run.lease)
        self.bodies.append(run)

    def step(self) -> None:
        super().step()
        if len(self.bodies) < 2:
            return
        sim = self.sim
        seen: dict[str, Run] = {}
        keep = []
        for run in self.bodies:
            if run.client.dead or run.body_returned or run.body_raised:
                continue
            keep.append(run)
            lease = run.lease
            if lease._released or lease.lost._set:
                continue
            previous, sim.active = sim.active, run.client
            try:
                alive = lease.held
            finally:
                sim.active = previous
            if not alive or self._exempt(lease):
                continue
            other = seen.get(run.task_id)
            if other is not None:
                self.fail(
                    f"two bodies of task {run.task_id} at once: {other.client.name} "
                    f"(fence {other.lease.fence}) and {run.client.name} (fence {lease.fence})"
                )
            seen[run.task_id] = run
        self.bodies = keep

    def deadline(self, client: Client, lease: Any) -> None:
        """The renewal rule, except for a lease whose release began (a run's guard, its
        release deferred or waiting behind the run lock's): it is renewed no more."""
        if not getattr(lease, "_releasing", False):
            super().deadline(client, lease)

    def _exempt(self, lease: Any) -> bool:
        grant = self.grants.get((lease.name, lease.token))
        return (
            grant is None
            or grant.fence != lease.fence  # (its token was granted again since: a copy's)
            or grant.epoch != self.server.epoch
            or lease.token in self.forced
        )

    def ended(self, run: Run, state: str, result: Any) -> None:
        """The tracer's outcome of one delivery, against docs/celery.md."""
        from task_locks.celery import DuplicateTask, Skipped

        options = self.world.options
        who = f"{run.client.name}'s run of {run.task_id}"
        if state in ("SUCCESS", "FAILURE"):
            self.ready_at[run.task_id] = self.sim.now
        if run.body_started:
            if run.body_raised:
                if state != "FAILURE":
                    self.fail(f"{who}: its body raised, yet it ended {state}")
                return
            if run.lost_at_end and options.on_lost != "ignore":
                if state != "FAILURE" or not isinstance(result, LockLost):
                    self.fail(
                        f"{who}: its lease was known lost when the body returned "
                        f"(on_lost={options.on_lost!r}), yet it ended {state} {_short(result)}"
                    )
                return
            if state != "SUCCESS" or result != ["done", run.task_id]:
                lost = " (lost, on_lost='ignore')" if run.lost_at_end else ""
                self.fail(f"{who}: its body returned{lost}, yet it ended {state} {_short(result)}")
            return
        # the body did not run
        if state in ("IGNORED", "RETRY"):
            if state == "RETRY" and "retry" not in (options.on_conflict, options.lock_unavailable):
                self.fail(f"{who} ended RETRY with on_conflict={options.on_conflict!r}")
            return
        if state == "SUCCESS":
            if not isinstance(result, Skipped):
                self.fail(f"{who}: no body ran, yet it ended SUCCESS {_short(result)}")
            if options.on_conflict != "skip" or options.skip_as != "success":
                self.fail(
                    f"{who}: skipped with on_conflict={options.on_conflict!r}, "
                    f"skip_as={options.skip_as!r}"
                )
            self._other_holder(who, result.holder_task_id, run)
            return
        if state != "FAILURE":
            self.fail(f"{who}: no body ran, ended {state} {_short(result)}")
        if isinstance(result, DuplicateTask):
            if options.on_conflict != "skip" or options.skip_as != "failure":
                self.fail(f"{who}: DuplicateTask with on_conflict={options.on_conflict!r}")
        elif isinstance(result, LockHeld):
            if options.on_conflict not in ("raise", "wait", "retry"):
                self.fail(f"{who}: LockHeld with on_conflict={options.on_conflict!r}")
        elif isinstance(result, (BackendUnavailable, LockLost)):
            return
        else:
            self.fail(f"{who}: no body ran, ended FAILURE {_short(result)}")
        holder = result.holder
        self._other_holder(who, holder.owner.task_id if holder is not None else None, run)

    def _other_holder(self, who: str, holder_id: str | None, run: Run) -> None:
        if holder_id is not None and holder_id == run.task_id:
            self.fail(f"{who} was skipped as a duplicate of its own task id (a copy is ignored)")

    def dropped(self, client: Client, task_id: str, key: str, holder: str | None) -> None:
        """A publish dropped as a duplicate: of a task id queued or running (or ended
        less than a run-lock TTL ago: its release may be on its way)."""
        if holder is None or holder not in self.task_ids:
            return  # the key's holder is no message (a run's retry, an old lock...)
        publisher = self.unanswered_publishes.get((key, holder))
        if publisher is not None and self.world.releaser_of(publisher).pending(key):
            # A publish of that task id got no answer, and its process is still freeing
            # what its acquire may have taken (which may land late: seed 542975).
            return
        ended = self.ready_at.get(holder)
        running = any(
            not run.ended and not run.client.dead
            for run in self.world.runs
            if run.task_id == holder
        )
        broker = self.world.broker
        # Queued, waiting for its ETA (a retry: seed 315455), or unacked with its worker
        # gone: the broker puts it back (seed 58571).
        pending = (*broker.queue, *broker.delayed, *broker.unacked)
        queued = any(d.message.task_id == holder for d in pending)
        if running or queued or ended is None:
            return
        if latest_token(self.task_ids[holder]) in self.unfreed:
            return  # a run's free of the publish-time lock got no answer (399827, 417491)
        if holder in self.acked_then_killed or any(
            r.client.dead and not r.ended and r.delivery.acked
            for r in self.world.runs
            if r.task_id == holder
        ):
            return  # a message of it was lost (acked early, then its worker killed): its key
            # stays until enqueue_ttl (docs/celery.md, "Locking at publish"; seed 265595)
        latest = max(self.task_ids[holder], key=lambda message: message.number)
        if self.snapshots.get(latest.number) != self._snapshot():
            return  # the server lost or was given back locks since (a failover's replica)
        options = self.world.options
        if any(
            r.unanswered is not None and (options.lock_on == "enqueue" or r.unanswered != r.key)
            for r in self.world.runs
            if r.delivery.message is latest
        ):
            # Open findings: an "enqueue" run whose drop of its queued lock gets no answer
            # fails (BackendUnavailable, even with lock_unavailable="retry": seed 1391), and
            # a "both" run whose guard gets none (seed 306, with the fix for the take-over);
            # either leaves the publish-time lock until enqueue_ttl. (Freeing it after the
            # guard failed raced another delivery of the message taking the token over.)
            # A "both" run whose free of that lock got no answer: ``unfreed``, above.
            return
        if {r.delivery.outcome for r in self.world.runs if r.delivery.message is latest} == {
            "IGNORED"
        }:
            # Open finding (seed 1700, "celery-both", no faults): the same task id published
            # again takes the key between the running message's two releases (its run lock,
            # then its guard), is refused as a copy by the guard, and its publish-time lock
            # stays for enqueue_ttl. Freeing it there races a duplicate of the running
            # message taking the same token over; one lock per run closes the window.
            return
        slack = self.world.options.ttl + 1.0
        # Judged from the publish's start: the server decided somewhere between then and
        # now (a reply delayed 3 s told of a refusal while the holder was queued: 589103).
        if self.publish_began.get(client.index, self.sim.now) - ended > slack:
            self.fail(
                f"{client.name}'s publish of {task_id} was dropped as a duplicate of {holder}, "
                f"which ended {(self.sim.now - ended) * 1000:.0f} ms before"
            )

    def final(self) -> None:
        """Never lost: when the broker has nothing left, every task id accepted ended ready."""
        world = self.world
        if not world.done:
            return  # cut off with work in flight (faults slowed it past the run's end)
        killed: set[str] = set(self.acked_then_killed)  # (seed 48095: its worker was paused)
        options = world.options
        for run in world.runs:
            if run.client.dead and not run.ended and run.delivery.acked:
                killed.add(run.task_id)  # acked early, then its worker killed: at most once
            if run.delivery.restored_running and run.client.dead and not run.ended:
                killed.add(run.task_id)  # see Delivery.restored_running
            if options.peers and options.lock_on == "both" and run.delivery.outcome == "IGNORED":
                # Open finding (seed 691): PeerCheckedLock gives way to a peer key that came
                # after its acquire by releasing what it took, here the message's publish
                # lock it took over: a publish of the same task id takes the key meanwhile,
                # and both messages are then refused as copies of each other.
                killed.add(run.task_id)
            if (
                run.delivery.outcome == "IGNORED"
                and run.delivery.redelivered
                and any(
                    r.client.name in self.sim.posthumous
                    for r in world.runs
                    if r.task_id == run.task_id and r.client.dead
                )
            ):
                # A redelivered copy whose watch saw its own task id's lock released
                # before its expiry took the original for alive (it finished); that
                # release was a killed worker's request still on the network (seed 79078).
                killed.add(run.task_id)
            if run.taken_away:
                # A copy refused while the server lost the lock it watched (a restart
                # without persistence, a failover: documented) or an operator freed it.
                killed.add(run.task_id)
        for task_id in self.task_ids:
            if task_id in self.ready_at or task_id in killed:
                continue
            outcomes_of = {r.delivery.outcome for r in world.runs if r.task_id == task_id}
            if len(self.task_ids[task_id]) > 1 and outcomes_of <= {"IGNORED", "", None}:
                # Open finding (seed 473039, as seed 1700's): the same task id published
                # again while its first message is still waiting; each message's run takes
                # the other's lock (a waiting mark, a publish-time lock) for a copy of
                # itself, and both are refused.
                continue
            outcomes = [
                f"{run.client.name}: {run.delivery.outcome or 'killed'}"
                for run in world.runs
                if run.task_id == task_id
            ]
            self.fail(
                f"message {task_id} was lost: its deliveries ended {', '.join(outcomes) or 'never'}"
            )
