"""A simulated PostgreSQL for the ``django://`` backend: the statements it sends, answered as
PostgreSQL answers them.

Only the statement texts the production ``DjangoBackend`` sends on PostgreSQL are
understood (keyed by their text with whitespace normalised; see :data:`ACQUIRE` and the
shapes of :meth:`PgModel._dispatch`); anything else raises :class:`UnknownStatement`, so
a backend that starts sending something new fails loudly instead of being answered as
something else. The semantics the lock protocol relies on:

- rows of ``task_locks_lock`` (name, token, fence, owner, acquired_at, expires_at,
  renewals) and the fence counters of ``task_locks_fence``; timestamps in whole
  microseconds, as ``timestamptz`` keeps them; ``EXTRACT(EPOCH FROM ...)`` answered as the
  ``numeric`` PostgreSQL returns (a ``Decimal`` with six places);
- transactions: a statement outside ``BEGIN`` is its own transaction; ``now()`` is the
  start of the transaction (of ``BEGIN``, or of the statement); ``COMMIT``/``ROLLBACK``;
  a session that ends (its client gone, ``idle_in_transaction_session_timeout``, a
  restart) rolls its open transaction back;
- READ COMMITTED visibility and row locks: each statement reads the rows as committed
  when it started (and its own transaction's writes); an ``UPDATE``/``DELETE`` whose
  snapshot row matches takes the row lock, waiting behind another open transaction that
  holds it, then re-checks its ``WHERE`` on the newest version with its own ``now()``
  (EvalPlanQual; skipped if it no longer matches or was deleted: a row whose expiry
  passed during the wait still matches ``expires_at > now()``); ``INSERT ... ON CONFLICT DO UPDATE`` locks the
  newest version of the conflicting row and evaluates its ``WHERE`` there. A statement
  blocked on a lock is finished when the lock is free even if its client went away
  meanwhile (PostgreSQL notices a vanished client only when it writes the answer): an
  autocommit statement then commits;
- ``NOTIFY`` (``pg_notify``) delivered at commit to every session that ``LISTEN``s on the
  channel, identical notifications of one transaction once.

Not modelled: a crash that loses the last asynchronously committed transactions (a
release commits with ``synchronous_commit`` off; ``DjangoBackend._delete`` says why that
is safe); a restart here is a clean one, every commit kept. Nor statement time: a
statement runs the moment it arrives, unless it waits for a row lock.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

LOCKS = "task_locks_lock"
FENCES = "task_locks_fence"


class UnknownStatement(AssertionError):
    """The backend sent a statement the model does not interpret."""


@dataclass(frozen=True)
class Row:
    token: str
    fence: int
    owner: str
    acquired_us: int
    expires_us: int
    renewals: int


#: A row lock's key: ("lock", name) or ("fence", name).
Key = tuple[str, str]


@dataclass
class Result:
    rows: list[tuple[Any, ...]] = field(default_factory=list)
    rowcount: int = -1


@dataclass
class Xact:
    start_us: int
    explicit: bool
    #: the committed version of each row this transaction wrote, for a rollback
    undo: dict[Key, Any] = field(default_factory=dict)
    locks: set[Key] = field(default_factory=set)
    notifies: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Session:
    """One backend process: its transaction, channels, and the statement it runs."""

    number: int
    #: told of each notification delivered to this session (channel, payload)
    notify: Callable[[str, str], None] = lambda channel, payload: None
    idle_timeout_us: int = 0
    xact: Xact | None = None
    listening: set[str] = field(default_factory=set)
    running: bool = False
    closed: bool = False
    #: bumped by every statement; the idle-in-transaction timer checks it did not move
    activity: int = 0


Step = Generator[Key, None, Result]


def normalise(sql: str) -> str:
    return " ".join(sql.split())


#: The acquire: ``_Dialect.take_pg_sql()`` as PostgreSQL reads it; its same-token refresh
#: (``mine``) assigns what :data:`MINE_SETS` lists, interpreted item by item.
ACQUIRE = normalise(
    "WITH live AS (SELECT token, fence, owner, acquired_at, expires_at "
    f"FROM {LOCKS} WHERE name = %(name)s AND expires_at > now()), "
    f"mine AS (UPDATE {LOCKS} SET owner = %(owner)s, expires_at = "
    "now() + %(ttl)s * interval '1 millisecond' "
    "WHERE name = %(name)s AND token = %(token)s AND expires_at > now() "
    "RETURNING fence), "
    f"bump AS (INSERT INTO {FENCES} (name, fence) SELECT %(name)s, 1 "
    "WHERE NOT EXISTS (SELECT 1 FROM live) "
    f"ON CONFLICT (name) DO UPDATE SET fence = {FENCES}.fence + 1 RETURNING fence), "
    f"took AS (INSERT INTO {LOCKS} "
    "(name, token, fence, owner, acquired_at, expires_at, renewals) "
    "SELECT %(name)s, %(token)s, bump.fence, %(owner)s, now(), "
    "now() + %(ttl)s * interval '1 millisecond', 0 FROM bump "
    "ON CONFLICT (name) DO UPDATE SET token = excluded.token, "
    "fence = excluded.fence, owner = excluded.owner, "
    "acquired_at = excluded.acquired_at, expires_at = excluded.expires_at, "
    f"renewals = 0 WHERE {LOCKS}.expires_at <= now() RETURNING fence) "
    "SELECT COALESCE((SELECT fence FROM took), (SELECT fence FROM mine)), "
    "live.token, live.fence, live.owner, EXTRACT(EPOCH FROM (live.acquired_at - now())), "
    "EXTRACT(EPOCH FROM (live.expires_at - now())) FROM (SELECT 1) AS one "
    "LEFT JOIN live ON true"
)
_MINE = "owner = %(owner)s, expires_at = now() + %(ttl)s * interval '1 millisecond'"
_ACQUIRE = re.compile(re.escape(ACQUIRE).replace(re.escape(_MINE), "(?P<mine>.+?)", 1) + r"\Z")
#: What the acquire's ``mine`` may set: the owner, the expiry from this request.
MINE_SETS = {
    "owner = %(owner)s": "owner",
    "expires_at = now() + %(ttl)s * interval '1 millisecond'": "expires",
}
_UPDATE = re.compile(rf"^UPDATE {LOCKS} SET (?P<sets>.+?) WHERE (?P<where>.+)$")
_DELETE = re.compile(
    rf"^WITH d AS \(DELETE FROM {LOCKS} WHERE (?P<where>.+?) RETURNING name, fence\) "
    r"SELECT (?P<select>.+) FROM d$"
)
_COLUMNS = (
    "name, token, fence, owner, EXTRACT(EPOCH FROM (acquired_at - now())), "
    "EXTRACT(EPOCH FROM (expires_at - now())), renewals"
)
_SELECT = re.compile(
    rf"^SELECT (?P<columns>{re.escape(_COLUMNS)}|1) FROM {LOCKS} WHERE (?P<where>.+?)"
    r"(?P<order> ORDER BY name)?$"
)
_LATER = "now() + %s * interval '1 millisecond'"


def seconds(us: int) -> Decimal:
    """``EXTRACT(EPOCH FROM interval)``: numeric seconds with six places."""
    return Decimal(us).scaleb(-6)


def _equals(column: str, value: Any) -> Callable[[str, Row, int], bool]:
    if column == "name":
        return lambda name, row, now: name == value
    if column == "token":
        return lambda name, row, now: row.token == value
    return lambda name, row, now: row.fence == int(value)


def _later(ttl_us: int) -> Callable[[Row, int], Row]:
    return lambda row, now: replace(row, expires_us=now + ttl_us)


def _renewed(row: Row, now: int) -> Row:
    return replace(row, renewals=row.renewals + 1)


def _notify(channel: str, with_fence: bool) -> Callable[[str, Row], tuple[str, str]]:
    if with_fence:
        return lambda name, row: (channel, f"{row.fence}|{name}")
    return lambda name, row: (channel, name)


def _live(name: str, row: Row, now: int) -> bool:
    return row.expires_us > now


def _like(pattern: re.Pattern[str]) -> Callable[[str, Row, int], bool]:
    return lambda name, row, now: pattern.match(name) is not None


def _holder(row: Row, now: int) -> tuple[Any, ...]:
    """A holder's columns as the backend selects them: the durations from ``now()``."""
    return (
        row.token,
        row.fence,
        row.owner,
        seconds(row.acquired_us - now),
        seconds(row.expires_us - now),
    )


def _items(text: str) -> list[str]:
    """A comma-separated list split at its top level (not inside parentheses)."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:index].strip())
            start = index + 1
    items.append(text[start:].strip())
    return items


def like(pattern: str, escape: str = "!") -> re.Pattern[str]:
    out, chars = [], iter(pattern)
    for char in chars:
        if char == escape:
            out.append(re.escape(next(chars, "")))
        elif char == "%":
            out.append(".*")
        elif char == "_":
            out.append(".")
        else:
            out.append(re.escape(char))
    return re.compile("".join(out) + r"\Z", re.DOTALL)


class PgModel:
    """One PostgreSQL database with the two tables; ``now_us`` is its clock."""

    def __init__(self, now_us: Callable[[], int]) -> None:
        self.now_us = now_us
        #: the newest version of each row (an open transaction's write included)
        self.locks: dict[str, Row] = {}
        self.fences: dict[str, int] = {}
        self.owners: dict[Key, Session] = {}
        self.waiters: dict[Key, deque[tuple[Session, Step, Callable[[Result], None]]]] = {}
        self.sessions: list[Session] = []
        self._numbers = 0
        #: told when a session's transaction (or statement) ended; the world's hooks
        self.on_commit: Callable[[Session], None] = lambda session: None
        #: told when a session's statement waits for a row lock another one holds
        self.on_wait: Callable[[Session, Key, Session], None] = lambda s, key, holder: None

    # -- sessions ----------------------------------------------------------------------
    def connect(self, idle_timeout_us: int = 0) -> Session:
        self._numbers += 1
        session = Session(self._numbers, idle_timeout_us=idle_timeout_us)
        self.sessions.append(session)
        return session

    def disconnect(self, session: Session) -> None:
        """The client went away: roll back, unless a statement is running (it finishes
        first, as PostgreSQL notices a gone client only when it answers)."""
        if session.closed:
            return
        session.closed = True
        session.listening.clear()
        if not session.running:
            self._end(session)

    def restart(self) -> None:
        """A clean restart: every session ends, open transactions roll back, statements
        waiting for a lock are gone; committed rows stay."""
        self.waiters.clear()  # first: a rollback below must not run them
        for session in list(self.sessions):
            session.closed = True
            session.running = False
            if session.xact is not None:
                self._rollback(session)
        self.sessions = []
        self.owners.clear()

    def idle_expired(self, session: Session, activity: int) -> bool:
        """``idle_in_transaction_session_timeout``: end the session if it is still idle in
        the transaction it was in at ``activity``."""
        if session.closed or session.running or session.activity != activity:
            return False
        if session.xact is None or not session.xact.explicit:
            return False
        self.disconnect(session)
        return True

    def _end(self, session: Session) -> None:
        if session.xact is not None:
            self._rollback(session)
        if session in self.sessions:
            self.sessions.remove(session)

    # -- statements --------------------------------------------------------------------
    def submit(
        self,
        session: Session,
        sql: str,
        params: Any,
        done: Callable[[Result], None],
    ) -> None:
        """Run one statement; ``done`` gets its result now, or once the row locks it waits
        for are free. A session runs one statement at a time."""
        assert not session.running, "a session runs one statement at a time"
        session.activity += 1
        text = normalise(sql)
        if text in ("BEGIN", "START TRANSACTION"):
            if session.xact is None:
                session.xact = Xact(self.now_us(), explicit=True)
            done(Result())
            return
        if text in ("COMMIT", "END"):
            if session.xact is not None:
                self._commit(session)
            done(Result())
            return
        if text == "ROLLBACK":
            if session.xact is not None:
                self._rollback(session)
            done(Result())
            return
        if session.xact is None:
            session.xact = Xact(self.now_us(), explicit=False)
        step = self._dispatch(session, text, params)
        session.running = True
        self._advance(session, step, done)

    def run(self, session: Session, sql: str, params: Any = None) -> Result:
        """:meth:`submit` for a caller that cannot wait (one session at a time)."""
        got: list[Result] = []
        self.submit(session, sql, params, got.append)
        if not got:
            raise AssertionError(f"statement blocked on a row lock: {normalise(sql)[:80]}")
        return got[0]

    def _take(self, session: Session, key: Key) -> None:
        self.owners[key] = session
        assert session.xact is not None
        session.xact.locks.add(key)

    def _advance(self, session: Session, step: Step, done: Callable[[Result], None]) -> None:
        """Run ``step`` until it needs a row lock someone else holds (it queues) or ends."""
        try:
            while True:
                key = next(step)
                holder = self.owners.get(key)
                if holder is None or holder is session:
                    self._take(session, key)
                    continue
                self._check_no_deadlock(session, holder)
                self.waiters.setdefault(key, deque()).append((session, step, done))
                self.on_wait(session, key, holder)
                return
        except StopIteration as stop:
            result: Result = stop.value
        session.running = False
        xact = session.xact
        if xact is not None and not xact.explicit:
            self._commit(session)
        if session.closed:
            self._end(session)
        done(result)

    def _check_no_deadlock(self, session: Session, holder: Session) -> None:
        seen = {session.number}
        while True:
            if holder.number in seen:
                raise AssertionError("a deadlock between the backend's statements")
            seen.add(holder.number)
            blocked_on = next(
                (k for k, q in self.waiters.items() if any(s is holder for s, _, _ in q)), None
            )
            if blocked_on is None:
                return
            holder = self.owners[blocked_on]

    # -- transactions ------------------------------------------------------------------
    def _commit(self, session: Session) -> None:
        """Make the transaction's writes the committed ones and send its notifications;
        only then free its row locks, so a statement that waited for them runs after
        the commit it waited for (and the world hears of the two in that order)."""
        xact = session.xact
        assert xact is not None
        session.xact = None
        seen = set()
        for note in xact.notifies:
            if note in seen:
                continue
            seen.add(note)
            for other in list(self.sessions):
                if note[0] in other.listening and not other.closed:
                    other.notify(*note)
        self.on_commit(session)
        self._release(xact)

    def _rollback(self, session: Session) -> None:
        xact = session.xact
        assert xact is not None
        session.xact = None
        for (table, name), old in xact.undo.items():
            store: dict[str, Any] = self.locks if table == "lock" else self.fences
            if old is None:
                store.pop(name, None)
            else:
                store[name] = old
        self.on_commit(session)
        self._release(xact)

    def _release(self, xact: Xact) -> None:
        for key in xact.locks:
            if self.owners.get(key) is not None:
                del self.owners[key]
        for key in list(xact.locks):
            queue = self.waiters.get(key)
            while queue and key not in self.owners:
                session, step, done = queue.popleft()
                if not queue and self.waiters.get(key) is queue:
                    del self.waiters[key]
                self._take(session, key)
                self._advance(session, step, done)

    # -- rows --------------------------------------------------------------------------
    def _visible(self, session: Session | None, key: Key) -> Any:
        """The version ``session`` sees: the newest, unless another open transaction
        wrote it (then the committed one it replaced; ``None``: the committed one)."""
        holder = self.owners.get(key)
        store: dict[str, Any] = self.locks if key[0] == "lock" else self.fences
        if holder is not None and holder is not session and holder.xact is not None:
            if key in holder.xact.undo:
                return holder.xact.undo[key]
        return store.get(key[1])

    def _write(self, session: Session, key: Key, value: Any) -> None:
        xact = session.xact
        assert xact is not None and self.owners.get(key) is session
        store: dict[str, Any] = self.locks if key[0] == "lock" else self.fences
        if key not in xact.undo:
            xact.undo[key] = store.get(key[1])
        if value is None:
            store.pop(key[1], None)
        else:
            store[key[1]] = value

    def _now(self, session: Session) -> int:
        assert session.xact is not None
        return session.xact.start_us

    # -- the statements ----------------------------------------------------------------
    def _dispatch(self, session: Session, text: str, params: Any) -> Step:
        found = _ACQUIRE.match(text)
        if found:
            sets = []
            for item in _items(found["mine"]):
                if item not in MINE_SETS:
                    raise UnknownStatement(f"the SQL model does not know the assignment {item!r}")
                sets.append(MINE_SETS[item])
            return self._acquire(session, params, sets)
        if text == "SELECT 1":
            return self._constant([(1,)])
        if text in (f"LISTEN {CHANNEL}", f"UNLISTEN {CHANNEL}"):
            (session.listening.add if text[0] == "L" else session.listening.discard)(CHANNEL)
            return self._constant([])
        found = _UPDATE.match(text)
        if found:
            return self._update(session, found["sets"], found["where"], list(params or ()))
        found = _DELETE.match(text)
        if found:
            return self._delete(session, found["where"], found["select"], list(params or ()))
        found = _SELECT.match(text)
        if found:
            return self._select(
                session, found["columns"] == "1", found["where"], bool(found["order"]),
                list(params or ()),
            )  # fmt: skip
        raise UnknownStatement(f"the SQL model does not know this statement: {text}")

    @staticmethod
    def _constant(rows: list[tuple[Any, ...]]) -> Step:
        return Result(rows, len(rows))
        yield  # a generator that needs no lock

    def _where(self, where: str, params: list[Any]) -> Callable[[str, Row | None, int], bool]:
        """A conjunction of the conditions the backend writes, as a predicate of a row
        (its name, the version, the statement's now); consumes its parameters."""
        tests: list[Callable[[str, Row, int], bool]] = []
        for atom in where.split(" AND "):
            if atom in ("name = %s", "token = %s", "fence = %s"):
                tests.append(_equals(atom.split(" ")[0], params.pop(0)))
            elif atom == "expires_at > now()":
                tests.append(_live)
            elif atom == "name LIKE %s ESCAPE '!'":
                tests.append(_like(like(str(params.pop(0)))))
            else:
                raise UnknownStatement(f"the SQL model does not know the condition {atom!r}")
        return lambda n, r, now: r is not None and all(t(n, r, now) for t in tests)

    def _update(self, session: Session, sets: str, where: str, params: list[Any]) -> Step:
        assignments: list[Callable[[Row, int], Row]] = []
        for item in _items(sets):
            if item == f"expires_at = {_LATER}":
                assignments.append(_later(int(params.pop(0)) * 1000))
            elif item == "renewals = renewals + 1":
                assignments.append(_renewed)
            else:
                raise UnknownStatement(f"the SQL model does not know the assignment {item!r}")
        match = self._where(where, params)
        now = self._now(session)
        count = 0
        for name in sorted(self._names()):
            key = ("lock", name)
            if not match(name, self._visible(session, key), now):
                continue
            yield key
            row = self.locks.get(name)  # the newest version, re-checked
            if not match(name, row, now):
                continue
            assert row is not None
            for assign in assignments:
                row = assign(row, now)
            self._write(session, key, row)
            count += 1
        return Result([], count)

    def _delete(self, session: Session, where: str, select: str, params: list[Any]) -> Step:
        match = self._where(where, params)
        channels: list[Callable[[str, Row], tuple[str, str]]] = []
        columns: list[Any] = []
        for item in _items(select):
            if item == "pg_notify(%s, name)":
                channels.append(_notify(str(params.pop(0)), with_fence=False))
                columns.append(None)
            elif item == "pg_notify(%s, fence || '|' || name)":
                channels.append(_notify(str(params.pop(0)), with_fence=True))
                columns.append(None)
            elif item == "set_config('synchronous_commit', 'off', true)":
                columns.append("off")
            else:
                raise UnknownStatement(f"the SQL model does not know {item!r} after DELETE")
        now = self._now(session)
        rows = []
        for name in sorted(self._names()):
            key = ("lock", name)
            if not match(name, self._visible(session, key), now):
                continue
            yield key
            row = self.locks.get(name)
            if not match(name, row, now):
                continue
            assert row is not None and session.xact is not None
            self._write(session, key, None)
            session.xact.notifies.extend(make(name, row) for make in channels)
            rows.append(tuple(columns))
        return Result(rows, len(rows))

    def _select(
        self, session: Session, one: bool, where: str, order: bool, params: list[Any]
    ) -> Step:
        match = self._where(where, params)
        now = self._now(session)
        rows = []
        for name in sorted(self._names()):
            row = self._visible(session, ("lock", name))
            if not match(name, row, now):
                continue
            rows.append((1,) if one else (name, *_holder(row, now), row.renewals))
        return Result(rows, len(rows))
        yield  # reads take no lock

    def _acquire(self, session: Session, params: dict[str, Any], sets: list[str]) -> Step:
        name, token, owner = str(params["name"]), str(params["token"]), str(params["owner"])
        ttl_us = int(params["ttl"]) * 1000
        now = self._now(session)
        lock_key: Key = ("lock", name)
        seen: Row | None = self._visible(session, lock_key)  # the statement's snapshot
        live = seen if seen is not None and seen.expires_us > now else None
        mine = None
        if live is not None and live.token == token:  # mine: UPDATE ... RETURNING fence
            yield lock_key
            row = self.locks.get(name)
            if row is not None and row.token == token and row.expires_us > now:
                if "owner" in sets:
                    row = replace(row, owner=owner)
                if "expires" in sets:
                    row = replace(row, expires_us=now + ttl_us)
                self._write(session, lock_key, row)
                mine = row.fence
        took = None
        if live is None:  # bump: the counter's next value, on its newest version
            fence_key: Key = ("fence", name)
            yield fence_key
            bump = self.fences.get(name, 0) + 1
            self._write(session, fence_key, bump)
            # took: insert, or take over the newest version if it has expired
            yield lock_key
            row = self.locks.get(name)
            if row is None or row.expires_us <= now:
                self._write(session, lock_key, Row(token, bump, owner, now, now + ttl_us, 0))
                took = bump
        fence = took if took is not None else mine
        if live is None:
            return Result([(fence, None, None, None, None, None)], 1)
        return Result([(fence, *_holder(live, now))], 1)

    # -- what a checker or a test reads -------------------------------------------------
    def table(self) -> list[tuple[str, str, int, str, int, int]]:
        """The committed lock rows (name, token, fence, owner, expires_us, renewals)."""
        rows = []
        for name in sorted(self._names()):
            row = self.committed(name)
            if row is not None:
                rows.append((name, row.token, row.fence, row.owner, row.expires_us, row.renewals))
        return rows

    def committed(self, name: str) -> Row | None:
        row: Row | None = self._visible(None, ("lock", name))
        return row

    def _names(self) -> set[str]:
        """Every lock row's name, those an open transaction deleted included."""
        names = set(self.locks)
        for s in self.sessions:
            if s.xact is not None:
                names |= {k[1] for k, v in s.xact.undo.items() if k[0] == "lock" and v}
        return names


#: The channel releases NOTIFY (``django_app.backend.CHANNEL``).
CHANNEL = "task_locks"
