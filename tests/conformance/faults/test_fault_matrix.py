"""The transport fault matrix (issue 12): backend x operation x fault, on real servers.

Each cell routes one client through the chaoskit TCP proxy, arms one fault for exactly
the call under test (acquire, renew, release, force release with the holder's fence,
holders), heals, and checks the invariants of :mod:`.cells` with a second client that
goes straight to the server. A cell that breaks an invariant today is listed in
:data:`KNOWN` with the issue item that fixes it: ``xfail(strict=True)``, so the fix
turns it into an XPASS failure until its entry is removed here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from .cells import FAULTS, OPERATIONS, Cell
from .conftest import KINDS, REASONS, RESULTS
from .targets import ProxyHub, Target, started

SYNC_REDIS = ("redis", "redis+wait_replicas", "sentinel", "cluster", "redlock")
ASYNC_REDIS = ("redis-asyncio", "sentinel-asyncio", "redlock-asyncio")
REDIS_FAMILY = (*SYNC_REDIS, *ASYNC_REDIS)
DATABASES = ("django-postgres", "django-mariadb")

ITEM2 = (
    "issue 12 item 2: force_release(name, fence=...) does not exist on this backend yet "
    "(TypeError: unexpected keyword argument 'fence')"
)
ITEM3_DEADLINE = (
    "issue 12 item 3: the call is still in flight at the lease's local deadline "
    "(reply delayed past the TTL) and lease.lost is not set"
)
ITEM3_CLUSTER = (
    "issue 12 item 3: Redis Cluster retries a timed-out call (3 attempts of socket_timeout), "
    "past the lease's local deadline, and lease.lost is not set meanwhile"
)
ITEM3_POSTGRES = (
    "issue 12 item 3: django:// on PostgreSQL has no read timeout: a lost packet blocks the "
    "call until the connection dies (still blocked after 3 s here; lease.lost not set at "
    "the deadline)"
)
RELEASE_UNKNOWN = (
    "issue 12 (matrix M1): a release whose reply is lost raises BackendUnavailable but "
    "leaves lease.held True; the server had freed the lock, and a second client takes it "
    "while the lease still reports held"
)
RELEASE_RETRY = (
    "issue 12 (matrix M2): redis-py's own retry resends a release whose first attempt freed "
    "the lock; the retry finds nothing and Lease.release raises NotOwned ('nothing was "
    "released', 'may be held by someone else'): it reports the opposite of what happened"
)
FORCE_RETRY = (
    "issue 12 (matrix M2, operator): redis-py's own retry resends a force release whose first "
    "attempt freed the holder; the retry finds nothing and force_release returns False, so "
    "the CLI says the lock changed hands or was not held although it freed it"
)
HOLDERS_EXPIRY = (
    "issue 12 (matrix M3): holders() computes expires_at as time.time() + PTTL when the reply "
    "lands, so a delayed listing shows a lock the server already dropped as live"
)


def _known() -> dict[tuple[str, str, str], str]:
    """Cells that fail on main, with the exact behaviour and the issue item.

    Each is ``xfail(strict=True)``: once a fix lands, the cell XPASSes and fails the run
    until its line here is removed. Fixed since the matrix was written: force release by
    fence (item 2), leases lost at their deadline with calls bounded by the validity left
    (item 3, on Redis Cluster and PostgreSQL too), a release with no reply marks the lease
    lost (M1), listings count expiry from the request's send (M3).
    """
    known: dict[tuple[str, str, str], str] = {}
    for kind in REDIS_FAMILY:
        known[(kind, "release", "retry")] = RELEASE_RETRY
        # Redlock matches the fence once, then deletes; Redis Cluster's retry sometimes
        # follows a slot-map refresh instead of a resend (see FLAKY).
        if not kind.startswith("redlock") and kind != "cluster":
            known[(kind, "force_release", "retry")] = FORCE_RETRY
    return known


#: Cells that fail only now and then (not strict): the reason says when.
FLAKY = {
    ("cluster", "force_release", "retry"): FORCE_RETRY + " (only when the cluster client resends)",
    ("redlock-asyncio", "force_release", "drop_reply"): (
        "redis.asyncio leaves the timed-out master connection's socket unclosed; the "
        "ResourceWarning (an error under -W error) surfaces at whichever garbage collection "
        "comes next: an asyncio client resource leak, not a lock-safety failure"
    ),
}


KNOWN = _known()


def _params() -> list[object]:
    params = []
    for kind in KINDS:
        for operation in OPERATIONS:
            for fault in FAULTS:
                marks = [pytest.mark.chaos]
                reason = KNOWN.get((kind, operation, fault))
                if reason:
                    marks.append(pytest.mark.xfail(strict=True, reason=reason))
                flaky = FLAKY.get((kind, operation, fault))
                if flaky:
                    marks.append(pytest.mark.xfail(strict=False, reason=flaky))
                params.append(
                    pytest.param(
                        (kind, operation, fault), marks=marks, id=f"{kind}-{operation}-{fault}"
                    )
                )
    return params


@pytest.fixture(scope="module")
def targets(django_db_blocker) -> Iterator[Callable[[str], Target | None]]:  # type: ignore[no-untyped-def]
    """Each backend's servers, started on first use and kept for the module."""
    hub = ProxyHub()
    running: dict[str, object] = {}
    contexts = []
    blocker = django_db_blocker.unblock()  # our own database aliases, no test database
    blocker.__enter__()

    def get(kind: str) -> Target | None:
        if kind not in running:
            context = started(kind, hub)
            running[kind] = context.__enter__()
            contexts.append(context)
        return running[kind]  # type: ignore[return-value]

    try:
        yield get
    finally:
        for context in reversed(contexts):
            context.__exit__(None, None, None)
        blocker.__exit__(None, None, None)
        hub.close()


@pytest.mark.parametrize("fault_cell", _params())
def test_fault_cell(fault_cell: tuple[str, str, str], targets) -> None:  # type: ignore[no-untyped-def]
    kind, operation, fault = fault_cell
    target = targets(kind)
    if target is None:
        RESULTS[fault_cell] = f"skipped: no {kind} server on this machine"
        pytest.skip(f"no {kind} server on this machine")
    REASONS[fault_cell] = KNOWN.get(fault_cell, "")
    started_at = time.monotonic()
    problems = Cell(target, operation, fault).run()
    RESULTS[fault_cell] = "; ".join(problems) if problems else "holds"
    assert not problems, "\n".join(problems) + f" ({time.monotonic() - started_at:.1f} s)"
