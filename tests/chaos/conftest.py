"""The chaos suite's options, shared servers and report.

``--chaos-long`` (``make chaos``) runs every backend x fault for longer; without it
(``make test``) a short form runs the faults that matter most. Either way the table is
printed at the end of the session and written to ``tests/artifacts/chaos-report.md``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from chaoskit import report
from chaoskit.resources import create_register_table
from chaoskit.scenario import REPO, TESTS_DIR
from servers import RedisServer, port_open

ARTIFACTS = TESTS_DIR / "artifacts"
_started = time.monotonic()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--chaos-long",
        action="store_true",
        default=False,
        help="run the long form of the chaos suite (every backend x fault, longer runs)",
    )


@pytest.fixture(scope="session")
def chaos_long(request: pytest.FixtureRequest) -> bool:
    # default: the option exists only when this directory was named on the command line
    return bool(request.config.getoption("--chaos-long", default=False))


@pytest.fixture(scope="session")
def chaos_resource_redis() -> Iterator[str]:
    """The Redis holding the protected registers; no fault ever touches it."""
    server = RedisServer().start()
    yield server.url()
    server.cleanup()


@pytest.fixture(scope="session")
def chaos_database() -> Iterator[str | None]:
    """A PostgreSQL database of this session with ``django_app``'s tables, or ``None``."""
    if not port_open(5432):
        yield None
        return
    import psycopg

    name = f"task_locks_chaos_{os.getpid()}"
    with psycopg.connect(
        host="127.0.0.1", user="postgres", dbname="postgres", autocommit=True
    ) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}"')
        c.execute(f'CREATE DATABASE "{name}"')
    try:
        env = dict(
            os.environ,
            DJANGO_SETTINGS_MODULE="chaoskit.django_settings",
            CHAOS_PG_DB=name,
            PYTHONPATH=os.pathsep.join([str(TESTS_DIR), str(REPO)]),
        )
        migrate = (
            "import django; django.setup(); from django.core.management import call_command; "
            "call_command('migrate', 'task_locks', verbosity=0)"
        )
        subprocess.run([sys.executable, "-c", migrate], env=env, check=True, timeout=120)
        with psycopg.connect(host="127.0.0.1", user="postgres", dbname=name, autocommit=True) as c:
            with c.cursor() as cursor:
                create_register_table(cursor)
        yield name
    finally:
        with psycopg.connect(
            host="127.0.0.1", user="postgres", dbname="postgres", autocommit=True
        ) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the report where the runs happened (under xdist: in the worker that ran
    them; the controller has none)."""
    if not report.OUTCOMES:
        return
    form = "long" if session.config.getoption("--chaos-long", default=False) else "short"
    seconds = sum(o.seconds for o in report.OUTCOMES)
    report.write(report.OUTCOMES, ARTIFACTS, form, seconds)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not report.OUTCOMES:
        return
    form = "long" if config.getoption("--chaos-long", default=False) else "short"
    terminalreporter.section(f"chaos report ({form} form)")
    terminalreporter.write_line(report.text_table(report.OUTCOMES))
    terminalreporter.write_line(f"written to {(ARTIFACTS / 'chaos-report.md').relative_to(REPO)}")
