"""The backend contract of base.py, on redis, redlock and memory (sync and async).

- an acquire for the token that already holds the lock resets the TTL and the owner
  and answers the same fence (a retried acquire's lease must not outlive the server's);
- ``force_release(name, fence)`` frees only the holder the operator saw;
- a TTL the server cannot store is refused, and no failure leaves a key without expiry.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from servers import RedisMasters, wait_until

from task_locks import AsyncLock, InvalidArgument, Lock, get_backend
from task_locks.backends.base import MAX_TTL, Backend
from task_locks.backends.redis_scripts import record_fields
from task_locks.semaphore import Semaphore
from task_locks.types import Owner


@pytest.fixture(scope="module")
def masters() -> Iterator[RedisMasters]:
    servers = RedisMasters(3).start()
    yield servers
    servers.cleanup()


@pytest.fixture(params=["redis", "redlock", "memory"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def servers(kind: str, request: pytest.FixtureRequest) -> list[int]:
    """Ports of the Redis servers behind ``kind`` (flushed), none for memory."""
    if kind == "redis":
        server = request.getfixturevalue("redis_server")
        redis.Redis(port=server.port).flushall()
        return [server.port]
    if kind == "redlock":
        masters = request.getfixturevalue("masters")
        masters.flushall()
        return [s.port for s in masters.servers]
    return []


@pytest.fixture
def url(kind: str, servers: list[int], request: pytest.FixtureRequest) -> str:
    if kind == "redis":
        return f"redis://127.0.0.1:{servers[0]}/0"
    if kind == "redlock":
        return str(request.getfixturevalue("masters").url())
    return f"memory://{uuid.uuid4().hex}"


@pytest.fixture(params=["sync", "async"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def call(backend: Backend, mode: str, method: str, *args: Any) -> Any:
    """``backend.method(*args)``, or its ``a``-prefixed twin run on a fresh event loop."""
    if mode == "sync":
        return getattr(backend, method)(*args)

    async def run() -> Any:
        try:
            return await getattr(backend, "a" + method)(*args)
        finally:
            await backend.aclose()

    return asyncio.run(run())


def on_every_server(servers: list[int], name: str) -> None:
    """Wait until every server holds ``name``'s lock: Redlock answers at a majority, and a
    straggler grant landing later would overwrite what the test writes next."""

    def everywhere() -> bool:
        clients = [redis.Redis(port=port) for port in servers]
        try:
            # Held, not merely there: a release's tombstone lives in the same key.
            return all(record_fields(c.get(f"task_locks:{{{name}}}")) for c in clients)
        finally:
            for client in clients:
                client.close()

    wait_until(everywhere, 5, f"every server's copy of {name!r}")


def test_same_token_acquire_resets_the_ttl_and_the_owner(
    url: str, mode: str, servers: list[int]
) -> None:
    backend = get_backend(url)
    first = call(backend, mode, "acquire", "retried", "tok", 1000, Owner(host="first"))
    assert first.acquired
    on_every_server(servers, "retried")
    # The retry of an acquire whose reply was lost: same token, the lease counted from now.
    again = call(backend, mode, "acquire", "retried", "tok", 30_000, Owner(host="retry"))
    assert again.fence == first.fence
    holder = backend.holder("retried")
    assert holder is not None and holder.token == "tok"
    assert holder.owner.host == "retry"
    assert holder.expires_at is not None and holder.expires_at - time.time() > 20
    # Still the same lock: another token is refused, the holder can release it.
    assert not call(backend, mode, "acquire", "retried", "other", 1000, Owner()).acquired
    assert call(backend, mode, "release", "retried", "tok") is True


def test_force_release_with_the_fence_seen_leaves_a_new_holder(url: str, mode: str) -> None:
    backend = get_backend(url)
    assert call(backend, mode, "acquire", "report", "token-a", 30_000, Owner(host="a")).acquired
    seen = backend.holder("report")  # what the operator was shown
    assert seen is not None and seen.token == "token-a"
    # Meanwhile the lock changes hands.
    assert call(backend, mode, "release", "report", "token-a") is True
    taken = call(backend, mode, "acquire", "report", "token-b", 30_000, Owner(host="b"))
    assert taken.acquired and taken.fence != seen.fence

    assert call(backend, mode, "force_release", "report", seen.fence) is False
    now = backend.holder("report")
    assert now is not None and now.token == "token-b" and now.fence == taken.fence
    assert call(backend, mode, "renew", "report", "token-b", 30_000) is True

    assert call(backend, mode, "force_release", "report", taken.fence) is True
    assert backend.holder("report") is None
    assert call(backend, mode, "force_release", "report", taken.fence) is False
    # fence=None stays the unconditional override.
    assert call(backend, mode, "acquire", "report", "token-c", 30_000, Owner()).acquired
    assert call(backend, mode, "force_release", "report", None) is True
    assert backend.holder("report") is None


@pytest.mark.parametrize("factory", [Lock, AsyncLock, Semaphore])
def test_a_ttl_above_the_maximum_is_refused_naming_it(url: str, factory: Any) -> None:
    extra = {"limit": 2} if factory is Semaphore else {}
    for ttl in (MAX_TTL + 1, 1e16):
        with pytest.raises(InvalidArgument) as refused:
            factory("forever", ttl=ttl, backend=url, **extra)
        assert f"{MAX_TTL:,.0f}" in str(refused.value)
    factory("forever", ttl=MAX_TTL, backend=url, **extra)  # the maximum itself is fine


@pytest.mark.parametrize("ttl_ms", [10**19, 10**16, int(MAX_TTL * 1000) + 1])
def test_a_huge_ttl_leaves_no_key_without_expiry(
    url: str, servers: list[int], mode: str, ttl_ms: int
) -> None:
    backend = get_backend(url)
    with pytest.raises(InvalidArgument, match="at most"):
        call(backend, mode, "acquire", "forever", "tok", ttl_ms, Owner())
    for port in servers:
        client = redis.Redis(port=port)
        for key in client.scan_iter("*"):
            assert client.pttl(key) != -1, f"{key!r} on port {port} has no expiry"
    assert backend.holder("forever") is None
    # A renewal asking for such a TTL is refused the same way, and the lease keeps its own.
    assert call(backend, mode, "acquire", "forever", "tok", 5000, Owner()).acquired
    with pytest.raises(InvalidArgument, match="at most"):
        call(backend, mode, "renew", "forever", "tok", ttl_ms)
    holder = backend.holder("forever")
    assert holder is not None and holder.expires_at is not None
    assert holder.expires_at - time.time() < 6


def test_the_acquire_script_refuses_a_huge_ttl_before_writing(redis_url: str) -> None:
    """Whatever the client sends, the script itself never writes a lock it cannot expire."""
    from task_locks.backends.redis_scripts import SCRIPTS

    client = redis.Redis.from_url(redis_url)
    args = [2, "task_locks:{raw}", "task_locks:{raw}:fence", "tok", str(10**19), "{}", 60_000]
    with pytest.raises(redis.ResponseError):
        client.eval(SCRIPTS.source["acquire"], *args)
    assert client.dbsize() == 0  # (not KEYS: a test elsewhere checks it is never run)
