"""Fences keep growing when the Redis server's own clock steps back.

A fence is max(counter + 1, server time in microseconds); the counter is shared by every
lock of its hash slot and outlives every release, so a clock stepped back an hour (an
NTP correction, a VM restored from a snapshot) can make no fence of a name smaller than
one that name had before. The server really runs with its wall clock
stepped (``chaoskit/clockshift``), not a counter set by hand.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from chaoskit.clockshift import ClockShiftedRedis

from task_locks import Lock


@pytest.fixture
def shifted() -> Iterator[ClockShiftedRedis]:
    server = ClockShiftedRedis()
    server.start()
    yield server
    server.cleanup()


def _server_seconds(server: ClockShiftedRedis) -> float:
    seconds, micros = redis.Redis(port=server.port).time()
    return seconds + micros / 1e6


def test_fences_grow_across_the_server_clock_stepping_back(shifted: ClockShiftedRedis) -> None:
    url = shifted.url()
    fences: dict[str, list[int]] = {"again": [], "other": [], "fresh": []}
    for name in ("again", "again", "other"):
        with Lock(name, ttl=5, backend=url, renew=False).acquire(timeout=0) as lease:
            fences[name].append(lease.fence)
    before = _server_seconds(shifted)
    shifted.shift(-3600)  # the server's clock steps back an hour
    assert _server_seconds(shifted) < before - 3500, "the server's clock did not step"
    for name in ("again", "fresh", "other", "again"):
        with Lock(name, ttl=5, backend=url, renew=False).acquire(timeout=0) as lease:
            fences[name].append(lease.fence)
    for name, seen in fences.items():
        assert seen == sorted(set(seen)), (name, seen)  # strictly increasing per name
    # The counter of the slot of "again" was read, not the clock: nothing an hour back.
    assert fences["again"][-1] > fences["again"][0] > (before - 60) * 1e6
