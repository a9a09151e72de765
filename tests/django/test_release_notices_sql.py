"""Release notices on the SQL backend (PostgreSQL's NOTIFY) and in ``LockedCommand``.

TTL 30 s everywhere: renewals come every 10 s, so a loss within a second or two can only
come from the notice. PostgreSQL announces a force release in the same statement as its
DELETE; SQLite and MySQL have no notification channel and do not declare the capability
(renewal finds the loss there), nor does PostgreSQL through psycopg2, which cannot wait
for a NOTIFY (``nox -s psycopg2`` runs this file with it).
"""

from __future__ import annotations

import io
import threading
import time

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db.backends.postgresql.psycopg_any import is_psycopg3
from django_helpers import finish, manage
from servers import wait_until

from django_app import conf
from django_app.backend import DjangoBackend
from task_locks import Lock, NotOwned, get_backend, notices
from task_locks.backends.base import Capability

TTL = 30.0
no_pg = pytest.mark.skipif("pg" not in settings.DATABASES, reason="no PostgreSQL on 127.0.0.1:5432")
pg_db = pytest.mark.django_db(transaction=True, databases=["default", "pg"])
#: psycopg2 cannot wait for a NOTIFY: django://pg has no release notices through it.
notices_heard = pytest.mark.skipif(
    not is_psycopg3, reason="not applicable: psycopg2 cannot wait for a NOTIFY (no notices)"
)


def listening(backend: object) -> notices.Listener:
    found = wait_until(
        lambda: notices.listener(backend, create=False), 10, "a listener"  # type: ignore[arg-type]
    )
    assert found.ready.wait(10), "the listener subscribed"
    return found  # type: ignore[no-any-return]


@no_pg
@notices_heard
@pg_db
def test_a_force_release_on_postgresql_is_heard_at_once() -> None:
    lease = Lock("pg-report", ttl=TTL, backend="django://pg").acquire(0)
    assert Capability.RELEASE_NOTICE in lease.backend.capabilities
    listening(lease.backend)
    released = manage("locks", "release", "pg-report", "--force", "--yes", backend_url="django://pg")
    status, _, err = finish(released, 60)
    assert status == 0, err
    assert lease.lost.wait(1.0), "lost at once, not at the renewal 10 s away"
    assert "announced by PostgreSQL" in (lease.lost_reason or ""), lease.lost_reason


@no_pg
@notices_heard
@pg_db
def test_a_stale_postgresql_notice_leaves_the_new_lease_alone() -> None:
    other = DjangoBackend("django://pg")
    first = Lock("pg-job", ttl=TTL, backend="django://pg").acquire(0)
    listening(first.backend)
    assert other.force_release("pg-job", first.fence)
    assert first.lost.wait(1.0)
    second = Lock("pg-job", ttl=TTL, backend="django://pg").acquire(0)
    with other._cursor(None) as cursor:  # the old notice again, as a late copy would be
        cursor.execute("SELECT pg_notify('task_locks_forced', %s)", [f"{first.fence}|pg-job"])
    marker = Lock("pg-marker", ttl=TTL, backend="django://pg").acquire(0)
    assert other.force_release("pg-marker", marker.fence)
    assert marker.lost.wait(1.0), "the notices before it were read too"
    assert second.held
    second.release()
    other.close()


@no_pg
@pytest.mark.skipif(is_psycopg3, reason="not applicable: psycopg 3 hears a force release at once")
@pg_db
def test_through_psycopg2_a_force_release_is_found_at_the_next_renewal() -> None:
    """docs/troubleshooting.md: no release notices through psycopg2, and the backend says
    so; the holder learns of a force release from its next renewal instead."""
    lease = Lock("pg2-report", ttl=TTL, backend="django://pg").acquire(0)
    assert Capability.RELEASE_NOTICE not in lease.backend.capabilities
    other = DjangoBackend("django://pg")
    try:
        assert other.force_release("pg2-report", lease.fence)
    finally:
        other.close()
    assert lease.held, "nothing could have told it yet"
    with pytest.raises(NotOwned):
        lease.renew()
    assert lease.lost.is_set() and not lease.held


@pytest.mark.django_db(transaction=True)
def test_sqlite_has_no_release_notices() -> None:
    backend = get_backend("django://default")
    assert Capability.RELEASE_NOTICE not in backend.capabilities


@pytest.mark.parametrize("kind", ["redis", pytest.param("pg", marks=[no_pg, notices_heard])])
@pytest.mark.django_db(
    transaction=True, databases=sorted({"default"} | ({"pg"} & set(settings.DATABASES)))
)
def test_a_locked_command_stops_soon_after_a_force_release(
    kind: str, request: pytest.FixtureRequest, settings: object
) -> None:
    url = request.getfixturevalue("redis_url") if kind == "redis" else "django://pg"
    settings.TASK_LOCKS = {"BACKEND": url, "DEFAULT_TTL": 30}  # type: ignore[attr-defined]
    backend = conf.backend()
    took: list[float] = []

    def take_it_away() -> None:
        holder = wait_until(lambda: backend.holder("sleepy:a"), 20, "the command's lock")
        listening(backend)
        assert backend.force_release("sleepy:a", holder.fence)
        took.append(time.monotonic())

    thief = threading.Thread(target=take_it_away)
    thief.start()
    with pytest.raises(CommandError, match="was lost while") as lost:
        call_command(
            "locked_sleep", "--lock-ttl", str(TTL), "--seconds", "20", stdout=io.StringIO()
        )
    stopped = time.monotonic()
    thief.join(10)
    assert took and stopped - took[0] < 3.0, "stopped long before the 10 s renewal"
    assert lost.value.returncode == 79
    assert "release notice" in str(lost.value), lost.value
