"""renew(ttl=...) racing a watchdog batch that still carries the old TTL.

The watchdog builds its batch (old TTL) and sends it; meanwhile ``lease.renew(ttl=5)``
goes out and returns; then the batch lands, last, and the server's TTL is the old one
again. The lease must never believe it holds the lock past what the server will keep:
its local deadline counts that stale renewal with the old TTL.

The delay is a wrapper around the backend's REAL ``renew_many`` that holds the batch
until the test releases it (a network delay on cue); the server is real Redis.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from chaoskit.proxy import Proxy
from servers import wait_until

from task_locks import BackendUnavailable, Lock, get_backend
from task_locks.backends._redis_compat import get_connection
from task_locks.types import RenewItem


@pytest.fixture(params=["memory", "redis"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "memory":
        yield f"memory://{uuid.uuid4().hex[:8]}"
    else:
        yield request.getfixturevalue("redis_url")


def test_a_stale_watchdog_renewal_never_extends_the_local_deadline(url: str) -> None:
    backend = get_backend(url)
    real_renew_many = backend.renew_many
    in_flight = threading.Event()
    land = threading.Event()
    sent: list[list[int]] = []

    def delayed_renew_many(items: Sequence[RenewItem], **options: Any) -> list[bool]:
        if not sent:  # hold the first batch only
            sent.append([item.ttl_ms for item in items])
            in_flight.set()
            assert land.wait(5)
        return real_renew_many(items, **options)

    backend.renew_many = delayed_renew_many  # type: ignore[method-assign]
    lease = Lock("raced", ttl=0.9, backend=url).acquire(timeout=0)
    assert in_flight.wait(5), "the watchdog never renewed"
    assert sent == [[900]]  # built before the TTL changed

    lease.renew(ttl=5)
    holder = backend.holder("raced")
    assert holder is not None and holder.expires_in is not None and holder.expires_in > 4.5
    # The old batch is still in flight: it may reach the server after ours, so until it
    # is answered the lease counts with its TTL, not the new one.
    assert lease.remaining <= 0.9
    land.set()  # the stale batch (900 ms) lands after ours
    deadline = time.monotonic() + 5
    while lease.renewals < 2:
        assert time.monotonic() < deadline, "the stale batch never landed"
        time.sleep(0.01)

    holder = backend.holder("raced")
    assert holder is not None and holder.expires_in is not None
    assert holder.expires_in <= 1.0  # the server keeps the old TTL now
    # Counted from when the stale batch was sent, with the old TTL: never past the server.
    assert lease.remaining <= holder.expires_in + 0.05, (lease.remaining, holder.expires_in)
    backend.renew_many = real_renew_many  # type: ignore[method-assign]
    lease.renew(ttl=5)  # an explicit renewal puts the new TTL back
    assert 4.5 < lease.remaining <= 5
    lease.release()


def warm_pool(backend: Any, connections: int = 3) -> None:
    """Open the pool's connections now: a new one's handshake (CLIENT SETINFO) would
    take the proxy's one-shot hold meant for a renewal."""
    pool = backend.client.connection_pool
    opened = [get_connection(pool, "PING") for _ in range(connections)]
    for connection in opened:
        connection.send_command("PING")
        connection.read_response()
        pool.release(connection)


def test_an_extension_answered_last_never_outlives_an_older_renewal_that_landed_last(
    scripted_link: Proxy, redis_url: str
) -> None:
    """A watchdog renewal (old TTL) is held in the network 0.6 s, so the
    extension ``renew(ttl=30)`` sent after it reaches the server first; the extension's
    reply is held 1 s, so the old renewal's reply is processed first. The server ends up
    with the old TTL; the lease must never count on the new one past it."""
    url = f"redis://127.0.0.1:{scripted_link.port}/0"
    backend = get_backend(url)
    warm_pool(backend)
    real_renew_many = backend.renew_many
    old_sent = threading.Event()

    def spy(items: Sequence[RenewItem], **options: Any) -> list[bool]:
        # A spy, not a fake: the real call goes to the real server, through the proxy.
        if not old_sent.is_set():
            scripted_link.hold_next_request(0.6)  # this batch reaches the server late
            old_sent.set()
        return real_renew_many(items, **options)

    backend.renew_many = spy  # type: ignore[method-assign]
    ttl = 1.2
    lease = Lock("raced-long", ttl=ttl, backend=backend).acquire(timeout=2)
    try:
        assert old_sent.wait(3), "the watchdog never renewed"
        wait_until(lambda: not scripted_link.holds_pending(), 1, "the renewal to be held")
        scripted_link.hold_next_reply(1.0)  # the extension's reply comes back last
        lease.renew(ttl=30)
        # Both have landed: the old renewal last, so the server keeps its TTL, unless a
        # renewal sent since carried the new one. Whatever the lease believes, the server
        # holds the lock at least as long.
        end = time.monotonic() + 2 * ttl
        while time.monotonic() < end:
            remaining = lease.remaining
            holder = backend.holder("raced-long")
            assert holder is not None and holder.token == lease.token, "the server let it go"
            assert holder.expires_in is not None
            assert remaining <= holder.expires_in + 0.05, (remaining, holder.expires_in)
            time.sleep(0.02)
        assert lease.held, lease.lost_reason  # renewed on the old TTL's schedule, in time
    finally:
        backend.renew_many = real_renew_many  # type: ignore[method-assign]
        lease.release()


def test_a_failed_shorter_ttl_renewal_moves_the_next_renewal_earlier_too(
    scripted_link: Proxy,
) -> None:
    """``renew(ttl=0.9)`` gets no answer (its request is dropped): the
    server may hold either TTL, so the lease counts with the shorter one; it must then be
    renewed on the shorter TTL's schedule, not the old one's (due 2 s on), or it is
    declared lost while the server still holds it."""
    url = f"redis://127.0.0.1:{scripted_link.port}/0?socket_timeout=0.2"
    lease = Lock("shortened", ttl=6, backend=url).acquire(timeout=2)
    try:
        scripted_link.fault("drop_request")
        with pytest.raises(BackendUnavailable):
            lease.renew(ttl=0.9)
        scripted_link.heal()
        assert lease.remaining <= 0.9
        end = time.monotonic() + 2.5
        while time.monotonic() < end:
            assert lease.held, f"lost while the server held it: {lease.lost_reason}"
            time.sleep(0.02)
        assert lease.renewals >= 3  # on the 0.9 s TTL's schedule (every 0.3 s)
        holder = get_backend(url).holder("shortened")
        assert holder is not None and holder.token == lease.token
        assert holder.expires_in is not None and holder.expires_in <= 0.9
    finally:
        scripted_link.heal()
        lease.release()
