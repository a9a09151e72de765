"""Fixtures for the coordination primitives (elections, semaphores, HA beat).

``local_url``: backends a single test process can use (memory, Redis), for the fast
in-process tests. ``shared_url``: backends several processes can share, for the
tests with real processes: Redis always; etcd when its backend and server
exist; redlock over three masters; the Django backend on PostgreSQL (pytest-django's test
database). Each shared backend that cannot run here is skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PROCS = HERE / "procs.py"


@pytest.fixture(params=["memory", "redis"])
def local_url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return f"memory://{uuid.uuid4().hex}"
    url: str = request.getfixturevalue("redis_url")
    return url


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[object]:
    if shutil.which("etcd") is None:
        pytest.skip("no etcd binary (scripts/install-servers.sh installs etcd-server)")
    from servers import EtcdServer

    server = EtcdServer().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def redlock_masters() -> Iterator[object]:
    from servers import RedisMasters

    masters = RedisMasters(3).start()
    yield masters
    masters.cleanup()


def _django_pg(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``django://pg`` on pytest-django's test database, shared with child processes."""
    from django.conf import settings

    if "pg" not in settings.DATABASES:
        pytest.skip("no PostgreSQL on 127.0.0.1:5432")
    request.applymarker(pytest.mark.django_db(transaction=True, databases=["default", "pg"]))
    request.getfixturevalue("transactional_db")
    from django.db import connections

    # Children read the test database's name from here (tests/django/settings.py).
    monkeypatch.setenv("TASK_LOCKS_TEST_PG", str(connections["pg"].settings_dict["NAME"]))
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "tests.django.settings")
    return "django://pg"


@pytest.fixture(params=["redis", "redlock", "etcd", "django-pg"])
def shared_url(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    prefix = f"coord-{uuid.uuid4().hex[:8]}:"
    if request.param == "etcd":
        return str(request.getfixturevalue("etcd_server").url(prefix=prefix))
    if request.param == "redlock":
        # A loaded 2-core test machine can stall a process past the 0.25 s default.
        masters = request.getfixturevalue("redlock_masters")
        return str(masters.url(prefix=prefix, node_timeout=1))
    if request.param == "django-pg":
        return _django_pg(request, monkeypatch)
    url: str = request.getfixturevalue("redis_url")
    return url


@pytest.fixture
def log_redis(redis_url: str) -> redis.Redis:
    """Where child processes write what they saw (interval logs, counters)."""
    return redis.Redis.from_url(redis_url, decode_responses=True)


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start ``procs.py`` children; any still running at the end are killed."""
    children: list[subprocess.Popen[bytes]] = []

    def start(*args: object) -> subprocess.Popen[bytes]:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE.parent)]))
        child = subprocess.Popen(
            [sys.executable, str(PROCS), *map(str, args)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        children.append(child)
        return child

    yield start
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        if child.stdout is not None:
            child.stdout.close()
