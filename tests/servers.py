"""Real servers for the tests: start, stop, pause (SIGSTOP), kill and restart them.

No fakes: every backend test talks to a real process on a free loopback port. Each
helper waits for readiness with a deadline and raises with the server's log on failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.01):
    """Poll ``predicate`` until it returns a true value, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


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
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def url(self, db: int = 0, **options: object) -> str:
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"redis://127.0.0.1:{self.port}/{db}" + (f"?{query}" if query else "")
