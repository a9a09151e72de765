"""The backends of the fault matrix: real servers, reached through the chaoskit TCP proxy.

Each :class:`Target` gives two ways to reach the same locks:

- the *faulty* backend (``url`` / ``slow_url``), whose every byte crosses a proxy the
  test arms for exactly one call;
- the *checker* (``checker(name)``), a second client straight to the server(s), never
  through a proxy: it reads the truth (holder, token, fence, expiry) and plays the
  second client that must not get a lock the first one believes it holds.

``url`` has short socket timeouts (a dropped packet costs a fraction of a second);
``slow_url`` has timeouts longer than :data:`DELAY`, so a reply delayed past the TTL
still arrives, late, instead of timing out.

How each deployment puts the proxy in the client's path:

- redis: the URL names the proxy.
- sentinel: Sentinel monitors the master *at the proxy's address*, so the master it
  hands to clients is the proxy (Sentinel's own link to the master crosses it too).
- cluster: each node announces its proxy's port (``cluster-announce-port``), so the
  slot map the client reads, and every MOVED, point at proxies.
- redlock: one proxy per master; a fault is armed on all of them.
- django (PostgreSQL, MariaDB): a database alias of this session whose PORT is the
  proxy's, next to a direct alias on the server's own port for the checker.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import redis
from chaoskit.proxy import Proxy, ProxyHub
from servers import (
    RedisClusterNodes,
    RedisMasters,
    RedisSentinel,
    RedisServer,
    port_open,
    wait_until,
)

import task_locks.backends.redlock  # noqa: F401  (registers its scripts)
from task_locks.backends import Backend, get_backend
from task_locks.backends.redis_scripts import SCRIPTS

#: Lock TTL of every cell (seconds): short, so "past the TTL" costs little.
TTL = 1.0
#: Socket timeout of the fast URLs (seconds): a lost packet costs this much.
FAST_TIMEOUT = 0.4
#: How late a delayed reply arrives (seconds, per reply): past the TTL.
DELAY = 1.3 * TTL
#: Socket timeout of the slow URLs: a delayed reply must still be read.
SLOW_TIMEOUT = DELAY + 1.5


@dataclass
class Target:
    """One backend deployment under the fault matrix."""

    kind: str
    url: str
    slow_url: str
    proxies: list[Proxy]
    #: The direct backend (second client) for a lock name.
    checker: Callable[[str], Backend]
    #: Redis clients straight to every server holding keys, for the expiry audit.
    raw: list[redis.Redis] = field(default_factory=list)
    prefix: str = ""
    #: The client has no read timeout: a lost reply blocks it until the link is reset.
    unbounded_reads: bool = False
    #: ``?wait_replicas=1``: the proxy on the replica's link to the master, and a client
    #: straight to the replica (an acquire reported held must be on the replica).
    replica_link: Proxy | None = None
    replica: redis.Redis | None = None
    #: True once the replica acknowledges writes again (polled after its link heals).
    replica_acks: Callable[[], bool] | None = None
    #: ``"sync"`` (Lock, Lease, backend methods) or ``"asyncio"`` (AsyncLock, ``a*``).
    api: str = "sync"
    #: The proxies of the servers that hold a lock name, when not all of them (Redis
    #: Cluster: the primary of its slot; a fault elsewhere would hit the client's slot
    #: map refreshes instead, at random).
    links_of: Callable[[str], list[Proxy]] | None = None
    cleanup: list[Callable[[], None]] = field(default_factory=list)

    def arm(self, fault: str, name: str) -> None:
        """Arm ``fault`` on the links that carry lock ``name`` (see :attr:`links_of`)."""
        for proxy in self.links_of(name) if self.links_of else self.proxies:
            if fault == "delay":
                proxy.latency(DELAY)
            else:
                proxy.fault(fault)

    def heal(self, *, reset: bool = False) -> None:
        """Back to ``pass``; ``reset`` first aborts every connection (frees blocked reads)."""
        for proxy in self.proxies:
            if reset:
                proxy.reset()
            proxy.heal()

    def no_expiry(self) -> list[str]:
        """Keys of this target's namespace that would live forever (Redis: PTTL -1)."""
        found = []
        for client in self.raw:
            for key in client.scan_iter(match=f"{self.prefix}*", count=1000):
                if client.pttl(key) == -1:
                    found.append(
                        f"{key.decode()} on :{client.connection_pool.connection_kwargs['port']}"
                    )
        return found

    def close(self) -> None:
        for client in self.raw:
            client.close()
        for step in reversed(self.cleanup):
            with contextlib.suppress(Exception):
                step()


def _prefix() -> str:
    return f"faults-{uuid.uuid4().hex[:8]}:"


def _query(**options: object) -> str:
    return "&".join(f"{k}={v}" for k, v in options.items())


#: ``TASK_LOCKS_TEST_HANDOFF=client`` runs the Redis targets with ``?handoff=client``.
HANDOFF = os.environ.get("TASK_LOCKS_TEST_HANDOFF", "")


def _redis_urls(base: str, prefix: str, handoff: bool = True, mode: str = "") -> tuple[str, str]:
    """The fast and slow URLs; ``mode`` forces a ``handoff`` mode (else ``HANDOFF``)."""
    fast = _query(prefix=prefix, socket_timeout=FAST_TIMEOUT, connect_timeout=FAST_TIMEOUT)
    slow = _query(prefix=prefix, socket_timeout=SLOW_TIMEOUT, connect_timeout=FAST_TIMEOUT)
    mode = mode or (HANDOFF if handoff else "")
    extra = f"&handoff={mode}" if mode else ""
    return f"{base}?{fast}{extra}", f"{base}?{slow}{extra}"


def redis_single(hub: ProxyHub, handoff: str = "") -> Target:
    server = RedisServer().start()
    proxy = hub.proxy(server.port)
    prefix = _prefix()
    url, slow = _redis_urls(f"redis://127.0.0.1:{proxy.port}/0", prefix, mode=handoff)
    direct = server.url(prefix=prefix, **({"handoff": handoff} if handoff else {}))
    return Target(
        "redis+client" if handoff == "client" else "redis",
        url,
        slow,
        [proxy],
        checker=lambda name: get_backend(direct),
        raw=[redis.Redis(port=server.port)],
        prefix=prefix,
        cleanup=[server.cleanup],
    )


def redis_wait_replicas(hub: ProxyHub) -> Target:
    """Redis with one replica and ``?wait_replicas=1``; the replica follows the master
    through a proxy of its own, which the acquire cells blackhole: only an acquire whose
    WAIT covered its own write may then fail, and a reported success must be on the
    replica (WAIT on a connection that did not run the script)."""
    master = RedisServer().start()
    replica_link = hub.proxy(master.port)
    replica = RedisServer(extra=["--replicaof", "127.0.0.1", str(replica_link.port)]).start()
    client_link = hub.proxy(master.port)
    prefix = _prefix()
    # (no hand-off here: a grant inside a release has no WAIT of its own)
    url, slow = _redis_urls(f"redis://127.0.0.1:{client_link.port}/0", prefix, handoff=False)
    url, slow = (u + "&wait_replicas=1&wait_timeout=300" for u in (url, slow))
    raw_master, raw_replica = redis.Redis(port=master.port), redis.Redis(port=replica.port)

    def in_sync() -> bool:
        info = raw_master.info("replication")
        return info.get("connected_slaves") == 1 and info["slave0"]["state"] == "online"

    wait_until(in_sync, 20, "the replica to sync")
    direct = master.url(prefix=prefix)
    return Target(
        "redis+wait_replicas",
        url,
        slow,
        [client_link],
        checker=lambda name: get_backend(direct),
        raw=[raw_master],
        prefix=prefix,
        replica_link=replica_link,
        replica=raw_replica,
        # WAIT itself: "online" in INFO lags a replica that has not reconnected yet.
        replica_acks=lambda: raw_master.wait(1, 200) == 1,
        cleanup=[raw_replica.close, replica.cleanup, master.cleanup],
    )


def redis_sentinel(hub: ProxyHub) -> Target:
    master = RedisServer().start()
    proxy = hub.proxy(master.port)
    # Sentinel reads only ``.port`` of its master: give it the proxy's.
    sentinel = RedisSentinel(SimpleNamespace(port=proxy.port)).start()  # type: ignore[arg-type]
    prefix = _prefix()
    base = f"redis+sentinel://127.0.0.1:{sentinel.port}/{sentinel.service}"
    url, slow = _redis_urls(base, prefix)
    direct = master.url(prefix=prefix)
    return Target(
        "sentinel",
        url,
        slow,
        [proxy],
        checker=lambda name: get_backend(direct),
        raw=[redis.Redis(port=master.port)],
        prefix=prefix,
        cleanup=[master.cleanup, sentinel.cleanup],
    )


def redis_cluster(hub: ProxyHub) -> Target:
    nodes = RedisClusterNodes(3)
    proxies = []
    for node in nodes.nodes:
        proxy = hub.proxy(node.port)
        proxies.append(proxy)
        node.extra += ["--cluster-announce-port", str(proxy.port)]
    try:
        nodes.start()
    except BaseException:
        nodes.cleanup()
        raise
    prefix = _prefix()
    hosts = ",".join(f"127.0.0.1:{p.port}" for p in proxies)
    url, slow = _redis_urls(f"redis+cluster://{hosts}", prefix)
    raw = [redis.Redis(port=node.port) for node in nodes.nodes]

    def owner(name: str) -> int:
        """Index of the primary that owns the name's slot."""
        key = f"{prefix}{{{name}}}"
        for index, client in enumerate(raw):
            try:
                client.exists(key)
            except redis.exceptions.MovedError:
                continue
            return index
        raise AssertionError(f"no cluster node owns {key!r}")

    def checker(name: str) -> Backend:
        # A plain client on the primary that owns the name's slot (straight to its port):
        # every key of one lock shares that slot, so its scripts run there as they are.
        return get_backend(nodes.nodes[owner(name)].url(prefix=prefix))

    return Target(
        "cluster",
        url,
        slow,
        proxies,
        checker=checker,
        raw=raw,
        prefix=prefix,
        links_of=lambda name: [proxies[owner(name)]],
        cleanup=[nodes.cleanup],
    )


def redlock(hub: ProxyHub) -> Target:
    masters = RedisMasters(3).start()
    proxies = [hub.proxy(server.port) for server in masters.servers]
    prefix = _prefix()
    hosts = ",".join(f"127.0.0.1:{p.port}" for p in proxies)
    fast = _query(prefix=prefix, node_timeout=FAST_TIMEOUT)
    slow = _query(prefix=prefix, node_timeout=SLOW_TIMEOUT)
    direct = masters.url(prefix=prefix)
    return Target(
        "redlock",
        f"redlock://{hosts}?{fast}",
        f"redlock://{hosts}?{slow}",
        proxies,
        checker=lambda name: get_backend(direct),
        raw=[redis.Redis(port=server.port) for server in masters.servers],
        prefix=prefix,
        cleanup=[masters.cleanup],
    )


# -- django:// on a real database server, through the proxy ------------------------------


def _add_alias(alias: str, settings_dict: dict[str, Any]) -> None:
    """A database alias added at run time, visible to ``settings`` and ``connections``."""
    from django.conf import settings
    from django.db import connections

    settings.DATABASES[alias] = settings_dict
    both = {"default": connections.settings["default"], alias: settings_dict}
    connections.settings[alias] = connections.configure_settings(both)[alias]


def _drop_alias(alias: str) -> None:
    from django.conf import settings
    from django.db import connections

    with contextlib.suppress(Exception):
        connections[alias].close()
    settings.DATABASES.pop(alias, None)
    connections.settings.pop(alias, None)


def _migrate(alias: str) -> None:
    from django.core.management import call_command

    call_command("migrate", "task_locks", database=alias, verbosity=0)


def django_postgres(hub: ProxyHub) -> Target | None:
    if not port_open(5432):
        return None
    import psycopg

    database = f"task_locks_faults_{os.getpid()}"
    with psycopg.connect(
        host="127.0.0.1", user="postgres", dbname="postgres", autocommit=True
    ) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{database}"')
        c.execute(f'CREATE DATABASE "{database}"')

    def drop_database() -> None:
        with psycopg.connect(
            host="127.0.0.1", user="postgres", dbname="postgres", autocommit=True
        ) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')

    proxy = hub.proxy(5432)
    common = {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": "127.0.0.1",
        "USER": "postgres",
        "NAME": database,
        "OPTIONS": {"connect_timeout": 2},
    }
    _add_alias("faults_pg_direct", dict(common, PORT=5432))
    _add_alias("faults_pg", dict(common, PORT=proxy.port))
    _migrate("faults_pg_direct")
    prefix = _prefix()
    # libpq has no read timeout: django:// bounds each call itself (its ``timeout``).
    url = f"django://faults_pg?prefix={prefix}&timeout={FAST_TIMEOUT}"
    slow = f"django://faults_pg?prefix={prefix}&timeout={SLOW_TIMEOUT}"
    direct = f"django://faults_pg_direct?prefix={prefix}"
    return Target(
        "django-postgres",
        url,
        slow,
        [proxy],
        checker=lambda name: get_backend(direct),
        prefix=prefix,
        cleanup=[
            drop_database,
            lambda: _drop_alias("faults_pg_direct"),
            lambda: _drop_alias("faults_pg"),
        ],
    )


def django_mariadb(hub: ProxyHub) -> Target | None:
    from django.conf import settings

    if "mysql" not in settings.DATABASES:  # tests/django/settings.py: port 3306 and a driver
        return None
    import MySQLdb  # PyMySQL, installed under this name by the settings

    database = f"task_locks_faults_{os.getpid()}"
    admin = MySQLdb.connect(host="127.0.0.1", port=3306, user="root")
    with admin.cursor() as cursor:
        cursor.execute(f"DROP DATABASE IF EXISTS `{database}`")
        cursor.execute(f"CREATE DATABASE `{database}` CHARACTER SET utf8mb4")
    admin.close()

    def drop_database() -> None:
        conn = MySQLdb.connect(host="127.0.0.1", port=3306, user="root")
        with conn.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS `{database}`")
        conn.close()

    proxy = hub.proxy(3306)
    common = {
        "ENGINE": "django.db.backends.mysql",
        "HOST": "127.0.0.1",
        "USER": "root",
        "NAME": database,
    }
    fast = {
        "charset": "utf8mb4",
        "connect_timeout": 2,
        "read_timeout": FAST_TIMEOUT,
        "write_timeout": FAST_TIMEOUT,
    }
    slow = dict(fast, read_timeout=SLOW_TIMEOUT, write_timeout=SLOW_TIMEOUT)
    _add_alias("faults_my_direct", dict(common, PORT=3306, OPTIONS={"charset": "utf8mb4"}))
    _add_alias("faults_my", dict(common, PORT=proxy.port, OPTIONS=fast))
    _add_alias("faults_my_slow", dict(common, PORT=proxy.port, OPTIONS=slow))
    _migrate("faults_my_direct")
    prefix = _prefix()
    direct = f"django://faults_my_direct?prefix={prefix}"
    return Target(
        "django-mariadb",
        f"django://faults_my?prefix={prefix}",
        f"django://faults_my_slow?prefix={prefix}",
        [proxy],
        checker=lambda name: get_backend(direct),
        prefix=prefix,
        cleanup=[
            drop_database,
            *(
                (lambda a=a: _drop_alias(a))
                for a in ("faults_my_direct", "faults_my", "faults_my_slow")
            ),
        ],
    )


def _asyncio(build: Callable[[ProxyHub], Target | None]) -> Callable[[ProxyHub], Target | None]:
    """The same deployment, driven through the asyncio API (redis.asyncio's own client)."""

    def build_asyncio(hub: ProxyHub) -> Target | None:
        target = build(hub)
        if target is not None:
            target.kind += "-asyncio"
            target.api = "asyncio"
        return target

    return build_asyncio


def redis_client_handoff(hub: ProxyHub) -> Target:
    """Redis with ``?handoff=client`` (the opt-out: a release wakes a waiter, which
    acquires again; its own scripts) in every run, whatever ``TASK_LOCKS_TEST_HANDOFF``
    says."""
    return redis_single(hub, handoff="client")


BUILDERS: dict[str, Callable[[ProxyHub], Target | None]] = {
    "redis": redis_single,
    "redis+client": redis_client_handoff,
    "redis+wait_replicas": redis_wait_replicas,
    "sentinel": redis_sentinel,
    "cluster": redis_cluster,
    "redlock": redlock,
    "django-postgres": django_postgres,
    "django-mariadb": django_mariadb,
    "redis-asyncio": _asyncio(redis_single),
    "sentinel-asyncio": _asyncio(redis_sentinel),
    "redlock-asyncio": _asyncio(redlock),
    "redis+client-asyncio": _asyncio(redis_client_handoff),
}


def preload_scripts(target: Target) -> None:
    """Load every script on every server first: a cell's first EVALSHA would otherwise
    get NOSCRIPT, and the fault would hit that refusal (nothing applied) instead of the
    call, whose resend by EVAL then passes untouched."""
    for client in target.raw:
        for source in SCRIPTS.source.values():
            client.script_load(source)


@contextlib.contextmanager
def started(kind: str, hub: ProxyHub) -> Iterator[Target | None]:
    target = BUILDERS[kind](hub)
    try:
        if target is not None:
            preload_scripts(target)
        yield target
    finally:
        if target is not None:
            target.close()
