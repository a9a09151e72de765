"""The lease's bookkeeping as plain logic, under a fake clock (extensions raced by renewals in
flight, failed shorter renewals).

A fake clock is what the bookkeeping is written for (:mod:`task_locks.leasing`): here it
replaces nothing but time. The "server" of the property test is a model of one thing
only, the expiry a renewal sets when it arrives (arrival + its TTL); the real server's
side is in tests/core/test_renew_ttl_race.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from task_locks import Lock
from task_locks.leasing import DeadlineHeap, LeaseBook, RenewalQueue, RenewCall, use_runtime


@dataclass
class FakeClock:
    now: float = 100.0
    epoch: float = 1_700_000_000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.epoch + self.now


def test_an_extension_granted_first_waits_for_the_older_renewal_in_flight() -> None:
    book = LeaseBook(ttl=1.2, valid=1.2, sent_at=0.0)
    old = book.begin(0.4)  # the watchdog's, with the old TTL
    longer = book.begin(0.45, ttl=30, valid=30)
    assert book.deadline == 1.2  # the acquire's: nothing granted since
    book.granted(longer)  # answered first, though it reached the server first
    assert book.deadline == 0.4 + 1.2  # `old` may have landed after it
    assert book.next_renewal() == pytest.approx(
        0.45 + 0.4
    )  # on the old TTL's schedule (from the last send)
    book.granted(old)
    assert book.deadline == 0.4 + 1.2  # and in the other reply order: the same
    later = book.begin(0.9)  # sent after both replies: it carries the new TTL
    assert later.ttl == 30
    book.granted(later)
    assert book.deadline == 0.9 + 30
    assert book.next_renewal() == 0.9 + 10


def test_either_reply_order_gives_the_same_deadline() -> None:
    for first in (0, 1):
        book = LeaseBook(ttl=1.2, valid=1.2, sent_at=0.0)
        calls = [book.begin(0.4), book.begin(0.45, ttl=30, valid=30)]
        book.granted(calls[first])
        book.granted(calls[1 - first])
        assert book.deadline == 0.4 + 1.2


def test_a_failed_shorter_ttl_moves_the_deadline_and_the_next_renewal_earlier() -> None:
    book = LeaseBook(ttl=6, valid=6, sent_at=0.0)
    assert book.next_renewal() == 2.0
    shorter = book.begin(0.1, ttl=0.9, valid=0.9)
    assert book.deadline == 0.1 + 0.9  # it may reach the server any moment
    book.failed(shorter)
    assert book.deadline == 0.1 + 0.9  # it may have: the shorter TTL holds
    assert book.next_renewal() == 0.1 + 0.3  # renewed on that TTL's schedule
    retry = book.begin(0.5)
    assert retry.ttl == 0.9
    book.granted(retry)
    assert book.deadline == 0.5 + 0.9


def test_a_renewal_unanswered_does_not_keep_the_next_one_due_at_once() -> None:
    """A ``renew()`` whose reply was lost stays open (and keeps the deadline) until its
    socket timeout; the watchdog's renewals beside it go on every third of the TTL, not
    back to back (counted from the unanswered call's send, the next one was always due)."""
    book = LeaseBook(ttl=3, valid=3, sent_at=0.0)
    unanswered = book.begin(0.5)  # renew(): its reply is lost
    assert book.next_renewal() == 0.5 + 1  # a third of the TTL after the latest send
    watchdog = book.begin(1.0)
    book.granted(watchdog)
    assert book.deadline == 0.5 + 3  # `unanswered` may still land after it
    assert book.next_renewal() == 1.0 + 1  # (it was 0.5 + 1: due again at once)
    again = book.begin(2.0)
    book.granted(again)
    assert book.next_renewal() == 2.0 + 1
    # Its socket timeout: a renewal sent after the failure drops it, so one is due now.
    book.failed(unanswered)
    assert book.next_renewal() == 0.5 + 1


def test_renewals_in_flight_together_do_not_keep_the_next_one_due_at_once() -> None:
    """A call granted before a later one was sent stays open until that one is granted;
    counted from its own send, the next renewal was due while the later one was on its
    way (each answer of several calls in flight sent one more, back to back)."""
    book = LeaseBook(ttl=0.3, valid=0.3, sent_at=0.0)
    first = book.begin(0.1)
    book.granted(first)
    on_its_way = book.begin(0.2)  # answered later
    assert book.next_renewal() == pytest.approx(0.2 + 0.1)  # not 0.1 + 0.1, gone by
    book.granted(on_its_way)
    assert book.next_renewal() == pytest.approx(0.2 + 0.1)


def test_a_timed_out_renewal_may_land_after_a_longer_one() -> None:
    """The watchdog's renewal (TTL 1 s) times out with its request still on its way; a
    renew(ttl=3) sent after the failure is granted, and then the late request lands:
    the server's expiry is 1 s from its arrival, so the lease must count with 1 s."""
    book = LeaseBook(ttl=1, valid=1, sent_at=0.0)
    late = book.begin(0.3)
    book.failed(late)  # the socket timeout
    longer = book.begin(0.9, ttl=3, valid=3)
    book.granted(longer)
    assert book.deadline == 0.9 + 1  # not 0.9 + 3: `late` may land any time after it
    assert book.next_renewal() == pytest.approx(0.9 + 1 / 3)
    again = book.begin(1.2)  # later calls too: `late` may land after each of them
    book.granted(again)
    assert book.deadline == 1.2 + 1


def test_a_failed_call_counts_until_a_later_call_is_granted_and_its_ttl_after() -> None:
    book = LeaseBook(ttl=3, valid=3, sent_at=0.0)
    failed = book.begin(1.0, ttl=1, valid=1)
    retry = book.begin(1.5, ttl=3, valid=3)  # sent before the failure was seen
    book.failed(failed)
    book.granted(retry)
    assert book.deadline == 1.0 + 1  # `failed` may still have landed after `retry`
    after = book.begin(1.8)
    book.granted(after)
    assert book.deadline == 1.8 + 1  # and may still land after `after`, with its 1 s


@dataclass
class _Flight:
    call: RenewCall
    arrived: bool = False
    granted: bool | None = None
    #: The client gave up on it (no answer will be read); its request may still arrive.
    failed: bool = False


@dataclass
class _Model:
    """One lease and the server's expiry for it; renewals arrive and answer in any order."""

    margin: float
    book: LeaseBook = field(init=False)
    now: float = 0.0
    expiry: float = 0.0
    flights: list[_Flight] = field(default_factory=list)
    lost: bool = False

    def __post_init__(self) -> None:
        self.book = LeaseBook(ttl=3.0, valid=3.0 - self.margin, sent_at=0.0)
        self.expiry = 3.0  # the acquire arrived at 0

    def step(self, op: str, pick: int, amount: float) -> None:
        waiting = [f for f in self.flights if not f.arrived]
        answerable = [
            f for f in self.flights if f.arrived and f.granted is not None and not f.failed
        ]
        if op == "tick":
            self.now += amount
        elif op == "send":
            ttl = (0.5, 3.0, 30.0)[pick % 3]
            new = ttl != self.book.ttl and pick % 2 == 0
            call = self.book.begin(self.now, *((ttl, ttl - self.margin) if new else (None, None)))
            self.flights.append(_Flight(call))
        elif op == "arrive" and waiting:
            flight = waiting[pick % len(waiting)]
            flight.arrived = True
            flight.granted = self.now < self.expiry  # a key past its TTL is gone
            if flight.granted:
                self.expiry = self.now + flight.call.ttl
        elif op == "reply" and answerable:
            flight = answerable[pick % len(answerable)]
            self.flights.remove(flight)
            if not flight.granted or self.now >= self.book.deadline:
                self.lost = True  # refused, or answered after the deadline: lost
            else:
                self.book.granted(flight.call)
        elif op == "fail":
            # No answer: it reached the server, or it has not yet (it may, any time later).
            unfailed = [f for f in self.flights if not f.failed]
            if unfailed:
                flight = unfailed[pick % len(unfailed)]
                flight.failed = True
                self.book.failed(flight.call)


steps = st.lists(
    st.tuples(
        st.sampled_from(["tick", "send", "arrive", "reply", "fail"]),
        st.integers(0, 5),
        st.floats(0.0, 1.5),
    ),
    max_size=60,
)


@settings(max_examples=1000, deadline=None)
@given(steps, st.sampled_from([0.0, 0.05]))
@example(
    [("send", 1, 0.0), ("fail", 0, 0.0), ("send", 2, 0.0), ("arrive", 1, 0.0),
     ("tick", 0, 1.5), ("tick", 0, 0.75), ("tick", 0, 0.25), ("tick", 0, 0.375),
     ("reply", 0, 0.0), ("send", 0, 0.0)],
    0.0,
)  # fmt: skip
@example([("tick", 0, 1.5), ("tick", 0, 1.25), ("tick", 0, 0.125), ("send", 0, 0.0),
          ("fail", 0, 0.0)], 0.0)  # fmt: skip
def test_the_local_deadline_never_passes_the_servers_expiry(
    schedule: list[tuple[str, int, float]], margin: float
) -> None:
    model = _Model(margin)
    for op, pick, amount in schedule:
        model.step(op, pick, amount)
        if model.lost or model.now >= model.book.deadline:
            return  # lost: nothing more to check
        # Whatever order the calls reach the server and answer in:
        assert model.book.deadline <= model.expiry + 1e-9, (op, model)
        # and a renewal is always due before the lease would run out, unless a call
        # still in flight holds the deadline down (no renewal can lift it before its
        # answer: the next one is due a third of the TTL after the latest send). A
        # grant counts each open call with at most the validity of a call that failed,
        # whose request may still land after it, so the deadline is a call's window
        # with or without that bound (Hypothesis found a failed 3 s call, a 30 s one
        # granted, then a 0.5 s one in flight: the deadline was the 30 s call's send +
        # 3 s, which only the 0.5 s call's answer can lift).
        latest = max(model.book._open, key=lambda c: c.sent_seq)
        floor = model.book._failed_valid
        pinned = any(
            model.book.deadline in (c.sent_at + c.valid, c.sent_at + min(c.valid, floor))
            and (c.resolved_seq is None or c.resolved_seq < latest.sent_seq)
            for c in model.book._open
        )
        assert pinned or model.book.next_renewal() < model.book.deadline


# -- a lease driven by hand under a fake clock (how the simulator drives one) -----------


class FakeRuntime:
    """A :class:`~task_locks.leasing.LeaseRuntime`: one renewal queue, one deadline heap,
    callbacks run when the test says."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.queue = RenewalQueue(clock)
        self.heap = DeadlineHeap()
        self.callbacks: list[Callable[[], object]] = []

    def schedule(self, lease: Any, asynchronous: bool) -> Any:
        self.queue.add(lease)
        return self

    def add(self, lease: Any, due: float | None = None, earlier_only: bool = False) -> None:
        self.queue.add(lease, due, earlier_only)

    def remove(self, lease: Any) -> None:
        self.queue.remove(lease)

    def watch(self, lease: Any) -> None:
        self.heap.add(lease)

    def unwatch(self, lease: Any) -> None:
        self.heap.remove(lease)

    def run_callback(self, lease: Any, callback: Callable[[], object]) -> None:
        self.callbacks.append(callback)

    def renew_due(self) -> int:
        """One lane wake-up: send what is due (to the real backend), apply the answers."""
        sent = 0
        for backend, leases in self.queue.take_due(self.clock.now).items():
            batch = self.queue.start(backend, leases)
            if batch is not None:
                self.queue.complete(batch, backend.renew_many(batch.items))
                sent += len(batch.items)
        return sent


def test_a_lease_runs_under_a_fake_clock_and_runtime() -> None:
    clock = FakeClock()
    runtime = FakeRuntime(clock)
    lost: list[Any] = []
    url = f"memory://{uuid.uuid4().hex[:8]}"  # a real backend; its TTL is real time
    with use_runtime(runtime):
        lease = Lock("simulated", ttl=30, backend=url, on_lost=lost.append).acquire(0)
    assert lease.remaining == 30 and lease.held
    assert runtime.queue.next_due() == clock.now + 10
    clock.now += 10
    assert runtime.renew_due() == 1
    assert lease.renewals == 1 and lease.remaining == 30
    assert runtime.queue.next_due() == clock.now + 10

    call = lease._begin_renew(3)  # renew(ttl=3), its I/O done by hand: no answer
    assert lease.remaining == 3
    assert runtime.queue.next_due() == clock.now + 1  # the shorter TTL's schedule
    lease._renew_call_failed(call)
    clock.now += 3  # nobody renewed it: the deadline passes in virtual time
    assert lease.lost.is_set() and not lease.held
    for expired in runtime.heap.expired(clock.now):
        expired._deadline_passed()
    assert lost == []  # the callback runs where the runtime runs it, not here
    runtime.callbacks.pop()()
    assert lost == [lease]
