"""Backend deployments on real servers, shared by the conformance suite and the tests
that run their bodies on every backend (``@locked``, ``lock_options``, ``renew(ttl=)``).

:func:`build_deployment` makes a :class:`Deployment` of a kind: ``memory``, ``redis``,
``redlock`` (3 masters), ``etcd`` (1 node), ``etcd-cluster`` (3 nodes), the Django
database backend on SQLite, PostgreSQL and MariaDB/MySQL (:data:`DJANGO_KINDS`), and
the Redis topologies ``sentinel`` and ``cluster`` (:data:`REDIS_TOPOLOGIES`). Servers
are session fixtures (imported by tests/conftest.py, so every directory shares one set);
each deployment gets its own key prefix, hence its own backend instance and namespace.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from servers import (
    EtcdCluster,
    EtcdServer,
    RedisClusterNodes,
    RedisMasters,
    RedisSentinel,
    RedisServer,
)

from task_locks.backends import get_backend

KINDS = ["memory", "redis", "redlock", "etcd", "etcd-cluster"]
#: Redis topologies ``build_deployment`` also knows, for the tests that ask for them
#: (``deployment_params(*REDIS_TOPOLOGIES)``): one master behind a Sentinel, and a
#: 3-primary Redis Cluster. Not in every conformance test: each adds a server set.
REDIS_TOPOLOGIES = ["sentinel", "cluster"]
#: django:// on these DATABASES aliases of tests/django/settings.py (pytest-django's
#: settings for the whole suite): SQLite always, PostgreSQL and MariaDB/MySQL when their
#: ports answer.
DJANGO_KINDS = {"django-sqlite": "default", "django-postgres": "pg", "django-mysql": "mysql"}


def django_params() -> list[object]:
    from django.conf import settings

    params: list[object] = []
    for kind, alias in DJANGO_KINDS.items():
        marks = [pytest.mark.django_db(transaction=True, databases=sorted({"default", alias}))]
        if alias not in settings.DATABASES:
            marks.append(pytest.mark.skip(reason=f"no {alias!r} database on this machine"))
        params.append(pytest.param(kind, marks=marks, id=kind))
    return params


@dataclass
class Deployment:
    """One backend under test, and what the suite may expect of it."""

    kind: str
    url: str
    #: How much later than its TTL a dead holder's lock may end: etcd leases are whole
    #: seconds and expired by the leader's 500 ms sweep.
    expiry_slack: float = 0.3
    #: URLs of this scheme that must be refused at definition time.
    bad_urls: list[str] = field(default_factory=list)
    #: Stop every server behind ``url`` (private deployments only).
    stop: Callable[[], None] | None = None
    #: Environment for a child process that must use the same backend.
    env: dict[str, str] = field(default_factory=dict)

    @property
    def capabilities(self) -> frozenset[str]:
        return get_backend(self.url).capabilities


def cannot_run(module: str, binary: str | None = None) -> str | None:
    """Why a backend cannot run here, or ``None`` if it can."""
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed (pip install task-locks[etcd])"
    if binary and shutil.which(binary) is None:
        return f"no {binary} binary (scripts/install-servers.sh installs it)"
    return None


def skip_without_etcd() -> None:
    """Skip the test (or fixture) on a machine without etcd's client or server."""
    reason = cannot_run("etcd3gw", "etcd")
    if reason:
        pytest.skip(reason)


def unique_id() -> str:
    return uuid.uuid4().hex[:10]


BAD_URLS = {
    "memory": [],
    "redis": ["redis://127.0.0.1:notaport/0", "redis://127.0.0.1:6379/0?socket_timeout=soon"],
    "redlock": [
        "redlock://",
        "redlock://127.0.0.1",
        "redlock://127.0.0.1:1,127.0.0.1:1",
        "redlock://127.0.0.1:1?node_timeout=-1",
        "redlock://127.0.0.1:1?bogus=1",
    ],
    "etcd": [
        "etcd://",
        "etcd://127.0.0.1:notaport",
        "etcd://127.0.0.1:2379?timeout=0",
        "etcd://127.0.0.1:2379?bogus=1",
        "etcd://127.0.0.1:2379/some/path",
    ],
}
BAD_URLS["etcd-cluster"] = BAD_URLS["etcd"]
BAD_URLS["sentinel"] = ["redis+sentinel://127.0.0.1:26379", "redis+sentinel://127.0.0.1:1/m/x"]
BAD_URLS["cluster"] = ["redis+cluster://127.0.0.1:notaport"]


def deployment_params(*extra: str) -> list[object]:
    """``pytest.fixture(params=...)`` for every conformance deployment and ``extra`` kinds."""
    return [*KINDS, *django_params(), *extra]


@pytest.fixture(scope="session")
def redis_masters() -> Iterator[RedisMasters]:
    masters = RedisMasters(3).start()
    yield masters
    masters.cleanup()


@pytest.fixture(scope="session")
def etcd_node() -> Iterator[EtcdServer]:
    skip_without_etcd()
    server = EtcdServer().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def etcd_cluster() -> Iterator[EtcdCluster]:
    skip_without_etcd()
    cluster = EtcdCluster(3).start()
    yield cluster
    cluster.cleanup()


@pytest.fixture(scope="session")
def redis_sentinel() -> Iterator[RedisSentinel]:
    """A Redis master and a Sentinel watching it (``redis+sentinel://``)."""
    master = RedisServer().start()
    watcher = RedisSentinel(master).start()
    yield watcher
    watcher.cleanup()
    master.cleanup()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterNodes]:
    """A 3-primary Redis Cluster (``redis+cluster://``)."""
    nodes = RedisClusterNodes(3).start()
    yield nodes
    nodes.cleanup()


def build_deployment(request: pytest.FixtureRequest, kind: str) -> Deployment:
    """The deployment of ``kind`` (for fixtures that add kinds of their own)."""
    prefix = f"conf-{unique_id()}:"
    if kind == "memory":
        url = f"memory://{unique_id()}"
    elif kind == "redis":
        url = request.getfixturevalue("redis_server").url(prefix=prefix)
        if os.environ.get("TASK_LOCKS_TEST_HANDOFF"):  # e.g. "server": the hand-off on
            url += f"&handoff={os.environ['TASK_LOCKS_TEST_HANDOFF']}"
    elif kind == "redlock":
        url = request.getfixturevalue("redis_masters").url(prefix=prefix)
    elif kind == "etcd":
        url = request.getfixturevalue("etcd_node").url(prefix=prefix)
    elif kind == "etcd-cluster":
        url = request.getfixturevalue("etcd_cluster").url(prefix=prefix)
    elif kind == "sentinel":
        url = request.getfixturevalue("redis_sentinel").url(prefix=prefix)
    elif kind == "cluster":
        url = request.getfixturevalue("redis_cluster").url(prefix=prefix)
    else:
        return _django(kind)
    slack = 1.0 if kind.startswith("etcd") else 0.3
    return Deployment(kind, url, expiry_slack=slack, bad_urls=BAD_URLS[kind])


def _django(kind: str) -> Deployment:
    """django:// on pytest-django's test database (flushed after each test)."""
    from django.db import connections

    env = dict(os.environ, DJANGO_SETTINGS_MODULE="tests.django.settings")
    env["TASK_LOCKS_TEST_SQLITE"] = str(connections["default"].settings_dict["NAME"])
    if "pg" in connections.settings:
        env["TASK_LOCKS_TEST_PG"] = str(connections["pg"].settings_dict["NAME"])
    if "mysql" in connections.settings:
        env["TASK_LOCKS_TEST_MYSQL"] = str(connections["mysql"].settings_dict["NAME"])
    bad = ["django://no-such-alias", "django://default?bogus=1"]
    return Deployment(kind, f"django://{DJANGO_KINDS[kind]}", bad_urls=bad, env=env)
