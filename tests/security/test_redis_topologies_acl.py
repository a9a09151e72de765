"""ACL users through Sentinel and Cluster URLs: ``user:password@`` reaches the Redis servers.

redis-py takes ``username`` apart from ``password``; a URL's user must not be dropped
(the password alone would be tried as the ``default`` user's).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from urllib.parse import quote

import pytest
from secure_fixtures import SECRET, readme_acl
from servers import RedisSentinel, SecureRedisServer, free_port, wait_until

from task_locks import Lock, get_backend

#: Characters a URL must percent-encode: the client must decode them before AUTH.
ODD_PASSWORD = SECRET + "@:/%?#"


@pytest.fixture(scope="module")
def acl_sentinel() -> Iterator[RedisSentinel]:
    admin = ("admin", SECRET + "-admin")
    acl = readme_acl() + f"user {admin[0]} on >{admin[1]} ~* &* +@all\n"
    acl += readme_acl(ODD_PASSWORD).replace("user locker ", "user odd ")

    master = SecureRedisServer(acl=acl, client=("locker", SECRET)).start()
    sentinel = RedisSentinel(master, auth=admin).start()
    yield sentinel
    sentinel.cleanup()
    master.cleanup()


@pytest.mark.parametrize("user, password", [("locker", SECRET), ("odd", ODD_PASSWORD)])
def test_sentinel_url_with_an_acl_user(
    acl_sentinel: RedisSentinel, user: str, password: str
) -> None:
    url = (
        f"redis+sentinel://{user}:{quote(password, safe='')}@127.0.0.1:{acl_sentinel.port}/"
        f"{acl_sentinel.service}?prefix=task_locks:sentinel:"
    )
    with Lock("via-sentinel", ttl=5, backend=url) as lease:
        (holder,) = get_backend(url).holders()
        assert holder.fence == lease.fence


#: What a Redis Cluster client needs beyond the README's ACL (also in the README):
#: the slot map and the command table redis-py reads when it connects.
CLUSTER_EXTRA = " +cluster|slots +command"


@pytest.fixture(scope="module")
def acl_cluster() -> Iterator[list[SecureRedisServer]]:
    admin = ("admin", SECRET + "-admin")
    odd = readme_acl(ODD_PASSWORD).replace("user locker ", "user odd ")
    acl = odd.rstrip("\n") + CLUSTER_EXTRA + "\n"
    acl += f"user {admin[0]} on >{admin[1]} ~* &* +@all\n"
    nodes = [SecureRedisServer(acl=acl, client=admin) for _ in range(3)]
    for node in nodes:
        node.extra = [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-port", str(free_port()),
            "--cluster-node-timeout", "2000",
        ]  # fmt: skip
        node.start()
    try:
        cli = shutil.which("redis-cli") or "redis-cli"
        done = subprocess.run(
            [cli, "--user", admin[0], "--pass", admin[1], "--no-auth-warning",
             "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes), "--cluster-yes"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr

        def agreed() -> bool:
            return all(
                n.redis_client().cluster("info").get("cluster_state") == "ok"  # type: ignore[attr-defined]
                for n in nodes
            )

        wait_until(agreed, 30, "the ACL cluster to report cluster_state:ok")
        yield nodes
    finally:
        for node in nodes:
            node.cleanup()


def test_cluster_url_with_an_acl_user(acl_cluster: list[SecureRedisServer]) -> None:
    hosts = ",".join(f"127.0.0.1:{n.port}" for n in acl_cluster)
    url = f"redis+cluster://odd:{quote(ODD_PASSWORD, safe='')}@{hosts}?prefix=task_locks:cl:"
    backend = get_backend(url)
    with Lock("via-cluster", ttl=5, backend=url) as lease:
        assert [h.fence for h in backend.holders()] == [lease.fence]
        assert backend.renew("via-cluster", lease.token, 5000)
    assert backend.holders() == []
    for node in acl_cluster:
        refused = [(e["reason"], e["object"]) for e in node.redis_client().acl_log()]  # type: ignore[attr-defined]
        assert refused == [], f"the cluster ACL refused: {refused}"
