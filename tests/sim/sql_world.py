"""The simulated world's PostgreSQL: the model of :mod:`tests.sim.sql_model` on virtual
time, reached over the simulated network through the connections of the production
``DjangoBackend``'s own pool.

The seam is the Django connection wrapper: the backend's production ``_Pool`` (checkout,
check-in, the idle ping, discarding a failed connection) runs unchanged, but opens a
:class:`SimWrapper` where it would open a Django ``DatabaseWrapper``. Everything above it
(the acquire's statement and its race retry, the same-token retry after a connection
error, renewals in one transaction, the token- and fence-checked deletes with their
``NOTIFY``, ``LISTEN`` and the waiter's re-check, the deadline of every call) is the
production code. Why there and not lower (psycopg's socket): Django's wrapper and cursor
are plain blocking calls, which a greenlet can park; below them psycopg waits in C.

What the wrapper reproduces of Django and psycopg 3:

- a statement is one request and one reply on the connection (FIFO both ways); an error
  on the wire is Django's ``OperationalError`` (psycopg's as its cause), so the backend's
  ``_cursor`` turns it into ``BackendUnavailable`` as it does in production;
- psycopg has no read timeout: a call waits until its reply, a reset, or the backend's
  connection cutter (``_ConnectionCutter``, replaced by :class:`SimCutter` on the
  client's monotonic clock) shuts the socket at the call's deadline; the server sees the
  connection close one network delay later (lost in a partition) and rolls back;
- the server ends a session idle inside a transaction after
  ``idle_in_transaction_session_timeout`` (the backend sets it to its timeout);
- notifications of a ``LISTEN`` reach the client over the network and wait in the
  connection's backlog until ``notifies()`` reads them (psycopg 3.2+ keeps them).

Faults: the scenario's message faults by request number (lost, delayed, reset before or
after the server applied it), partitions, pauses, clock rates; the server's clock steps
(``now()``); a restart keeps every committed row (the database is durable) and resets every
connection; a "failover" is the same restart. Release notices (``LISTEN
task_locks_forced`` in a thread of its own) are not simulated: the backends here do not
declare ``Capability.RELEASE_NOTICE``.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import greenlet

from .sql_model import PgModel, Result, Row, Session
from .world import Client, Net, Sim, SimTime

EPOCH_US = 1_700_000_000_000_000


def _errors() -> tuple[type[Exception], type[Exception]]:
    """Django's ``OperationalError`` and psycopg's (the cause Django wraps)."""
    import psycopg
    from django.db import OperationalError

    return OperationalError, psycopg.OperationalError


def _failure(message: str) -> Exception:
    django_error, driver_error = _errors()
    cause = driver_error(message)
    error = django_error(message)
    error.__cause__ = cause
    return error


class SqlSimServer:
    """One PostgreSQL on virtual time: the model, its clock, connections, restarts."""

    name = "postgres"

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.clock_offset_us = 0
        self.model = PgModel(self.now_us)
        self.model.on_commit = self._committed
        self.model.on_wait = self._waits
        #: The database is durable: a restart loses no grant (the checker's epoch).
        self.epoch = 0
        self.restarts = 0
        self.down_until = -1.0
        self.observe: Callable[[Any, tuple[Any, ...]], None] | None = None
        self.wires: dict[int, Wire] = {}  # session number -> its connection
        #: session number -> its client, also after its connection closed (a statement
        #: that waited for a row lock commits after its client went away)
        self.clients: dict[int, Client] = {}
        self._next_fileno = 1000

    def now_us(self) -> int:
        return EPOCH_US + int(self.sim.now * 1_000_000) + self.clock_offset_us

    def up(self) -> bool:
        return self.sim.now >= self.down_until

    def fileno(self) -> int:
        self._next_fileno += 1
        return self._next_fileno

    def _committed(self, session: Session) -> None:
        if self.observe is not None:
            self.observe(self.clients.get(session.number), ("SQL",))

    def _waits(self, session: Session, key: tuple[str, str], holder: Session) -> None:
        if self.sim.record:
            who, whose = self.clients.get(session.number), self.clients.get(holder.number)
            self.sim.say(
                self.name,
                f"{who.name if who else '?'}'s statement waits for the row lock on {key[1]} "
                f"held by {whose.name if whose else '?'}'s transaction",
            )

    # faults ----------------------------------------------------------------------------
    def restart(self, downtime: float, quiet: bool = False) -> None:
        if not quiet:
            self.sim.say(self.name, f"RESTART, every commit kept (down {downtime * 1000:.0f} ms)")
        self.restarts += 1
        self.down_until = self.sim.now + downtime
        self.model.restart()
        wires, self.wires = self.wires, {}
        for wire in wires.values():
            wire.reset_later()
        if self.observe is not None:
            self.observe(None, ("RESTART",))

    def snapshot(self) -> None:
        return None

    def failover(self, replica: Any, lag: float) -> None:
        self.sim.say(self.name, "failover: a restart with every commit kept")
        self.restart(0.0, quiet=True)

    def step_clock(self, delta_us: int) -> None:
        self.sim.say(self.name, f"clock steps {delta_us / 1000:+.1f} ms")
        self.clock_offset_us += delta_us
        if self.observe is not None:
            self.observe(None, ("CLOCK",))

    # sessions --------------------------------------------------------------------------
    def open(self, wire: Wire, idle_timeout_us: int) -> Session:
        session = self.model.connect(idle_timeout_us)
        session.notify = wire.notified
        self.wires[session.number] = wire
        self.clients[session.number] = wire.client
        return session

    def close(self, session: Session) -> None:
        self.wires.pop(session.number, None)
        self.model.disconnect(session)

    def statement(
        self, wire: Wire, sql: str, params: Any, answer: Callable[[Result], None]
    ) -> None:
        session = wire.session
        assert session is not None

        def done(result: Result) -> None:
            if self.sim.record:
                self.sim.say(self.name, f"{wire.client.name}: {_describe(sql, params, result)}")
            self._idle_check(wire, session)
            answer(result)

        self.model.submit(session, sql, params, done)

    def _idle_check(self, wire: Wire, session: Session) -> None:
        xact = session.xact
        if xact is None or not xact.explicit or not session.idle_timeout_us or session.closed:
            return
        activity = session.activity

        def check() -> None:
            if self.model.idle_expired(session, activity):
                self.sim.say(self.name, f"ends {wire.client.name}'s session idle in a transaction")
                self.wires.pop(session.number, None)
                wire.reset_later()

        self.sim.at(self.sim.now + session.idle_timeout_us / 1e6, check)


def _describe(sql: str, params: Any, result: Result) -> str:
    words = " ".join(sql.split())
    if words.startswith("WITH live"):
        what = f"acquire {params.get('name')} ttl {params.get('ttl')}"
    elif words.startswith("UPDATE"):
        what = f"renew {params[1]} ttl {params[0]}"
    elif words.startswith("WITH d AS"):
        what = ("release " if "token" in words else "force release ") + str(params[0])
    else:
        what = words if len(words) < 60 else words[:57] + "..."
    rows = repr(result.rows)
    return f"{what} -> {rows if len(rows) < 100 else rows[:97] + '...'} ({result.rowcount})"


class _Pending:
    """One statement (or the startup handshake) in flight: its answer once it arrives."""

    __slots__ = ("answer",)

    def __init__(self) -> None:
        self.answer: Result | None = None


class Wire:
    """One TCP connection of a client to the server: requests and replies in order."""

    def __init__(self, client: Client, server: SqlSimServer, net: Net, cutter: SimCutter) -> None:
        self.client, self.server, self.net, self.cutter = client, server, net, cutter
        self.restarts = server.restarts
        self.session: Session | None = None
        self.broken = False
        self.fileno = server.fileno()
        self.deadline = math.inf  # the cutter's, on the client's monotonic clock
        self.armed: Any = None
        self.backlog: deque[Any] = deque()
        self._waiter: greenlet.greenlet | None = None
        self._last_arrival = 0.0
        self._last_reply = 0.0
        cutter.wires[self.fileno] = self

    # client side -------------------------------------------------------------------
    def connect(self, idle_timeout_us: int, connect_timeout: float) -> None:
        """The startup handshake: one round trip (a partition makes it time out)."""
        client, sim, server = self.client, self.client.sim, self.server
        if not server.up():
            raise _failure("connection refused (simulated): is the server running?")
        pending = _Pending()

        def arrive() -> None:
            if not server.up() or self.restarts != server.restarts or self.broken:
                return
            self.session = server.open(self, idle_timeout_us)
            if self.net.cut(client, sim.now):
                return
            sim.at(sim.now + self.net.delay(), lambda: self._deliver(pending, Result()))

        if not self.net.cut(client, sim.now):
            sim.at(sim.now + self.net.delay(), arrive)
        try:
            self._wait(pending, client.monotonic() + connect_timeout, "connection timeout expired")
        except Exception:
            self.close()
            raise

    def query(self, sql: str, params: Any) -> Result:
        client, sim = self.client, self.client.sim
        self._check_cut()
        if self.broken or self.restarts != self.server.restarts:
            self.broken = True
            raise _failure("the connection is closed (simulated)")
        client.requests += 1
        number = client.requests
        fault = self.net.faults.get((client.index, number))
        kind, amount = fault if fault else ("", 0.0)
        if fault:
            sim.say(client.name, f"request #{number}: fault {kind} {amount or ''}")
        if kind == "reset_before":
            self._drop()
            raise _failure("server closed the connection unexpectedly (simulated, before sending)")
        pending = _Pending()
        arrival = sim.now + self.net.delay() + (amount if kind == "delay_request" else 0.0)
        arrival = self._last_arrival = max(arrival, self._last_arrival)
        if kind == "drop_request" or self.net.cut(client, sim.now):
            sim.say(client.name, f"request #{number} lost")
        else:
            reply_fault = kind if kind in ("drop_reply", "reset_after", "delay_reply") else ""

            def arrive() -> None:
                session = self.session
                if self.restarts != self.server.restarts or session is None or session.closed:
                    return  # the connection died meanwhile
                self.server.statement(
                    self,
                    sql,
                    params,
                    lambda r: self._reply(pending, r, reply_fault, amount, number),
                )

            sim.at(arrival, arrive)
        return self._wait(pending, self.deadline, "")

    def _wait(self, pending: _Pending, deadline: float, timeout_message: str) -> Result:
        client = self.client
        while pending.answer is None:
            if self.broken or self.restarts != self.server.restarts:
                self._drop()
                raise _failure("server closed the connection unexpectedly (simulated)")
            if deadline <= client.monotonic():
                if timeout_message:
                    raise _failure(timeout_message + " (simulated)")
                self._cut()
                raise _failure("consuming input failed: the socket was shut down (simulated)")
            self._park(deadline)
        return pending.answer

    def _park(self, deadline: float) -> None:
        """Wait for a wake-up (a reply, a reset, a notification) or ``deadline`` on the
        client's monotonic clock."""
        client = self.client
        me = greenlet.getcurrent()
        self._waiter = me
        left = deadline - client.monotonic()
        timer = client.resume_at(client.sim.now + left / client.rate, me, None)
        client.park()
        timer.cancelled = True
        self._waiter = None

    def _check_cut(self) -> None:
        if self.client.monotonic() >= self.deadline:
            self._cut()
            raise _failure("the socket was shut down (simulated)")

    def _cut(self) -> None:
        """The cutter shuts the socket down at the call's deadline."""
        if self.armed is not None:
            self.armed.fired = True
        self.client.sim.say(self.client.name, "the connection cutter shuts a call's socket")
        self._drop()

    def _drop(self) -> None:
        """The client's end is gone: the server hears of it one delay later (FIN/RST)."""
        if self.broken:
            return
        self.broken = True
        session, sim = self.session, self.client.sim
        if session is None or self.net.cut(self.client, sim.now):
            return
        restarts = self.restarts

        def fin() -> None:
            if restarts == self.server.restarts:
                self.server.close(session)

        sim.at(sim.now + self.net.delay(), fin)

    def close(self) -> None:
        self._drop()
        self.cutter.wires.pop(self.fileno, None)

    def notifies(self, timeout: float | None) -> Iterator[Any]:
        """psycopg's ``notifies(timeout=..., stop_after=1)``: the backlog, else wait."""
        _, driver_error = _errors()
        client = self.client
        deadline = math.inf if timeout is None else client.monotonic() + timeout
        while True:
            if self.backlog:
                yield self.backlog.popleft()
                return
            if self.broken or self.restarts != self.server.restarts:
                raise driver_error("consuming input failed: server closed the connection")
            now = client.monotonic()
            if now >= self.deadline:
                self._cut()
                raise driver_error("consuming input failed: the socket was shut down")
            if now >= deadline:
                return
            self._park(min(deadline, self.deadline))

    # server side -------------------------------------------------------------------
    def _reply(self, pending: _Pending, result: Result, fault: str, amount: float, n: int) -> None:
        sim, client = self.client.sim, self.client
        if fault == "drop_reply" or self.net.cut(client, sim.now):
            sim.say(client.name, f"reply to #{n} lost")
            return
        if fault == "reset_after":
            sim.say(client.name, f"connection reset after #{n} was applied")
            session = self.session
            if session is not None:
                self.server.close(session)
            self.reset_later()
            return
        arrival = sim.now + self.net.delay() + (amount if fault == "delay_reply" else 0.0)
        arrival = self._last_reply = max(arrival, self._last_reply)
        sim.at(arrival, lambda: self._deliver(pending, result))

    def _deliver(self, pending: _Pending, result: Result) -> None:
        if self.broken:
            return
        pending.answer = result
        self._wake()

    def reset_later(self) -> None:
        def reset() -> None:
            self.broken = True
            self._wake()

        self.client.sim.at(self.client.sim.now + self.net.delay(), reset)

    def notified(self, channel: str, payload: str) -> None:
        sim, client = self.client.sim, self.client
        if self.net.cut(client, sim.now):
            return  # lost with the partition (the waiter re-checks the row in time)
        note = _Notify(channel, payload)

        def arrive() -> None:
            if not self.broken:
                self.backlog.append(note)
                self._wake()

        sim.at(sim.now + self.net.delay(), arrive)

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            self.client._resume(waiter, None)


class _Notify:
    __slots__ = ("channel", "payload")

    def __init__(self, channel: str, payload: str) -> None:
        self.channel, self.payload = channel, payload


class _Armed:
    """The cutter's ``_Deadline``: whether it fired."""

    __slots__ = ("done", "fired", "wire")

    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self.done = self.fired = False


class SimCutter:
    """``django_app.backend._cutter`` on virtual time: a call's deadline is on its
    connection, which shuts itself down when a wait reaches it."""

    def __init__(self) -> None:
        self.wires: dict[int, Wire] = {}

    def arm(self, fileno: int, seconds: float) -> _Armed:
        wire = self.wires[fileno]
        armed = _Armed(wire)
        wire.armed = armed
        wire.deadline = wire.client.monotonic() + seconds
        return armed

    def disarm(self, armed: _Armed) -> bool:
        armed.done = True
        wire = armed.wire
        if wire.armed is armed:
            wire.armed, wire.deadline = None, math.inf
        return armed.fired


class SimRawConnection:
    """What the backend uses of psycopg's connection: its socket, ``notifies()`` and
    ``cursor()`` (the backend's single statements run on the driver's own cursor)."""

    def __init__(self, wire: Wire, wrapper: Any) -> None:
        self.wire = wire
        self.wrapper = wrapper

    def cursor(self) -> SimCursor:
        return SimCursor(self.wrapper)

    def fileno(self) -> int:
        return self.wire.fileno

    def notifies(self, timeout: float | None = None, stop_after: int | None = None) -> Any:
        return self.wire.notifies(timeout)

    def close(self) -> None:
        self.wire.close()


class SimCursor:
    """Django's cursor wrapper: each ``execute`` is the wrapper's ``query``."""

    def __init__(self, wrapper: Any) -> None:
        self.db = wrapper
        self.rowcount = -1
        self._rows: list[tuple[Any, ...]] = []

    def __enter__(self) -> SimCursor:
        return self

    def __exit__(self, *exc: object) -> None:
        self._rows = []

    def execute(self, sql: str, params: Any = None) -> None:
        result = self.db.query(sql, params)
        self._rows, self.rowcount = list(result.rows), result.rowcount

    def fetchone(self) -> Any:
        return self._rows.pop(0) if self._rows else None

    def fetchall(self) -> list[tuple[Any, ...]]:
        rows, self._rows = self._rows, []
        return rows


class Wrapper:
    """What the backend uses of a Django ``DatabaseWrapper``: a connection made on first
    use (:meth:`ensure_connection`), cursors whose statements go to :meth:`send`."""

    vendor = "postgresql"
    connection: Any = None
    #: Django's query-instrumentation hooks: none, so the backend uses the driver's cursor.
    execute_wrappers: tuple[Any, ...] = ()
    #: Django maps the driver's errors to its own here; the model raises Django's already.
    wrap_database_errors = contextlib.nullcontext()

    def inc_thread_sharing(self) -> None:
        pass

    def ensure_connection(self) -> None:
        raise NotImplementedError

    def send(self, sql: str, params: Any) -> Result:
        raise NotImplementedError

    def cursor(self) -> SimCursor:
        self.ensure_connection()
        return SimCursor(self)

    def query(self, sql: str, params: Any) -> Result:
        """One statement (Django connects on a cursor's first use)."""
        self.ensure_connection()
        return self.send(sql, params)


class SimWrapper(Wrapper):
    """A Django ``DatabaseWrapper`` look-alike over the simulated network."""

    def __init__(
        self, client: Client, server: SqlSimServer, net: Net, cutter: SimCutter, timeout: float
    ) -> None:
        self.client, self.server, self.net, self.cutter = client, server, net, cutter
        # As _Pool._own_settings sets them for PostgreSQL.
        seconds = max(1, math.ceil(timeout))
        self.connect_timeout = float(max(2, seconds))
        self.idle_timeout_us = seconds * 1_000_000
        self.connection: SimRawConnection | None = None

    def ensure_connection(self) -> None:
        if self.connection is None:
            wire = Wire(self.client, self.server, self.net, self.cutter)
            wire.connect(self.idle_timeout_us, self.connect_timeout)
            self.connection = SimRawConnection(wire, self)

    def send(self, sql: str, params: Any) -> Result:
        assert self.connection is not None
        return self.connection.wire.query(sql, params)

    def is_usable(self) -> bool:
        if self.connection is None:
            return False
        try:
            self.connection.wire.query("SELECT 1", None)
        except Exception:
            return False
        return True

    def close(self) -> None:
        raw, self.connection = self.connection, None
        if raw is not None:
            raw.close()


# -- the checker's view, a client's backend, the module patches ----------------------------


def sql_checker(base: type) -> type:
    """The scenario's checker (``base``), reading each name's holder from the committed
    rows: live while its ``expires_at`` is after the server's clock."""

    class SqlChecker(base):  # type: ignore[misc]
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            #: name -> the grant whose row is in the table (live or not)
            self.present: dict[str, tuple[str, int] | None] = {}

        def observe(self, conn: Any, command: tuple[Any, ...]) -> None:
            who = "restart" if conn is None else conn.name
            present = self.present
            for name, key in self.keys.items():
                there = self.server.model.committed(key)
                grant = (there.token, there.fence) if there is not None else None
                gone = present.get(name)
                if gone is not None and grant is None and conn is not None:
                    self._deleted(gone, who)
                present[name] = grant
                row = self._row(key)
                if row is None:
                    if there is not None and there.token == self.current[name]:
                        # The row is there but no longer live: a renewal that waited for
                        # the row lock set its expiry from its own (older) now(), already
                        # past at commit (seeds 544711, 656455). It expired; nobody
                        # removed it.
                        self.removed_by.setdefault((there.token, there.fence), "expiry")
                    self.track(name, None, None, who)
                    continue
                token, fence = row.token, str(row.fence)
                if (
                    self.current[name] is None
                    and self.last_fence.get(name) == row.fence
                    and (name, token) in self.grants
                ):
                    self._live_again(name, token, row.fence)
                    continue
                self.track(name, token, fence, who)

        def _deleted(self, grant: tuple[str, int], who: str) -> None:
            """``who``'s statement deleted the row of ``grant``. Every delete the backend
            sends checks ``expires_at > now()`` with ``now()`` its start, also when it
            waited for the row lock of another transaction meanwhile (a renewal's): a row
            whose expiry passed during that wait is still deleted, and it was ``who``
            that removed it (nobody else could take the locked row), not its expiry."""
            if self.removed_by.get(grant) == "expiry":
                self.removed_by[grant] = who
                if who.startswith("operator"):
                    self.forced.add(grant[0])

        def _live_again(self, name: str, token: str, fence: int) -> None:
            """A grant whose row had expired is live again: a renewal whose transaction
            began before the expiry (its ``now()``), or the server's clock stepped back.
            Not a new grant; nobody took the row meanwhile (else the token differs)."""
            self.sim.say("checker", f"{name!r}: fence {fence} live again")
            self.current[name] = token
            self.current_fence[name] = str(fence)
            self.removed_by.pop((token, fence), None)
            self.expiry[name] = self._expiry_sim(self.keys[name])
            self._taken(name)

        def _row(self, key: Any) -> Row | None:
            server: SqlSimServer = self.server
            row = server.model.committed(key)
            return row if row is not None and row.expires_us > server.now_us() else None

        def _alive(self, key: Any) -> bool:
            return self._row(key) is not None

        def _expiry_sim(self, key: Any) -> float | None:
            server: SqlSimServer = self.server
            row = server.model.committed(key)
            if row is None:
                return None
            return (row.expires_us - EPOCH_US - server.clock_offset_us) / 1e6

    return SqlChecker


_prototypes: dict[str, Any] = {}


def prototype(url: str) -> Any:
    """A ``DjangoBackend`` for ``url`` on PostgreSQL, made without a Django project (the
    simulator runs without settings or a database): the attributes its ``__init__``
    sets, from the URL (the differential test checks the two agree)."""
    from django_app.backend import DEFAULT_TIMEOUT, DjangoBackend, _Dialect
    from task_locks.backends.base import Backend, Capability
    from task_locks.lock import MAX_NAME_LENGTH

    backend = DjangoBackend.__new__(DjangoBackend)
    Backend.__init__(backend, url)
    parts = urlsplit(url)
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    backend.alias = parts.netloc or "default"
    backend.prefix = options.get("prefix", "")
    backend.max_name_length = MAX_NAME_LENGTH - len(backend.prefix)
    backend.timeout = float(options.get("timeout", DEFAULT_TIMEOUT))
    backend._pool = None  # type: ignore[assignment]
    backend._dialect = _Dialect("postgresql")
    backend.capabilities = DjangoBackend.capabilities | {Capability.WAKEUP}  # type: ignore[misc]
    return backend


def sql_backend(url: str, client: Client, server: SqlSimServer, net: Net, timeout: float) -> Any:
    """A client's own ``DjangoBackend``: the production pool, opening simulated wrappers."""
    import copy

    from django_app.backend import _Pool

    base = _prototypes.get(url)
    if base is None:
        base = _prototypes[url] = prototype(url)
    backend = copy.copy(base)
    pool = _Pool(backend.alias, backend.timeout)
    cutter = _cutter_of(server)
    pool._open = lambda: SimWrapper(client, server, net, cutter, backend.timeout)  # type: ignore[method-assign]
    pool.usable = backend._ping
    backend._pool = pool
    backend._key = lambda name: backend.prefix + name  # the checker's key of a name
    return backend


def _cutter_of(server: SqlSimServer) -> SimCutter:
    import django_app.backend as module

    cutter = module._cutter
    assert isinstance(cutter, SimCutter), "sql_world.install() first"
    return cutter


def install(sim: Sim, patches: Any) -> SqlSimServer:
    """The server, and the backend module's clock and connection cutter on virtual time
    (undone with the run's other patches)."""
    import django_app.backend as module

    for attribute, fake in (("time", SimTime(sim)), ("_cutter", SimCutter())):
        patches._saved.append((module, attribute, getattr(module, attribute)))
        setattr(module, attribute, fake)
    return SqlSimServer(sim)
