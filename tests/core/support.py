"""Test-side helpers: holder processes to steer, and one driver API over Lock and AsyncLock.

The behaviour tests are written once against :class:`SyncDriver`'s API; the ``driver``
fixture hands them either a :class:`SyncDriver` (``Lock``, the watchdog thread) or an
:class:`AsyncDriver` (``AsyncLock`` on an event loop running in its own thread, so its
renewal task keeps running between the test's calls, as in a real asyncio service).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import redis

from task_locks import AsyncLock, Lock, get_backend
from task_locks.backends.base import Backend
from task_locks.backends.redis_scripts import record_fields

HOLDER_SCRIPT = Path(__file__).with_name("holder.py")
#: What the reader thread queues once the holder's stdout closes.
_EOF = ""
#: Bound on any single wait for a child's answer.
REPLY_TIMEOUT = 15.0


class Child:
    """A lock holder in another process (``holder.py``), answering JSON commands."""

    def __init__(self, url: str, name: str, ttl: float, mode: str) -> None:
        # stderr to a file: read back when the holder dies unanswered, and copied to this
        # process's stderr at close (pytest shows it with the test, as before).
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, str(HOLDER_SCRIPT), url, name, str(ttl), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            bufsize=1,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.stopped = False
        self.grandchildren: list[int] = []
        try:
            ready = self._next(REPLY_TIMEOUT)
        except AssertionError:
            self.close()
            raise
        assert ready.get("ready") == self.proc.pid, ready

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(_EOF)

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"holder pid {self.proc.pid} gave no answer within {timeout}s "
                f"(exit code {self.proc.poll()})"
            ) from None
        if line == _EOF:  # it closed its stdout: it exited, or is about to
            self._lines.put(_EOF)  # every later wait fails at once too
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            raise AssertionError(
                f"holder pid {self.proc.pid} exited (code {self.proc.poll()}) without "
                f"answering; its stderr:\n{self._stderr_text()[-3000:]}"
            )
        return dict(json.loads(line))

    def _stderr_text(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def send(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def call(self, op: str, timeout: float = REPLY_TIMEOUT, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self._next(timeout)

    def answer(self, timeout: float = REPLY_TIMEOUT) -> dict[str, Any]:
        """The answer to a command sent earlier with :meth:`send`."""
        return self._next(timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        self.stopped = True

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self.stopped = False

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        for pid in self.grandchildren:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.stopped and self.proc.poll() is None:
            self.cont()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()  # EOF: a live holder exits on its own
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
        self._reader.join(timeout=5)
        self.proc.stdout.close()
        if not self._stderr.closed:
            sys.stderr.write(self._stderr_text())
            self._stderr.close()


class Handle:
    """A lease as the tests see it, whatever the driver: sync calls only."""

    def __init__(self, driver: SyncDriver, lease: Any) -> None:
        self.driver = driver
        self.lease = lease

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.lease, attribute)

    def release(self) -> None:
        self.driver.call(self.lease.release)

    def renew(self) -> None:
        self.driver.call(self.lease.renew)

    def check(self) -> None:
        self.driver.call(self.lease.check)


class SyncDriver:
    """Drives :class:`Lock` directly; waiters run in threads."""

    mode = "sync"
    lock_class: Any = Lock

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="test-waiter")

    def lock(self, name: str, **options: Any) -> Any:
        return self.lock_class(name, **options)

    def call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``function`` (sync, or async under :class:`AsyncDriver`) and return its result."""
        return function(*args, **kwargs)

    def start(self, function: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        """Run ``function`` in the background (a thread; a task under AsyncDriver)."""
        return self._pool.submit(function, *args)

    def acquire(self, name: str, timeout: float | None = 5, **options: Any) -> Handle:
        lock = self.lock(name, **options)
        return Handle(self, self.call(lock.acquire, timeout=timeout))

    def try_acquire(self, name: str, **options: Any) -> Handle | None:
        lease = self.call(self.lock(name, **options).try_acquire)
        return None if lease is None else Handle(self, lease)

    def start_acquire(
        self, name: str, timeout: float | None = 5, **options: Any
    ) -> concurrent.futures.Future[tuple[Handle, float]]:
        """A waiter in the background; its result is ``(handle, perf_counter at grant)``."""
        lock = self.lock(name, **options)

        def wait() -> tuple[Handle, float]:
            lease = lock.acquire(timeout=timeout)
            return Handle(self, lease), time.perf_counter()

        return self._pool.submit(wait)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class AsyncDriver(SyncDriver):
    """Drives :class:`AsyncLock` on an event loop that runs in its own thread."""

    mode = "async"
    lock_class = AsyncLock

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-loop")
        self._thread.start()
        self._backends: set[Backend] = set()

    def lock(self, name: str, **options: Any) -> Any:
        lock = self.lock_class(name, **options)
        self._backends.add(lock.backend)
        return lock

    def _submit(self, coroutine: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        async def run() -> Any:
            result = function(*args, **kwargs)
            return await result if asyncio.iscoroutine(result) else result

        return self._submit(run()).result(timeout=60)

    def start(self, function: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        async def run() -> Any:
            result = function(*args)
            return await result if asyncio.iscoroutine(result) else result

        return self._submit(run())

    def start_acquire(
        self, name: str, timeout: float | None = 5, **options: Any
    ) -> concurrent.futures.Future[tuple[Handle, float]]:
        lock = self.lock(name, **options)

        async def wait() -> tuple[Handle, float]:
            lease = await lock.acquire(timeout=timeout)
            return Handle(self, lease), time.perf_counter()

        return self._submit(wait())

    def close(self) -> None:
        async def shutdown() -> None:
            for backend in self._backends:
                await backend.aclose()
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self._submit(shutdown()).result(timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.loop.close()
            super().close()


def blocked_clients(url: str) -> int:
    """How many clients the server has blocked in BLPOP (a waiter that is really waiting)."""
    with redis.Redis.from_url(url) as client:
        return int(client.info("clients")["blocked_clients"])


def lock_fields(url: str, name: str) -> dict[str, str]:
    """The lock's record as stored in Redis (token, fence, renewals...); {} if none."""
    with redis.Redis.from_url(url, decode_responses=True) as client:
        return record_fields(client.get(f"task_locks:{{{name}}}")) or {}


def holder_token(url: str, name: str) -> str | None:
    holder = get_backend(url).holder(name)
    return None if holder is None else holder.token


__all__ = [
    "AsyncDriver",
    "Child",
    "Handle",
    "SyncDriver",
    "blocked_clients",
    "holder_token",
    "lock_fields",
]
