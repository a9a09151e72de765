"""Private servers for the backend acceptance tests: each test may stop, pause or kill them."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator

import pytest
from servers import EtcdCluster, RedisMasters


@pytest.fixture
def masters_factory() -> Iterator[Callable[..., RedisMasters]]:
    """Start N independent Redis masters (``extra``: redis-server arguments per master)."""
    started: list[RedisMasters] = []

    def start(count: int = 3) -> RedisMasters:
        masters = RedisMasters(count)
        started.append(masters)
        return masters.start()

    yield start
    for masters in started:
        masters.cleanup()


@pytest.fixture
def etcd_cluster() -> Iterator[EtcdCluster]:
    if shutil.which("etcd") is None:
        pytest.skip("no etcd binary (scripts/install-servers.sh installs etcd-server)")
    cluster = EtcdCluster(3).start()
    yield cluster
    cluster.cleanup()
