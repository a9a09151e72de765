"""The harness itself: a checker that misses a violation, or a proxy that injects no
fault, would make every chaos result meaningless, so both are tested on their own."""

from __future__ import annotations

import time

import pytest
import redis
from chaoskit.checker import check
from chaoskit.clock import now
from chaoskit.proxy import ProxyHub
from redis.backoff import NoBackoff
from redis.retry import Retry
from servers import wait_until

pytestmark = pytest.mark.chaos


def ev(p, f, type, t, **data):
    return {"p": p, "f": f, "type": type, "t": t, **data}


def hold(p, start, end, fence, ttl=1.0):
    """Acquire at ``start`` (ok 0.01 later), release invoked at ``end``."""
    return [
        ev(p, "acquire", "invoke", start, ttl=ttl),
        ev(p, "acquire", "ok", start + 0.01, fence=fence),
        ev(p, "release", "invoke", end),
        ev(p, "release", "ok", end + 0.01),
    ]


def write(p, t, fence, wid, version=None, guard="fenced", refused=False):
    done = (
        ev(p, "write", "fail", t + 0.001, current=fence + 1)
        if refused
        else ev(p, "write", "ok", t + 0.001, version=version)
    )
    return [ev(p, "write", "invoke", t, guard=guard, fence=fence, id=wid), done]


# -- checker ----------------------------------------------------------------------------


def test_sequential_holds_with_rising_fences_are_clean() -> None:
    events = hold(0, 0.0, 1.0, 10) + hold(1, 1.05, 2.0, 11) + hold(0, 2.05, 3.0, 12)
    result = check(events)
    assert (result.holds, result.overlaps, result.fence_regressions) == (3, 0, 0)
    assert result.operations == 6


def test_overlapping_holds_are_counted_once_per_pair_with_their_duration() -> None:
    events = hold(0, 0.0, 2.0, 10) + hold(1, 1.0, 1.5, 11) + hold(2, 1.6, 3.0, 12)
    result = check(events)
    assert result.overlaps == 2  # (0,1) and (0,2); 1 and 2 do not meet
    assert result.overlap_seconds == pytest.approx(0.49 + 0.39, abs=1e-6)


def test_an_unknown_acquire_counts_as_held_until_its_ttl_but_only_as_possible() -> None:
    events = [
        ev(0, "acquire", "invoke", 0.0, ttl=1.0),
        ev(0, "acquire", "info", 0.4, error="timeout"),
        *hold(1, 0.5, 0.8, 11),  # inside 0's possible hold
        *hold(1, 1.2, 1.5, 12),  # after its TTL ran out
    ]
    result = check(events)
    assert (result.overlaps, result.possible_overlaps, result.unknown_acquires) == (0, 1, 1)


def test_a_killed_holder_stops_holding_when_it_dies() -> None:
    events = [
        ev(0, "acquire", "invoke", 0.0, ttl=1.0),
        ev(0, "acquire", "ok", 0.01, fence=10),
        ev("nemesis", "nemesis", "info", 0.5, action="kill", target=0),
        *hold(1, 1.6, 2.0, 11),
    ]
    result = check(events)
    assert (result.holds, result.overlaps, result.faults) == (2, 0, 1)


def test_a_holder_that_never_released_holds_until_the_end_of_the_run() -> None:
    events = [ev(0, "acquire", "invoke", 0.0, ttl=1.0), ev(0, "acquire", "ok", 0.01, fence=10)]
    events += hold(1, 5.0, 6.0, 11)
    assert check(events).overlaps == 1


def test_a_fence_that_does_not_rise_after_a_completed_acquire_is_a_regression() -> None:
    events = hold(0, 0.0, 1.0, 10) + hold(1, 1.1, 2.0, 9)
    assert check(events).fence_regressions == 1
    concurrent = [
        *hold(0, 0.0, 1.0, 10),
        ev(1, "acquire", "invoke", 0.005, ttl=1.0),  # began before 0's acquire completed
        ev(1, "acquire", "ok", 1.2, fence=9),
    ]
    assert check(concurrent).fence_regressions == 0


def test_stale_writes_are_judged_in_the_resources_own_order() -> None:
    events = (
        hold(0, 0.0, 3.0, 10)  # paused holder, superseded at 1.0
        + hold(1, 1.0, 2.0, 11)
        + write(0, 0.5, 10, "0.1", version=1)
        + write(1, 1.5, 11, "1.1", version=2)
        + write(0, 2.5, 10, "0.2", version=3)  # accepted after fence 11: stale
    )
    result = check(events, {"fenced": "0.1 1.1 0.2"})
    g = result.guards["fenced"]
    assert (g.writes, g.accepted, g.stale_attempted, g.stale_accepted, g.lost) == (3, 3, 1, 1, 0)


def test_a_refused_stale_write_is_attempted_not_accepted_and_lost_writes_are_found() -> None:
    events = (
        hold(0, 0.0, 3.0, 10)
        + hold(1, 1.0, 2.0, 11)
        + write(0, 0.5, 10, "0.1", version=1)
        + write(1, 1.5, 11, "1.1", version=2)
        + write(0, 2.5, 10, "0.2", refused=True)
    )
    result = check(events, {"fenced": "1.1"})  # 0.1 was overwritten: lost
    g = result.guards["fenced"]
    assert (g.stale_attempted, g.stale_accepted, g.refused, g.lost) == (1, 0, 1, 1)
    assert g.lost_ids == ["0.1"]


def test_non_lock_errors_escaping_the_api_are_reported() -> None:
    events = [
        ev(0, "acquire", "invoke", 0.0, ttl=1.0),
        ev(0, "acquire", "info", 0.1, error="TypeError: boom", unexpected=True),
    ]
    assert check(events).unexpected == ["acquire: TypeError: boom"]


# -- proxy ------------------------------------------------------------------------------


def no_retry_client(port: int, timeout: float) -> redis.Redis:
    """redis-py retries timeouts by default; a retried request would blur what we measure."""
    return redis.Redis(port=port, socket_timeout=timeout, retry=Retry(NoBackoff(), 0))


@pytest.fixture
def proxied(redis_server):
    hub = ProxyHub()
    proxy = hub.proxy(redis_server.port)
    client = no_retry_client(proxy.port, 1.0)
    direct = redis.Redis(port=redis_server.port)
    direct.delete("chaos:proxy")
    yield proxy, client, direct
    client.close()
    direct.close()
    hub.close()


def test_proxy_passes_traffic_through(proxied) -> None:
    _proxy, client, direct = proxied
    assert client.incr("chaos:proxy") == 1
    assert direct.get("chaos:proxy") == b"1"


def test_proxy_latency_delays_replies(proxied) -> None:
    proxy, client, _ = proxied
    client.ping()
    proxy.latency(reply_delay=0.3)
    started = now()
    assert client.incr("chaos:proxy") == 1
    assert now() - started >= 0.3
    proxy.heal()
    started = now()
    client.ping()
    assert now() - started < 0.3


def test_proxy_blackhole_holds_requests_and_delivers_them_late(proxied) -> None:
    proxy, client, direct = proxied
    client.ping()
    proxy.blackhole()
    with pytest.raises(redis.TimeoutError):
        no_retry_client(proxy.port, 0.3).ping()  # a new connection hangs in its handshake
    with pytest.raises(redis.TimeoutError):
        client.incr("chaos:proxy")
    time.sleep(0.1)
    assert direct.get("chaos:proxy") is None  # nothing reached the server
    proxy.heal()
    # the request the client gave up on still arrives, late, as after a partition
    wait_until(lambda: direct.get("chaos:proxy") == b"1", 5, "the held request to arrive")
    assert client.incr("chaos:proxy") == 2  # the client reconnects and carries on


def test_proxy_reset_aborts_connections_until_healed(proxied) -> None:
    proxy, client, _ = proxied
    client.ping()
    proxy.reset()
    no_retry = no_retry_client(proxy.port, 1.0)
    with pytest.raises(redis.ConnectionError):
        no_retry.ping()
    proxy.heal()
    assert no_retry.ping()
    no_retry.close()
