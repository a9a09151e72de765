"""The transport fault matrix: backend x operation x fault, on real servers.

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
from .conftest import FLAKY_REASONS, KINDS, REASONS, RESULTS
from .targets import ProxyHub, Target, started

#: Cells that fail on main, each with the exact behaviour it shows instead: ``xfail(strict=True)``, so a fix XPASSes and fails the run until its line here is
#: removed. None now. Fixed since the matrix was written: force release by fence,
#: leases lost at their deadline with calls bounded by the validity left (on Redis
#: Cluster and PostgreSQL too), a release with no reply marks the lease lost, listings
#: count expiry from the request's send, and a release or force release that redis-py
#: resends after its first reply was lost finds the tombstone of the release it already
#: made, and says it released.
KNOWN: dict[tuple[str, str, str], str] = {}

#: Cells that fail only now and then (not strict): the reason says when.
FLAKY = {
    ("redlock-asyncio", "force_release", "drop_reply"): (
        "redis.asyncio leaves the timed-out master connection's socket unclosed; the "
        "ResourceWarning (an error under -W error) surfaces at whichever garbage collection "
        "comes next: an asyncio client resource leak, not a lock-safety failure"
    ),
}


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
    FLAKY_REASONS[fault_cell] = FLAKY.get(fault_cell, "")
    started_at = time.monotonic()
    problems = Cell(target, operation, fault).run()
    RESULTS[fault_cell] = "; ".join(problems) if problems else "holds"
    assert not problems, "\n".join(problems) + f" ({time.monotonic() - started_at:.1f} s)"
