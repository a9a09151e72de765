"""The simulator's PostgreSQL model against a real PostgreSQL: the production ``django://``
backend over each, the same operations, the same answers and the same tables after every
step.

Hypothesis draws sequences of the ``DjangoBackend`` calls a lock makes (acquire with a
token, again with the same token as a retried acquire does, renew with the TTL or
another, a batch of renewals in one transaction, release, force release of the holder
seen, of a wrong fence or of whoever holds the name, holder, holders under a prefix,
the waiter's LISTEN and re-check) and a step of the clock for one row (its
``expires_at`` moved into the past: the lock has expired, without waiting for it). Two
backends send them: one over its production pool to the test PostgreSQL, one (built by
the simulator's :func:`~tests.sim.sql_world.prototype`) over connections whose cursors
the model answers, with its clock the machine's, as the real server's is.

What differs by nature is compared loosely: durations from the database clock
(a holder's expiry, ``retry_after``) within a second, as the two sides read the clock at
slightly different moments; every TTL is long enough that nothing expires by itself
inside an example. Each example has a prefix of its own (it holds a ``_``, which the
holders' ``LIKE`` must escape), so fence counters start afresh.

Row locks between sessions (a statement waiting for another's open transaction) and
``NOTIFY`` are the tests after it, with two or three connections on each side.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.db import connections
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from django_app.backend import DjangoBackend
from task_locks.backends.base import Capability
from task_locks.errors import LockError
from task_locks.types import Owner, RenewItem

from .sql_model import PgModel, Result, Row, Session
from .sql_world import SimCursor, Wrapper, prototype

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=["default", "pg"]),
    pytest.mark.skipif("pg" not in settings.DATABASES, reason="no PostgreSQL on 127.0.0.1:5432"),
]

NAMES = ["a", "ab"]
TOKENS = ["t0", "t1"]
OWNERS = [Owner(host="h", pid=1, thread="t"), Owner(host="g", pid=2, thread="u")]
names = st.sampled_from(NAMES)
tokens = st.sampled_from(TOKENS)
ttls = st.sampled_from([30_000, 45_500, 60_000])

operations = st.one_of(
    st.tuples(st.just("acquire"), names, tokens, ttls, st.sampled_from([0, 1])),
    st.tuples(st.just("renew"), names, tokens, ttls),
    st.tuples(
        st.just("renew_many"), st.lists(st.tuples(names, tokens, ttls), min_size=2, max_size=3)
    ),
    st.tuples(st.just("release"), names, tokens),
    st.tuples(st.just("force"), names, st.sampled_from(["seen", "wrong", "any"])),
    st.tuples(st.just("holder"), names),
    st.tuples(st.just("holders"), st.sampled_from(["", "a", "ab", "b"])),
    st.tuples(st.just("wait"), names),
    st.tuples(st.just("expire"), names),
)


# -- the model's side: Django-wrapper look-alikes answered by the model at once ----------


class _ModelRaw:
    """psycopg's connection as the backend uses it: a socket for the connection cutter
    (a real one of its own, which the cutter may shut down harmlessly), no notifications
    (a wait here is never given time), and the driver's cursor for single statements."""

    def __init__(self, session: Session, wrapper: Wrapper) -> None:
        self.session = session
        self.wrapper = wrapper
        self.sockets = socket.socketpair()

    def cursor(self) -> SimCursor:
        return SimCursor(self.wrapper)

    def fileno(self) -> int:
        return self.sockets[0].fileno()

    def notifies(self, timeout: float | None = None, stop_after: int | None = None) -> Any:
        return iter(())

    def close(self) -> None:
        for end in self.sockets:
            end.close()


class _ModelWrapper(Wrapper):
    def __init__(self, model: PgModel) -> None:
        self.model = model
        self.connection: _ModelRaw | None = None

    def ensure_connection(self) -> None:
        if self.connection is None:
            self.connection = _ModelRaw(self.model.connect(), self)

    def send(self, sql: str, params: Any) -> Result:
        assert self.connection is not None
        return self.model.run(self.connection.session, sql, params)

    def is_usable(self) -> bool:
        return self.connection is not None

    def close(self) -> None:
        raw, self.connection = self.connection, None
        if raw is not None:
            self.model.disconnect(raw.session)
            raw.close()


def _now_us() -> int:
    return int(time.time() * 1_000_000)


def _model_backend(url: str, model: PgModel) -> DjangoBackend:
    from django_app.backend import _Pool

    backend: DjangoBackend = prototype(url)
    pool = _Pool(backend.alias, backend.timeout)
    pool._open = lambda: _ModelWrapper(model)  # type: ignore[method-assign]
    pool.usable = backend._ping
    backend._pool = pool
    return backend


# -- one side: a backend and what reads its table ----------------------------------------


class Side:
    def __init__(self, backend: DjangoBackend, model: PgModel | None) -> None:
        self.backend, self.model = backend, model
        self.fences: dict[str, int] = {}

    def run(self, op: tuple[Any, ...]) -> Any:
        try:
            return self._run(op)
        except LockError as exc:
            return ("error", type(exc).__name__, str(exc)[:60])

    def _run(self, op: tuple[Any, ...]) -> Any:
        kind, backend = op[0], self.backend
        if kind == "acquire":
            _, name, token, ttl, who = op
            got = backend.acquire(name, token, ttl, OWNERS[who])
            if got.fence is not None:
                self.fences[name] = got.fence
                return ("acquired", got.fence)
            return ("held", got.holder_fence, got.holder, _Approx(got.retry_after))
        if kind == "renew":
            return backend.renew(op[1], op[2], op[3])
        if kind == "renew_many":
            return backend.renew_many([RenewItem(n, t, ttl) for n, t, ttl in op[1]])
        if kind == "release":
            return backend.release(op[1], op[2])
        if kind == "force":
            _, name, which = op
            fence = {"seen": self.fences.get(name, 1), "wrong": 99, "any": None}[which]
            return backend.force_release(name, fence)
        if kind == "holder":
            return _holder(backend.holder(op[1]))
        if kind == "holders":
            return [_holder(h) for h in backend.holders(op[1])]
        if kind == "wait":  # LISTEN, the re-check, UNLISTEN: no time to wait
            return backend.wait_release(op[1], 0.0)
        if kind == "expire":
            self._expire(backend.prefix + op[1])
            return None
        raise AssertionError(op)

    def _expire(self, key: str) -> None:
        """The lock's row expired a second ago (the clock stepped past it)."""
        if self.model is not None:
            row = self.model.locks.get(key)
            if row is not None:
                self.model.locks[key] = Row(
                    row.token, row.fence, row.owner, row.acquired_us, _now_us() - 1_000_000,
                    row.renewals,
                )  # fmt: skip
            return
        with connections["pg"].cursor() as cursor:
            cursor.execute(
                "UPDATE task_locks_lock SET expires_at = now() - interval '1 second' "
                "WHERE name = %s",
                [key],
            )

    def tables(self) -> tuple[list[Any], list[Any]]:
        prefix = self.backend.prefix
        if self.model is not None:
            now = _now_us()
            rows = [
                (name, token, fence, owner, renewals, _Approx((expires - now) / 1e6))
                for name, token, fence, owner, expires, renewals in self.model.table()
                if name.startswith(prefix)
            ]
            fences = sorted((n, f) for n, f in self.model.fences.items() if n.startswith(prefix))
            return rows, fences
        with connections["pg"].cursor() as cursor:
            cursor.execute(
                "SELECT name, token, fence, owner, renewals, "
                "EXTRACT(EPOCH FROM (expires_at - now())) FROM task_locks_lock "
                "WHERE left(name, %s) = %s ORDER BY name",
                [len(prefix), prefix],
            )
            rows = [(*row[:5], _Approx(float(row[5]))) for row in cursor.fetchall()]
            cursor.execute(
                "SELECT name, fence FROM task_locks_fence WHERE left(name, %s) = %s ORDER BY name",
                [len(prefix), prefix],
            )
            return rows, [tuple(row) for row in cursor.fetchall()]


class _Approx:
    """A duration read from a database clock: equal within a second."""

    def __init__(self, value: float | None) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Approx):
            return NotImplemented
        if self.value is None or other.value is None:
            return self.value is other.value
        return abs(self.value - other.value) <= 1.0

    def __repr__(self) -> str:
        return f"~{self.value!r}"


def _holder(found: Any) -> Any:
    if found is None:
        return None
    now = time.time()
    return (
        found.name,
        found.fence,
        found.owner,
        found.token,
        found.renewals,
        _Approx(found.expires_at - now),
        _Approx(found.acquired_at - now),
    )


@pytest.fixture
def sides() -> Iterator[Any]:
    """Makes the two sides of one example (closing the last example's: each real
    backend has connections of its own)."""
    made: list[DjangoBackend] = []

    def make() -> tuple[Side, Side]:
        while made:
            made.pop().close()
        url = f"django://pg?prefix=d{uuid.uuid4().hex[:8]}_"
        real = DjangoBackend(url)
        model = PgModel(_now_us)
        simulated = _model_backend(url, model)
        made.extend((real, simulated))
        return Side(real, None), Side(simulated, model)

    yield make
    while made:
        made.pop().close()


@hypothesis_settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(operations, min_size=1, max_size=20))
def test_the_model_answers_as_postgresql_does(sides: Any, ops: list[tuple[Any, ...]]) -> None:
    real, model = sides()
    for step, op in enumerate(ops):
        got_real, got_model = real.run(op), model.run(op)
        assert got_real == got_model, (step, op, got_real, got_model)
        assert real.tables() == model.tables(), (step, op)


def test_the_simulated_backend_is_made_as_the_real_one() -> None:
    """The simulator makes its ``DjangoBackend`` without a Django project: the same
    attributes, with the same values, as the production constructor sets."""
    url = "django://pg?prefix=p_&timeout=2.5"
    real, simulated = DjangoBackend(url), prototype(url)
    try:
        assert set(vars(real)) == set(vars(simulated))
        for name in ("url", "server", "alias", "prefix", "max_name_length", "timeout"):
            assert getattr(real, name) == getattr(simulated, name), name
        assert real.dialect.vendor == simulated.dialect.vendor == "postgresql"
        assert real.dialect.take_pg_sql() == simulated.dialect.take_pg_sql()
        assert simulated.capabilities == real.capabilities - {Capability.RELEASE_NOTICE}
    finally:
        real.close()


@contextlib.contextmanager
def _connections(count: int, keys: list[str]) -> Iterator[list[Any]]:
    """``count`` psycopg connections to the test PostgreSQL, opened as the backend opens
    its own (autocommit); closed afterwards, and the lock rows of ``keys`` deleted."""
    real = DjangoBackend("django://pg")
    wrappers = [real.new_connection() for _ in range(count)]
    try:
        for wrapper in wrappers:
            wrapper.ensure_connection()
        yield [wrapper.connection for wrapper in wrappers]
    finally:
        for wrapper in wrappers:
            if wrapper.connection is not None:
                wrapper.connection.close()
        with connections["pg"].cursor() as cursor:
            cursor.execute("DELETE FROM task_locks_lock WHERE name = ANY(%s)", [keys])
        real.close()


# -- row locks: a statement that waits for another session's open transaction -------------

RENEW = (
    "UPDATE task_locks_lock SET expires_at = now() + %s * interval '1 millisecond', "
    "renewals = renewals + 1 WHERE name = %s AND token = %s AND expires_at > now()"
)
FORCE = (
    "WITH d AS (DELETE FROM task_locks_lock WHERE name = %s AND expires_at > now() "
    "RETURNING name, fence) SELECT pg_notify(%s, name), pg_notify(%s, fence || '|' || name) "
    "FROM d"
)
RELEASE = (
    "WITH d AS (DELETE FROM task_locks_lock WHERE name = %s AND token = %s AND expires_at > "
    "now() RETURNING name, fence) SELECT pg_notify(%s, name), "
    "set_config('synchronous_commit', 'off', true) FROM d"
)
#: (whether the lock "a", held by t0, had expired; what the first session does in its
#: open transaction; the second session's statement that waits for it; how the first
#: ends; whether the second's client goes away while its statement waits).
ROW_LOCK_CASES: dict[str, tuple[bool, list[Any], Any, str, bool]] = {
    "force release after a renewal commits": (False, [("renew", "t0")], "force", "COMMIT", False),
    "force release after a release commits": (False, [("release", "t0")], "force", "COMMIT", False),
    "force release after a release rolls back": (
        False, [("release", "t0")], "force", "ROLLBACK", False
    ),
    "same-token acquire after a renewal": (
        False, [("renew", "t0")], ("acquire", "t0"), "COMMIT", False
    ),
    "takeover behind a takeover": (True, [("acquire", "t1")], ("acquire", "t2"), "COMMIT", False),
    "takeover behind one rolled back": (
        True, [("acquire", "t1")], ("acquire", "t2"), "ROLLBACK", False
    ),
    # PostgreSQL notices a gone client only when it answers: the statement still commits
    # (a call the connection cutter gave up on may land later).
    "force release of a client gone while it waited": (
        False, [("renew", "t0")], "force", "COMMIT", True
    ),
}  # fmt: skip


def _statement(what: Any, key: str) -> tuple[str, Any]:
    from django_app.backend import CHANNEL, FORCED_CHANNEL, _Dialect

    kind, token = (what, None) if isinstance(what, str) else what
    if kind == "acquire":
        params = {"name": key, "token": token, "owner": "{}", "ttl": 30_000}
        return _Dialect("postgresql").take_pg_sql(), params
    if kind == "renew":
        return RENEW, [45_500, key, token]
    if kind == "release":
        return RELEASE, [key, token, CHANNEL]
    return FORCE, [key, CHANNEL, FORCED_CHANNEL]


def _answer(rows: list[tuple[Any, ...]], what: Any) -> Any:
    """What the backend reads of a statement's rows (fence and holder for an acquire)."""
    if not isinstance(what, str) and what[0] == "acquire":
        return [row[:3] for row in rows]
    return len(rows)


def _activity(backend_pid: int) -> Any:
    """The session's row in ``pg_stat_activity`` (None once its process has ended)."""
    with connections["pg"].cursor() as cursor:
        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [backend_pid])
        return cursor.fetchone()


def _blocked(backend_pid: int) -> bool:
    row = _activity(backend_pid)
    return row is not None and row[0] == "Lock"


@pytest.mark.parametrize("case", sorted(ROW_LOCK_CASES))
def test_a_statement_waits_for_a_transaction_as_on_postgresql(case: str) -> None:
    """Two sessions: the first leaves a transaction open after writing the row; the
    second's statement waits for its row lock, then re-checks the newest version (or
    finds the row another transaction took and commits nothing of its own). The model's
    answer and tables agree with PostgreSQL's."""
    from tests.servers import wait_until

    expired, first_steps, waiting, end, gone = ROW_LOCK_CASES[case]
    key = f"r{uuid.uuid4().hex[:8]}_a"
    with _connections(3, [key]) as (setup, first, second):
        model = PgModel(_now_us)
        m_setup, m_first, m_second = model.connect(), model.connect(), model.connect()
        # the lock, held by t0 (or expired a second ago)
        sql, params = _statement(("acquire", "t0"), key)
        setup.execute(sql, params)
        model.run(m_setup, sql, params)
        if expired:
            setup.execute(
                "UPDATE task_locks_lock SET expires_at = now() - interval '1 second' "
                "WHERE name = %s",
                [key],
            )
            row = model.locks[key]
            model.locks[key] = Row(
                row.token, row.fence, row.owner, row.acquired_us, _now_us() - 1_000_000, 0
            )
        first.execute("BEGIN")
        model.run(m_first, "BEGIN")
        for what in first_steps:
            sql, params = _statement(what, key)
            first.execute(sql, params)
            model.run(m_first, sql, params)
        sql, params = _statement(waiting, key)
        real_rows: list[Any] = []

        def wait() -> None:
            try:
                real_rows.append(second.execute(sql, params).fetchall())
            except Exception as exc:  # the socket shut down under it (gone)
                real_rows.append(exc)

        thread = threading.Thread(target=wait)
        thread.start()
        pid = second.info.backend_pid
        wait_until(lambda: _blocked(pid), 10, "the statement to wait")
        model_got: list[Result] = []
        model.submit(m_second, sql, params, model_got.append)
        assert not model_got, "the model's statement must wait too"
        if gone:  # as the connection cutter does
            with socket.socket(fileno=os.dup(second.fileno())) as cut:
                cut.shutdown(socket.SHUT_RDWR)
            thread.join(10)
            model.disconnect(m_second)
        first.execute(end)
        model.run(m_first, end)
        thread.join(10)
        assert not thread.is_alive()
        assert model_got, "the model's statement must go on when the first session ends"
        if gone:  # no answer; the statement ran on, then its process saw the client gone
            wait_until(lambda: _activity(pid) is None, 10, "the statement's session to end")
        else:
            assert _answer(real_rows[0], waiting) == _answer(model_got[0].rows, waiting)
        with connections["pg"].cursor() as cursor:
            cursor.execute(
                "SELECT l.token, l.fence, l.renewals, f.fence FROM task_locks_fence f "
                "LEFT JOIN task_locks_lock l ON l.name = f.name WHERE f.name = %s",
                [key],
            )
            real_table = cursor.fetchall()
        left = model.locks.get(key)
        model_table = [
            (
                left.token if left else None,
                left.fence if left else None,
                left.renewals if left else None,
                model.fences[key],
            )
        ]
        assert real_table == model_table


def test_notifications_as_on_postgresql() -> None:
    """A release's ``NOTIFY`` reaches a session that ``LISTEN``s when the release commits,
    once per transaction for the same payload, and never from a transaction rolled back
    (the next notification is the one after it), on both."""
    from django_app.backend import CHANNEL

    keys = [f"n{uuid.uuid4().hex[:8]}_{name}" for name in ("a", "b")]
    model = PgModel(_now_us)
    heard: list[tuple[str, str]] = []
    with _connections(2, keys) as (listener, writer):
        m_listener, m_writer = model.connect(), model.connect()
        m_listener.notify = lambda channel, payload: heard.append((channel, payload))
        listener.execute(f"LISTEN {CHANNEL}")
        model.run(m_listener, f"LISTEN {CHANNEL}")

        def both(sql: str, params: Any = None) -> None:
            writer.execute(sql, params)
            model.run(m_writer, sql, params)

        for key in keys:
            both(*_statement(("acquire", "t0"), key))
        both("BEGIN")
        both(*_statement(("release", "t0"), keys[0]))
        both("ROLLBACK")
        both("BEGIN")
        both(*_statement(("release", "t0"), keys[0]))
        both(*_statement(("acquire", "t1"), keys[0]))
        both(*_statement(("release", "t1"), keys[0]))
        both("COMMIT")
        both(*_statement(("release", "t0"), keys[1]))
        got = []
        for note in listener.notifies(timeout=10, stop_after=2):
            got.append((note.channel, note.payload))
        assert got == heard == [(CHANNEL, keys[0]), (CHANNEL, keys[1])]


def test_a_restart_keeps_commits_and_ends_what_was_running() -> None:
    """The model's clean restart (no real server restarts here): committed rows stay, an
    open transaction's writes are rolled back, and a statement waiting for its row lock
    never runs (its session died with the server)."""
    model = PgModel(_now_us)
    holder, renewer, forcer = model.connect(), model.connect(), model.connect()
    model.run(holder, *_statement(("acquire", "t0"), "k"))
    committed = model.locks["k"]
    model.run(renewer, "BEGIN")
    assert model.run(renewer, *_statement(("renew", "t0"), "k")).rowcount == 1
    answered: list[Result] = []
    model.submit(forcer, *_statement("force", "k"), answered.append)
    model.restart()
    assert not answered
    assert model.locks["k"] == committed
    assert model.fences["k"] == 1
    assert not model.owners and not model.waiters and not model.sessions


def test_a_delete_that_waited_past_the_expiry_still_deletes() -> None:
    """``now()`` is the statement's start, also for the re-check after a row-lock wait:
    a release that waited for a renewal transaction (rolled back in the end) deletes the
    row although its expiry passed while it waited, on PostgreSQL and in the model (the
    simulator's checker counts that release as the holder's, not as the expiry's)."""
    from tests.servers import wait_until

    key = f"x{uuid.uuid4().hex[:8]}_a"
    model = PgModel(_now_us)
    with _connections(3, [key]) as (setup, first, second):
        sessions = [model.connect() for _ in range(3)]
        sql, params = _statement(("acquire", "t0"), key)
        params["ttl"] = 1000
        setup.execute(sql, params)
        model.run(sessions[0], sql, params)
        for raw, session in ((first, sessions[1]), (None, sessions[1])):
            if raw is not None:
                raw.execute("BEGIN")
                raw.execute(*_statement(("renew", "t0"), key))
            else:
                model.run(session, "BEGIN")
                model.run(session, *_statement(("renew", "t0"), key))
        sql, params = _statement(("release", "t0"), key)
        real_rows: list[Any] = []
        thread = threading.Thread(
            target=lambda: real_rows.append(second.execute(sql, params).fetchall())
        )
        thread.start()
        pid = second.info.backend_pid
        wait_until(lambda: _blocked(pid), 10, "the release to wait")
        model_got: list[Result] = []
        model.submit(sessions[2], sql, params, model_got.append)
        assert not model_got

        def expired() -> bool:
            with connections["pg"].cursor() as cursor:
                cursor.execute(
                    "SELECT expires_at <= now() FROM task_locks_lock WHERE name = %s", [key]
                )
                return bool(cursor.fetchone()[0])

        row = model.committed(key)
        assert row is not None
        wait_until(
            lambda: expired() and row.expires_us <= _now_us(), 10, "the committed expiry to pass"
        )
        first.execute("ROLLBACK")
        model.run(sessions[1], "ROLLBACK")
        thread.join(10)
        assert len(real_rows[0]) == len(model_got[0].rows) == 1  # deleted: "released"
        assert key not in model.locks
