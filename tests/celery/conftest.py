"""Real ``celery worker`` processes for the Celery tests.

One private Redis serves as broker (db 0), result backend (db 1) and lock server (db 2);
it is never flushed by the shared ``redis_url`` fixture, so workers started once serve
the whole session. Workers are started on first use (prefork, solo, threads, gevent,
eventlet, and one with a 5 s visibility timeout) and cold-stopped at the end; their logs are in
``worker.log`` files printed when a worker fails to start.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
from servers import RedisServer, wait_until

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@dataclass
class Worker:
    name: str
    hostname: str
    proc: subprocess.Popen[bytes]
    log: Path
    queues: list[str] = field(default_factory=list)

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            pass


class Cluster:
    """The broker/backend/lock URLs, the tasks module, and the workers started so far."""

    def __init__(self, server: RedisServer, tmp: Path) -> None:
        self.server = server
        self.tmp = tmp
        self.env = {
            "TL_CELERY_BROKER": server.url(0),
            "TL_CELERY_RESULTS": server.url(1),
            "TL_CELERY_LOCKS": server.url(2),
        }
        os.environ.update(self.env)
        # celery_tasks sits beside this conftest, whose folder pytest put on sys.path (a
        # folder without __init__.py); the workers find it through PYTHONPATH below.
        self.tasks: ModuleType = importlib.import_module("celery_tasks")
        self.app: Any = self.tasks.app
        self.locks_url = server.url(2)
        self.store = redis.Redis(port=server.port, db=2)
        self.broker = redis.Redis(port=server.port, db=0)
        self.workers: dict[str, Worker] = {}

    def start(
        self, specs: list[tuple[str, list[str], dict[str, str]]], broker: str | None = None
    ) -> list[Worker]:
        """Start workers ``(name, celery worker options, extra env)`` together; wait for all
        (``broker``: they use another broker than the cluster's; read their logs instead
        of pinging them)."""
        started = []
        for name, options, extra in specs:
            hostname = f"{name}-{uuid.uuid4().hex[:6]}@tltest"
            log = self.tmp / f"{name}.log"
            env = {
                **os.environ,
                **self.env,
                **extra,
                "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]),
                "PYTHONWARNINGS": "ignore",
            }
            command = [
                sys.executable, "-m", "celery", "-A", "celery_tasks", "worker",
                "-n", hostname, "-l", "INFO", "--logfile", str(log),
                "--without-gossip", "--without-mingle", "--without-heartbeat",
                *options,
            ]  # fmt: skip
            with open(self.tmp / f"{name}.stderr", "wb") as stderr:
                proc = subprocess.Popen(
                    command,
                    cwd=HERE,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                    start_new_session=True,
                )
            worker = Worker(name, hostname, proc, log)
            self.workers[name] = worker
            started.append(worker)
        for worker in started:
            self.wait_ready(worker, broker=broker)
        return started

    @contextmanager
    def running(
        self, specs: list[tuple[str, list[str], dict[str, str]]], broker: str | None = None
    ) -> Iterator[list[Worker]]:
        """:meth:`start` these workers, and stop them when done (a test module's own)."""
        workers = self.start(specs, broker)
        try:
            yield workers
        finally:
            self.stop(workers)
            for worker in workers:
                self.workers.pop(worker.name, None)

    def wait_ready(self, worker: Worker, timeout: float = 30.0, broker: str | None = None) -> None:
        def ready() -> bool:
            if worker.proc.poll() is not None:
                stderr = (self.tmp / f"{worker.name}.stderr").read_text(errors="replace")
                raise RuntimeError(f"worker {worker.name} exited:\n{stderr}\n{worker.tail()}")
            if broker is not None:  # the app's control commands go to its own broker
                return f"{worker.hostname} ready." in worker.tail()
            replies = self.app.control.ping(destination=[worker.hostname], timeout=0.5)
            return any(worker.hostname in reply for reply in replies)

        try:
            wait_until(ready, timeout, f"celery worker {worker.name} to answer ping", 0.2)
        except AssertionError:
            raise AssertionError(f"worker {worker.name} not ready:\n{worker.tail()}") from None

    def worker(self, name: str) -> Worker:
        return self.workers[name]

    def stop_all(self) -> None:
        """Cold shutdown (SIGQUIT) for all at once, then SIGKILL what is left."""
        self.stop(list(self.workers.values()))

    def stop(self, workers: list[Worker]) -> None:
        """Cold shutdown (SIGQUIT) for ``workers`` at once, then SIGKILL what is left."""
        for worker in workers:
            worker.signal(signal.SIGQUIT)
        deadline = time.monotonic() + 3
        for worker in workers:
            try:
                worker.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            worker.signal(signal.SIGKILL)
            worker.proc.wait(timeout=5)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    server = RedisServer().start()
    cluster = Cluster(server, tmp_path_factory.mktemp("celery"))
    try:
        yield cluster
    finally:
        cluster.stop_all()
        server.cleanup()


@pytest.fixture(scope="session")
def prefork_workers(cluster: Cluster) -> list[Worker]:
    """Two workers with three prefork processes each."""
    options = ["-P", "prefork", "-c", "3", "-Q", "tl_default"]
    return cluster.start([("prefork-a", options, {}), ("prefork-b", options, {})])


@pytest.fixture(scope="session")
def solo_worker(cluster: Cluster) -> Worker:
    return cluster.start([("solo", ["-P", "solo", "-Q", "tl_solo"], {})])[0]


@pytest.fixture(scope="session")
def threads_worker(cluster: Cluster) -> Worker:
    return cluster.start([("threads", ["-P", "threads", "-c", "3", "-Q", "tl_threads"], {})])[0]


@pytest.fixture(scope="session")
def gevent_worker(cluster: Cluster) -> Worker:
    return cluster.start([("gevent", ["-P", "gevent", "-c", "30", "-Q", "tl_gevent"], {})])[0]


@pytest.fixture(scope="session")
def eventlet_worker(cluster: Cluster) -> Worker:
    options = ["-P", "eventlet", "-c", "30", "-Q", "tl_eventlet"]
    return cluster.start([("eventlet", options, {})])[0]


@pytest.fixture(scope="session")
def redelivery_worker(cluster: Cluster) -> Worker:
    """Redis broker with visibility_timeout=5: unacked messages come back after 5 s."""
    options = ["-P", "prefork", "-c", "2", "-Q", "tl_redeliver"]
    return cluster.start([("redeliver", options, {"TL_VISIBILITY_TIMEOUT": "5"})])[0]


@pytest.fixture
def key() -> str:
    """A fresh key (and log list name) per test, so tests sharing workers never meet."""
    return f"k{uuid.uuid4().hex[:10]}"


@pytest.fixture
def intervals(cluster: Cluster) -> Callable[[str], list[dict[str, Any]]]:
    import json

    def read(log: str) -> list[dict[str, Any]]:
        return [json.loads(item) for item in cluster.store.lrange(log, 0, -1)]

    return read
