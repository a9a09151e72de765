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
from .conftest import KINDS, RESULTS
from .targets import ProxyHub, Target, started

#: Cells that fail on this branch, with the exact behaviour and the issue item.
KNOWN: dict[tuple[str, str, str], str] = {}


def _params() -> list[object]:
    params = []
    for kind in KINDS:
        for operation in OPERATIONS:
            for fault in FAULTS:
                marks = [pytest.mark.chaos]
                reason = KNOWN.get((kind, operation, fault))
                if reason:
                    marks.append(pytest.mark.xfail(strict=True, reason=reason))
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
    started_at = time.monotonic()
    problems = Cell(target, operation, fault).run()
    RESULTS[fault_cell] = "; ".join(problems) if problems else "holds"
    assert not problems, "\n".join(problems) + f" ({time.monotonic() - started_at:.1f} s)"
