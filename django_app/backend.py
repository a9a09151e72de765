"""``django://ALIAS``: locks in a table of a Django database (SQLite, PostgreSQL, MySQL).

Why a database: it is already there, it is the truth for the data the lock protects,
and its commits are durable, so fences never repeat (``task_locks_fence`` keeps one
counter row per name, never deleted).

How it stays correct:

- **Expiry by the database clock.** Every comparison and every new ``expires_at`` is
  computed in SQL from the database's own clock (``now()``, ``UTC_TIMESTAMP(6)``,
  SQLite's ``'now'``); client clocks never decide whether a lock is free. (SQLite is
  embedded: its clock is the operating-system clock of the process using it.)
- **One short transaction per operation.** Acquire is a conditional upsert that takes
  the row only if it is absent or expired (or, for the token that holds it, refreshes
  its expiry and owner and keeps its fence), then bumps the fence counter, then
  commits; renew and release are single token-checked statements, a force release
  with a fence a single fence-checked one. Nothing is held open between operations,
  and the server ends a transaction whose client vanished within the timeout
  (PostgreSQL's ``idle_in_transaction_session_timeout``, MariaDB's
  ``idle_transaction_timeout``). On PostgreSQL an acquire is ONE prepared statement
  (:meth:`_Dialect.take_pg_sql`) and a release one ``DELETE`` with its ``NOTIFY``: a
  cycle is two round trips and one durable commit (the acquire's: its fence must
  survive a crash; a release does not wait for its WAL flush, see :meth:`_delete`).
- **Wake-ups.** On PostgreSQL a release sends ``NOTIFY task_locks`` and waiters
  ``LISTEN``, so a hand-off costs about one round trip; elsewhere waiters poll the row
  with a short, growing pause (at most ``POLL_MAX``). Either way a waiter never waits
  longer than the holder's remaining TTL.
- **Every call has a deadline** (``?timeout=``, default :data:`DEFAULT_TIMEOUT` s). A
  network that stops answering makes the call raise ``BackendUnavailable`` in about that
  long, never hang: PostgreSQL connections are cut at the deadline by a thread of
  their own (psycopg has no read timeout), MySQL's driver has its own read/write
  timeouts. An acquire whose outcome is unknown (its COMMIT's reply was lost, the
  connection reset) is retried once, at once,
  on a fresh connection with the *same token*: the same-token acquire is idempotent
  (same fence, fresh TTL), so a lock committed whose reply was lost is returned to its
  caller instead of staying held by nobody's lease until its TTL. Renew, release and
  force release are not retried: a retried release would answer "not ours" for a
  delete that did happen; their ``BackendUnavailable`` says the outcome is unknown.
- **Own connections.** Operations use connections of their own (a small pool per
  backend, opened from the alias's settings), never the request's or task's
  ``connections[alias]``: a lock taken inside someone's ``transaction.atomic()`` must
  be visible to other processes at once and must not vanish on their rollback. This
  also makes the backend safe from Celery workers and plain threads; after ``fork()``
  a child opens fresh connections and never touches its parent's.

Settings: outside a Django project (a plain script, the ``task-locks`` CLI, a test
process) set ``DJANGO_SETTINGS_MODULE`` to settings whose ``DATABASES`` has the alias and
run ``manage.py migrate`` once; the backend calls ``django.setup()`` itself if nobody
has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from task_locks.backends.base import Backend, Capability, RunChecked, unknown_options
from task_locks.backends.notices import Notice, NoticeStream, close_streams, retired, track
from task_locks.errors import BackendUnavailable, InvalidArgument
from task_locks.lock import MAX_NAME_LENGTH as NAME_LENGTH  # the name column's size
from task_locks.types import AcquireResult, Holder, Owner, RenewItem, RunCheck, parse_slot

LOCKS = "task_locks_lock"
FENCES = "task_locks_fence"
#: The longest TTL a row is written with: one year, the bound ``task_locks`` validates
#: TTLs against (repeated here so that no caller can make this backend write a row whose
#: expiry the database cannot compute; every column type holds it on every database).
MAX_TTL_MS = 365 * 24 * 3600 * 1000
#: Seconds a call may take before it fails with ``BackendUnavailable`` (``?timeout=``).
DEFAULT_TIMEOUT = 5.0
#: Pooled connections idle longer than this are pinged before use.
PING_AFTER = 30.0
MAX_IDLE = 8
#: wait(): first and longest pause between polls of the holder's row.
POLL_FIRST = 0.01
POLL_MAX = 0.2
#: PostgreSQL: releases NOTIFY this channel (payload: the lock's name); waiters LISTEN.
CHANNEL = "task_locks"
#: PostgreSQL: a force release also NOTIFYs this one (payload ``<fence>|<name>``), which
#: the holder's process LISTENs on (:mod:`task_locks.notices`): its own channel, so that
#: the listener never wakes for an ordinary release.
FORCED_CHANNEL = "task_locks_forced"
#: Why a lease is lost when PostgreSQL announced its force release.
FORCED_NOTICE = "it was force-released (an operator's release, announced by PostgreSQL)"
#: PostgreSQL: an acquire that lost a race since its snapshot is re-run at most this often.
RACE_RETRIES = 5
#: PostgreSQL: a waiter re-reads the row at least this often, in case a NOTIFY was missed.
NOTIFY_RECHECK = 1.0

# Connections inherited through fork(): kept referenced so they are never closed from
# the child (closing would end the parent's session on some drivers).
_inherited: list[Any] = []


class _Dialect:
    """The few SQL fragments that differ between databases."""

    def __init__(self, vendor: str) -> None:
        self.vendor = vendor
        self._take_pg: str | None = None
        if vendor == "postgresql":
            self.now = "now()"
            self.later = "now() + %s * interval '1 millisecond'"
            self.begin = "BEGIN"
        elif vendor == "mysql":
            self.now = "UTC_TIMESTAMP(6)"
            self.later = "UTC_TIMESTAMP(6) + INTERVAL %s MICROSECOND"
            self.begin = "START TRANSACTION"
        elif vendor == "sqlite":
            self.now = "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now')"
            self.later = "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', %s)"
            # IMMEDIATE takes the write lock up front: no deadlock on lock upgrade.
            self.begin = "BEGIN IMMEDIATE"
        else:
            raise InvalidArgument(
                f"the django:// backend supports PostgreSQL, MySQL/MariaDB and SQLite, "
                f"not {vendor!r}"
            )

    def ttl_param(self, ttl_ms: int) -> object:
        if self.vendor == "mysql":
            return ttl_ms * 1000
        if self.vendor == "sqlite":
            return f"+{ttl_ms / 1000:.3f} seconds"
        return ttl_ms

    def seconds_until(self, column: str) -> str:
        """SQL for the seconds from the database's now to ``column`` (negative if past)."""
        if self.vendor == "postgresql":
            return f"EXTRACT(EPOCH FROM ({column} - now()))"
        if self.vendor == "mysql":
            return f"TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), {column}) / 1000000.0"
        return f"(julianday({column}) - julianday('now')) * 86400.0"

    def take_sql(self) -> str:
        """Insert the row, or take over an expired one, or (same token) refresh ours.

        A live row of another token is left untouched. A live row of the same token (a
        retried acquire whose reply was lost, a queued lock becoming the run lock) keeps
        its fence and ``acquired_at`` but takes this request's expiry and owner: the
        caller counts its lease from this request's send time.
        """
        values = f"VALUES (%s, %s, 0, %s, {self.now}, {self.later}, 0)"
        columns = "(name, token, fence, owner, acquired_at, expires_at, renewals)"
        if self.vendor == "mysql":
            # Assignments run left to right and see earlier ones: expires_at goes last
            # so every condition reads the old value (token only changes when expired,
            # and then equals the new one, so "ours" stays true after it).
            expired = f"expires_at <= {self.now}"
            ours = f"({expired} OR token = VALUES(token))"
            sets = ", ".join(
                f"{col} = IF({when}, {new}, {col})"
                for col, when, new in [
                    ("token", expired, "VALUES(token)"),
                    ("fence", expired, "0"),
                    ("owner", ours, "VALUES(owner)"),
                    ("acquired_at", expired, "VALUES(acquired_at)"),
                    ("renewals", expired, "0"),
                    ("expires_at", ours, "VALUES(expires_at)"),
                ]
            )
            return f"INSERT INTO {LOCKS} {columns} {values} ON DUPLICATE KEY UPDATE {sets}"
        expired = f"{LOCKS}.expires_at <= {self.now}"
        return (
            f"INSERT INTO {LOCKS} {columns} {values} ON CONFLICT (name) DO UPDATE SET "
            "token = excluded.token, owner = excluded.owner, expires_at = excluded.expires_at, "
            f"fence = CASE WHEN {expired} THEN 0 ELSE {LOCKS}.fence END, "
            f"acquired_at = CASE WHEN {expired} THEN excluded.acquired_at "
            f"ELSE {LOCKS}.acquired_at END, "
            f"renewals = CASE WHEN {expired} THEN 0 ELSE {LOCKS}.renewals END "
            f"WHERE {expired} OR {LOCKS}.token = excluded.token"
        )

    def bump_fence_sql(self) -> str:
        if self.vendor == "mysql":
            return (
                f"INSERT INTO {FENCES} (name, fence) VALUES (%s, 1) "
                "ON DUPLICATE KEY UPDATE fence = fence + 1"
            )
        return (
            f"INSERT INTO {FENCES} (name, fence) VALUES (%s, 1) "
            f"ON CONFLICT (name) DO UPDATE SET fence = {FENCES}.fence + 1"
        )

    def take_pg_sql(self) -> str:
        """:meth:`_take_pg_sql`, built once (a dialect's SQL never changes)."""
        sql = self._take_pg
        if sql is None:
            sql = self._take_pg = self._take_pg_sql()
        return sql

    def _take_pg_sql(self) -> str:
        """PostgreSQL: the whole acquire as ONE statement (one round trip, one commit).

        Parameters by name: ``name``, ``token``, ``owner``, ``ttl``. The sub-statements:

        - ``live``: the live row, if any, in the statement's snapshot;
        - ``mine``: that row is this token's: refresh its expiry and owner, keep its
          fence (re-checked on the latest row version, as any UPDATE);
        - ``bump``: no live row: the fence counter's next value, taken on the counter
          row's latest version under its row lock, so no two bumps return the same
          value and a later commit never gets a smaller one;
        - ``took``: insert the row with that fence, or take over the row if it has
          expired on its latest version; a row someone took since the snapshot stays
          theirs (that fence is then never used: fences may skip, never repeat).

        A lock held by someone else writes nothing (no commit to flush). The final
        SELECT answers with the fence we got, else the snapshot's live holder; neither
        (a race lost since the snapshot) means "try again at once".
        """
        later = "now() + %(ttl)s * interval '1 millisecond'"
        return (
            "WITH live AS (SELECT token, fence, owner, acquired_at, expires_at "
            f"FROM {LOCKS} WHERE name = %(name)s AND expires_at > now()), "
            f"mine AS (UPDATE {LOCKS} SET owner = %(owner)s, expires_at = {later} "
            "WHERE name = %(name)s AND token = %(token)s AND expires_at > now() "
            "RETURNING fence), "
            f"bump AS (INSERT INTO {FENCES} (name, fence) SELECT %(name)s, 1 "
            "WHERE NOT EXISTS (SELECT 1 FROM live) "
            f"ON CONFLICT (name) DO UPDATE SET fence = {FENCES}.fence + 1 RETURNING fence), "
            f"took AS (INSERT INTO {LOCKS} "
            "(name, token, fence, owner, acquired_at, expires_at, renewals) "
            f"SELECT %(name)s, %(token)s, bump.fence, %(owner)s, now(), {later}, 0 FROM bump "
            "ON CONFLICT (name) DO UPDATE SET token = excluded.token, "
            "fence = excluded.fence, owner = excluded.owner, "
            "acquired_at = excluded.acquired_at, expires_at = excluded.expires_at, "
            f"renewals = 0 WHERE {LOCKS}.expires_at <= now() RETURNING fence) "
            "SELECT COALESCE((SELECT fence FROM took), (SELECT fence FROM mine)), "
            f"live.token, live.fence, live.owner, {self.seconds_until('live.acquired_at')}, "
            f"{self.seconds_until('live.expires_at')} FROM (SELECT 1) AS one "
            "LEFT JOIN live ON true"
        )

    @property
    def for_update(self) -> str:
        return "" if self.vendor == "sqlite" else " FOR UPDATE"


def _like_prefix(prefix: str) -> str:
    """A LIKE pattern for ``prefix``; ``!`` escapes (a backslash means different things
    in MySQL and PostgreSQL string literals)."""
    escaped = prefix.replace("!", "!!").replace("%", "!%").replace("_", "!_")
    return escaped + "%"


class _Deadline:
    """One armed call: the socket to cut at ``at``, and whether that happened."""

    __slots__ = ("at", "done", "fileno", "fired")

    def __init__(self, at: float, fileno: int) -> None:
        self.at, self.fileno = at, fileno
        self.done = self.fired = False


class _ConnectionCutter:
    """Cuts the socket of a database call that outlives its deadline.

    Why: psycopg has no read timeout, so a request or reply lost on the network would
    block a call (an acquire, a renewal) forever. Shutting the socket down from this
    thread makes the blocked driver call fail at once with a connection error. One
    thread per process serves every backend; arming and disarming cost a heap push and
    a flag, not a thread per call.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Deadline]] = []
        self._order = itertools.count()
        self._pid = -1
        #: When the thread wakes next by itself (inf: only when notified).
        self._wake_at = math.inf

    def after_fork(self) -> None:
        """A forked child has no cutter thread, and the lock may have been held by it."""
        self._cond = threading.Condition()
        self._heap = []
        self._pid = -1
        self._wake_at = math.inf

    def arm(self, fileno: int, seconds: float) -> _Deadline:
        deadline = _Deadline(time.monotonic() + seconds, fileno)
        with self._cond:
            if self._pid != os.getpid():  # first use, or a forked child: no thread yet
                self._pid, self._heap = os.getpid(), []
                threading.Thread(target=self._run, name="task-locks-db-cutter", daemon=True).start()
            heapq.heappush(self._heap, (deadline.at, next(self._order), deadline))
            if deadline.at < self._wake_at:  # else the thread wakes in time anyway
                self._cond.notify()
        return deadline

    def disarm(self, deadline: _Deadline) -> bool:
        """``True`` if the deadline fired: the connection is cut, throw it away."""
        with self._cond:
            deadline.done = True
            heap = self._heap
            while heap and heap[0][2].done:  # deadlines are mostly FIFO: keep it small
                heapq.heappop(heap)
            return deadline.fired

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._wake_at = math.inf
                    self._cond.wait()
                    continue
                left = self._heap[0][0] - time.monotonic()
                if left > 0:
                    self._wake_at = self._heap[0][0]
                    self._cond.wait(left)
                    continue
                deadline = heapq.heappop(self._heap)[2]
                # Under the condition's lock: disarm() cannot run in between, so the
                # socket is still the call's own (not closed, its number not reused).
                deadline.fired = True
                with contextlib.suppress(OSError):
                    cut = socket.socket(fileno=os.dup(deadline.fileno))
                    try:
                        cut.shutdown(socket.SHUT_RDWR)
                    finally:
                        cut.close()


_cutter = _ConnectionCutter()
os.register_at_fork(after_in_child=_cutter.after_fork)


class _Call:
    """One call on a pooled connection, within ``seconds``: the connection checked out
    and connected, its deadline armed; after the call, back to the pool (a failed or
    cut one thrown away: it may be mid-reply), and a database error raised as
    ``BackendUnavailable`` (:class:`_NotConnected` if it never connected)."""

    __slots__ = ("armed", "backend", "connected", "name", "seconds", "wrapper")

    def __init__(self, backend: DjangoBackend, name: str | None, seconds: float) -> None:
        self.backend, self.name, self.seconds = backend, name, seconds
        self.wrapper: Any = None
        self.armed: _Deadline | None = None
        self.connected = False

    def __enter__(self) -> Any:
        try:
            self.wrapper = self.backend._pool.checkout()
            self.armed = self.backend._arm(self.wrapper, self.seconds)
        except BaseException as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        self.connected = True
        return self.wrapper

    def __exit__(self, kind: Any, exc: BaseException | None, traceback: Any) -> None:
        wrapper, armed, pool = self.wrapper, self.armed, self.backend._pool
        cut = armed is not None and _cutter.disarm(armed)
        if wrapper is not None:
            if exc is None and not cut:
                pool.checkin(wrapper)
            else:
                pool.discard(wrapper)  # failed, or done but cut at the last moment
        if exc is None:
            return
        from django.db import Error as DatabaseError

        if isinstance(exc, DatabaseError):
            raise self.backend._unavailable(
                exc, cut, self.connected, self.seconds, self.name
            ) from exc


def _kept_cursor(wrapper: Any) -> Any:
    """The driver cursor kept with ``wrapper``'s connection (made anew for a new one).

    A cursor is reusable: each ``execute`` replaces its results. It is the connection's,
    so a connection that reconnected gets its own; one that failed is thrown away with
    its wrapper (:class:`_Call`).
    """
    connection = wrapper.connection
    kept = getattr(wrapper, "task_locks_cursor", None)
    if kept is None or kept[0] is not connection:
        kept = wrapper.task_locks_cursor = (connection, connection.cursor())
    return kept[1]


class _Pool:
    """Connections of our own, opened from the alias's settings, one user at a time."""

    def __init__(self, alias: str, timeout: float) -> None:
        self.alias = alias
        self.timeout = timeout
        self._idle: list[tuple[Any, float]] = []
        self._guard = threading.Lock()
        self._pid = os.getpid()
        self._closed = False
        #: Pings an idle connection (the backend bounds it with its deadline).
        self.usable: Any = lambda wrapper: wrapper.is_usable()

    def _settings(self) -> dict[str, Any]:
        from django.db import connections

        # The live wrapper's dict: under a test runner it names the test database.
        return dict(connections[self.alias].settings_dict)

    def _own_settings(self) -> dict[str, Any]:
        """The alias's settings, adjusted for lock operations.

        - Bounded waits: a connect timeout everywhere; MySQL's driver read/write
          timeouts; PostgreSQL ends a session idle inside a transaction (a client that
          vanished mid-acquire) after the same time, so its row locks do not outlive it.
        - No Django connection pool: these connections are pooled here already.
        - PostgreSQL: server-side binding (prepared statements), unless the alias says a
          transaction-mode pooler is in the way (``DISABLE_SERVER_SIDE_CURSORS``).
        """
        settings_dict = self._settings()
        options = dict(settings_dict.get("OPTIONS") or {})
        options.pop("pool", None)
        seconds = max(1, math.ceil(self.timeout))
        from django.db import connections

        vendor = connections[self.alias].vendor  # no I/O; "postgresql" for PostGIS too
        if vendor == "postgresql":
            options.setdefault("connect_timeout", max(2, seconds))
            from django.db.backends.postgresql.psycopg_any import is_psycopg3

            if is_psycopg3 and not settings_dict.get("DISABLE_SERVER_SIDE_CURSORS"):
                # Prepared statements (psycopg 3 only, after a statement's 5th run on a
                # connection): the server stops parsing and planning the acquire's CTE
                # on every call, most of its cost besides the commit. Django turns them
                # off for poolers; an alias behind a transaction-mode pooler says so
                # with DISABLE_SERVER_SIDE_CURSORS (or an explicit prepare_threshold).
                options.setdefault("server_side_binding", True)
                options.setdefault("prepare_threshold", 5)
            idle = f"-c idle_in_transaction_session_timeout={seconds * 1000}"
            options["options"] = f"{options.get('options', '')} {idle}".strip()
        elif vendor == "mysql":
            options.setdefault("connect_timeout", seconds)
            options.setdefault("read_timeout", seconds)
            options.setdefault("write_timeout", seconds)
        settings_dict["OPTIONS"] = options
        return settings_dict

    def _open(self) -> Any:
        from django.db.utils import load_backend

        settings_dict = self._own_settings()
        wrapper = load_backend(settings_dict["ENGINE"]).DatabaseWrapper(settings_dict, self.alias)
        wrapper.inc_thread_sharing()  # used by one thread at a time, from any thread
        return wrapper

    def _after_fork(self) -> None:
        _inherited.extend(w for w, _ in self._idle)
        self._idle = []
        self._guard = threading.Lock()
        self._pid = os.getpid()

    def checkout(self) -> Any:
        if self._pid != os.getpid():
            self._after_fork()
        with self._guard:
            item = self._idle.pop() if self._idle else None
        if item is None:
            return self._open()
        wrapper, since = item
        if time.monotonic() - since > PING_AFTER and not self.usable(wrapper):
            self._close(wrapper)
            return self._open()
        return wrapper

    def checkin(self, wrapper: Any) -> None:
        if self._pid != os.getpid():
            _inherited.append(wrapper)
            return
        with self._guard:
            if not self._closed and len(self._idle) < MAX_IDLE:
                self._idle.append((wrapper, time.monotonic()))
                return
        self._close(wrapper)

    @staticmethod
    def _close(wrapper: Any) -> None:
        try:
            wrapper.close()
        except Exception:  # a broken connection is being thrown away anyway
            pass

    def discard(self, wrapper: Any) -> None:
        if self._pid == os.getpid():
            self._close(wrapper)

    def close(self) -> None:
        if self._pid != os.getpid():
            self._after_fork()
            return
        with self._guard:
            idle, self._idle = self._idle, []
            self._closed = True  # connections checked in later are closed, not kept
        for wrapper, _ in idle:
            self._close(wrapper)


def _setup_django() -> None:
    """In a plain process (the CLI, a script, a worker of a test), set Django up first.

    Django's database layer expects a populated app registry; inside a project this has
    already happened (or is happening: the app's own ``ready()`` configures the backend).
    """
    from django.apps import apps

    if not apps.apps_ready and not apps.loading:
        import django

        django.setup()


class _NotConnected(BackendUnavailable):
    """No connection could be opened: nothing was sent, so no outcome is unknown.

    Why its own class: an acquire retries a failed call once (its COMMIT may have
    landed), but retrying a connect that timed out would only double the time an
    unreachable database takes to be reported.
    """


class DjangoBackend(Backend, RunChecked):
    """Locks in the ``task_locks_lock`` table of the database ``ALIAS`` names."""

    capabilities = frozenset(
        {Capability.FENCING, Capability.MULTIPROCESS, Capability.HOLDERS, Capability.RUN_CHECK}
    )

    def __init__(self, url: str) -> None:
        super().__init__(url)
        parts = urlsplit(url)
        self.alias = parts.netloc or parts.path.strip("/") or "default"
        options = dict(parse_qsl(parts.query, keep_blank_values=True))
        #: Namespace inside the shared table (``django://default?prefix=shop:``).
        self.prefix = options.pop("prefix", "")
        # The table's name column holds the prefix and the name.
        self.max_name_length = NAME_LENGTH - len(self.prefix)
        if self.max_name_length < 1:
            raise InvalidArgument(
                f"{self.server}: the prefix must be shorter than {NAME_LENGTH} characters"
            )
        #: Seconds a call may wait for the database before ``BackendUnavailable``.
        self.timeout = self._number(options, "timeout", DEFAULT_TIMEOUT, positive=True)
        options.pop("timeout", None)
        if options:
            raise InvalidArgument(unknown_options(self.server, options, ("prefix", "timeout")))
        try:
            from django.conf import settings
        except ImportError as exc:  # pragma: no cover - django is an extra
            raise InvalidArgument("the django:// backend needs Django installed") from exc
        if not settings.configured and not os.environ.get("DJANGO_SETTINGS_MODULE"):
            raise InvalidArgument(
                f"{self.server}: Django settings are not configured; set "
                "DJANGO_SETTINGS_MODULE (settings with this DATABASES alias) or call "
                "settings.configure() first"
            )
        _setup_django()
        databases = settings.DATABASES
        if self.alias not in databases:
            raise InvalidArgument(
                f"{self.server}: no database alias {self.alias!r} in DATABASES "
                f"(known: {', '.join(sorted(databases))})"
            )
        self._pool = _Pool(self.alias, self.timeout)
        self._pool.usable = self._ping
        self._dialect: _Dialect | None = None
        if self.dialect.vendor == "postgresql":
            extra = {Capability.WAKEUP}
            if _can_listen():
                extra.add(Capability.RELEASE_NOTICE)
            self.capabilities = type(self).capabilities | extra  # type: ignore[misc]

    # -- plumbing ----------------------------------------------------------------------

    def _prepare_mysql(self, wrapper: Any) -> None:
        """Once per new MySQL/MariaDB connection: bound the server's waits as well.

        A client that vanished inside an acquire (its COMMIT lost) leaves a transaction
        holding the row's lock until the server notices; every acquire of that name
        would wait behind it. MariaDB ends such a transaction after
        ``idle_transaction_timeout`` (MySQL has no such setting: there the row stays
        locked until the connection dies); a row-lock wait gives up after
        ``innodb_lock_wait_timeout``. PostgreSQL gets the same through its startup
        options (see ``_Pool._own_settings``).
        """
        if getattr(wrapper, "task_locks_prepared", False):
            return
        seconds = max(1, math.ceil(self.timeout))
        with wrapper.cursor() as cursor:
            cursor.execute(f"SET SESSION innodb_lock_wait_timeout = {seconds}")
            if wrapper.mysql_is_mariadb:
                cursor.execute(f"SET SESSION idle_transaction_timeout = {seconds}")
        wrapper.task_locks_prepared = True

    def _arm(self, wrapper: Any, seconds: float) -> _Deadline | None:
        """Connect, then arm the cutter on the connection's socket (PostgreSQL only:
        MySQL's driver has its own timeouts, SQLite no network)."""
        if self.dialect.vendor == "mysql":
            self._prepare_mysql(wrapper)
        if self.dialect.vendor != "postgresql":
            return None
        wrapper.ensure_connection()  # bounded by connect_timeout
        return _cutter.arm(wrapper.connection.fileno(), seconds)

    def _ping(self, wrapper: Any) -> bool:
        """``is_usable()`` within the deadline: a blackholed idle connection fails it."""
        from django.db import Error as DatabaseError

        try:
            armed = self._arm(wrapper, self.timeout)
        except DatabaseError:
            return False
        try:
            usable = bool(wrapper.is_usable())
        finally:
            cut = armed is not None and _cutter.disarm(armed)
        return usable and not cut  # a connection the cutter cut is gone

    @contextmanager
    def _cursor(
        self,
        name: str | None,
        *,
        transaction: bool = False,
        budget: float | None = None,
    ) -> Iterator[Any]:
        """A Django cursor on a pooled connection, within ``budget`` seconds (default: the
        backend's timeout); database errors become ``BackendUnavailable``. (PostgreSQL's
        one-statement acquire and release take :meth:`_one_row` instead.)
        """
        seconds = self.timeout if budget is None else budget
        with _Call(self, name, seconds) as wrapper:
            with wrapper.cursor() as cursor:
                if transaction:
                    cursor.execute(self.dialect.begin)
                    try:
                        yield cursor
                    except BaseException:
                        cursor.execute("ROLLBACK")
                        raise
                    cursor.execute("COMMIT")
                else:
                    yield cursor

    def _one_row(self, name: str, sql: str, params: Any) -> Any:
        """One statement on PostgreSQL, through the driver's own cursor: its first row.

        The acquire's and the release's only request. Its errors are still mapped to
        Django's, and it needs none of Django's cursor layers, nor a new cursor, nor a
        generator per call (each cost about a tenth of a cycle's client CPU): the driver
        cursor is kept with the connection (:func:`_kept_cursor`). A connection given
        ``execute_wrappers`` (Django's hook for instrumenting queries) keeps Django's
        cursor, so that they see every statement.
        """
        with _Call(self, name, self.timeout) as wrapper:
            if wrapper.execute_wrappers:  # Django's cursor, so that they see it
                with wrapper.cursor() as cursor:
                    cursor.execute(sql, params)
                    return cursor.fetchone()
            with wrapper.wrap_database_errors:
                cursor = _kept_cursor(wrapper)
                cursor.execute(sql, params)
                return cursor.fetchone()

    def _unavailable(
        self,
        exc: Exception,
        cut: bool,
        connected: bool,
        seconds: float,
        name: str | None,
    ) -> BackendUnavailable:
        """A database error as the lock's error, with what it most likely means."""
        hint = ""
        text = str(exc).lower()
        if cut:
            hint = f" (no answer within {seconds:g}s: the outcome is unknown)"
        elif "no such table" in text or "does not exist" in text or "doesn't exist" in text:
            hint = " (has `manage.py migrate` been run for the task_locks app?)"
        return (BackendUnavailable if connected else _NotConnected)(
            f"lock database {self.server} failed: {exc}{hint}", name=name, server=self.server
        )

    @property
    def dialect(self) -> _Dialect:
        """The SQL the alias's database speaks (PostgreSQL, MySQL/MariaDB, SQLite), found without
        I/O."""
        if self._dialect is None:
            from django.db import connections

            self._dialect = _Dialect(connections[self.alias].vendor)  # no I/O
        return self._dialect

    def _select_sql(self, where: str) -> str:
        d = self.dialect
        return (
            f"SELECT name, token, fence, owner, {d.seconds_until('acquired_at')}, "
            f"{d.seconds_until('expires_at')}, renewals FROM {LOCKS} WHERE {where}"
        )

    def _holder(self, row: Sequence[Any]) -> Holder:
        name, token, fence, owner, since_acquired, remaining, renewals = row
        now = time.time()
        # Durations come from the database clock; only the anchor is ours.
        return Holder(
            name=name[len(self.prefix) :],
            fence=int(fence),
            owner=Owner.from_json(owner),
            acquired_at=now + float(since_acquired),
            expires_at=now + float(remaining),
            renewals=int(renewals),
            token=token,
        )

    # -- the contract ------------------------------------------------------------------

    def _check_ttl(self, name: str, ttl_ms: int) -> None:
        """Refuse a TTL that would write a row without a computable, future expiry."""
        if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int) or not 0 < ttl_ms <= MAX_TTL_MS:
            raise InvalidArgument(
                f"{self.server}: ttl_ms must be an int from 1 to {MAX_TTL_MS} (one year), "
                f"got {ttl_ms!r}",
                name=name,
            )

    def acquire(self, name: str, token: str, ttl_ms: int, owner: Owner) -> AcquireResult:
        """One transaction; retried once with the same token if the connection failed.

        A lost COMMIT reply or a reset leaves the outcome unknown: the row may be ours.
        Retrying with the same token is safe (same fence, fresh TTL if it is ours; a
        fresh take if the first attempt rolled back), and spares the name from being
        held by nobody's lease until its TTL runs out.
        """
        return self._once_more_if_unknown(
            name, ttl_ms, lambda: self._take(name, token, ttl_ms, owner)
        )

    def acquire_run(
        self, name: str, token: str, ttl_ms: int, owner: Owner, run: RunCheck
    ) -> AcquireResult:
        """:meth:`acquire` with a run check, in one transaction: the rows of the run's
        names are read under a row lock (a semaphore's checks are first serialised on
        the fence counter row of its first slot, since a free slot has no row to lock;
        one name needs none: the insert of its row is what two copies race on), then
        the lock is taken over from ``run.take_over`` or taken as usual."""
        return self._once_more_if_unknown(
            name, ttl_ms, lambda: self._take_run(name, token, ttl_ms, owner, run)
        )

    def _once_more_if_unknown(
        self, name: str, ttl_ms: int, take: Callable[[], AcquireResult]
    ) -> AcquireResult:
        from django.db import InterfaceError, OperationalError

        self._check_ttl(name, ttl_ms)
        self.check_name(name)
        try:
            return take()
        except _NotConnected:
            raise  # nothing was sent: no unknown outcome, and a retry doubles the wait
        except BackendUnavailable as exc:
            if not isinstance(exc.__cause__, (OperationalError, InterfaceError)):
                raise
        return take()

    def _take(self, name: str, token: str, ttl_ms: int, owner: Owner) -> AcquireResult:
        d = self.dialect
        key = self.prefix + name
        if d.vendor == "postgresql":
            return self._take_pg(name, key, token, owner.to_json(), ttl_ms)
        with self._cursor(name, transaction=True) as cursor:
            return self._take_in(cursor, name, token, ttl_ms, owner)

    def _take_in(
        self, cursor: Any, name: str, token: str, ttl_ms: int, owner: Owner
    ) -> AcquireResult:
        """The acquire's statements, inside the caller's transaction."""
        d = self.dialect
        key = self.prefix + name
        cursor.execute(d.take_sql(), [key, token, owner.to_json(), d.ttl_param(ttl_ms)])
        cursor.execute(self._select_sql("name = %s") + d.for_update, [key])
        row = cursor.fetchone()
        if row is not None and row[1] == token and not row[2]:
            cursor.execute(d.bump_fence_sql(), [key])
            cursor.execute(f"SELECT fence FROM {FENCES} WHERE name = %s{d.for_update}", [key])
            fence = int(cursor.fetchone()[0])
            cursor.execute(f"UPDATE {LOCKS} SET fence = %s WHERE name = %s", [fence, key])
            return AcquireResult(fence)
        return self._taken(name, token, row)

    def _take_run(
        self, name: str, token: str, ttl_ms: int, owner: Owner, run: RunCheck
    ) -> AcquireResult:
        d = self.dialect
        keys = sorted(self.prefix + other for other in {name, *run.names})
        mine = {token, run.take_over, run.mark}
        slots = sorted(other for other in run.names if parse_slot(other) is not None)
        with self._cursor(name, transaction=True) as cursor:
            if len(slots) > 1:  # a free slot has no row to lock: serialise on the first's
                cursor.execute(d.bump_fence_sql(), [self.prefix + slots[0]])  # (fences skip)
            marks = ", ".join(["%s"] * len(keys))
            live = f"name IN ({marks}) AND expires_at > {d.now}"
            cursor.execute(self._select_sql(live) + d.for_update, keys)
            for row in cursor.fetchall():
                holder = self._holder(row)
                if holder.token not in mine and holder.owner.task_id == run.task_id:
                    found = self._taken(name, token, row)
                    other = None if holder.name == name else holder.name
                    return dataclasses.replace(found, holder_name=other)
            if run.take_over is not None:
                cursor.execute(
                    f"UPDATE {LOCKS} SET token = %s WHERE name = %s AND token = %s "
                    f"AND expires_at > {d.now}",
                    [token, self.prefix + name, run.take_over],
                )
            return self._take_in(cursor, name, token, ttl_ms, owner)

    def _take_pg(self, name: str, key: str, token: str, owner: str, ttl_ms: int) -> AcquireResult:
        """:meth:`_Dialect.take_pg_sql`, again at once when it lost a race since its
        snapshot (the next statement sees the winner's row)."""
        params = {"name": key, "token": token, "owner": owner, "ttl": ttl_ms}
        for _ in range(RACE_RETRIES):
            fence, holder_token, *holder = self._one_row(name, self.dialect.take_pg_sql(), params)
            if fence is not None:
                return AcquireResult(int(fence))
            if holder_token is not None and holder_token != token:
                return self._taken(name, token, [key, holder_token, *holder, 0])
            # No live row in the snapshot, or ours there but not on the latest version
            # (force-released, taken over): the row changed since; look again.
        return AcquireResult(None, 0.0)  # pragma: no cover - a race lost every time

    def _taken(self, name: str, token: str, row: Sequence[Any] | None) -> AcquireResult:
        """The acquire's answer from the lock's row as the acquire left it."""
        if row is None:  # pragma: no cover - the upsert always leaves a row
            raise BackendUnavailable(
                f"lock database {self.server}: the row of lock {name!r} vanished inside "
                "its acquire transaction",
                name=name,
                server=self.server,
            )
        holder = self._holder(row)
        if holder.token != token:
            return AcquireResult(
                None,
                max(0.0, holder.expires_at - time.time()) if holder.expires_at else None,
                holder.owner,
                holder.fence,
                holder.acquired_at,
            )
        # Ours: a fresh fence, or (same token again) the fence it kept with a new expiry.
        return AcquireResult(holder.fence)

    def renew(self, name: str, token: str, ttl_ms: int) -> bool:
        return self.renew_many([RenewItem(name, token, ttl_ms)])[0]

    def renew_many(self, items: Sequence[RenewItem], timeout: float | None = None) -> list[bool]:
        """One statement per lease, in one transaction when there are several.

        ``timeout``: the validity left to the first of these leases to expire; an answer
        after it is useless, so on PostgreSQL the call's deadline is the smaller of it
        and the backend's ``timeout`` (MySQL's driver timeouts are fixed per connection).
        """
        if not items:
            return []
        budget = None if timeout is None else max(0.01, min(timeout, self.timeout))
        for item in items:
            self._check_ttl(item.name, item.ttl_ms)
        d = self.dialect
        sql = (
            f"UPDATE {LOCKS} SET expires_at = {d.later}, renewals = renewals + 1 "
            f"WHERE name = %s AND token = %s AND expires_at > {d.now}"
        )
        results = []
        with self._cursor(items[0].name, transaction=len(items) > 1, budget=budget) as cursor:
            for item in items:
                cursor.execute(sql, [d.ttl_param(item.ttl_ms), self.prefix + item.name, item.token])
                results.append(cursor.rowcount > 0)
        return results

    def release(self, name: str, token: str) -> bool:
        return self._delete(name, token)

    def force_release(self, name: str, fence: int | None = None) -> bool:
        return self._delete(name, None, fence)

    def _delete(self, name: str, token: str | None, fence: int | None = None) -> bool:
        """Delete the live row in one statement, only if ``token`` (and/or ``fence``)
        still holds it when given; wake waiters."""
        where, params = "name = %s", [self.prefix + name]
        if token is not None:
            where += " AND token = %s"
            params.append(token)
        if fence is not None:
            where += " AND fence = %s"
            params.append(fence)
        delete = f"DELETE FROM {LOCKS} WHERE {where} AND expires_at > {self.dialect.now}"
        if self.dialect.vendor == "postgresql":
            # One round trip: the NOTIFY rides in the DELETE's statement (sent at
            # commit). A token-checked release commits without waiting for its WAL
            # flush: a crash can only bring the row back until its TTL (as if this
            # holder had died before releasing), and any acquire that saw the row gone
            # flushes this commit with its own, the WAL being one sequence. A force
            # release also tells the holder's process (FORCED_CHANNEL).
            relaxed = ", set_config('synchronous_commit', 'off', true)" if token else ""
            forced = "" if token else ", pg_notify(%s, fence || '|' || name)"
            row = self._one_row(
                name,
                f"WITH d AS ({delete} RETURNING name, fence) SELECT pg_notify(%s, name)"
                f"{relaxed}{forced} FROM d",
                [*params, CHANNEL, *([] if token else [FORCED_CHANNEL])],
            )
            return row is not None
        with self._cursor(name) as cursor:
            cursor.execute(delete, params)
            return bool(cursor.rowcount > 0)

    def holders(self, prefix: str = "") -> list[Holder]:
        d = self.dialect
        where = f"expires_at > {d.now}"
        params: list[Any] = []
        key_prefix = self.prefix + prefix
        if key_prefix:
            where += " AND name LIKE %s ESCAPE '!'"
            params.append(_like_prefix(key_prefix))
        with self._cursor(prefix or None) as cursor:
            cursor.execute(self._select_sql(where) + " ORDER BY name", params)
            rows = cursor.fetchall()
        # LIKE ignores case on SQLite and MySQL; keep exact prefixes only.
        return [self._holder(row) for row in rows if str(row[0]).startswith(key_prefix)]

    def holder(self, name: str) -> Holder | None:
        d = self.dialect
        with self._cursor(name) as cursor:
            cursor.execute(
                self._select_sql(f"name = %s AND expires_at > {d.now}"), [self.prefix + name]
            )
            row = cursor.fetchone()
        return None if row is None else self._holder(row)

    def _wait_for_notify(self, name: str, deadline: float) -> bool:
        """PostgreSQL: LISTEN, re-check the row, then sleep until a NOTIFY names it.

        ``False`` if the driver cannot wait for notifications (psycopg2): poll instead.
        """
        key = self.prefix + name
        check = f"SELECT 1 FROM {LOCKS} WHERE name = %s AND expires_at > now()"
        with self._cursor(name, budget=deadline - time.monotonic() + self.timeout) as cursor:
            raw = cursor.db.connection
            # psycopg 3's notifies() waits; psycopg2's ``notifies`` is a list it fills.
            if not callable(getattr(raw, "notifies", None)):
                return False
            cursor.execute(f"LISTEN {CHANNEL}")
            try:
                while True:
                    # Checked after LISTEN: a release before it is seen here, one after
                    # it arrives as a notification.
                    cursor.execute(check, [key])
                    if cursor.fetchone() is None:
                        return True
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return True
                    for note in raw.notifies(timeout=min(left, NOTIFY_RECHECK), stop_after=1):
                        if note.payload == key:
                            return True
            finally:
                cursor.execute(f"UNLISTEN {CHANNEL}")

    def wait_release(self, name: str, timeout: float) -> None:
        """Return once ``name`` is probably free, or after ``timeout`` seconds.

        The caller bounds ``timeout`` by the holder's remaining TTL, so an expiring
        holder costs no extra wait. PostgreSQL is woken by the release's NOTIFY; other
        databases poll with a growing pause, seeing a release within ``POLL_MAX``.
        """
        d = self.dialect
        if d.vendor == "postgresql" and self._wait_for_notify(name, time.monotonic() + timeout):
            return
        deadline = time.monotonic() + timeout
        pause = POLL_FIRST
        sql = f"SELECT 1 FROM {LOCKS} WHERE name = %s AND expires_at > {d.now}"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(pause, left))
            pause = min(pause * 2, POLL_MAX)
            with self._cursor(name) as cursor:
                cursor.execute(sql, [self.prefix + name])
                if cursor.fetchone() is None:
                    return

    def release_notices(self) -> NoticeStream:
        """PostgreSQL: ``LISTEN task_locks_forced`` on a connection of its own."""
        return _PostgresNotices(self)

    def close(self) -> None:
        close_streams(self)
        self._pool.close()

    def idle_connections(self) -> list[Any]:
        """The pooled connections waiting for a lock operation (Django ``DatabaseWrapper``
        objects): where a benchmark counts what one sends (on their driver connections)."""
        return [wrapper for wrapper, _ in self._pool._idle]

    def new_connection(self) -> Any:
        """A connection opened as the pool opens its own (same settings and options),
        outside the pool: the caller uses and closes it."""
        return self._pool._open()


def _can_listen() -> bool:
    """Whether a listener thread may wait for NOTIFYs here: psycopg 3 (psycopg2 has no
    ``notifies()`` generator), and no gevent/eventlet hub, whose other greenlets
    psycopg's own wait (a C ``poll``) would block for a whole read."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return False
    import sys

    for green, check in (("gevent", "gevent.monkey"), ("eventlet", "eventlet.patcher")):
        if green in sys.modules:
            module = sys.modules.get(check)
            patched = getattr(module, "is_module_patched", None) or getattr(
                module, "is_monkey_patched", None
            )
            if patched is not None and patched("socket"):
                return False
    return True


class _PostgresNotices:
    """Release notices of one PostgreSQL database: ``LISTEN`` on an unpooled connection.

    A notification sent while this connection is down is lost, as with Redis pub/sub: the
    listener has every lease renewed when it reconnects. Other databases have no
    notification channel; there, renewal finds a force release (a third of the TTL at
    worst).
    """

    def __init__(self, backend: DjangoBackend) -> None:
        self._backend = backend
        self._wrapper: Any = None
        self._guard = threading.Lock()

    def open(self, since: int | None) -> None:
        from django.db import Error as DatabaseError

        backend = self._backend
        track(backend, self)  # closed with the backend
        wrapper = backend._pool._open()
        try:
            wrapper.ensure_connection()
            wrapper.connection.execute(f"LISTEN {FORCED_CHANNEL}")  # autocommit: at once
        except DatabaseError as exc:
            _close_raw(wrapper)
            raise BackendUnavailable(
                f"release notices: cannot LISTEN at {backend.server}: {exc}", server=backend.server
            ) from exc
        with self._guard:  # the backend's close() may have run meanwhile, from its thread
            if not retired(self):
                self._wrapper = wrapper
                return
        _close_raw(wrapper)
        raise BackendUnavailable(f"{backend.server}: closed", server=backend.server)

    def read(self, timeout: float) -> list[Notice]:
        backend = self._backend
        raw = self._wrapper.connection
        notices: list[Notice] = []
        try:
            for note in raw.notifies(timeout=timeout, stop_after=1):
                fence, _, key = str(note.payload).partition("|")
                if fence.isdigit() and key.startswith(backend.prefix):
                    notices.append(Notice(key[len(backend.prefix) :], int(fence), FORCED_NOTICE))
        except Exception as exc:  # psycopg's own errors: the raw connection is not Django's
            raise BackendUnavailable(
                f"release notices from {backend.server} interrupted: {exc}", server=backend.server
            ) from exc
        return notices

    def close(self) -> None:
        with self._guard:
            wrapper, self._wrapper = self._wrapper, None
        if wrapper is not None:
            _close_raw(wrapper)


def _close_raw(wrapper: Any) -> None:
    """Close the driver's connection itself: Django's ``close()`` refuses to run where an
    event loop runs (async_unsafe), and a backend's close may be called from there."""
    raw = wrapper.connection
    if raw is not None:
        with contextlib.suppress(Exception):
            raw.close()
        wrapper.connection = None


__all__ = ["DjangoBackend"]
