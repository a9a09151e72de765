"""``django://`` on PostgreSQL and MariaDB with transport faults, injected for real.

The backend's own connections go through the chaoskit TCP proxy to the database
(PostgreSQL on 127.0.0.1:5432, MariaDB/MySQL on 127.0.0.1:3306; the transport fault
matrix for django://; SQLite has no network to fault). A client-side hook on the REAL connection (Django's execute wrapper)
switches the proxy's fault on just before the operation's decisive statement is sent
(the acquire's COMMIT or its INSERT, the renew's UPDATE, the release's DELETE; on
PostgreSQL an acquire is one statement that commits by itself, its INSERT in a ``WITH``
as is a release's DELETE), so the fault hits exactly that statement:

- ``request dropped``: the statement never reaches the server (held at the proxy, then
  discarded by a reset once the call has given up);
- ``reply dropped``: the server applies it, its reply never comes back;
- ``reset``: the server applies it, then the connection is reset (RST) mid-call.

Meanwhile the network heals for new connections (the faulted link alone stays broken),
as after a short glitch. After each cell the invariants are checked on the server
through a connection of its own: the call ended within its deadline (never hung); a
lease reported held is held (our token and fence on the row) and a contender is
refused; renew/release answer what the server did or raise ``BackendUnavailable``;
nothing else ever holds the name.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from chaoskit.proxy import Proxy, ProxyHub
from django.conf import settings
from django.db import connections

from django_app.backend import DjangoBackend
from task_locks import BackendUnavailable, Owner
from task_locks.types import RenewItem, RunCheck

NETWORKED = [alias for alias in ("pg", "mysql") if alias in settings.DATABASES]
pytestmark = pytest.mark.skipif(not NETWORKED, reason="no PostgreSQL or MariaDB on 127.0.0.1")

#: The backend's per-call deadline in these tests (seconds).
CALL_TIMEOUT = 1.0
#: A call must end within this (an acquire may try twice); beyond it, it hung.
CALL_BOUND = 4 * CALL_TIMEOUT + 2
#: A delay that is, for the test, forever: the delayed bytes are discarded by a reset.
FOREVER = 120.0
HEAL_AFTER = 0.3
RESET_AFTER = 0.15
#: "request delayed": the statement reaches the server this long after it was sent,
#: after the call gave up (CALL_TIMEOUT) and the lock changed hands.
LATE = 1.5
TOKEN = "token-under-test"
FAULTS = ["request dropped", "reply dropped", "reset"]


class Injector:
    """Turns the proxy's fault on when the hooked connection sends ``trigger``."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.trigger: str | None = None
        self.fault = ""
        self.fired = threading.Event()
        #: Set once a "request delayed" statement has been handed to the server.
        self.late = threading.Event()
        self.timers: list[threading.Timer] = []

    def arm(self, trigger: str, fault: str) -> None:
        self.trigger, self.fault = trigger, fault

    def hook(
        self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        head = sql.lstrip().upper()
        if (
            self.trigger
            and (
                head.startswith(self.trigger) or (head.startswith("WITH ") and self.trigger in head)
            )
            and not self.fired.is_set()
        ):
            self.fired.set()
            self._inject()
        return execute(sql, params, many, context)

    def _later(self, seconds: float, action: Callable[[], None]) -> None:
        timer = threading.Timer(seconds, action)
        self.timers.append(timer)
        timer.start()

    def _inject(self) -> None:
        if self.fault == "request delayed":
            self.proxy.latency(reply_delay=0.0, request_delay=LATE)
            self._later(LATE + 0.2, self.late.set)
        elif self.fault == "request dropped":
            self.proxy.latency(reply_delay=0.0, request_delay=FOREVER)
        else:
            self.proxy.latency(reply_delay=FOREVER)
        if self.fault == "reset":
            self._later(RESET_AFTER, self._reset_this_link)
        else:
            # New connections work again; the faulted link's bytes stay delayed.
            self._later(HEAL_AFTER, self.proxy.heal)

    def _reset_this_link(self) -> None:
        """RST the open connections and let new ones through, in one step of the
        proxy's loop (two calls would refuse a reconnect made in between, which is not
        the fault under test)."""

        async def reset_then_pass() -> None:
            await self.proxy._set("reset")
            await self.proxy._set("pass")

        self.proxy.hub.call(reset_then_pass())

    def stop(self) -> None:
        for timer in self.timers:
            timer.cancel()
            timer.join(5)
        self.proxy.reset()  # discards whatever the fault still holds
        self.proxy.heal()


@pytest.fixture(scope="module")
def hub() -> Iterator[ProxyHub]:
    proxies = ProxyHub()
    yield proxies
    proxies.close()


@pytest.fixture(
    params=[
        # "default" too: every test database depends on it (Django's TEST DEPENDENCIES).
        # Not transactional: the backends write on connections of their own, and
        # ``truth`` deletes what a cell left (a flush per cell would double the time).
        pytest.param(a, marks=pytest.mark.django_db(databases=["default", a]))
        for a in NETWORKED
    ]
)
def alias(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def truth(alias: str) -> Iterator[DjangoBackend]:
    """The server's state, seen through a direct connection of its own."""
    backend = DjangoBackend(f"django://{alias}")
    yield backend
    for holder in backend.holders():
        backend.force_release(holder.name)
    backend.close()


@pytest.fixture
def faulty(
    hub: ProxyHub, alias: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[DjangoBackend, Injector]]:
    """A django://ALIAS backend whose connections go through the proxy, with the hook."""
    proxy = hub.proxy(int(connections[alias].settings_dict["PORT"]))
    backend = DjangoBackend(f"django://{alias}?timeout={CALL_TIMEOUT}")
    injector = Injector(proxy)
    real_settings, real_open = backend._pool._settings, backend._pool._open

    def through_proxy() -> dict[str, Any]:
        return {**real_settings(), "HOST": "127.0.0.1", "PORT": proxy.port}

    def open_hooked() -> Any:
        wrapper = real_open()
        wrapper.execute_wrappers.append(injector.hook)
        return wrapper

    monkeypatch.setattr(backend._pool, "_settings", through_proxy)
    monkeypatch.setattr(backend._pool, "_open", open_hooked)
    yield backend, injector
    injector.stop()
    backend.close()


def _bounded(call: Callable[[], Any]) -> Any:
    """Run ``call`` in a thread; its result or exception, or fail if it hung."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(CALL_BOUND)
    if worker.is_alive():
        pytest.fail(f"the call hung past {CALL_BOUND}s behind a lost message")
    return outcome[0]


def _assert_no_other_holder(truth: DjangoBackend, name: str) -> None:
    holder = truth.holder(name)
    assert holder is None or holder.token == TOKEN, f"{name}: held by {holder}"


@pytest.mark.parametrize("trigger", ["COMMIT", "INSERT"])
@pytest.mark.parametrize("fault", FAULTS)
def test_acquire(
    faulty: tuple[DjangoBackend, Injector], truth: DjangoBackend, fault: str, trigger: str
) -> None:
    backend, injector = faulty
    if trigger == "COMMIT" and backend.dialect.vendor == "postgresql":
        pytest.skip("not applicable: one statement on PostgreSQL: its commit is the INSERT cell's")
    name = f"acquire:{fault}:{trigger}"
    earlier = truth.acquire(name, "an-earlier-holder", 30_000, Owner()).fence
    assert earlier is not None and truth.release(name, "an-earlier-holder")
    injector.arm(trigger, fault)
    outcome = _bounded(lambda: backend.acquire(name, TOKEN, 30_000, Owner(host="faulty")))
    assert injector.fired.is_set()
    injector.stop()
    _assert_no_other_holder(truth, name)
    holder = truth.holder(name)
    # One lost message never costs the caller the lock: the backend retries once with
    # the same token (idempotent), and a transaction its vanished first attempt left
    # open is ended by the server within the backend's timeout (idle-in-transaction
    # timeout), so the retry is not stuck behind its row lock.
    assert not isinstance(outcome, BaseException), outcome
    assert outcome.fence is not None, "nobody else holds it: the acquire must be granted"
    assert outcome.fence > earlier, "fences never go backwards"
    assert holder is not None and (holder.token, holder.fence) == (TOKEN, outcome.fence)
    assert holder.owner.host == "faulty"
    contender = truth.acquire(name, "a-contender", 30_000, Owner())
    assert contender.fence is None, "two holders"


@pytest.mark.parametrize("fault", FAULTS)
def test_a_runs_take_over(
    faulty: tuple[DjangoBackend, Injector], truth: DjangoBackend, fault: str
) -> None:
    """A Celery run's acquire (its run check, and the take-over of the publish-time lock
    under the run's own token) whose COMMIT is lost: the backend's retry with the same
    token finds the run's own row and is granted, never refused as a copy of itself."""
    backend, injector = faulty
    name = f"run:{fault}"
    queued = truth.acquire(name, "the-publish-time-token", 30_000, Owner(task_id="t-1"))
    assert queued.fence is not None
    run = RunCheck("t-1", (name,), take_over="the-publish-time-token")
    injector.arm("COMMIT", fault)
    owner = Owner(host="faulty", task_id="t-1")
    outcome = _bounded(lambda: backend.acquire_run(name, TOKEN, 30_000, owner, run))
    assert injector.fired.is_set()
    injector.stop()
    _assert_no_other_holder(truth, name)
    assert not isinstance(outcome, BaseException), outcome
    assert outcome.fence is not None, f"refused as a copy of itself: {outcome}"
    holder = truth.holder(name)
    assert holder is not None and (holder.token, holder.fence) == (TOKEN, outcome.fence)
    copy = truth.acquire_run(name, "a-copy", 30_000, Owner(task_id="t-1"), run)
    assert copy.fence is None and run.is_copy(copy), "a copy of the message ran too"


def _held(truth: DjangoBackend, name: str, ttl_ms: int = 30_000) -> int:
    fence = truth.acquire(name, TOKEN, ttl_ms, Owner()).fence
    assert fence is not None
    return fence


@pytest.mark.parametrize("fault", FAULTS)
def test_renew(faulty: tuple[DjangoBackend, Injector], truth: DjangoBackend, fault: str) -> None:
    backend, injector = faulty
    name = f"renew:{fault}"
    _held(truth, name, ttl_ms=5_000)
    injector.arm("UPDATE", fault)
    outcome = _bounded(lambda: backend.renew(name, TOKEN, 60_000))
    assert injector.fired.is_set()
    injector.stop()
    holder = truth.holder(name)
    assert holder is not None and holder.token == TOKEN, "a renewal never frees the lock"
    applied = holder.expires_in > 30  # type: ignore[operator]
    if isinstance(outcome, BackendUnavailable):
        assert applied == (fault != "request dropped"), "the fault hit where it was aimed"
        return
    assert outcome is True and applied, f"renew said {outcome!r}; the server renewed: {applied}"


@pytest.mark.parametrize("op", ["release", "force_release"])
@pytest.mark.parametrize("fault", FAULTS)
def test_release(
    faulty: tuple[DjangoBackend, Injector], truth: DjangoBackend, fault: str, op: str
) -> None:
    backend, injector = faulty
    name = f"{op}:{fault}"
    fence = _held(truth, name)
    injector.arm("DELETE", fault)
    if op == "release":
        outcome = _bounded(lambda: backend.release(name, TOKEN))
    else:
        outcome = _bounded(lambda: backend.force_release(name, fence))
    assert injector.fired.is_set()
    injector.stop()
    _assert_no_other_holder(truth, name)
    deleted = truth.holder(name) is None
    if isinstance(outcome, BackendUnavailable):
        assert deleted == (fault != "request dropped"), "the fault hit where it was aimed"
        return
    assert outcome is deleted is True, f"{op} said {outcome!r}; the server deleted: {deleted}"


@pytest.mark.parametrize("op", ["release", "force_release"])
def test_a_late_release_never_frees_the_next_holder(
    faulty: tuple[DjangoBackend, Injector], truth: DjangoBackend, op: str
) -> None:
    """The DELETE is delayed past the call's deadline and reaches the server only after
    the lock changed hands: it is token- (fence-) checked, so the new holder keeps it."""
    backend, injector = faulty
    name = f"late:{op}"
    fence = _held(truth, name)
    injector.arm("DELETE", "request delayed")
    if op == "release":
        outcome = _bounded(lambda: backend.release(name, TOKEN))
    else:
        outcome = _bounded(lambda: backend.force_release(name, fence))
    assert isinstance(outcome, BackendUnavailable), outcome
    assert truth.force_release(name, fence) is True  # the operator frees it meanwhile
    newer = truth.acquire(name, "the-next-holder", 30_000, Owner()).fence
    assert newer is not None and newer > fence
    assert injector.late.wait(LATE + 2), "the delayed DELETE was delivered"
    # The server has had the DELETE since ``late``; a statement on a fresh connection
    # is ordered after it only once it ran, so poll briefly (bounded) for a change.
    for _ in range(20):
        holder = truth.holder(name)
        assert holder is not None and holder.fence == newer, "the late DELETE freed it"
        threading.Event().wait(0.05)


@pytest.mark.parametrize("fault", ["request dropped", "reply dropped"])
def test_holders_answer_or_fail_within_the_deadline(
    faulty: tuple[DjangoBackend, Injector], truth: DjangoBackend, fault: str
) -> None:
    backend, injector = faulty
    fence = _held(truth, f"holders:{fault}")
    injector.arm("SELECT", fault)
    outcome = _bounded(lambda: backend.holders("holders:"))
    if not isinstance(outcome, BackendUnavailable):
        assert [(h.name, h.fence) for h in outcome] == [(f"holders:{fault}", fence)]


def test_a_renewal_is_bounded_by_the_validity_left(
    faulty: tuple[DjangoBackend, Injector], truth: DjangoBackend, alias: str
) -> None:
    """``renew_many(items, timeout)``: the caller's lease is valid ``timeout`` more
    seconds; an answer later than that is useless, so the call gives up by then
    (PostgreSQL: the connection cutter's deadline; MySQL's driver timeouts are per connection)."""
    if connections[alias].vendor != "postgresql":
        pytest.skip("not applicable: MySQL's read timeout is fixed when the connection opens")
    backend, injector = faulty
    name = "renew:bounded"
    _held(truth, name)
    injector.arm("UPDATE", "reply dropped")
    started = time.monotonic()
    outcome = _bounded(lambda: backend.renew_many([RenewItem(name, TOKEN, 30_000)], timeout=0.3))
    took = time.monotonic() - started
    assert isinstance(outcome, BackendUnavailable), outcome
    assert took < CALL_TIMEOUT, f"the renewal waited {took:.2f}s, past the lease's validity"
