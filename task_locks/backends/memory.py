"""``memory://``: locks inside one process, for tests, examples and single-process tools.

Same contract as the networked backends (TTL, token, fence, wake-ups), so code written
against it moves to Redis or etcd by changing the URL. ``memory://NAME`` gives separate
namespaces in one process.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from ..types import AcquireResult, Holder, Owner, RunCheck
from .base import Backend, Capability, RunChecked, check_ttl_ms, log_forced

log = logging.getLogger("task_locks.backends.memory")


@dataclass(slots=True)
class _Entry:
    token: str
    fence: int
    owner: Owner
    acquired_at: float
    deadline: float  # time.monotonic()
    renewals: int = 0


class MemoryBackend(Backend, RunChecked):
    capabilities = frozenset(
        {Capability.FENCING, Capability.WAKEUP, Capability.HOLDERS, Capability.RUN_CHECK}
    )

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self._locks: dict[str, _Entry] = {}
        self._fences: dict[str, int] = {}
        self._cond = threading.Condition()

    def _live(self, name: str, now: float) -> _Entry | None:
        entry = self._locks.get(name)
        if entry is not None and entry.deadline <= now:
            del self._locks[name]
            return None
        return entry

    def acquire(self, name: str, token: str, ttl_ms: int, owner: Owner) -> AcquireResult:
        check_ttl_ms(ttl_ms, name)
        with self._cond:
            return self._take(name, token, ttl_ms, owner, time.monotonic())

    def acquire_run(
        self, name: str, token: str, ttl_ms: int, owner: Owner, run: RunCheck
    ) -> AcquireResult:
        check_ttl_ms(ttl_ms, name)
        with self._cond:
            now = time.monotonic()
            for other in run.names:
                entry = self._live(other, now)
                if (
                    entry is not None
                    and entry.token not in (token, run.take_over, run.mark)
                    and entry.owner.task_id == run.task_id
                ):
                    return AcquireResult(
                        None,
                        entry.deadline - now,
                        entry.owner,
                        entry.fence,
                        entry.acquired_at,
                        None if other == name else other,
                    )
            entry = self._live(name, now)
            if entry is not None and run.take_over is not None and entry.token == run.take_over:
                entry.token = token  # the publish-time lock becomes this run's
            return self._take(name, token, ttl_ms, owner, now)

    def _take(self, name: str, token: str, ttl_ms: int, owner: Owner, now: float) -> AcquireResult:
        """The acquire, under the condition's lock."""
        entry = self._live(name, now)
        if entry is not None and entry.token != token:
            return AcquireResult(
                None, entry.deadline - now, entry.owner, entry.fence, entry.acquired_at
            )
        if entry is None:
            fence = max(self._fences.get(name, 0) + 1, time.time_ns() // 1000)
            self._fences[name] = fence
            entry = _Entry(token, fence, owner, time.time(), now + ttl_ms / 1000)
            self._locks[name] = entry
        else:  # ours already (a retried acquire): its lease counts from this request
            entry.deadline = now + ttl_ms / 1000
            entry.owner = owner
        return AcquireResult(entry.fence)

    def renew(self, name: str, token: str, ttl_ms: int) -> bool:
        check_ttl_ms(ttl_ms, name)
        with self._cond:
            now = time.monotonic()
            entry = self._live(name, now)
            if entry is None or entry.token != token:
                return False
            entry.deadline = now + ttl_ms / 1000
            entry.renewals += 1
            return True

    def release(self, name: str, token: str) -> bool:
        with self._cond:
            entry = self._live(name, time.monotonic())
            if entry is None or entry.token != token:
                return False
            del self._locks[name]
            self._cond.notify_all()
            return True

    def force_release(self, name: str, fence: int | None = None) -> bool:
        with self._cond:
            entry = self._live(name, time.monotonic())
            if entry is None or (fence is not None and entry.fence != fence):
                return False  # free, or no longer the holder the operator saw
            del self._locks[name]
            self._cond.notify_all()
        log_forced(log, name, self.server)
        return True

    def wait_release(self, name: str, timeout: float) -> None:
        with self._cond:
            if self._live(name, time.monotonic()) is not None:
                self._cond.wait(timeout)

    def holders(self, prefix: str = "") -> list[Holder]:
        with self._cond:
            now = time.monotonic()
            wall = time.time()
            return [
                Holder(
                    name=name,
                    fence=e.fence,
                    owner=e.owner,
                    acquired_at=e.acquired_at,
                    expires_at=wall + (e.deadline - now),
                    renewals=e.renewals,
                    token=e.token,
                )
                for name, e in sorted(self._locks.items())
                if name.startswith(prefix) and e.deadline > now
            ]
