"""One run: a lock service, N client processes, a nemesis, then the checker.

Everything a run starts, it stops: servers, proxies, client processes (continued
first if a fault left them stopped), in ``finally`` blocks with deadlines.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import history as history_module
from .checker import CheckResult, check
from .client import HOLDING, LAST_STEP
from .clock import now
from .clusters import LockService
from .nemesis import FAKETIME_LIB, SKEW, nemesis
from .proxy import Proxy, ProxyHub

HERE = Path(__file__).resolve().parent
TESTS_DIR = HERE.parent
REPO = TESTS_DIR.parent
UNSET = 255


@dataclass
class Settings:
    duration: float = 4.0
    clients: int = 3
    ttl: float = 1.0
    writes_per_hold: int = 4
    work: float = 0.1
    idle: float = 0.05
    acquire_timeout: float = 1.0


@dataclass
class ClientProcess:
    slot: int
    process: int
    popen: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.popen.pid


@dataclass
class Outcome:
    backend: str
    fault: str
    seconds: float
    result: CheckResult
    errors: list[str] = field(default_factory=list)
    workdir: str = ""


class Run:
    def __init__(
        self,
        service: LockService,
        fault: str,
        settings: Settings,
        resource_redis: str,
        django_db: str | None = None,
        workdir: Path | None = None,
    ) -> None:
        self.service = service
        self.fault = fault
        self.settings = dataclasses.replace(settings, **service.settings)
        self.ttl = self.settings.ttl
        self.resource_redis = resource_redis
        self.django_db = django_db
        self.dir = workdir or Path(tempfile.mkdtemp(prefix="task-locks-chaos-"))
        (self.dir / "history").mkdir(parents=True, exist_ok=True)
        self.clients: list[ClientProcess] = []
        self.proxies: list[list[Proxy]] = []
        self.hub: ProxyHub | None = None
        self.errors: list[str] = []
        #: Seconds from the start of the run at which each phase ended (for the curious).
        self.phases: dict[str, float] = {}
        self.skew_recorded = False
        self._stopping = threading.Event()
        self._next_process = 0
        self._nemesis_log: history_module.Recorder | None = None
        self._state: mmap.mmap | None = None
        self._config_path = self.dir / "config.json"

    # -- helpers the nemesis uses ---------------------------------------------------------

    def record(self, action: str, **data: Any) -> None:
        assert self._nemesis_log is not None
        self._nemesis_log.event("nemesis", "info", action=action, **data)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def sleep(self, seconds: float) -> bool:
        """Sleep, waking early when the run ends; ``False`` if it ended."""
        return not self._stopping.wait(seconds)

    def state(self, slot: int) -> int:
        assert self._state is not None
        return self._state[slot]

    def wait_for_state(self, wanted: int, timeout: float, exclude: int | None = None) -> int | None:
        """A slot whose client is in ``wanted`` state (random among several), or ``None``.

        ``HOLDING`` includes the last step of a hold.
        """
        deadline = now() + timeout
        while not self._stopping.is_set():
            wanted_states = {HOLDING, LAST_STEP} if wanted == HOLDING else {wanted}
            slots = [
                c.slot
                for c in self.clients
                if c.slot != exclude and self.state(c.slot) in wanted_states
            ]
            if slots:
                return random.choice(slots)
            if now() >= deadline:
                return None
            time.sleep(0.002)
        return None

    def wait_for_new_holder(self, timeout: float) -> bool:
        """True once some client *becomes* a holder (an acquire completes from now on)."""
        before = {c.slot: self.state(c.slot) in (HOLDING, LAST_STEP) for c in self.clients}
        deadline = now() + timeout
        while now() < deadline and not self._stopping.is_set():
            for client in self.clients:
                holding = self.state(client.slot) in (HOLDING, LAST_STEP)
                if holding and not before[client.slot]:
                    return True
                before[client.slot] = holding
            time.sleep(0.001)
        return False

    def spawn(self, slot: int) -> ClientProcess:
        process = self._next_process
        self._next_process += 1
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR), str(REPO)])
        env["DJANGO_SETTINGS_MODULE"] = "chaoskit.django_settings"
        if self.django_db:
            env["CHAOS_PG_DB"] = self.django_db
        ports = [p.port for p in self.proxies[slot]] if self.proxies else self.service.ports()
        env.update(self.service.client_env(ports))
        if self.fault == "clock-skew" and slot in SKEW:
            env["LD_PRELOAD"] = FAKETIME_LIB
            env["FAKETIME"] = SKEW[slot]
            env["FAKETIME_NO_CACHE"] = "1"
        assert self._state is not None
        self._state[slot] = UNSET
        log = open(self.dir / f"client-{process}.log", "wb")
        try:
            popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "chaoskit.client",
                    str(self._config_path),
                    str(slot),
                    str(process),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=str(TESTS_DIR),
            )
        finally:
            log.close()
        client = ClientProcess(slot, process, popen)
        if slot < len(self.clients):
            self.clients[slot] = client
        else:
            self.clients.append(client)
        return client

    # -- the run --------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        backends = []
        for slot in range(self.settings.clients):
            ports = [p.port for p in self.proxies[slot]] if self.proxies else self.service.ports()
            backends.append(self.service.url(ports))
        return {
            "lock": f"chaos:{self.dir.name}",
            "resource": f"chaos:{self.dir.name}",
            "ttl": self.ttl,
            "backends": backends,
            "history": str(self.dir / "history"),
            "state": str(self.dir / "state"),
            "stop": str(self.dir / "stop"),
            "resource_redis": self.resource_redis,
            "django_resource": "resource" if self.django_db else None,
            "django": bool(self.django_db) or self.service.django,
            "writes_per_hold": self.settings.writes_per_hold,
            "work": self.settings.work,
            "idle": self.settings.idle,
            "acquire_timeout": self.settings.acquire_timeout,
        }

    def execute(self) -> Outcome:
        started = now()
        config: dict[str, Any] = {}
        self.service.start()
        try:
            if self.fault.startswith("proxy-"):
                self.hub = ProxyHub()
                self.proxies = [
                    [self.hub.proxy(port) for port in self.service.ports()]
                    for _ in range(self.settings.clients)
                ]
            config = self._config()
            self._config_path.write_text(json.dumps(config))
            (self.dir / "state").write_bytes(bytes([UNSET]) * 64)
            with open(self.dir / "state", "r+b") as state_file:
                self._state = mmap.mmap(state_file.fileno(), 0)
            self._nemesis_log = history_module.Recorder(
                self.dir / "history" / "nemesis.jsonl", "nemesis"
            )
            self.phases["servers"] = now() - started
            for slot in range(self.settings.clients):
                self.spawn(slot)
            self._wait_clients_started()
            self.phases["clients up"] = now() - started
            self._run_nemesis()
            self.phases["nemesis done"] = now() - started
            self._stop_clients()
            self.phases["clients stopped"] = now() - started
        finally:
            self._kill_clients()
            if self.hub is not None:
                self.hub.close()
            self.service.cleanup()
            if self._nemesis_log is not None:
                self._nemesis_log.close()
        events = history_module.load(self.dir / "history")
        result = check(events, self._finals(config))
        return Outcome(
            self.service.name, self.fault, now() - started, result, self.errors, str(self.dir)
        )

    def _wait_clients_started(self) -> None:
        deadline = now() + 30
        while any(self.state(c.slot) == UNSET for c in self.clients):
            for client in self.clients:
                if client.popen.poll() is not None:
                    log = (self.dir / f"client-{client.process}.log").read_text()[-3000:]
                    raise RuntimeError(f"chaos client {client.process} died at start:\n{log}")
            if now() > deadline:
                raise RuntimeError("chaos clients did not start within 30 s")
            time.sleep(0.01)

    def _run_nemesis(self) -> None:
        thread = threading.Thread(
            target=nemesis, args=(self, self.fault, self._stopping), name="nemesis", daemon=True
        )
        thread.start()
        self._stopping.wait(self.settings.duration)  # the run's length, nothing sets it early
        self._stopping.set()
        thread.join(60)
        if thread.is_alive():
            self.errors.append("the nemesis did not finish healing within 60 s")

    def _stop_clients(self) -> None:
        (self.dir / "stop").touch()
        deadline = now() + self.settings.acquire_timeout + 2 * self.ttl + 5
        for client in self.clients:
            _signal(client.pid, signal.SIGCONT)
            remaining = max(0.1, deadline - now())
            try:
                client.popen.wait(remaining)
            except subprocess.TimeoutExpired:
                self.errors.append(f"client {client.process} did not stop in time")
            if client.popen.returncode not in (0, None, -signal.SIGKILL):
                log = (self.dir / f"client-{client.process}.log").read_text()[-2000:]
                self.errors.append(
                    f"client {client.process} exited {client.popen.returncode}: {log}"
                )

    def _kill_clients(self) -> None:
        for client in self.clients:
            if client.popen.poll() is None:
                _signal(client.pid, signal.SIGCONT)
                client.popen.kill()
                client.popen.wait(10)
            # everything a client did is in its history; record deaths the checker needs
        if self._state is not None:
            self._state.close()

    def _finals(self, config: dict[str, Any]) -> dict[str, str | None]:
        import redis

        client = redis.Redis.from_url(self.resource_redis)
        try:
            plain = client.hget(f"chaos:plain:{config['resource']}", "value")
            fenced = client.hget(f"chaos:fenced:{config['resource']}", "value")
        finally:
            client.close()
        finals: dict[str, str | None] = {
            "unfenced": plain.decode() if plain is not None else None,
            "fenced": fenced.decode() if fenced is not None else None,
        }
        if self.django_db:
            finals["django"] = read_django_register(self.django_db, config["resource"])
        return finals


def read_django_register(database: str, name: str) -> str | None:
    import psycopg

    from .resources import REGISTER_TABLE

    with psycopg.connect(host="127.0.0.1", user="postgres", dbname=database) as connection:
        row = connection.execute(
            f"SELECT value FROM {REGISTER_TABLE} WHERE name = %s", [name]
        ).fetchone()
    return None if row is None else str(row[0])


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
