"""A force release reaches the holder's process at once (release notices), on real servers.

Every lease here has a TTL of 30 s, so its renewals come every 10 s: a loss seen within
a second can only have come from the notice, never from a renewal. Each test waits for
the listener to be subscribed first (its ``ready`` event, or the server's subscriber
count for another process): a release before that is found by renewal, by design.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator

import pytest
import redis
from servers import RedisServer, wait_until

from task_locks import AsyncLock, Lock, events, get_backend, notices
from task_locks.backends.redis import RedisBackend
from task_locks.events import LostReason
from task_locks.lock import Lease

TTL = 30.0
#: The bound the tests assert (the bench measures the real delay: a few ms).
PROMPT = 1.0


@pytest.fixture(params=["redis", "etcd"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "redis":  # a server of its own: no other test's subscribers on it
        yield request.getfixturevalue("redis_factory")().url()
    else:
        node = request.getfixturevalue("etcd_node")
        yield node.url(prefix=f"notices-{time.monotonic_ns()}/")


def listening(lease: Lease) -> notices.Listener:
    """The lease's listener, once it is subscribed (a release from then on is heard)."""
    found = notices.listener(lease.backend, create=False)
    assert found is not None, "a renewed lease on this backend has a listener"
    assert found.ready.wait(10), "the listener subscribed"
    return found


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "task_locks.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_force_release_from_the_cli_marks_the_lease_lost_at_once(url: str) -> None:
    seen: list[events.LockEvent] = []
    subscription = events.subscribe(seen.append)
    called: list[Lease] = []
    try:
        lease = Lock("report", ttl=TTL, backend=url, on_lost=called.append).acquire(0)
        listening(lease)
        done = cli("--url", url, "release", "report", "--force", "--yes")
        assert done.returncode == 0, done.stderr
        heard = time.monotonic()
        assert lease.lost.wait(PROMPT), "lost at once, not at the renewal 10 s away"
        assert time.monotonic() - heard < PROMPT
        assert "release notice" in (lease.lost_reason or ""), lease.lost_reason
        assert not lease.held
        wait_until(lambda: called, 5, "on_lost")
        assert called == [lease]
        assert events.flush(5.0)
        lost = [e for e in seen if e.kind == "lost" and e.name == "report"]
        assert len(lost) == 1 and lost[0].reason == LostReason.FORCED, lost
    finally:
        subscription.close()


def test_a_stale_or_foreign_notice_does_not_touch_a_lease(url: str) -> None:
    """A notice about an earlier lease of the name (or about a fence that is no lease of
    ours) is ignored; the new lease of the same name stays held."""
    backend = get_backend(url)
    first = Lock("job", ttl=TTL, backend=url).acquire(0)
    listener = listening(first)
    assert backend.force_release("job", first.fence)
    assert first.lost.wait(PROMPT)
    second = Lock("job", ttl=TTL, backend=url).acquire(0)
    # The old notice again (a late copy), and one for a fence nobody here holds.
    assert not listener.deliver(notices.Notice("job", first.fence, "late copy"))
    assert not listener.deliver(notices.Notice("job", second.fence + 1, "not ours"))
    if isinstance(backend, RedisBackend):  # the same through the server, in order
        client = redis.Redis.from_url(url)
        key = backend._key("job")
        client.publish(backend.notice_channel, f"{first.fence}|{key}")
        client.publish(backend.notice_channel, f"{second.fence + 1}|{key}")
        client.publish(backend.notice_channel, "garbage")
    marker = Lock("marker", ttl=TTL, backend=url).acquire(0)
    assert backend.force_release("marker", marker.fence)
    assert marker.lost.wait(PROMPT), "the notices before it were read too"
    assert second.held and not second.lost.is_set()
    second.release()


def test_the_holders_own_release_is_no_loss(url: str) -> None:
    """etcd's watch sees our own deletes too: a lease being released ignores them."""
    other = Lock("stays", ttl=TTL, backend=url).acquire(0)
    listening(other)
    leases = [Lock(f"mine:{i}", ttl=TTL, backend=url).acquire(0) for i in range(5)]
    for lease in leases:
        lease.release()
    assert get_backend(url).force_release("stays", other.fence)
    assert other.lost.wait(PROMPT)  # every delete before it was read
    assert all(lease.lost_reason is None and not lease.lost.is_set() for lease in leases)


def test_an_asyncio_lease_hears_it_too(url: str) -> None:
    async def hold() -> tuple[bool, str | None]:
        lease = await AsyncLock("async-job", ttl=TTL, backend=url).acquire(0)
        listening(lease)  # type: ignore[arg-type]
        assert await asyncio.to_thread(get_backend(url).force_release, "async-job", lease.fence)
        deadline = time.monotonic() + PROMPT
        while not lease.lost.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # (a poll with a deadline: LostFlag has no await)
        await lease.backend.aclose()  # this loop's client, before the loop ends
        return lease.lost.is_set(), lease.lost_reason

    lost, reason = asyncio.run(hold())
    assert lost and "release notice" in (reason or ""), reason


def test_run_exits_79_soon_after_a_force_release(url: str) -> None:
    """``task-locks run``'s lease is in another process: the test waits until that
    process is subscribed (Redis: the channel's subscriber count; etcd replays its watch
    from the lease's revision, so there is nothing to wait for), then force-releases."""
    program = [sys.executable, "-c", "import time; time.sleep(60)"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "task_locks.cli", "--url", url, "run", "nightly", "--ttl",
         str(TTL), "--", *program],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        backend = get_backend(url)
        holder = wait_until(lambda: backend.holder("nightly"), 30, "run to take the lock")
        if isinstance(backend, RedisBackend):
            client = redis.Redis.from_url(url)
            wait_until(
                lambda: client.pubsub_numsub(backend.notice_channel)[0][1] >= 1,
                10,
                "run's listener to subscribe",
            )
        assert backend.force_release("nightly", holder.fence)
        released = time.monotonic()
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - released
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 79, err
    assert took < 5, f"run stopped {took:.1f}s after the release (renewal: 10 s)"
    assert "release notice" in err, err


def test_the_listener_reconnects_after_a_redis_restart(redis_factory: object) -> None:
    """The restart loses every key (no persistence) and every notice sent meanwhile: on
    reconnecting the listener has the leases renewed at once, which finds the lock gone;
    afterwards a force release is heard again."""
    server: RedisServer = redis_factory()  # type: ignore[operator]
    url = server.url()
    lease = Lock("survivor", ttl=TTL, backend=url).acquire(0)
    listener = listening(lease)
    server.restart()
    wait_until(lambda: listener.reconnects >= 1 and listener.ready.is_set(), 20, "a reconnect")
    # Found by the renewal the reconnect asked for, not by a notice (there was none).
    assert lease.lost.wait(5), "renewed at the reconnect: its key is gone"
    assert "renewal found the lock's token gone" in (lease.lost_reason or ""), lease.lost_reason
    again = Lock("survivor", ttl=TTL, backend=url).acquire(0)
    assert get_backend(url).force_release("survivor", again.fence)
    assert again.lost.wait(PROMPT) and "release notice" in (again.lost_reason or "")


def test_one_listener_per_backend_and_none_without_leases(redis_factory: object) -> None:
    redis_url = redis_factory().url()  # type: ignore[operator]  # (no other test's listener)
    leases = [Lock(f"many:{i}", ttl=TTL, backend=redis_url).acquire(0) for i in range(20)]
    listener = listening(leases[0])
    client = redis.Redis.from_url(redis_url)
    channel = get_backend(redis_url).notice_channel  # type: ignore[attr-defined]
    assert client.pubsub_numsub(channel)[0][1] == 1, "one subscription for every lease"
    for lease in leases:
        lease.release()
    assert len(listener) == 0
    wait_until(lambda: not listener.running, notices.IDLE_EXIT + 5, "the idle listener to stop")
    wait_until(lambda: client.pubsub_numsub(channel)[0][1] == 0, 5, "the unsubscribe")


def test_a_lease_that_is_not_renewed_is_not_listened_for(redis_url: str) -> None:
    lease = Lock("manual", ttl=TTL, backend=redis_url, renew=False).acquire(0)
    found = notices.listener(lease.backend, create=False)
    assert found is None or len(found) == 0
    lease.release()


def test_a_forked_child_closing_its_backends_leaves_the_parents_listener_alone(url: str) -> None:
    """The child inherits the listener's socket; closing its backends must not shut it
    down (etcd) or end the parent's session: the parent still hears the next release."""
    import os

    import task_locks

    lease = Lock("forked", ttl=TTL, backend=url).acquire(0)
    listener = listening(lease)
    with warnings.catch_warnings():  # eventlet (imported by etcd3gw) warns at every fork
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            task_locks.close_all()
            lease.backend.close()
            os._exit(0)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert get_backend(url).force_release("forked", lease.fence)
    assert lease.lost.wait(PROMPT) and "release notice" in (lease.lost_reason or "")
    assert listener.reconnects == 0, "the child's close did not break the parent's stream"


def test_a_holder_behind_sentinel_hears_a_force_release(redis_sentinel: object) -> None:
    url = redis_sentinel.url(prefix=f"notices-{time.monotonic_ns()}:")  # type: ignore[attr-defined]
    lease = Lock("sentinel-job", ttl=TTL, backend=url).acquire(0)
    listening(lease)
    assert get_backend(url).force_release("sentinel-job", lease.fence)
    assert lease.lost.wait(PROMPT) and "release notice" in (lease.lost_reason or "")


def test_a_force_release_that_hands_the_lock_on_tells_only_the_old_holder(
    redis_factory: object,
) -> None:
    """``handoff=server``: the force release grants the lock to the queued waiter inside
    the script; the notice names the old holder's fence, so the new holder keeps it."""
    server: RedisServer = redis_factory()  # type: ignore[operator]
    url = server.url(handoff="server")
    first = Lock("queued", ttl=TTL, backend=url).acquire(0)
    listening(first)
    granted: list[Lease] = []
    waiter = threading.Thread(
        target=lambda: granted.append(Lock("queued", ttl=TTL, backend=url).acquire(10))
    )
    waiter.start()
    with redis.Redis(port=server.port) as client:  # closed: no socket left to the collector
        wait_until(
            lambda: client.zcard(get_backend(url)._key("queued") + ":queue"),  # type: ignore[attr-defined]
            10,
            "the waiter to queue",
        )
    assert get_backend(url).force_release("queued", first.fence)
    assert first.lost.wait(PROMPT) and "release notice" in (first.lost_reason or "")
    waiter.join(10)
    assert granted and granted[0].held and granted[0].fence > first.fence
    granted[0].release()


def test_a_backend_collected_while_a_listener_is_made_does_not_deadlock() -> None:
    """A dead backend's weakref callback drops its listener under the registry's guard,
    and a garbage collection can run it in the very thread that holds the guard (while a
    listener is being made): the guard must be reentrant, or that thread waits for
    itself for ever (a support-matrix run hung 300 s there)."""
    import gc
    import threading
    import weakref

    class Stand:  # stands in for a backend: only its lifetime matters here
        pass

    stand: Stand | None = Stand()
    key = id(stand)
    notices._listeners[key] = (weakref.ref(stand, lambda ref: notices._drop(key, ref)), None)  # type: ignore[assignment]
    done = threading.Event()

    def collect_under_the_guard() -> None:
        nonlocal stand
        with notices._guard:
            stand = None  # its callback runs now, in this thread
            gc.collect()
        done.set()

    threading.Thread(target=collect_under_the_guard, daemon=True).start()
    assert done.wait(5), "the registry's guard deadlocked on its own weakref callback"
    assert key not in notices._listeners


def test_a_stream_closed_while_it_reads_leaves_no_connection_open(redis_url: str) -> None:
    """A backend closed while its listener waits for a notice: the read fails, and
    redis-py's error handler connects the subscription's connection again before it
    raises. The stream disconnects it: nothing stays open on the server (and no socket
    is left to the garbage collector)."""
    stream = get_backend(redis_url).release_notices()
    stream.open(None)
    server = redis.Redis.from_url(redis_url)
    try:
        assert sum(c["sub"] != "0" for c in server.client_list()) == 1
        reader = threading.Thread(target=lambda: _read_quietly(stream), daemon=True)
        reader.start()
        wait_until(lambda: _reading(reader), 5, "the read to wait on its socket")
        stream.close()
        reader.join(5)
        assert not reader.is_alive()
        wait_until(
            lambda: len(server.client_list()) == 1,  # this one: the stream's are all gone
            5,
            "the stream's connections to close",
        )
    finally:
        server.close()


def _read_quietly(stream: object) -> None:
    try:
        stream.read(5.0)  # type: ignore[attr-defined]
    except Exception:
        pass  # closed under it: the failure the listener would see


def _reading(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside redis-py's wait for a pub/sub message."""
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        if frame.f_code.co_name in ("can_read", "_can_read", "read_response", "get_message"):
            return True
        frame = frame.f_back
    return False
