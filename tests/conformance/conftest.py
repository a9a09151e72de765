"""Backends for the conformance suite: one deployment per URL scheme, same test bodies.

``deployment`` is parametrised over every backend this machine can run: ``memory``,
``redis``, ``redlock`` (3 masters), ``etcd`` (1 node), ``etcd-cluster`` (3 nodes), and
the Django database backend on SQLite, PostgreSQL and MariaDB/MySQL. The deployments
and their servers live in tests/deployments.py (other directories reuse them; a module
adds Sentinel and Cluster with ``deployment_params(*REDIS_TOPOLOGIES)``).
``private_deployment`` starts fresh servers a test may stop (backend-down errors).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from deployments import (
    BAD_URLS,
    DJANGO_KINDS,
    KINDS,
    REDIS_TOPOLOGIES,
    Deployment,
    build_deployment,
    deployment_params,
    django_params,
    skip_without_etcd,
    unique_id,
)
from lease_fixtures import no_leftover_renewals  # noqa: F401  (autouse here)
from servers import EtcdCluster, EtcdServer, RedisMasters, RedisServer


@pytest.fixture(params=[*KINDS, *django_params()])
def deployment(request: pytest.FixtureRequest) -> Deployment:
    """A backend on the session's servers, in a namespace of its own."""
    return build_deployment(request, request.param)


@pytest.fixture(params=[k for k in KINDS if k != "memory"])
def private_deployment(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    """A backend on servers of its own, which the test may stop."""
    kind: str = request.param
    servers: list[object] = []
    if kind == "redis":
        server = RedisServer().start()
        servers.append(server)
        url = server.url()
    elif kind == "redlock":
        masters = RedisMasters(3).start()
        servers.extend(masters.servers)
        url = masters.url()
    else:
        skip_without_etcd()
        if kind == "etcd":
            node = EtcdServer().start()
            servers.append(node)
            url = node.url(timeout=1)
        else:
            cluster = EtcdCluster(3).start()
            servers.extend(cluster.members)
            url = cluster.url(timeout=1)

    def stop() -> None:
        for server in servers:
            server.kill()  # type: ignore[attr-defined]

    yield Deployment(kind, url, stop=stop)
    for server in servers:
        server.cleanup()  # type: ignore[attr-defined]


__all__ = [
    "BAD_URLS",
    "DJANGO_KINDS",
    "KINDS",
    "REDIS_TOPOLOGIES",
    "Deployment",
    "build_deployment",
    "deployment_params",
    "django_params",
    "unique_id",
]
