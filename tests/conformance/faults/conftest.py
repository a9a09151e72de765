"""Short or long form of the fault matrix, and its table.

``make test`` runs the short form: every cell of plain Redis, and for each other backend
one cell per operation and per fault (a Latin square over the five of each). ``make
chaos`` (``--chaos-long``, or ``TASK_LOCKS_FAULTS_LONG=1``) runs the full cross product.
Either way the table of the cells that ran is printed at the end and written to
``tests/artifacts/fault-matrix.md``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from .cells import FAULT_TEXT, FAULTS, OPERATIONS

ARTIFACT = Path(__file__).resolve().parents[2] / "artifacts" / "fault-matrix.md"
#: Backends in table order; the index also picks each one's short-form cells.
KINDS = (
    "redis",
    "redis+wait_replicas",
    "sentinel",
    "cluster",
    "redlock",
    "django-postgres",
    "django-mariadb",
    "redis-asyncio",
    "sentinel-asyncio",
    "redlock-asyncio",
    "redis+client",
    "redis+client-asyncio",
)
#: (kind, operation, fault) -> "holds" | "FAILS: ..." | "skipped: ..."; filled by the tests.
RESULTS: dict[tuple[str, str, str], str] = {}
#: The known-failure reason of each cell that ran ("" if none), for the table.
REASONS: dict[tuple[str, str, str], str] = {}
#: Why a cell that ran may fail now and then (its non-strict xfail; "" if none).
FLAKY_REASONS: dict[tuple[str, str, str], str] = {}
_started = time.monotonic()

NOT_COVERED = {
    "django-sqlite": (
        "n/a: SQLite is a library call on a local file, not a request over a link: "
        "there is no request or reply to drop, delay or reset, and no client retry. "
        "Its faults are the process's own (crash, pause: tests/chaos) and a busy "
        "database file (the busy timeout)."
    ),
    "cluster-asyncio": (
        "not in the matrix: after a timeout, redis.asyncio's cluster client refreshes its "
        "slot map and drops the old node objects without closing their sockets "
        "(ResourceWarning: unclosed socket/transport at garbage collection, an error under "
        "this suite's warnings policy, raised in whichever test runs then)."
    ),
}
#: Backends whose cells run elsewhere, with their own table.
ELSEWHERE = {
    "etcd (2+ endpoints)": (
        "its own fault tests, tests/backends/test_etcd_faults.py: each gateway request of "
        "each operation x 5 faults (55 cells), table in tests/artifacts/etcd-fault-matrix.md."
    ),
}


def long_form(config: pytest.Config) -> bool:
    return bool(config.getoption("--chaos-long", default=False)) or (
        os.environ.get("TASK_LOCKS_FAULTS_LONG") == "1"
    )


def in_short_form(kind: str, operation: str, fault: str) -> bool:
    if kind == "redis":
        return True
    shift = KINDS.index(kind)
    return (OPERATIONS.index(operation) + FAULTS.index(fault) + shift) % len(FAULTS) == 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if long_form(config):
        return
    keep, drop = [], []
    for item in items:
        cell = getattr(item, "callspec", None)
        params = cell.params if cell is not None else {}
        if "fault_cell" in params and not in_short_form(*params["fault_cell"]):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _label(reason: str) -> str:
    """A known failure's short label in the table: the first words of its reason (which
    says the behaviour seen)."""
    return " ".join(reason.split()[:3]).rstrip(":,;") or "?"


def table(details: bool = True) -> str:
    """The Markdown table of the cells that ran, its legend and (``details``) what each
    failing cell saw."""
    ran = {kind for kind, _o, _f in RESULTS}
    lines = [
        "| backend | operation | " + " | ".join(FAULTS) + " |",
        "|---|---|" + "---|" * len(FAULTS),
    ]
    reasons: dict[str, str] = {}
    seen: list[str] = []
    for kind in KINDS:
        if kind not in ran:
            continue
        for operation in OPERATIONS:
            cells = []
            for fault in FAULTS:
                key = (kind, operation, fault)
                result = RESULTS.get(key)
                reason = REASONS.get(key, "")
                flaky = FLAKY_REASONS.get(key, "")
                if result is None:
                    cells.append("·")
                elif result.startswith("skipped"):
                    cells.append("skipped")
                elif result == "holds":
                    cells.append("XPASS: fixed, drop its xfail" if reason else "holds")
                elif flaky:
                    # A non-strict xfail: known to fail now and then, reason below.
                    reasons[flaky] = "flaky"
                    cells.append("flaky")
                    seen.append(f"- {kind} x {operation} x {fault} (flaky): {result}")
                elif reason:
                    reasons[reason] = _label(reason)
                    cells.append(f"xfail {_label(reason)}")
                    seen.append(f"- {kind} x {operation} x {fault}: {result}")
                else:
                    cells.append("**FAILS**")
                    seen.append(f"- {kind} x {operation} x {fault} (not known): {result}")
            lines.append(f"| {kind} | {operation} | " + " | ".join(cells) + " |")
    for kind in NOT_COVERED:
        lines.append(f"| {kind} | all | " + " | ".join(["n/a"] * len(FAULTS)) + " |")
    for kind in ELSEWHERE:
        lines.append(f"| {kind} | all | " + " | ".join(["own table"] * len(FAULTS)) + " |")
    out = [
        "Faults: " + "; ".join(f"`{f}` = {FAULT_TEXT[f]}" for f in FAULTS) + ".",
        "`holds` = every invariant held; `xfail X` = a known failure, reason X below "
        "(`xfail(strict=True)` in tests/conformance/faults/test_fault_matrix.py); "
        "`flaky` = failed this run, a known occasional failure (non-strict xfail, reason "
        "below); `·` = not in this form (`make chaos` runs every cell).",
        "",
        *lines,
        "",
        *(
            f"- **{label}**: {reason}"
            for reason, label in sorted(reasons.items(), key=lambda r: r[1])
        ),
        *(f"- **{kind}**: {why}" for kind, why in {**NOT_COVERED, **ELSEWHERE}.items()),
    ]
    if details and seen:
        out += ["", "What each failing cell saw:", "", *seen]
    return "\n".join(out)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the table where the cells ran (under xdist: in that worker)."""
    if not RESULTS:
        return
    form = "long" if long_form(session.config) else "short"
    seconds = time.monotonic() - _started
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    ARTIFACT.write_text(
        f"# Transport fault matrix ({form} form, {len(RESULTS)} cells, {seconds:.0f} s)\n\n"
        f"{table()}\n"
    )


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # type: ignore[no-untyped-def]
    if not RESULTS:
        return
    form = "long" if long_form(config) else "short"
    terminalreporter.section(f"fault matrix ({form} form)")
    terminalreporter.write_line(table(details=False))
    terminalreporter.write_line(f"written to {ARTIFACT}")
