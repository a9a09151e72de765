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
  the row only if it is absent or expired, then bumps the fence counter, then commits;
  renew and release are single token-checked statements. Nothing is held open between
  operations.
- **Wake-ups.** On PostgreSQL a release sends ``NOTIFY task_locks`` and waiters
  ``LISTEN``, so a hand-off costs about one round trip; elsewhere waiters poll the row
  with a short, growing pause (at most ``POLL_MAX``). Either way a waiter never waits
  longer than the holder's remaining TTL.
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

import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from task_locks.backends.base import Backend
from task_locks.errors import BackendUnavailable, InvalidArgument
from task_locks.types import AcquireResult, Holder, Owner, RenewItem

LOCKS = "task_locks_lock"
FENCES = "task_locks_fence"
#: Pooled connections idle longer than this are pinged before use.
PING_AFTER = 30.0
MAX_IDLE = 8
#: wait(): first and longest pause between polls of the holder's row.
POLL_FIRST = 0.01
POLL_MAX = 0.2
#: PostgreSQL: releases NOTIFY this channel (payload: the lock's name); waiters LISTEN.
CHANNEL = "task_locks"
#: PostgreSQL: a waiter re-reads the row at least this often, in case a NOTIFY was missed.
NOTIFY_RECHECK = 1.0

# Connections inherited through fork(): kept referenced so they are never closed from
# the child (closing would end the parent's session on some drivers).
_inherited: list[Any] = []


class _Dialect:
    """The few SQL fragments that differ between databases."""

    def __init__(self, vendor: str) -> None:
        self.vendor = vendor
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
        """Insert the row, or take over an expired one; a live row is left untouched."""
        values = f"VALUES (%s, %s, 0, %s, {self.now}, {self.later}, 0)"
        columns = "(name, token, fence, owner, acquired_at, expires_at, renewals)"
        if self.vendor == "mysql":
            # Assignments run left to right and see earlier ones: expires_at goes last
            # so every condition reads the old value.
            expired = f"expires_at <= {self.now}"
            sets = ", ".join(
                f"{col} = IF({expired}, {new}, {col})"
                for col, new in [
                    ("token", "VALUES(token)"),
                    ("fence", "0"),
                    ("owner", "VALUES(owner)"),
                    ("acquired_at", "VALUES(acquired_at)"),
                    ("renewals", "0"),
                    ("expires_at", "VALUES(expires_at)"),
                ]
            )
            return f"INSERT INTO {LOCKS} {columns} {values} ON DUPLICATE KEY UPDATE {sets}"
        return (
            f"INSERT INTO {LOCKS} {columns} {values} ON CONFLICT (name) DO UPDATE SET "
            "token = excluded.token, fence = 0, owner = excluded.owner, "
            "acquired_at = excluded.acquired_at, expires_at = excluded.expires_at, "
            f"renewals = 0 WHERE {LOCKS}.expires_at <= {self.now}"
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

    @property
    def for_update(self) -> str:
        return "" if self.vendor == "sqlite" else " FOR UPDATE"


def _like_prefix(prefix: str) -> str:
    """A LIKE pattern for ``prefix``; ``!`` escapes (a backslash means different things
    in MySQL and PostgreSQL string literals)."""
    escaped = prefix.replace("!", "!!").replace("%", "!%").replace("_", "!_")
    return escaped + "%"


class _Pool:
    """Connections of our own, opened from the alias's settings, one user at a time."""

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self._idle: list[tuple[Any, float]] = []
        self._guard = threading.Lock()
        self._pid = os.getpid()
        self._closed = False

    def _settings(self) -> dict[str, Any]:
        from django.db import connections

        # The live wrapper's dict: under a test runner it names the test database.
        return dict(connections[self.alias].settings_dict)

    def _open(self) -> Any:
        from django.db.utils import load_backend

        settings_dict = self._settings()
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
        if time.monotonic() - since > PING_AFTER and not wrapper.is_usable():
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


class DjangoBackend(Backend):
    """Locks in the ``task_locks_lock`` table of the database ``ALIAS`` names."""

    schemes = ("django",)
    capabilities = frozenset({"fencing", "multiprocess", "holders"})

    def __init__(self, url: str) -> None:
        super().__init__(url)
        parts = urlsplit(url)
        self.alias = parts.netloc or parts.path.strip("/") or "default"
        options = dict(parse_qsl(parts.query, keep_blank_values=True))
        #: Namespace inside the shared table (``django://default?prefix=shop:``).
        self.prefix = options.pop("prefix", "")
        if options:
            raise InvalidArgument(
                f"{self.server}: unknown option(s) {sorted(options)}; the django:// "
                "backend takes only prefix"
            )
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
        self._pool = _Pool(self.alias)
        self._dialect: _Dialect | None = None
        if self.dialect.vendor == "postgresql":
            self.capabilities = type(self).capabilities | {"wakeup"}  # type: ignore[misc]

    # -- plumbing ----------------------------------------------------------------------

    @contextmanager
    def _cursor(self, name: str | None, *, transaction: bool = False) -> Iterator[Any]:
        """A cursor on a pooled connection; database errors become ``BackendUnavailable``."""
        from django.db import Error as DatabaseError

        wrapper = None
        try:
            wrapper = self._pool.checkout()
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
        except DatabaseError as exc:
            if wrapper is not None:
                self._pool.discard(wrapper)
            wrapper = None
            hint = ""
            text = str(exc).lower()
            if "no such table" in text or "does not exist" in text or "doesn't exist" in text:
                hint = " (has `manage.py migrate` been run for the task_locks app?)"
            raise BackendUnavailable(
                f"lock database {self.server} failed: {exc}{hint}", name=name, server=self.server
            ) from exc
        except BaseException:
            if wrapper is not None:
                self._pool.discard(wrapper)
            wrapper = None
            raise
        finally:
            if wrapper is not None:
                self._pool.checkin(wrapper)

    @property
    def dialect(self) -> _Dialect:
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

    def acquire(self, name: str, token: str, ttl_ms: int, owner: Owner) -> AcquireResult:
        d = self.dialect
        key = self.prefix + name
        with self._cursor(name, transaction=True) as cursor:
            cursor.execute(d.take_sql(), [key, token, owner.to_json(), d.ttl_param(ttl_ms)])
            cursor.execute(self._select_sql("name = %s") + d.for_update, [key])
            row = cursor.fetchone()
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
            if holder.fence:  # already ours (a retried acquire with the same token)
                return AcquireResult(holder.fence)
            cursor.execute(d.bump_fence_sql(), [key])
            cursor.execute(f"SELECT fence FROM {FENCES} WHERE name = %s{d.for_update}", [key])
            fence = int(cursor.fetchone()[0])
            cursor.execute(f"UPDATE {LOCKS} SET fence = %s WHERE name = %s", [fence, key])
        return AcquireResult(fence)

    def renew(self, name: str, token: str, ttl_ms: int) -> bool:
        return self.renew_many([RenewItem(name, token, ttl_ms)])[0]

    def renew_many(self, items: Sequence[RenewItem], timeout: float | None = None) -> list[bool]:
        # ``timeout`` is not applied: a statement timeout differs per database; the
        # watchdog marks a lease lost at its deadline whatever a call still waits for.
        if not items:
            return []
        d = self.dialect
        sql = (
            f"UPDATE {LOCKS} SET expires_at = {d.later}, renewals = renewals + 1 "
            f"WHERE name = %s AND token = %s AND expires_at > {d.now}"
        )
        results = []
        with self._cursor(items[0].name, transaction=len(items) > 1) as cursor:
            for item in items:
                cursor.execute(sql, [d.ttl_param(item.ttl_ms), self.prefix + item.name, item.token])
                results.append(cursor.rowcount > 0)
        return results

    def release(self, name: str, token: str) -> bool:
        return self._delete(name, token)

    def force_release(self, name: str) -> bool:
        return self._delete(name, None)

    def _delete(self, name: str, token: str | None) -> bool:
        """Delete the live row (only if ``token`` holds it, unless ``None``); wake waiters."""
        where, params = "name = %s", [self.prefix + name]
        if token is not None:
            where += " AND token = %s"
            params.append(token)
        with self._cursor(name) as cursor:
            cursor.execute(
                f"DELETE FROM {LOCKS} WHERE {where} AND expires_at > {self.dialect.now}", params
            )
            released = bool(cursor.rowcount > 0)
            if released:
                self._notify(cursor, name)
            return released

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

    def _notify(self, cursor: Any, name: str) -> None:
        if self.dialect.vendor == "postgresql":
            cursor.execute("SELECT pg_notify(%s, %s)", [CHANNEL, self.prefix + name])

    def _wait_for_notify(self, name: str, deadline: float) -> bool:
        """PostgreSQL: LISTEN, re-check the row, then sleep until a NOTIFY names it.

        ``False`` if the driver cannot wait for notifications (psycopg2): poll instead.
        """
        key = self.prefix + name
        check = f"SELECT 1 FROM {LOCKS} WHERE name = %s AND expires_at > now()"
        with self._cursor(name) as cursor:
            raw = cursor.db.connection
            if not hasattr(raw, "notifies"):
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

    def wait(self, name: str, timeout: float) -> None:
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

    def close(self) -> None:
        self._pool.close()


__all__ = ["DjangoBackend"]
