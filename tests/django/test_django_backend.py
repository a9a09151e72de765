"""The ``django://ALIAS`` backend on real databases: SQLite, PostgreSQL, MySQL/MariaDB."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connections, transaction
from django_helpers import HERE, subprocess_env

from django_app.backend import LOCKS, MAX_TTL_MS, DjangoBackend
from task_locks import (
    BackendUnavailable,
    InvalidArgument,
    Lock,
    LockHeld,
    NotOwned,
    Owner,
    get_backend,
)

ALIASES = [a for a in ("default", "pg", "mysql") if a in settings.DATABASES]
ALL_DBS = pytest.mark.django_db(transaction=True, databases=ALIASES)


@pytest.fixture(params=ALIASES)
def alias(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def url(alias: str) -> str:
    return f"django://{alias}"


def _db_sql(alias: str, sql: str) -> None:
    """Run SQL with the database's own clock expressions on the test's connection."""
    vendor = connections[alias].vendor
    now = {
        "postgresql": "now()",
        "mysql": "UTC_TIMESTAMP(6)",
        "sqlite": "strftime('%Y-%m-%d %H:%M:%f', 'now')",
    }[vendor]
    past = {
        "postgresql": "now() - interval '1 second'",
        "mysql": "UTC_TIMESTAMP(6) - INTERVAL 1 SECOND",
        "sqlite": "strftime('%Y-%m-%d %H:%M:%f', 'now', '-1 seconds')",
    }[vendor]
    with connections[alias].cursor() as cursor:
        cursor.execute(sql.format(now=now, past=past))


@ALL_DBS
def test_lock_basics(url: str) -> None:
    backend = get_backend(url)
    first = Lock("report:1", ttl=5, backend=url).acquire(timeout=0)
    with pytest.raises(LockHeld) as held:
        Lock("report:1", ttl=5, backend=url).acquire(timeout=0)
    assert held.value.name == "report:1"
    assert held.value.holder is not None and held.value.holder.fence == first.fence

    [holder] = backend.holders("report:")
    assert (holder.name, holder.fence) == ("report:1", first.fence)
    assert 0 < holder.expires_in <= 5.5  # type: ignore[operator]
    assert backend.holders("other:") == []

    first.renew()
    assert backend.holder("report:1").renewals == 1  # type: ignore[union-attr]
    first.release()
    second = Lock("report:1", ttl=5, backend=url).acquire(timeout=0)
    assert second.fence > first.fence, "fences strictly increase per name"
    second.release()
    assert backend.holders() == []


@ALL_DBS
def test_release_is_token_checked_and_force_release_is_not(url: str) -> None:
    backend = get_backend(url)
    lease = Lock("job", ttl=5, backend=url).acquire(timeout=0)
    assert backend.release("job", "not-the-token") is False
    assert backend.renew("job", "not-the-token", 5000) is False
    assert backend.holder("job") is not None, "a stranger's release changed nothing"
    assert backend.force_release("job") is True
    assert backend.force_release("job") is False
    with pytest.raises(NotOwned):
        lease.release()


@ALL_DBS
def test_prefix_search_is_exact(url: str) -> None:
    backend = get_backend(url)
    leases = [Lock(n, ttl=5, backend=url).acquire(timeout=0) for n in ["a_b", "axb", "A_b", "a%"]]
    assert [h.name for h in backend.holders("a_")] == ["a_b"]
    assert [h.name for h in backend.holders("a%")] == ["a%"]
    assert len(backend.holders()) == 4
    for lease in leases:
        lease.release()


@ALL_DBS
def test_expiry_is_judged_by_the_database_clock(
    alias: str, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = get_backend(url)
    Lock("clock", ttl=30, backend=url, renew=False).acquire(timeout=0)
    real_time = time.time

    # The client's clock is mocked on purpose (a clock cannot be skewed for real here):
    # an hour slow, a client-side check would still see 30 s left on the lock below.
    monkeypatch.setattr(time, "time", lambda: real_time() - 3600)
    _db_sql(alias, f"UPDATE {LOCKS} SET expires_at = {{past}} WHERE name = 'clock'")
    assert backend.holders() == []
    taken = Lock("clock", ttl=30, backend=url, renew=False).acquire(timeout=0)

    # A day fast, a client-side check would call the lock expired; the database does not.
    monkeypatch.setattr(time, "time", lambda: real_time() + 86400)
    with pytest.raises(LockHeld):
        Lock("clock", ttl=30, backend=url).acquire(timeout=0)
    assert [h.fence for h in backend.holders()] == [taken.fence]
    monkeypatch.undo()
    taken.release()


def test_the_sql_uses_the_database_clock() -> None:
    from django_app.backend import _Dialect

    for vendor, now in [
        ("postgresql", "now()"),
        ("mysql", "UTC_TIMESTAMP(6)"),
        ("sqlite", "'now'"),
    ]:
        dialect = _Dialect(vendor)
        assert now in dialect.take_sql()
        assert f"expires_at <= {dialect.now}" in dialect.take_sql()


@ALL_DBS
def test_a_lock_taken_inside_a_transaction_is_visible_and_survives_rollback(
    alias: str, url: str
) -> None:
    backend = get_backend(url)
    with pytest.raises(RuntimeError), transaction.atomic(using=alias):
        lease = Lock("in-txn", ttl=5, backend=url).acquire(timeout=0)
        seen = threading.Thread(target=lambda: results.append(backend.holder("in-txn")))
        results: list[object] = []
        seen.start()
        seen.join(10)
        assert results and results[0] is not None, "other connections see the lock at once"
        raise RuntimeError("roll the caller's transaction back")
    assert backend.holder("in-txn") is not None
    lease.release()


@ALL_DBS
def test_threads_never_overlap_and_hand_off_quickly(url: str) -> None:
    inside = 0
    overlaps = 0
    fences: list[int] = []
    guard = threading.Lock()

    def worker() -> None:
        nonlocal inside, overlaps
        for _ in range(5):
            with Lock("shared", ttl=10, backend=url, timeout=30) as lease:
                with guard:
                    inside += 1
                    overlaps += inside > 1
                    fences.append(lease.fence)
                time.sleep(0.01)
                with guard:
                    inside -= 1

    threads = [threading.Thread(target=worker) for _ in range(4)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert overlaps == 0
    assert fences == sorted(fences) and len(set(fences)) == 20
    assert time.monotonic() - started < 20


def _run_workers(url: str, name: str, rounds: int, tmp_path: Path) -> list[list[float]]:
    log = tmp_path / "sections.log"
    env = subprocess_env()
    workers = [
        subprocess.Popen(
            [sys.executable, str(HERE / "lock_worker.py"), url, name, str(rounds), str(log)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for proc in workers:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for proc in workers:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for proc in workers:
            assert proc.wait(timeout=60) == 0
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
    return [list(map(float, line.split())) for line in log.read_text().splitlines()]


@pytest.mark.skipif("pg" not in settings.DATABASES, reason="no PostgreSQL on 127.0.0.1:5432")
@pytest.mark.django_db(transaction=True, databases=ALIASES)
def test_two_processes_never_overlap_on_postgresql(tmp_path: Path) -> None:
    sections = sorted(_run_workers("django://pg", "pg-contended", 15, tmp_path))
    assert len(sections) == 30
    assert len({int(s[3]) for s in sections}) == 2, "both processes took the lock"
    for before, after in itertools.pairwise(sections):
        assert before[1] <= after[0], f"critical sections overlap: {before} and {after}"
        assert after[2] > before[2], "fences grow in the order the lock was held"


@pytest.mark.skipif("pg" not in settings.DATABASES, reason="no PostgreSQL on 127.0.0.1:5432")
@pytest.mark.django_db(transaction=True, databases=ALIASES)
@pytest.mark.parametrize("pooler", [False, True])
def test_prepared_statements_unless_the_alias_declares_a_pooler(
    pooler: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README: behind a transaction-mode pooler, ``DISABLE_SERVER_SIDE_CURSORS``
    keeps our PostgreSQL connections from preparing statements (a pooler hands the next
    statement to another session, where the prepared name does not exist). psycopg2
    prepares none either way (``nox -s psycopg2`` runs this with it)."""
    monkeypatch.setitem(connections["pg"].settings_dict, "DISABLE_SERVER_SIDE_CURSORS", pooler)
    backend = DjangoBackend("django://pg")
    try:
        for _ in range(8):  # past psycopg's prepare threshold, on one pooled connection
            assert backend.acquire("prepared", "t", 5_000, Owner()).acquired
            assert backend.release("prepared", "t")
        wrapper = backend._pool.checkout()  # that same connection (the pool is LIFO)
        try:
            with wrapper.cursor() as cursor:
                cursor.execute("SELECT count(*) FROM pg_prepared_statements")
                prepared = cursor.fetchone()[0]
        finally:
            backend._pool.checkin(wrapper)
    finally:
        backend.close()
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    assert (prepared == 0) if pooler or not is_psycopg3 else (prepared > 0), prepared


@pytest.mark.skipif("pg" not in settings.DATABASES, reason="no PostgreSQL on 127.0.0.1:5432")
@pytest.mark.django_db(transaction=True, databases=ALIASES)
def test_a_connection_keeps_its_driver_cursor_and_a_dead_one_goes_with_it() -> None:
    """A pooled PostgreSQL connection runs its statements on one kept driver cursor (a
    new one per call cost about a tenth of a cycle's client CPU). A connection the
    server ended goes, cursor and all, and the next call runs on a fresh one."""
    backend = DjangoBackend("django://pg")
    try:
        for _ in range(3):
            assert backend.acquire("kept-cursor", "t", 5_000, Owner()).acquired
            assert backend.release("kept-cursor", "t")
        wrapper = backend.idle_connections()[-1]  # the next checkout's (the pool is LIFO)
        connection, cursor = wrapper.task_locks_cursor
        assert connection is wrapper.connection and not cursor.closed
        assert backend.acquire("kept-cursor", "t", 5_000, Owner()).acquired
        assert wrapper.task_locks_cursor[1] is cursor, "the same cursor, used again"
        with connections["pg"].cursor() as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [connection.info.backend_pid])
        with pytest.raises(BackendUnavailable):  # a release is never retried: unknown
            backend.release("kept-cursor", "t")
        # Still held by "t" (nothing reached the server): taken again on a new connection.
        assert backend.acquire("kept-cursor", "t", 5_000, Owner()).acquired
        assert backend.release("kept-cursor", "t")
        fresh = backend.idle_connections()[-1]
        assert fresh is not wrapper and fresh.task_locks_cursor[1] is not cursor
    finally:
        backend.close()


@pytest.mark.django_db(transaction=True)
def test_two_processes_never_overlap_on_sqlite(tmp_path: Path) -> None:
    sections = sorted(_run_workers("django://default", "sqlite-contended", 8, tmp_path))
    assert len(sections) == 16
    for before, after in itertools.pairwise(sections):
        assert before[1] <= after[0]
        assert after[2] > before[2]


def test_bad_urls_fail_at_definition() -> None:
    with pytest.raises(InvalidArgument, match="no database alias 'nope'"):
        DjangoBackend("django://nope")


def test_database_errors_become_backend_unavailable(
    django_db_blocker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = DjangoBackend("django://default")
    broken = {**connections["default"].settings_dict, "NAME": "/nonexistent/dir/locks.sqlite3"}
    monkeypatch.setattr(backend._pool, "_settings", lambda: dict(broken))
    with django_db_blocker.unblock():
        with pytest.raises(BackendUnavailable) as failed:
            Lock("x", ttl=1, backend=backend).acquire(timeout=0)
    assert failed.value.name == "x" and failed.value.server == "django://default"


@ALL_DBS
def test_prefix_option_namespaces_the_table(url: str) -> None:
    shop, blog = get_backend(f"{url}?prefix=shop:"), get_backend(f"{url}?prefix=blog:")
    one = Lock("sync", ttl=5, backend=shop).acquire(timeout=0)
    two = Lock("sync", ttl=5, backend=blog).acquire(timeout=0)
    assert [h.name for h in shop.holders()] == ["sync"]
    assert [h.name for h in get_backend(url).holders()] == ["blog:sync", "shop:sync"]
    assert shop.holder("sync").fence == one.fence  # type: ignore[union-attr]
    one.release()
    two.release()
    with pytest.raises(InvalidArgument, match="unknown option"):
        DjangoBackend(f"{url}?bogus=1")


@ALL_DBS
def test_a_forked_child_uses_its_own_connections(url: str) -> None:
    backend = get_backend(url)
    lease = Lock("fork:parent", ttl=5, backend=backend).acquire(timeout=0)  # pools a connection
    pid = os.fork()
    if pid == 0:  # the child: lock through the inherited backend, then leave at once
        status = 1
        try:
            child = Lock("fork:child", ttl=5, backend=backend).acquire(timeout=0)
            child.release()
            status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's pooled connection still works: the child never closed it.
    assert [h.name for h in backend.holders("fork:")] == ["fork:parent"]
    lease.release()


def test_ready_configures_task_locks_from_settings() -> None:
    env = subprocess_env("memory://from-settings")
    code = (
        "import django; django.setup(); "
        "from task_locks.config import resolve_backend, default_ttl; "
        "print(resolve_backend().url, default_ttl())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["memory://from-settings", "30.0"], out.stderr


@ALL_DBS
def test_a_waiter_wakes_soon_after_the_release(alias: str, url: str) -> None:
    backend = get_backend(url)
    assert ("wakeup" in backend.capabilities) == (connections[alias].vendor == "postgresql")
    lease = Lock("wake", ttl=30, backend=backend).acquire(timeout=0)
    released_at: list[float] = []

    def release_soon() -> None:
        time.sleep(0.3)
        released_at.append(time.monotonic())
        lease.release()

    releaser = threading.Thread(target=release_soon)
    releaser.start()
    started = time.monotonic()
    backend.wait_release("wake", 20)  # the holder's TTL is 30 s: only the release ends this early
    woke = time.monotonic()
    releaser.join(10)
    assert woke - started < 5
    assert woke - released_at[0] < 0.5  # a generous bound: speed lives in bench/


# -- the backend contract: same-token acquire, conditional force release ------------


@ALL_DBS
def test_acquire_by_the_holding_token_resets_the_ttl_and_owner(url: str) -> None:
    """A retried acquire (its reply was lost) or a queued lock becoming the run lock: same
    fence, and the database's TTL and owner are this request's, in the same transaction."""
    backend = get_backend(url)
    first = backend.acquire("retry", "token-1", 1_000, Owner(host="a", pid=1))
    assert first.fence is not None
    again = backend.acquire("retry", "token-1", 60_000, Owner(host="b", pid=2))
    assert again.fence == first.fence
    holder = backend.holder("retry")
    assert holder is not None and holder.fence == first.fence
    assert 50 < holder.expires_in <= 61  # type: ignore[operator]
    assert (holder.owner.host, holder.owner.pid) == ("b", 2)
    shorter = backend.acquire("retry", "token-1", 2_000, Owner(host="c", pid=3))
    assert shorter.fence == first.fence
    assert backend.holder("retry").expires_in <= 2.5  # type: ignore[union-attr]
    other = backend.acquire("retry", "token-2", 5_000, Owner(host="d"))
    assert other.fence is None and other.holder_fence == first.fence
    assert backend.release("retry", "token-1") is True


@ALL_DBS
def test_force_release_with_a_fence_frees_only_that_holder(url: str) -> None:
    backend = get_backend(url)
    seen = backend.acquire("op", "token-1", 30_000, Owner(host="seen")).fence
    assert seen is not None
    assert backend.force_release("op", seen + 1) is False
    assert backend.holder("op") is not None, "a different fence frees nothing"
    assert backend.force_release("op", seen) is True
    assert backend.holder("op") is None
    now = backend.acquire("op", "token-2", 30_000, Owner(host="now")).fence
    assert now is not None and now > seen
    assert backend.force_release("op", seen) is False, "the lock changed hands"
    assert backend.holder("op").fence == now  # type: ignore[union-attr]
    assert asyncio.run(backend.aforce_release("op", seen)) is False
    assert asyncio.run(backend.aforce_release("op", now)) is True
    assert backend.force_release("op", now) is False


# -- the largest TTL is stored exactly, with an expiry -------------------------------


@ALL_DBS
def test_the_largest_ttl_is_stored_with_its_expiry(url: str) -> None:
    backend = get_backend(url)
    for ttl_ms in (MAX_TTL_MS, 1):
        result = backend.acquire(f"long:{ttl_ms}", "t", ttl_ms, Owner())
        assert result.fence is not None
    holder = backend.holder(f"long:{MAX_TTL_MS}")
    assert holder is not None and holder.expires_at is not None
    assert abs(holder.expires_in - MAX_TTL_MS / 1000) < 5  # type: ignore[operator]
    assert backend.renew(f"long:{MAX_TTL_MS}", "t", MAX_TTL_MS) is True
    holder = backend.holder(f"long:{MAX_TTL_MS}")
    assert abs(holder.expires_in - MAX_TTL_MS / 1000) < 5  # type: ignore[union-attr,operator]
    again = backend.acquire(f"long:{MAX_TTL_MS}", "t", MAX_TTL_MS, Owner())
    assert again.fence == result.fence or again.fence is not None
    assert backend.release(f"long:{MAX_TTL_MS}", "t") is True
    for bad in (0, -1):
        with pytest.raises(InvalidArgument):
            backend.acquire("long:bad", "t", bad, Owner())
    with pytest.raises(InvalidArgument):
        backend.acquire("long:bad", "t", MAX_TTL_MS + 1, Owner())
    with pytest.raises(InvalidArgument):
        backend.renew("long:1", "t", MAX_TTL_MS + 1)
    assert backend.holder("long:bad") is None


# -- the alias's isolation level does not leak into the backend's transactions ----------


def _strict_levels() -> list[Any]:
    """(alias, OPTIONS to add): Django's isolation_level, and a session default the
    way a DBA sets it (``ALTER DATABASE ... SET default_transaction_isolation``)."""
    cases: list[tuple[str, dict[str, object]]] = []
    if "pg" in settings.DATABASES:
        from django.db.backends.postgresql.psycopg_any import IsolationLevel

        cases += [
            ("pg", {"isolation_level": IsolationLevel.REPEATABLE_READ}),
            ("pg", {"options": "-c default_transaction_isolation=serializable"}),
        ]
    if "mysql" in settings.DATABASES:
        cases += [
            ("mysql", {"isolation_level": "repeatable read"}),
            ("mysql", {"isolation_level": "serializable"}),
        ]
    return [
        pytest.param(a, extra, marks=pytest.mark.django_db(transaction=True, databases=ALIASES))
        for a, extra in cases
    ]


@pytest.mark.parametrize(("strict_alias", "extra"), _strict_levels())
def test_contended_acquires_answer_held_under_a_strict_isolation_level(
    strict_alias: str, extra: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An alias whose transactions default to REPEATABLE READ or SERIALIZABLE: threads
    racing for one name get a fence or "held", never a serialization error."""
    options = {**connections[strict_alias].settings_dict.get("OPTIONS", {}), **extra}
    monkeypatch.setitem(connections[strict_alias].settings_dict, "OPTIONS", options)
    backend = DjangoBackend(f"django://{strict_alias}")
    errors: list[BaseException] = []
    granted: list[int] = []
    start = threading.Barrier(4)

    def contend(worker: int) -> None:
        try:
            for round_ in range(15):
                start.wait(10)  # every round raced by all four at once
                token = f"w{worker}-{round_}"
                result = backend.acquire(f"strict:{round_}", token, 30_000, Owner())
                if result.fence is not None:
                    granted.append(round_)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    backend.close()
    assert errors == [], errors[:1]
    assert sorted(granted) == list(range(15)), "exactly one winner per name"


@ALL_DBS
def test_a_name_too_long_for_the_table_is_refused_at_validation(url: str) -> None:
    """Prefix plus name must fit the 512-character column: refused before any SQL, with
    the limit, never BackendUnavailable ("value too long") nor cut by a non-strict MySQL
    (two names would be one lock)."""
    shop = get_backend(f"{url}?prefix=shop:")
    longest = "n" * (512 - len("shop:"))
    with pytest.raises(InvalidArgument, match=r"at most 507 characters.*got 508") as refused:
        Lock(longest + "a", ttl=5, backend=shop)
    assert refused.value.name.startswith("nnnn")
    # The default backend resolved later: refused at acquire, before the database sees it.
    with pytest.raises(InvalidArgument, match="at most 507 characters"):
        shop.acquire(longest + "b", "t" * 32, 5000, Owner())
    assert get_backend(url).holders("shop:") == []
    lease = Lock(longest, ttl=5, backend=shop).acquire(timeout=0)  # exactly the limit fits
    assert [h.name for h in shop.holders()] == [longest]
    lease.release()
