"""Real servers for the tests: start, stop, pause (SIGSTOP), kill and restart them.

No fakes: every backend test talks to a real process on a free loopback port. Each
helper waits for readiness with a deadline and raises with the server's log on failure.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def _port_range() -> range:
    """This process's share of the loopback ports below the kernel's ephemeral range.

    A port the kernel picks (bind to 0) is free only until it hands the same number out
    as the source port of an outgoing connection, and the suite opens thousands: servers
    started a moment after ``free_port`` failed with "address already in use". Ports
    below the ephemeral range are never source ports. Each pytest worker draws from its
    own slice, so two workers never pick the same port."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            ephemeral_low = int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    if ephemeral_low < 12000:
        return range(0)  # no room below it: let the kernel pick
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker) % workers if worker.isdigit() else 0
    size = (ephemeral_low - 10000) // workers
    return range(10000 + index * size, 10000 + (index + 1) * size)


_ports = _port_range()
#: In turn from a random start: two calls made before either port is bound get two ports.
_turns = itertools.count(random.SystemRandom().randrange(len(_ports)) if _ports else 0)


def free_port() -> int:
    """A loopback port nothing listens on, that no outgoing connection can take."""
    for _ in range(len(_ports)):
        port = _ports[next(_turns) % len(_ports)]
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(
    predicate: Callable[[], object],
    timeout: float,
    what: str,
    interval: float = 0.01,
    alive: Iterable[subprocess.Popen[Any]] = (),
):
    """Poll ``predicate`` until it returns a true value, or fail after ``timeout`` seconds.

    ``alive``: child processes the wait depends on. One that has exited before
    ``predicate`` holds fails the wait at once, with what it printed, instead of at the
    timeout (a child that cannot import the package never gets there)."""
    deadline = time.monotonic() + timeout
    children = list(alive)
    while True:
        value = predicate()
        if value:
            return value
        for child in children:
            if child.poll() is not None:
                raise AssertionError(f"waiting for {what}: {exited(child)}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def exited(child: subprocess.Popen[Any], tail: int = 3000) -> str:
    """One line saying that ``child`` exited and how, then the end of what it printed on
    the pipes the caller gave it (stdout, stderr)."""
    try:
        out, err = child.communicate(timeout=5)
    except (subprocess.TimeoutExpired, ValueError):  # a grandchild holds a pipe; closed
        out, err = None, None
    printed = "".join(
        part.decode(errors="replace") if isinstance(part, bytes) else part
        for part in (out, err)
        if part
    )
    return f"pid {child.pid} exited with code {child.returncode}:\n{printed[-tail:]}"


def finish(proc: subprocess.Popen[str], timeout: float = 30) -> tuple[int, str, str]:
    """Wait (bounded) for a child started with text pipes; ``(status, stdout, stderr)``."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{proc.args} did not finish in {timeout}s: {out}\n{err}") from None
    return proc.returncode, out, err


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


class ServerProcess:
    """Common process control; subclasses say how to start and how to probe."""

    name = "server"

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix=f"task-locks-{self.name}-"))
        self.log = self.dir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False
        #: Added to the server's environment (an LD_PRELOAD clock shim, say).
        self.env: dict[str, str] = {}

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        return port_open(self.port)

    def start(self, timeout: float = 10.0) -> ServerProcess:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
                start_new_session=True,
                env={**os.environ, **self.env} if self.env else None,
            )
        try:
            wait_until(
                lambda: self.proc.poll() is not None or self.ready(),
                timeout,
                f"{self.name} on {self.port}",
            )
        except AssertionError:
            self.kill()
            raise
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited at start:\n{self.log.read_text()[-2000:]}")
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self.paused = False

    def kill(self) -> None:
        """SIGKILL: the server dies without a word (nothing is saved)."""
        if self.proc and self.proc.poll() is None:
            if self.paused:
                self.resume()
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.paused = False

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            if self.paused:
                self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def restart(self) -> ServerProcess:
        self.kill()
        wait_until(lambda: not port_open(self.port), 5, f"{self.name} port {self.port} to close")
        return self.start()

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisServer(ServerProcess):
    name = "redis"
    binary = shutil.which("redis-server") or "redis-server"

    def __init__(self, port: int | None = None, extra: list[str] | None = None) -> None:
        super().__init__(port)
        self.extra = extra or []

    def command(self) -> list[str]:
        return [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            *self.extra,
        ]

    def ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                # -NOAUTH: up, and requiring a password (--requirepass)
                return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def url(self, db: int = 0, **options: object) -> str:
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"redis://127.0.0.1:{self.port}/{db}" + (f"?{query}" if query else "")


class RedisMasters:
    """N independent Redis masters (no replication between them), for ``redlock://``."""

    def __init__(self, count: int = 3) -> None:
        self.servers = [RedisServer() for _ in range(count)]

    def start(self) -> RedisMasters:
        for server in self.servers:
            server.start()
        return self

    def __getitem__(self, index: int) -> RedisServer:
        return self.servers[index]

    def __len__(self) -> int:
        return len(self.servers)

    def url(self, **options: object) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.servers)
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"redlock://{hosts}" + (f"?{query}" if query else "")

    def flushall(self) -> None:
        import redis

        for server in self.servers:
            if server.proc is not None and server.proc.poll() is None and not server.paused:
                redis.Redis(port=server.port).flushall()

    def cleanup(self) -> None:
        for server in self.servers:
            server.cleanup()


class EtcdServer(ServerProcess):
    """One etcd member (Debian ``etcd-server``, v3.4). Alone, or one of an :class:`EtcdCluster`.

    Heartbeat 50 ms / election 500 ms: fast elections on loopback, and a minimum lease
    TTL of 1 s (etcd's floor is 1.5 election timeouts, rounded up to whole seconds).
    """

    name = "etcd"
    binary = shutil.which("etcd") or "etcd"

    def __init__(self, member: str = "n0", port: int | None = None, peer_port: int | None = None):
        super().__init__(port)
        self.member = member
        self.peer_port = peer_port or free_port()
        self.initial_cluster = f"{member}=http://127.0.0.1:{self.peer_port}"
        self.initial_state = "new"
        self.cluster_token = f"task-locks-{self.dir.name}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            self.binary,
            "--name",
            self.member,
            "--data-dir",
            str(self.dir / "data"),
            "--listen-client-urls",
            self.client_url,
            "--advertise-client-urls",
            self.client_url,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            self.initial_cluster,
            "--initial-cluster-state",
            self.initial_state,
            "--initial-cluster-token",
            self.cluster_token,
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
            "--log-level",
            "warn",
        ]

    def healthy(self) -> bool:
        """The member answers and sees a leader (``/health`` needs one)."""
        import json
        import urllib.request

        try:
            with urllib.request.urlopen(self.client_url + "/health", timeout=0.5) as answer:
                return json.loads(answer.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def status(self) -> dict[str, object] | None:
        """``/v3/maintenance/status``: member id, leader id, raft term; ``None`` if down."""
        import json
        import urllib.request

        request = urllib.request.Request(
            self.client_url + "/v3/maintenance/status",
            data=b"{}",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=0.5) as answer:
                return json.loads(answer.read())
        except (OSError, ValueError):
            return None

    def ready(self) -> bool:
        return self.healthy() if self.initial_cluster.count("=") == 1 else port_open(self.port)

    def url(self, **options: object) -> str:
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"etcd://127.0.0.1:{self.port}" + (f"?{query}" if query else "")


class EtcdCluster:
    """Three (or N) etcd members on loopback ports forming one Raft cluster."""

    def __init__(self, size: int = 3) -> None:
        self.members = [EtcdServer(f"n{i}") for i in range(size)]
        initial = ",".join(f"{m.member}={m.peer_url}" for m in self.members)
        for member in self.members:
            member.initial_cluster = initial
            member.cluster_token = self.members[0].cluster_token

    def start(self, timeout: float = 20.0) -> EtcdCluster:
        for member in self.members:
            member.start(timeout)
        wait_until(
            lambda: all(m.healthy() for m in self.members), timeout, "the etcd cluster to elect"
        )
        return self

    def __getitem__(self, index: int) -> EtcdServer:
        return self.members[index]

    def __iter__(self):
        return iter(self.members)

    def url(self, **options: object) -> str:
        hosts = ",".join(f"127.0.0.1:{m.port}" for m in self.members)
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"etcd://{hosts}" + (f"?{query}" if query else "")

    def leader(self, timeout: float = 10.0) -> EtcdServer:
        """The member that is the Raft leader now (as the live members agree)."""

        def find() -> EtcdServer | None:
            for member in self.members:
                if member.proc is None or member.proc.poll() is not None:
                    continue
                status = member.status()
                if status and status.get("leader") == status.get("header", {}).get("member_id"):  # type: ignore[union-attr]
                    return member
            return None

        return wait_until(find, timeout, "an etcd leader")

    def cleanup(self) -> None:
        for member in self.members:
            member.cleanup()


class RedisClusterNodes:
    """N ``redis-server`` nodes in cluster mode, all primaries, slots split by redis-cli.

    Each node gets an explicit cluster bus port (``--cluster-port``), so any free port
    works (the default bus port, port + 10000, needs ports <= 55535).
    """

    def __init__(self, size: int = 3, replicas: int = 0) -> None:
        #: ``replicas`` per primary (``size`` primaries): ``size * (1 + replicas)`` nodes.
        self.replicas = replicas
        self.nodes = [
            RedisServer(
                extra=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-port",
                    str(free_port()),
                    "--cluster-node-timeout",
                    "2000",
                    "--repl-diskless-sync-delay",
                    "0",
                ]
            )
            for _ in range(size * (1 + replicas))
        ]

    def start(self, timeout: float = 30.0) -> RedisClusterNodes:
        import redis

        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        cli = shutil.which("redis-cli") or "redis-cli"
        done = subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *addresses,
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{done.stdout}{done.stderr}")

        def agreed() -> bool:
            return all(
                redis.Redis(port=n.port).cluster("info").get("cluster_state") == "ok"
                for n in self.nodes
            )

        wait_until(agreed, timeout, "the Redis cluster to report cluster_state:ok")
        if self.replicas:

            def replicas_synced() -> bool:
                roles = [redis.Redis(port=n.port).info("replication") for n in self.nodes]
                return all(
                    r.get("master_link_status") == "up" for r in roles if r["role"] == "slave"
                ) and sum(r["role"] == "slave" for r in roles) == len(self.nodes) - len(
                    self.nodes
                ) // (1 + self.replicas)

            wait_until(replicas_synced, timeout, "the cluster's replicas to sync")
        return self

    def replica_of(self, primary_port: int) -> RedisServer:
        """The (first) replica of the primary listening on ``primary_port``."""
        import redis

        for node in self.nodes:
            info = redis.Redis(port=node.port).info("replication")
            if info["role"] == "slave" and int(info["master_port"]) == primary_port:
                return node
        raise LookupError(f"no replica of port {primary_port}")

    def url(self, **options: object) -> str:
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"redis+cluster://{hosts}" + (f"?{query}" if query else "")

    def flushall(self) -> None:
        import redis

        for node in self.nodes:
            if redis.Redis(port=node.port).info("replication")["role"] == "master":
                redis.Redis(port=node.port).flushall()

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()


class RedisSentinel(ServerProcess):
    """One Sentinel watching ``master`` under ``service`` (quorum 1)."""

    name = "sentinel"
    binary = shutil.which("redis-sentinel") or "redis-sentinel"

    def __init__(
        self,
        master: RedisServer,
        service: str = "mymaster",
        port: int | None = None,
        auth: tuple[str, str] | None = None,
    ):
        super().__init__(port)
        self.master = master
        self.service = service
        self.auth = auth  # (user, password) the sentinel uses on a master with ACL users

    def command(self) -> list[str]:
        config = self.dir / "sentinel.conf"  # Sentinel rewrites its config: a private copy
        config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} 1\n"
        )
        if self.auth is not None:
            user, password = self.auth
            with open(config, "a") as text:
                text.write(f"sentinel auth-user {self.service} {user}\n")
                text.write(f"sentinel auth-pass {self.service} {password}\n")
        return [self.binary, str(config)]

    def ready(self) -> bool:
        import redis

        try:
            client = redis.Redis(port=self.port, socket_timeout=0.5)
            with client:
                return client.sentinel_get_master_addr_by_name(self.service) is not None
        except (OSError, redis.RedisError):
            return False

    def url(self, **options: object) -> str:
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"redis+sentinel://127.0.0.1:{self.port}/{self.service}" + (
            f"?{query}" if query else ""
        )


# -- secured servers: TLS with a throwaway CA, etcd RBAC, Redis ACL users -------------------


class Certs:
    """A throwaway CA with a server certificate (for 127.0.0.1 only) and a client one.

    Made with the ``openssl`` CLI (EC P-256 keys: fast), valid for one day, in ``directory``.
    The server certificate also allows client use: etcd 3.4's gateway dials its own gRPC
    port with it when ``--client-cert-auth`` is on.
    """

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ca = self.dir / "ca.crt"
        self.ca_key = self.dir / "ca.key"
        self.server_cert, self.server_key = self.dir / "server.crt", self.dir / "server.key"
        self.client_cert, self.client_key = self.dir / "client.crt", self.dir / "client.key"
        self.other_ca = self.dir / "other-ca.crt"  # a CA that signed none of these

    def _openssl(self, *args: str) -> None:
        openssl = shutil.which("openssl") or "openssl"
        done = subprocess.run([openssl, *args], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"openssl {' '.join(args)} failed:\n{done.stderr}")

    def _self_signed(self, cert: Path, key: Path, subject: str) -> None:
        self._openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", subject,
        )  # fmt: skip

    def _signed(self, cert: Path, key: Path, subject: str, extensions: str) -> None:
        request = cert.with_suffix(".csr")
        ext = cert.with_suffix(".ext")
        ext.write_text(extensions)
        self._openssl(
            "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(key), "-out", str(request), "-subj", subject,
        )  # fmt: skip
        self._openssl(
            "x509", "-req", "-in", str(request), "-CA", str(self.ca), "-CAkey", str(self.ca_key),
            "-CAcreateserial", "-out", str(cert), "-days", "1", "-extfile", str(ext),
        )  # fmt: skip

    def make(self) -> Certs:
        self._self_signed(self.ca, self.ca_key, "/CN=task-locks test CA")
        self._self_signed(self.other_ca, self.dir / "other-ca.key", "/CN=some other CA")
        self._signed(
            self.server_cert,
            self.server_key,
            "/CN=task-locks test server",  # not a host name: only the SAN may match
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n",
        )
        self._signed(
            self.client_cert,
            self.client_key,
            "/CN=task-locks-client",
            "extendedKeyUsage=clientAuth\n",
        )
        return self


class TLSEtcdServer(EtcdServer):
    """One etcd member serving clients over HTTPS only, demanding a client certificate."""

    def __init__(self, certs: Certs, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.certs = certs

    @property
    def client_url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            *super().command(),
            "--cert-file", str(self.certs.server_cert),
            "--key-file", str(self.certs.server_key),
            "--trusted-ca-file", str(self.certs.ca),
            "--client-cert-auth",
        ]  # fmt: skip

    def ready(self) -> bool:
        import requests

        try:
            answer = requests.get(
                self.client_url + "/health",
                verify=str(self.certs.ca),
                cert=(str(self.certs.client_cert), str(self.certs.client_key)),
                timeout=0.5,
            )
            return bool(answer.json().get("health") == "true")
        except (OSError, ValueError, requests.RequestException):
            return False

    def url(self, **options: object) -> str:
        files = {
            "ca": self.certs.ca,
            "cert": self.certs.client_cert,
            "key": self.certs.client_key,
        }
        query = "&".join(f"{k}={v}" for k, v in {**files, **options}.items())
        return f"etcds://127.0.0.1:{self.port}?{query}"


class AuthEtcdServer(EtcdServer):
    """One etcd member with RBAC on: a ``root`` user and a lock user whose role covers one prefix.

    Set up through the v3 JSON gateway (no ``etcdctl`` needed): roles, users, grants,
    then ``auth/enable``.
    """

    def __init__(
        self, user: str, password: str, prefix: str, root_password: str, **kwargs: object
    ) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.user, self.password, self.prefix = user, password, prefix
        self.root_password = root_password

    def call(self, path: str, body: dict[str, object], token: str | None = None) -> dict:
        import json
        import urllib.request

        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = token
        request = urllib.request.Request(
            f"{self.client_url}/v3/{path}", data=json.dumps(body).encode(), headers=headers
        )
        with urllib.request.urlopen(request, timeout=5) as answer:
            return dict(json.loads(answer.read()))

    def grant(self, role: str, prefix: str, perm: str = "READWRITE") -> None:
        """Give ``role`` ``perm`` on every key starting with ``prefix`` (as root)."""
        from base64 import b64encode

        start = prefix.encode()
        end = start[:-1] + bytes([start[-1] + 1])
        token = self.root_token()
        self.call("auth/role/add", {"name": role}, token)
        perm_body = {
            "permType": perm,
            "key": b64encode(start).decode(),
            "range_end": b64encode(end).decode(),
        }
        self.call("auth/role/grant", {"name": role, "perm": perm_body}, token)

    def add_user(self, user: str, password: str, role: str) -> None:
        token = self.root_token()
        self.call("auth/user/add", {"name": user, "password": password}, token)
        self.call("auth/user/grant", {"user": user, "role": role}, token)

    def invalidate_tokens(self) -> None:
        """Set the lock user's password again (to the same one): etcd drops its tokens."""
        self.call(
            "auth/user/changepw",
            {"name": self.user, "password": self.password},
            self.root_token(),
        )

    def root_token(self) -> str:
        answer = self.call("auth/authenticate", {"name": "root", "password": self.root_password})
        return str(answer["token"])

    def start(self, timeout: float = 10.0) -> AuthEtcdServer:
        super().start(timeout)
        if (self.dir / "auth-set-up").exists():  # a restart: the data dir keeps it
            return self
        self.call("auth/user/add", {"name": "root", "password": self.root_password})
        self.call("auth/role/add", {"name": "root"})
        self.call("auth/user/grant", {"user": "root", "role": "root"})
        self.call("auth/role/add", {"name": "locks"})
        from base64 import b64encode

        start = self.prefix.encode()
        end = start[:-1] + bytes([start[-1] + 1])
        perm = {
            "permType": "READWRITE",
            "key": b64encode(start).decode(),
            "range_end": b64encode(end).decode(),
        }
        self.call("auth/role/grant", {"name": "locks", "perm": perm})
        self.call("auth/user/add", {"name": self.user, "password": self.password})
        self.call("auth/user/grant", {"user": self.user, "role": "locks"})
        self.call("auth/enable", {})
        (self.dir / "auth-set-up").touch()
        return self

    def url(self, **options: object) -> str:
        from urllib.parse import quote

        query = "&".join(f"{k}={v}" for k, v in options.items())
        credentials = f"{quote(self.user, safe='')}:{quote(self.password, safe='')}@"
        return f"etcd://{credentials}127.0.0.1:{self.port}" + (f"?{query}" if query else "")


class SecureRedisServer(RedisServer):
    """``redis-server`` on TLS only (when ``certs`` is given) and/or with an ACL file.

    ``acl`` is the ACL file's text (``user NAME on >PASSWORD ~pattern +command ...``);
    the ``default`` user is turned off unless the text says otherwise. ``client`` is the
    (user, password) the readiness probe and :meth:`url` use.
    """

    def __init__(
        self,
        certs: Certs | None = None,
        acl: str | None = None,
        client: tuple[str, str] | None = None,
        port: int | None = None,
        client_certs: bool = False,
    ) -> None:
        super().__init__(port)
        self.certs, self.acl, self.client = certs, acl, client
        self.client_certs = client_certs  # TLS clients must show a certificate

    def command(self) -> list[str]:
        command = super().command()
        if self.certs is not None:
            port_at = command.index("--port")
            command[port_at + 1] = "0"  # no plaintext port at all
            command += [
                "--tls-port", str(self.port),
                "--tls-cert-file", str(self.certs.server_cert),
                "--tls-key-file", str(self.certs.server_key),
                "--tls-ca-cert-file", str(self.certs.ca),
                "--tls-auth-clients", "yes" if self.client_certs else "optional",
            ]  # fmt: skip
        if self.acl is not None:
            acl_file = self.dir / "users.acl"
            text = self.acl if "user default" in self.acl else "user default off\n" + self.acl
            acl_file.write_text(text)
            command += ["--aclfile", str(acl_file)]
        return command

    def redis_client(self, user: str | None = None, password: str | None = None) -> object:
        """A plain redis-py client (as ``user``, default: :attr:`client`) on this server."""
        import redis

        if user is None and self.client is not None:
            user, password = self.client
        kwargs: dict[str, object] = {"host": "127.0.0.1", "port": self.port, "socket_timeout": 2}
        if user is not None:
            kwargs.update(username=user, password=password)
        if self.certs is not None:
            kwargs.update(ssl=True, ssl_ca_certs=str(self.certs.ca))
            if self.client_certs:
                kwargs.update(
                    ssl_certfile=str(self.certs.client_cert),
                    ssl_keyfile=str(self.certs.client_key),
                )
        return redis.Redis(**kwargs)  # type: ignore[arg-type]

    def ready(self) -> bool:
        import redis

        client = self.redis_client()
        try:
            with client:  # type: ignore[attr-defined]
                return bool(client.ping())  # type: ignore[attr-defined]
        except (OSError, redis.RedisError):
            return False

    def url(self, db: int = 0, **options: object) -> str:
        from urllib.parse import quote

        scheme = "redis"
        if self.certs is not None:
            scheme = "rediss"
            files: dict[str, object] = {"ssl_ca_certs": self.certs.ca}
            if self.client_certs:
                files.update(ssl_certfile=self.certs.client_cert, ssl_keyfile=self.certs.client_key)
            options = {**files, **options}
        credentials = ""
        if self.client is not None:
            user, password = self.client
            credentials = f"{quote(user, safe='')}:{quote(password, safe='')}@"
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"{scheme}://{credentials}127.0.0.1:{self.port}/{db}" + (
            f"?{query}" if query else ""
        )
