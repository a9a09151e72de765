"""The lock services under test, each with the faults that make sense for it.

A service starts its servers, says which ports clients connect to (so the scenario can
put a proxy in front of each one per client), builds a client URL from those ports, and
implements its own share of the faults. ``faults`` lists what it supports.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from typing import Any

import redis
from servers import EtcdCluster, RedisMasters, RedisSentinel, RedisServer, port_open, wait_until

#: Socket timeouts well under the 1 s TTL the runs use: a stuck call must not outlive a lease.
REDIS_OPTIONS = "socket_timeout=0.4&connect_timeout=0.4"
#: A replica's full sync starts at once (Redis waits 5 s by default to batch replicas).
FAST_SYNC = ("--repl-diskless-sync-delay", "0")


class LockService:
    name = "service"
    #: Run settings this service needs (see ``scenario.Settings``).
    settings: dict[str, float] = {}
    faults: frozenset[str] = frozenset()
    #: Extra environment for the client processes.
    env: dict[str, str] = {}
    django = False

    def start(self) -> None:
        raise NotImplementedError

    def ports(self) -> list[int]:
        raise NotImplementedError

    def url(self, ports: list[int]) -> str:
        raise NotImplementedError

    def client_env(self, ports: list[int]) -> dict[str, str]:
        return {}

    def cleanup(self) -> None:
        raise NotImplementedError

    # faults -----------------------------------------------------------------------
    def pause(self) -> None:
        raise NotImplementedError

    def resume(self) -> None:
        raise NotImplementedError

    def restart(self, record: Callable[..., Any]) -> None:
        raise NotImplementedError


class SingleRedis(LockService):
    name = "redis"
    faults = frozenset(
        {
            "pause-holder",
            "kill-holder",
            "pause-server",
            "restart-server",
            "proxy-latency",
            "proxy-blackhole",
            "proxy-reset",
            "clock-skew",
        }
    )

    def __init__(self, options: str = "") -> None:
        self.server = RedisServer()
        self.options = options
        if options:
            self.name = f"redis?{options}"

    def start(self) -> None:
        self.server.start()

    def ports(self) -> list[int]:
        return [self.server.port]

    def url(self, ports: list[int]) -> str:
        extra = f"&{self.options}" if self.options else ""
        return f"redis://127.0.0.1:{ports[0]}/0?{REDIS_OPTIONS}{extra}"

    def cleanup(self) -> None:
        self.server.cleanup()

    def pause(self) -> None:
        self.server.pause()

    def resume(self) -> None:
        self.server.resume()

    def restart(self, record: Callable[..., Any]) -> None:
        """Kill and start again empty (no RDB, no AOF): every lock is forgotten."""
        self.server.restart()


class _FastSentinel(RedisSentinel):
    """A Sentinel that notices a dead master within a second and fails over at once.

    The failover fault resumes the replica as it kills the master, a second before
    Sentinel acts: a replica Sentinel still saw as down could not be promoted, and a
    promoted one whose last reply is stale would be failed over again at once.
    """

    def command(self) -> list[str]:
        command = super().command()
        config = self.dir / "sentinel.conf"
        with open(config, "a") as extra:
            extra.write(
                f"sentinel down-after-milliseconds {self.service} 1000\n"
                f"sentinel failover-timeout {self.service} 3000\n"
                f"sentinel parallel-syncs {self.service} 1\n"
            )
        return command


class SentinelRedis(LockService):
    """A master, one replica and a Sentinel (quorum 1), on loopback."""

    name = "sentinel"
    # A failover takes over a second (down-after 1 s): holds must outlast it to be hit.
    settings = {"ttl": 4.0, "work": 0.8}
    faults = frozenset(
        {"pause-holder", "kill-holder", "pause-server", "restart-server", "failover", "clock-skew"}
    )

    def __init__(self, options: str = "") -> None:
        self.options = options
        if options:
            self.name = f"sentinel?{options}"
        self.nodes = [RedisServer(extra=list(FAST_SYNC)), RedisServer()]
        self.nodes[1].extra = [*FAST_SYNC, "--replicaof", "127.0.0.1", str(self.nodes[0].port)]
        self.master, self.replica = self.nodes
        self.sentinel = _FastSentinel(self.master)

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        self._wait_replicated()
        self.sentinel.start()
        wait_until(self._sentinel_sees_replica, 10, "Sentinel to discover the replica")

    def _wait_replicated(self) -> None:
        def linked() -> bool:
            info = redis.Redis(port=self.replica.port, socket_timeout=0.5).info("replication")
            return info.get("master_link_status") == "up"

        wait_until(linked, 10, "the replica to sync")

    def _sentinel_client(self) -> redis.Redis:
        return redis.Redis(port=self.sentinel.port, socket_timeout=0.5)

    def _sentinel_sees_replica(self) -> bool:
        replicas = self._sentinel_client().sentinel_slaves(self.sentinel.service)
        return any(int(r["port"]) == self.replica.port for r in replicas)

    def master_port(self) -> int | None:
        address = self._sentinel_client().sentinel_get_master_addr_by_name(self.sentinel.service)
        return int(address[1]) if address else None

    def ports(self) -> list[int]:
        return []  # clients ask the Sentinel for the master; no proxy in between

    def url(self, ports: list[int]) -> str:
        extra = f"&{self.options}" if self.options else ""
        return (
            f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{self.sentinel.service}"
            f"?{REDIS_OPTIONS}{extra}"
        )

    def cleanup(self) -> None:
        self.sentinel.cleanup()
        for node in self.nodes:
            node.cleanup()

    def pause(self) -> None:
        self.master.pause()

    def resume(self) -> None:
        self.master.resume()
        self._settle()

    def restart(self, record: Callable[..., Any]) -> None:
        """The master dies and comes back empty before Sentinel notices (< 1 s).

        The replica then resynchronises from the empty master: the lock is gone on both.
        """
        self.master.extra = list(FAST_SYNC)
        self.master.restart()

    def _settle(self) -> None:
        """After a failover, re-learn who is master and make the other its replica."""
        port = wait_until(self.master_port, 10, "Sentinel to name a master")
        if port != self.master.port:
            self.master, self.replica = self.replica, self.master

    def failover(
        self,
        record: Callable[..., Any],
        handover_due: Callable[[], bool],
        holder_appeared: Callable[[], bool],
    ) -> None:
        """Replica promoted before it got the lock: SIGSTOP replica, acquire, SIGKILL master."""
        old_master, replica = self.master, self.replica
        if not handover_due():  # the holder is releasing: the next acquire is close
            return
        replica.pause()
        # Bytes already sent would still reach the stopped replica from its socket buffer
        # when it resumes: cut the link, so what follows exists on the master only.
        redis.Redis(port=old_master.port, socket_timeout=0.5).client_kill_filter(_type="replica")
        record("failover", phase="replica paused and cut off", port=replica.port)
        holder_appeared()  # a fresh acquire on the master, not replicated
        old_master.kill()
        replica.resume()
        record("note", phase="master killed, replica resumed", port=old_master.port)
        wait_until(
            lambda: self.master_port() == replica.port, 15, "Sentinel to promote the replica"
        )
        record("heal", phase="replica promoted", port=replica.port)
        self.master, self.replica = replica, old_master
        # The old master comes back (empty) as a replica of the new one.
        old_master.extra = [*FAST_SYNC, "--replicaof", "127.0.0.1", str(replica.port)]
        wait_until(lambda: not port_open(old_master.port), 5, "the old master's port to close")
        old_master.start()
        self._wait_replicated()


class Redlock(LockService):
    name = "redlock"
    faults = frozenset(
        {
            "pause-holder",
            "kill-holder",
            "pause-server",
            "restart-server",
            "proxy-latency",
            "proxy-blackhole",
            "proxy-reset",
            "clock-skew",
        }
    )

    def __init__(self, options: str = "") -> None:
        self.masters = RedisMasters(3)
        self.options = options
        if options:
            self.name = f"redlock?{options}"

    def start(self) -> None:
        self.masters.start()

    def ports(self) -> list[int]:
        return [server.port for server in self.masters.servers]

    def url(self, ports: list[int]) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in ports)
        extra = f"?{self.options}" if self.options else ""
        return f"redlock://{hosts}{extra}"

    def cleanup(self) -> None:
        self.masters.cleanup()

    def pause(self) -> None:
        for server in self.masters.servers:
            server.pause()

    def resume(self) -> None:
        for server in self.masters.servers:
            server.resume()

    def restart(self, record: Callable[..., Any]) -> None:
        """One master (at random) dies and comes back at once, empty."""
        server = random.choice(self.masters.servers)
        record("note", restarted=server.port)
        server.restart()


class Etcd(LockService):
    name = "etcd"
    faults = frozenset(
        {
            "pause-holder",
            "kill-holder",
            "pause-server",
            "kill-leader",
            "proxy-latency",
            "proxy-blackhole",
            "proxy-reset",
            "clock-skew",
        }
    )

    def __init__(self) -> None:
        self.cluster = EtcdCluster(3)

    def start(self) -> None:
        self.cluster.start()

    def ports(self) -> list[int]:
        return [member.port for member in self.cluster]

    def url(self, ports: list[int]) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in ports)
        return f"etcd://{hosts}?timeout=0.5"

    def cleanup(self) -> None:
        self.cluster.cleanup()

    def pause(self) -> None:
        for member in self.cluster:
            member.pause()

    def resume(self) -> None:
        for member in self.cluster:
            member.resume()

    def kill_leader(self, record: Callable[..., Any]) -> None:
        leader = self.cluster.leader()
        record("kill-leader", member=leader.member, port=leader.port)
        leader.kill()
        wait_until(lambda: self._leader_among_others(leader), 15, "a new etcd leader")
        record("heal", phase="new leader elected")
        time.sleep(0.5)
        leader.start()  # same data dir: it rejoins as a follower
        wait_until(leader.healthy, 15, "the old leader to rejoin")

    def _leader_among_others(self, dead: Any) -> bool:
        for member in self.cluster:
            if member is dead or member.proc is None or member.proc.poll() is not None:
                continue
            status = member.status()
            if status and status.get("leader") == status.get("header", {}).get("member_id"):
                return True
        return False


class DjangoDatabase(LockService):
    """``django://locks``: the lock table in a PostgreSQL database of its own."""

    name = "django"
    faults = frozenset(
        {
            "pause-holder",
            "kill-holder",
            "proxy-latency",
            "proxy-blackhole",
            "proxy-reset",
            "clock-skew",
        }
    )
    django = True

    def __init__(self, database: str) -> None:
        self.database = database

    def start(self) -> None:
        pass

    def ports(self) -> list[int]:
        return [5432]

    def url(self, ports: list[int]) -> str:
        return "django://locks"

    def client_env(self, ports: list[int]) -> dict[str, str]:
        return {"CHAOS_PG_PORT": str(ports[0])}

    def cleanup(self) -> None:
        pass


def environment(service: LockService, ports: list[int]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(service.client_env(ports))
    return env
