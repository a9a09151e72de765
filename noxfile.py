"""Support matrix: the package with pinned Django, Celery and redis-py versions.

Each session installs task-locks with one set of pins into its own virtualenv and runs a
smoke subset of the suite against real servers (the fixtures start their own Redis).

::

    nox -t short    # `make matrix-short` (in `make test`): the lowest pins we support
    nox             # `make matrix`: every session below
    nox -s psycopg2 # django:// on PostgreSQL through psycopg2 (in `make test` too)

The highest pins are what `make test` itself installs and runs the whole suite on.
Django: only 5.2 runs on Python 3.11 and is supported (6.0 needs Python 3.12; 4.2, 5.0
and 5.1 are out of support). docs/installation.md's "Supported versions" table lists what ran.
"""

from __future__ import annotations

import nox

#: None: the interpreter nox runs on (`make` runs it from .venv; we test on 3.11).
PYTHON = None
#: The floor declared in pyproject.toml, exactly.
LOWEST = {"django": "5.2", "celery": "5.3.0", "kombu": "5.3.0", "redis": "5.0.1"}
#: The Celery pools every set runs real workers of (``POOL_CELLS``).
POOLS = ("prefork", "threads", "solo", "gevent", "eventlet")
#: One cell per pool: a lock lost mid-run interrupts the body (a signal in prefork and
#: solo, an async exception in threads, the hub's throw in gevent and eventlet).
POOL_CELLS = [
    "tests/celery/test_celery_outcomes.py::"
    f"test_interrupt_raises_lock_lost_in_the_body_as_soon_as_the_loss_is_known[{pool}-True]"
    for pool in POOLS
]
#: Tests that exercise every integration point the pins affect: the lock API and the Redis
#: backend's scripts and error translation (core), LockedCommand and both CLIs (Django),
#: and real workers of every pool (Celery), in about a minute.
SMOKE = [
    "tests/core/test_lock_api.py",
    "tests/core/test_redis_backend.py",
    "tests/core/test_operator_messages.py",
    "tests/django/test_front_ends.py",
    "tests/celery/test_celery_compat.py",
    "tests/celery/test_celery_acceptance.py::test_skip_never_overlaps_and_skips_are_visible",
    "tests/celery/test_celery_acceptance.py::test_revoke_terminate_frees_the_lock_within_3s",
    "tests/celery/test_celery_acceptance.py::test_enqueue_lock_queues_one_message_per_key",
    "tests/celery/test_celery_acceptance.py::test_async_task_runs_under_an_async_lease_and_releases",
    *POOL_CELLS,
]
#: What the smoke subset needs beyond the package (not the whole `test` extra: no browser,
#: no linters), so a session installs in seconds.
TEST_TOOLS = [
    "pytest>=8",
    "pytest-django>=4.8",
    "pytest-timeout>=2.3",
    "hypothesis>=6.100",
    "psycopg[binary]>=3.1",
    "gevent>=24.2",  # the gevent and eventlet pools' workers
    "eventlet>=0.36",
]


def pins(
    django: str | None = None,
    celery: str | None = None,
    kombu: str | None = None,
    redis: str | None = None,
) -> dict[str, str]:
    chosen = {"django": django, "celery": celery, "kombu": kombu, "redis": redis}
    return {name: version for name, version in chosen.items() if version}


#: The newest Celery whose Redis broker (kombu 5.6) still takes redis-py 5.x: kombu 5.7
#: refuses redis-py < 6.1 (its own limit, not task-locks'; the suite's broker is Redis).
CELERY_FOR_REDIS_5 = {"celery": "5.6.3", "kombu": "5.6.2"}

#: The lowest; each Celery minor with the newest redis-py; each redis-py major (and 5.x's
#: newest) with the newest Celery that takes it. An absent pin means the newest release.
MATRIX = [
    nox.param(LOWEST, id="lowest", tags=["short"]),
    nox.param(pins(), id="newest"),
    *(
        nox.param(pins(celery=version), id=f"celery-{version}")
        for version in ("5.3.6", "5.4.0", "5.5.3", "5.6.3")
    ),
    *(
        nox.param(
            pins(redis=version, **(CELERY_FOR_REDIS_5 if version < "6" else {})),
            id=f"redis-{version}",
        )
        for version in ("5.0.1", "5.3.1", "6.4.0", "7.4.1")
    ),
]


@nox.session(python=PYTHON)
@nox.parametrize("versions", MATRIX)
def tests(session: nox.Session, versions: dict[str, str]) -> None:
    requirements = [f"{name}=={version}" for name, version in versions.items()]
    session.install("-e", ".[celery,django]", *requirements, *TEST_TOOLS)
    session.run(
        "python", "-c",
        "import celery, django, kombu, redis; print('versions: django', django.__version__,"
        " 'celery', celery.__version__, 'kombu', kombu.__version__, 'redis', redis.__version__)",
    )  # fmt: skip
    session.run(
        "python", "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x", "--durations=5",
        *(session.posargs or SMOKE),
    )  # fmt: skip


#: django:// on PostgreSQL through psycopg2, the driver Django takes when psycopg 3 is not
#: installed: the paths that differ (no server-side binding, NOTIFYs polled rather than
#: waited for, psycopg2's errors) under the backend's own tests and faults.
PSYCOPG2_TESTS = [
    "tests/django/test_django_backend.py",
    "tests/django/test_django_backend_faults.py",
    "tests/django/test_release_notices_sql.py",
]


@nox.session(python=PYTHON, tags=["short"])
def psycopg2(session: nox.Session) -> None:
    tools = [tool for tool in TEST_TOOLS if not tool.startswith("psycopg")]
    session.install("-e", ".[celery,django]", "psycopg2-binary>=2.9", *tools, "PyMySQL>=1.1")
    session.run(
        "python", "-c",
        "import importlib.util, psycopg2; assert importlib.util.find_spec('psycopg') is None, "
        "'psycopg 3 is installed: Django would not use psycopg2'; "
        "print('psycopg2', psycopg2.__version__)",
    )  # fmt: skip
    session.run(
        "python", "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x", "--durations=5",
        *(session.posargs or PSYCOPG2_TESTS),
    )  # fmt: skip
