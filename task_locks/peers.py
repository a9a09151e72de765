"""Rolling deploys from other lock libraries: wait while a peer library's key is held.

During a rolling deploy old code (python-redis-lock, redis-py's ``Lock``, pottery,
celery-singleton, celery-once) and new task-locks code run side by side. They store
their locks under different Redis keys, so neither excludes the other. A
:class:`PeerCheckedLock` is a :class:`~task_locks.Lock` that, in addition, does not
take its name while any of the peer keys for that name exists on a Redis you name,
and re-checks right after acquiring (a peer that got in between makes it give way).

It is one-sided: old code does not look at task-locks' keys, so it can still start
while new code holds the lock. The cut-over in ``docs/migrating.md`` closes that side
(stop old publishers/holders from starting new work, then switch). Peer keys are
polled (every :data:`PEER_POLL` seconds, or sooner when the peer key's TTL ends):
none of the peers signals releases in a way another library can wait on without
stealing the peer's own wake-ups.

Key layouts, read from each library's source:

- python-redis-lock: ``Lock(redis, name)`` stores ``"lock:" + name``
  (:data:`PYTHON_REDIS_LOCK`); its release pushes to ``"lock-signal:" + name``.
- redis-py: ``redis.lock(name)`` stores the name itself (:data:`REDIS_PY`).
- pottery: ``Redlock(key=name)`` stores ``"redlock:" + name`` on each master
  (:data:`POTTERY`).
- celery-singleton: ``"SINGLETONLOCK_" + md5(task name + JSON args + JSON kwargs)``,
  a function of the task call rather than of a lock name: :func:`celery_singleton_key`.
- celery-once: ``"qo_" + task name + "_k-v"`` per argument: :func:`celery_once_key`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterable, Mapping
from hashlib import md5
from typing import Any, Final

import redis

from ._plan import UNSET, Unset
from .errors import BackendUnavailable, InvalidArgument, LockError, LockHeld
from .lock import AsyncLease, AsyncLock, Lease, Lock

#: python-redis-lock's key for a lock name.
PYTHON_REDIS_LOCK: Final = "lock:{name}"
#: redis-py's ``Lock`` uses the name as the key.
REDIS_PY: Final = "{name}"
#: pottery's ``Redlock`` key for a lock name (on every master).
POTTERY: Final = "redlock:{name}"
#: Seconds between looks at a peer key that is held.
PEER_POLL: Final = 0.1

Pattern = str | Callable[[str], str]


def celery_singleton_key(
    task_name: str,
    args: Iterable[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    *,
    prefix: str = "SINGLETONLOCK_",
) -> str:
    """The key celery-singleton (0.3) holds for ``task_name(*args, **kwargs)``.

    With ``unique_on=[...]`` celery-singleton hashes no args and only those kwargs:
    pass ``args=()`` and ``kwargs={name: value}`` for them. ``prefix`` is its
    ``singleton_key_prefix`` setting.
    """
    text = json.dumps(list(args or []), sort_keys=True) + json.dumps(
        dict(kwargs or {}), sort_keys=True
    )
    return prefix + md5((task_name + text).encode()).hexdigest()


def celery_once_key(
    task_name: str, arguments: Mapping[str, Any], keys: Iterable[str] | None = None
) -> str:
    """The key celery-once (3.0) holds: ``arguments`` as its signature binds them (no
    defaults applied); ``keys`` is its ``once={"keys": [...]}`` option."""
    if keys is not None:
        arguments = {key: arguments[key] for key in keys}
    pairs = sorted(arguments.items(), key=lambda kv: (str(kv[0]), str(kv[1])))
    return "_".join(["qo", task_name, *(f"{k}-{v}" for k, v in pairs)])


class PeerKeys:
    """The keys other libraries would hold for a lock name, on one Redis.

    ``patterns`` are ``str.format`` templates over ``{name}`` (``"lock:{name}"``) or
    callables from the lock name to the key.
    """

    def __init__(self, client: str | redis.Redis, *patterns: Pattern) -> None:
        if not patterns:
            raise InvalidArgument("PeerKeys needs at least one key pattern")
        for pattern in patterns:
            if isinstance(pattern, str):
                try:
                    pattern.format(name="probe")
                except (KeyError, IndexError, ValueError) as exc:
                    raise InvalidArgument(
                        f"peer key pattern {pattern!r} may only use {{name}}: {exc!r}"
                    ) from exc
            elif not callable(pattern):
                raise InvalidArgument(f"a peer key pattern is a str or a callable: {pattern!r}")
        self.patterns = patterns
        self.client = redis.Redis.from_url(client) if isinstance(client, str) else client

    def keys(self, name: str) -> list[str]:
        return [p.format(name=name) if isinstance(p, str) else p(name) for p in self.patterns]

    def holding(self, name: str) -> dict[str, float | None]:
        """The peer keys for ``name`` that exist -> seconds left (``None``: no TTL)."""
        keys = self.keys(name)
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.pttl(key)
                answers = pipe.execute()
        except redis.RedisError as exc:
            raise BackendUnavailable(
                f"lock {name!r}: cannot read the peer keys {keys}: {exc}", name=name
            ) from exc
        left = zip(keys, answers, strict=True)  # PTTL: -2 no key, -1 no TTL
        return {key: (None if ms == -1 else ms / 1000) for key, ms in left if ms != -2}

    def close(self) -> None:
        self.client.close()


def _peer_held(name: str, found: Mapping[str, float | None], waited: float) -> LockHeld:
    keys = ", ".join(
        f"{key!r} ({'no TTL' if left is None else f'{left:.3g}s left'})"
        for key, left in found.items()
    )
    after = f" after waiting {waited:.3g}s" if waited else ""
    return LockHeld(f"lock {name!r} is held by another library's key {keys}{after}", name=name)


def _pause(found: Mapping[str, float | None], now: float, deadline: float | None) -> float:
    """Until the next look: :data:`PEER_POLL`, or sooner if a peer key's TTL ends sooner."""
    ends = [left for left in found.values() if left is not None]
    pause = min([PEER_POLL, *ends]) if ends else PEER_POLL
    pause = max(pause, 0.001)
    return pause if deadline is None else max(0.0, min(pause, deadline - now))


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class PeerCheckedLock(Lock):
    """A :class:`~task_locks.Lock` that also waits while a peer library's key exists.

    ``peers`` says which keys on which Redis (:class:`PeerKeys`). ``timeout`` covers
    the wait for both; a peer still holding at the end raises
    :class:`~task_locks.LockHeld` naming the peer key.
    """

    def __init__(self, name: str, ttl: float | None = None, *, peers: PeerKeys, **options: Any):
        super().__init__(name, ttl, **options)
        if not isinstance(peers, PeerKeys):
            raise InvalidArgument(f"peers must be a PeerKeys, got {peers!r}", name=name)
        self.peers = peers

    def acquire(self, timeout: float | Unset | None = UNSET) -> Lease:
        wait = self._timeout(timeout)
        start = time.monotonic()
        deadline = None if wait is None else start + wait
        while True:
            while found := self.peers.holding(self.name):
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise _peer_held(self.name, found, now - start)
                time.sleep(_pause(found, now, deadline))
            lease = super().acquire(timeout=_left(deadline))
            try:
                clear = not self.peers.holding(self.name)
            except BaseException:
                # The second look failed: give the lock back (else it stays held and renewed
                # with nobody to release it), then report the failure.
                with contextlib.suppress(LockError):
                    lease.release()
                raise
            if clear:
                return lease
            lease.release()  # a peer took its key in between: it was first, give way


class AsyncPeerCheckedLock(AsyncLock):
    """The asyncio twin of :class:`PeerCheckedLock` (peer keys read in a thread)."""

    def __init__(self, name: str, ttl: float | None = None, *, peers: PeerKeys, **options: Any):
        super().__init__(name, ttl, **options)
        if not isinstance(peers, PeerKeys):
            raise InvalidArgument(f"peers must be a PeerKeys, got {peers!r}", name=name)
        self.peers = peers

    async def acquire(self, timeout: float | Unset | None = UNSET) -> AsyncLease:
        wait = self._timeout(timeout)
        start = time.monotonic()
        deadline = None if wait is None else start + wait
        while True:
            while found := await asyncio.to_thread(self.peers.holding, self.name):
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise _peer_held(self.name, found, now - start)
                await asyncio.sleep(_pause(found, now, deadline))
            lease = await super().acquire(timeout=_left(deadline))
            try:
                clear = not await asyncio.to_thread(self.peers.holding, self.name)
            except BaseException:
                with contextlib.suppress(LockError):  # as in PeerCheckedLock.acquire
                    await lease.release()
                raise
            if clear:
                return lease
            await lease.release()


__all__ = [
    "PEER_POLL",
    "POTTERY",
    "PYTHON_REDIS_LOCK",
    "REDIS_PY",
    "AsyncPeerCheckedLock",
    "PeerCheckedLock",
    "PeerKeys",
    "celery_once_key",
    "celery_singleton_key",
]
