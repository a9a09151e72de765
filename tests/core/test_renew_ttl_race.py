"""renew(ttl=...) racing a watchdog batch that still carries the old TTL (issue 16).

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

from task_locks import Lock, get_backend
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
    assert 4.5 < lease.remaining <= 5
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
