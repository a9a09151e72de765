"""A release that redis-py resends after its reply was lost reports what the server did.

The fault is real: the chaoskit TCP proxy lets the release reach
a real redis-server, which frees the lock, then resets the connection instead of
passing the reply on; redis-py's own retry sends the release again, on a new connection.
That resend finds the lock gone. Without a trace of the first attempt it would answer
"not ours" (``NotOwned``: "nothing was released"), the opposite of what happened; the
release script leaves a short-lived tombstone in the lock's own key, ``<prefix>{name}``
(``r<waiters>|<release id>``), that the resend recognises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis
from chaoskit.proxy import Proxy
from servers import RedisServer

from task_locks import AsyncLock, Lock, NotOwned, get_backend
from task_locks.backends.redis_scripts import SCRIPTS, record_fields
from task_locks.types import Owner

SOCKET_TIMEOUT = 0.5


@pytest.fixture
def link(scripted_link: Proxy) -> Proxy:
    return scripted_link


@pytest.fixture
def server(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(port=redis_server.port)
    yield client
    client.close()


def proxy_url(proxy: Proxy) -> str:
    return f"redis://127.0.0.1:{proxy.port}/0?socket_timeout={SOCKET_TIMEOUT}"


def script_calls(server: redis.Redis) -> int:
    """EVALSHA calls the server ran: the resend is counted, the lost reply is not."""
    return int(server.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_a_release_resent_after_its_reply_was_lost_reports_success(
    link: Proxy, redis_url: str, server: redis.Redis
) -> None:
    lease = Lock("resent", ttl=30, backend=proxy_url(link), renew=False).acquire(timeout=0)
    before = script_calls(server)
    link.fault("reset_once")  # the first reply resets the connection; the retry passes
    try:
        lease.release()  # raised NotOwned ("nothing was released") before the tombstone
    finally:
        link.heal()
    assert script_calls(server) - before == 2, "the release was not sent twice"
    assert not lease.held and not lease.lost.is_set()
    direct = get_backend(redis_url)
    assert direct.holder("resent") is None

    # The tombstone, in the lock's own key, expires: max(60 s, 4 x socket_timeout).
    tombstone = "task_locks:{resent}"
    assert 0 < server.pttl(tombstone) <= 60_000
    assert direct.release("resent", "another-token") is False
    assert direct.release("resent", lease.token) is False  # a new call: no resend
    other = Lock("resent", ttl=30, backend=redis_url, renew=False).acquire(timeout=0)
    assert direct.force_release("resent")  # an operator frees the new holder ...
    with pytest.raises(NotOwned, match="nothing was released"):
        other.release()  # ... whose own release is no resend of the force release


def test_an_async_release_resent_after_its_reply_was_lost_reports_success(
    link: Proxy, redis_url: str, server: redis.Redis
) -> None:
    async def run() -> None:
        lock = AsyncLock("resent-async", ttl=30, backend=proxy_url(link), renew=False)
        lease = await lock.acquire(timeout=0)
        before = script_calls(server)
        link.fault("reset_once")
        try:
            await lease.release()
        finally:
            link.heal()
        assert script_calls(server) - before == 2, "the release was not sent twice"
        await lease.backend.aclose()

    asyncio.run(run())
    assert get_backend(redis_url).holder("resent-async") is None


def test_a_force_release_resent_after_its_reply_was_lost_reports_success(
    link: Proxy, redis_url: str, server: redis.Redis
) -> None:
    holder = Lock("forced", ttl=30, backend=redis_url, renew=False).acquire(timeout=0)
    faulty = get_backend(proxy_url(link))
    faulty.holders()  # connect first: the fault is for the force release
    before = script_calls(server)
    link.fault("reset_once")
    try:
        assert faulty.force_release("forced", fence=holder.fence) is True
    finally:
        link.heal()
    assert script_calls(server) - before == 2, "the force release was not sent twice"
    direct = get_backend(redis_url)
    assert direct.holder("forced") is None
    # A new call, for this fence or another, is no resend: nothing released.
    assert direct.force_release("forced", fence=holder.fence) is False
    assert direct.force_release("forced", fence=holder.fence + 1) is False
    # ... and the freed holder's own release learns it was freed by someone else.
    with pytest.raises(NotOwned):
        holder.release()


def test_a_new_release_call_is_no_resend(redis_url: str, server: redis.Redis) -> None:
    """The tombstone matches the call that made it (its release id), not the token or
    fence: releasing again, or force-releasing the same fence again, still says that
    nothing was released."""
    backend = get_backend(redis_url)
    assert backend.acquire("again", "tok", 30_000, Owner()).acquired
    assert backend.release("again", "tok") is True
    tombstone = server.get("task_locks:{again}").decode()
    waiters, release_id = tombstone[1:].split("|")
    assert tombstone.startswith("r") and waiters == "0" and len(release_id) == 16
    assert backend.release("again", "tok") is False
    taken = backend.acquire("again", "tok2", 30_000, Owner())
    assert backend.force_release("again", fence=taken.fence) is True
    assert backend.force_release("again", fence=taken.fence) is False
    assert backend.force_release("again") is False


def test_a_resend_that_arrives_after_the_next_acquire_still_reports_released(
    redis_url: str, server: redis.Redis
) -> None:
    """The tombstone lives in the lock's own key; the next holder's record keeps its
    release id, so a resend delayed past someone else's acquire is still recognised."""
    backend = get_backend(redis_url)
    assert backend.acquire("overtaken", "first", 30_000, Owner()).acquired
    key = "task_locks:{overtaken}"
    release = [2, key, key + ":signal", "first", "", "0123456789abcdef", 60_000, 5_000]
    assert server.eval(SCRIPTS.source["release"], *release) == 1
    assert backend.acquire("overtaken", "second", 30_000, Owner()).acquired
    assert server.eval(SCRIPTS.source["release"], *release) == 2  # the resend
    release[-3] = "fedcba9876543210"  # a new call of the same token
    assert server.eval(SCRIPTS.source["release"], *release) == 0
    assert backend.holder("overtaken").token == "second"  # type: ignore[union-attr]


@pytest.mark.parametrize("handoff", ["client", "server"])
def test_a_resend_after_another_holder_came_and_went_still_reports_released(
    redis_server: RedisServer, server: redis.Redis, handoff: str
) -> None:
    """The release ids of the last two releases stay in the record: a resend that arrives
    after the next holder has taken the lock and released it too (its reply lost while
    the lock was busy: simulation seed 50773) still answers 'released', where it said
    'not ours'. A third release in between is past what the record keeps."""
    url = f"redis://127.0.0.1:{redis_server.port}/0?handoff={handoff}"
    backend = get_backend(url)
    script = SCRIPTS.source["release_handoff" if handoff == "server" else "release"]
    args = backend._release_args("came-and-went", "first")  # as the backend sends it
    at = 1 + int(args[0]) + 2  # after the keys, the token and the fence: the release id
    args[at] = "1111111111111111"

    def send() -> int:  # the first holder's release, sent again
        return int(server.eval(script, *args))

    assert backend.acquire("came-and-went", "first", 30_000, Owner()).acquired
    assert send() == 1
    assert backend.acquire("came-and-went", "second", 30_000, Owner()).acquired
    assert backend.release("came-and-went", "second") is True
    assert send() == 2  # the resend
    assert backend.acquire("came-and-went", "third", 30_000, Owner()).acquired
    live = record_fields(server.get("task_locks:{came-and-went}"))
    assert live is not None and "," not in live["rid"]  # a live lock keeps just the newest
    assert backend.release("came-and-went", "third") is True
    assert send() == 0  # two releases later: forgotten
