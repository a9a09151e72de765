"""A lease is offered to the deadline watch's next look, not registered at acquire.

Registering a lease on the deadline heap and in its renewal lane at acquire, and taking
it off both at release, cost more client CPU than the rest of an uncontended cycle; most
leases are released long before either is needed. So a lease the watch promises to look
at in time (``watchdog._Pending``) is only offered, and forgotten if released first.
What must stay true, with real threads on a real server: an offered lease is renewed
and watched from the look on, as an eagerly registered one is; a lease released, lost
or parked first is never renewed by the look; a dropped one is still reported.
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from servers import wait_until

from task_locks import Lease, Lock, events, get_backend, watchdog


@pytest.fixture
def looking(monkeypatch: pytest.MonkeyPatch) -> Iterator[float]:
    """The deadline watch looks every 0.5 s while it watches anything, and is asleep
    now with that promise (a lease acquired then released starts it). Half a second
    leaves an acquire made after :func:`_asleep_with_promise` a quarter of a second to
    land in the watch's sleep, under CI's load too: at 0.1 s, an acquire slower than
    20 ms could find the watch awake, looking, and be registered at once."""
    monkeypatch.setattr(watchdog, "LOOK_EVERY", 0.5)
    yield 0.5


def _asleep_with_promise(url: str, within: float, beyond: float = 0.25) -> None:
    """Make the watch watch something, and wait until it sleeps promising a look within
    ``within`` seconds and not before ``beyond`` (so that an acquire made right after
    lands in that sleep: awake, the watch promises nothing)."""
    keeper = Lock("offers:keeper", ttl=60, backend=url).acquire(timeout=0)
    watch = watchdog.deadline_watch()
    watch._wake_for(-math.inf)  # re-read its sleep with the patched LOOK_EVERY

    def promised() -> bool:
        promise = watch._wake_at
        return math.isfinite(promise) and beyond <= promise - time.monotonic() <= within

    wait_until(promised, 5, "the watch to sleep with a promise")
    _kept.append(keeper)


_kept: list[object] = []


@pytest.fixture(autouse=True)
def _release_keepers() -> Iterator[None]:
    yield
    while _kept:
        _kept.pop().release()  # type: ignore[attr-defined]


def _offered(lease: object) -> bool:
    offer = watchdog._pending._offers.get(id(lease))
    return offer is not None and offer.ref() is lease


def _offered_lease(url: Any, looking: float, name: str, ttl: float = 3) -> Lease:
    """A lease of ``name`` that was offered to the watch's look. Whether an acquire lands
    in the watch's sleep is timing: other leases of the process (earlier tests') can wake
    the watch, and an awake watch takes the lease at once. A few tries, then fail."""
    for _ in range(5):
        _asleep_with_promise(url, looking)
        lease = Lock(name, ttl=ttl, backend=url).acquire(timeout=0)
        if _offered(lease):
            return lease
        lease.release()
        while _kept:  # the next try takes the keeper again
            _kept.pop().release()  # type: ignore[attr-defined]
    pytest.fail(f"no acquire of {name!r} in five landed in the deadline watch's sleep")


def _scheduled(lease: object) -> bool:
    lanes = watchdog.thread_renewer().lanes.all()
    return any(id(lease) in lane.schedule._entries for lane in lanes)


def test_a_lease_released_before_the_look_is_never_registered(
    redis_url: str, looking: float
) -> None:
    backend = get_backend(redis_url)
    lease = _offered_lease(backend, looking, "offers:quick", ttl=30)
    assert _offered(lease) and not _scheduled(lease)
    lease.release()
    assert not _offered(lease) and not _scheduled(lease)
    time.sleep(2.5 * looking)  # several looks: measuring that nothing happens, not syncing
    assert not _scheduled(lease) and lease.renewals == 0


def test_an_offered_lease_is_renewed_and_watched_after_the_look(
    redis_url: str, looking: float
) -> None:
    lease = _offered_lease(redis_url, looking, "offers:held")
    wait_until(lambda: not _offered(lease), 2, "the watch's look")
    wait_until(lambda: lease.renewals >= 2, 5, "two renewals")
    assert lease.held
    lease.release()
    assert not _scheduled(lease)


def test_a_lease_parked_before_the_look_is_watched_but_not_renewed(
    redis_url: str, looking: float
) -> None:
    """A Celery run parks its lease for a retry (``stop_renewal``): the look must not
    renew it, and the deadline watch still marks it lost at its deadline."""
    lease = _offered_lease(redis_url, looking, "offers:parked")
    lease.stop_renewal()
    wait_until(lambda: not _offered(lease), 2, "the watch's look")
    assert not _scheduled(lease)
    wait_until(lease.lost.is_set, 5, "the deadline to pass")
    assert lease.renewals == 0
    assert lease.lost_reason is not None


def test_a_lease_dropped_before_the_look_is_reported(
    redis_url: str, looking: float, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    lease = _offered_lease(redis_url, looking, "offers:dropped")
    del lease
    gc.collect()
    wait_until(lambda: not watchdog._pending._offers, 2, "the watch's look")
    assert events.flush(5.0)
    assert "'offers:dropped'" in caplog.text and "garbage-collected" in caplog.text


def test_a_lease_needed_before_the_promised_look_is_registered_at_once(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TTL whose first renewal comes before the watch's next look: registered now."""
    monkeypatch.setattr(watchdog, "LOOK_EVERY", 2.0)
    _asleep_with_promise(redis_url, 2.0, beyond=1.0)
    lease = Lock("offers:short", ttl=0.6, backend=redis_url).acquire(timeout=0)
    assert not _offered(lease) and _scheduled(lease)
    wait_until(lambda: lease.renewals >= 1, 2, "a renewal")
    lease.release()


def test_releases_racing_the_looks_leave_nothing_registered(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threads acquire and release while the watch looks every millisecond: whichever
    wins each race (a release's take-back or the look's hand-over), no released lease is
    left in a lane or on the heap, and none is reported lost."""
    monkeypatch.setattr(watchdog, "LOOK_EVERY", 0.001)
    _asleep_with_promise(redis_url, 0.01, beyond=0.0)
    lost: list[object] = []
    subscription = events.subscribe(lost.append, kinds={events.EventKind.LOST})
    backend = get_backend(redis_url)
    released: list[object] = []

    def cycles(index: int) -> None:
        lock = Lock(f"offers:race:{index}", ttl=30, backend=backend)
        for _ in range(300):
            lease = lock.acquire(timeout=5)
            time.sleep(0.0003)  # held across a look now and then: the race under test
            lease.release()
            released.append(lease)

    threads = [threading.Thread(target=cycles, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(released) == 1200
    wait_until(lambda: not watchdog._pending._offers, 2, "the last look")
    # A released lease left in a lane would be renewed in 10 s (and refused): none is.
    assert not [lease for lease in released if _scheduled(lease)]
    assert events.flush(5.0)
    subscription.close()
    assert not lost


def test_a_lease_offered_while_the_watch_is_awake_is_registered_at_once(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Awake, the watch promises nothing: it may have looked already and be about to
    sleep until a later deadline, past the new lease's first renewal. (Made
    deterministic by marking the sleeping watch awake, as it is between its look and
    its sleep.)"""
    monkeypatch.setattr(watchdog, "LOOK_EVERY", 2.0)
    _asleep_with_promise(redis_url, 2.0, beyond=1.0)
    watch = watchdog.deadline_watch()
    monkeypatch.setattr(watch, "_wake_at", -math.inf)
    lease = Lock("offers:awake", ttl=0.6, backend=redis_url).acquire(timeout=0)
    assert not _offered(lease) and _scheduled(lease)
    wait_until(lambda: lease.renewals >= 1, 2, "a renewal")
    lease.release()
