"""A Celery run's acquire (ACQUIRE_RUN) that redis-py resends after its reply was lost
answers what the server did: the run's own lock, never a "copy" of itself.

The fault is real: the chaoskit TCP proxy lets the script reach a real redis-server,
which applies it (takes the lock, takes the publish-time lock over under the run's
token, takes a semaphore's slot), then resets the connection instead of passing the
reply on; redis-py's own retry sends the same script again on a new connection. That
resend finds the name held by its own token, with the run's task id in the owner: it
must be granted with the same fence, not refused as a second delivery of the message
(which Celery would acknowledge without running it: the message lost).
"""

from __future__ import annotations

import asyncio
import secrets

import pytest
import redis
from chaoskit.proxy import Proxy
from servers import RedisServer

from task_locks import AsyncLock, Lock, LockHeld, Semaphore, get_backend
from task_locks._friends import acquire_as_run
from task_locks.owner import owner_context
from task_locks.types import Owner

SOCKET_TIMEOUT = 0.5
TASK_ID = 'task "resent" \\ é'  # JSON escapes in the id the script matches as text


@pytest.fixture
def server(redis_server: RedisServer) -> redis.Redis:
    return redis.Redis(port=redis_server.port)


def proxy_url(proxy: Proxy) -> str:
    """The proxied URL, its pooled connection already open (the fault is for the script,
    not for the connection's handshake)."""
    url = f"redis://127.0.0.1:{proxy.port}/0?socket_timeout={SOCKET_TIMEOUT}"
    get_backend(url).holder("warm-up")
    return url


def script_calls(server: redis.Redis) -> int:
    """EVALSHA calls the server ran: the resend is counted, the lost reply is not."""
    return int(server.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_a_resent_take_over_is_the_runs_own_lock(
    scripted_link: Proxy, redis_url: str, server: redis.Redis
) -> None:
    name = f"resent-run-{secrets.token_hex(4)}"
    direct = get_backend(redis_url)
    queued = secrets.token_hex(16)  # the publish-time lock (lock_on="both")
    fence = direct.acquire(name, queued, 30_000, Owner(task_id=TASK_ID)).fence
    assert fence is not None
    lock = Lock(name, ttl=30, backend=proxy_url(scripted_link), renew=False)
    before = script_calls(server)
    scripted_link.fault("reset_once")
    try:
        with owner_context(task_id=TASK_ID):
            lease = acquire_as_run(lock, queued, TASK_ID).acquire(timeout=0)
    finally:
        scripted_link.heal()
    assert script_calls(server) - before == 2, "the acquire was not sent twice"
    assert lease.fence == fence  # taken over in one step, then its resend: same fence
    holder = direct.holder(name)
    assert holder is not None and holder.token == lease.token != queued
    assert not direct.release(name, queued)  # an old worker's release of it frees nothing
    lease.release()
    assert direct.holder(name) is None


def test_a_resent_semaphore_run_keeps_its_slot(
    scripted_link: Proxy, redis_url: str, server: redis.Redis
) -> None:
    name = f"resent-sem-{secrets.token_hex(4)}"
    sem = Semaphore(name, 3, ttl=30, backend=proxy_url(scripted_link), renew=False)
    before = script_calls(server)
    scripted_link.fault("reset_once")
    try:
        with owner_context(task_id=TASK_ID):
            permit = acquire_as_run(sem, None, TASK_ID).acquire(timeout=0)
    finally:
        scripted_link.heal()
    assert script_calls(server) - before == 2, "the acquire was not sent twice"
    direct = get_backend(redis_url)
    held = [h for h in direct.holders() if h.name.startswith(f"semaphore:{name}")]
    assert [(h.name, h.token) for h in held] == [(permit.name, permit.token)]
    # A copy of the message (another token) is still refused while it holds the slot.
    copy = Semaphore(name, 3, ttl=30, backend=redis_url, renew=False)
    with owner_context(task_id=TASK_ID), pytest.raises(LockHeld) as refused:
        acquire_as_run(copy, None, TASK_ID).acquire(timeout=0)
    assert refused.value.holder is not None and refused.value.holder.name == permit.name
    permit.release()


def test_an_async_resent_run_acquire_is_granted(
    scripted_link: Proxy, redis_url: str, server: redis.Redis
) -> None:
    name = f"resent-async-{secrets.token_hex(4)}"

    async def run() -> None:
        url = proxy_url(scripted_link)
        await get_backend(url).aholder("warm-up")  # this loop's connection, opened
        lock = AsyncLock(name, ttl=30, backend=url, renew=False)
        before = script_calls(server)
        scripted_link.fault("reset_once")
        try:
            with owner_context(task_id=TASK_ID):
                lease = await acquire_as_run(lock, None, TASK_ID).acquire(timeout=0)
        finally:
            scripted_link.heal()
        assert script_calls(server) - before == 2, "the acquire was not sent twice"
        holder = get_backend(redis_url).holder(name)
        assert holder is not None and holder.token == lease.token
        await lease.release()
        await lease.backend.aclose()

    asyncio.run(run())
