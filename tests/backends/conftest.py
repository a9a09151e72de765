"""Private servers for the backend tests: each test may stop, pause or kill them."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from servers import EtcdCluster, RedisMasters


@pytest.fixture
def masters_factory() -> Iterator[Callable[..., RedisMasters]]:
    """Start N independent Redis masters (``extra``: redis-server arguments per master)."""
    started: list[RedisMasters] = []

    def start(count: int = 3) -> RedisMasters:
        masters = RedisMasters(count)
        started.append(masters)
        return masters.start()

    yield start
    for masters in started:
        masters.cleanup()


@pytest.fixture
def etcd_cluster() -> Iterator[EtcdCluster]:
    if shutil.which("etcd") is None:
        pytest.skip("no etcd binary (scripts/install-servers.sh installs etcd-server)")
    cluster = EtcdCluster(3).start()
    yield cluster
    cluster.cleanup()


# -- the etcd row of the fault matrix: its table, like tests/conformance/faults' ----------

#: (operation, gateway path, fault) -> "holds" | "FAILS" | "skipped", filled as cells run.
ETCD_CELLS: dict[tuple[str, str, str], str] = {}
ETCD_ARTIFACT = Path(__file__).resolve().parents[1] / "artifacts" / "etcd-fault-matrix.md"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    callspec = getattr(item, "callspec", None)
    if callspec is None or getattr(item, "originalname", "") != "test_fault_matrix":
        return
    if not item.nodeid.split("::")[0].endswith("test_etcd_faults.py"):
        return
    params = callspec.params
    key = (params["operation"], params["path"], params["fault"])
    if report.skipped:
        ETCD_CELLS[key] = "skipped"
    elif report.failed:
        ETCD_CELLS[key] = "**FAILS**"
    elif report.when == "call":
        ETCD_CELLS[key] = "holds"


def etcd_table() -> str:
    """The etcd cells that ran: one row per operation and gateway request it makes."""
    from .test_etcd_faults import FAULTS, TARGETS

    lines = [
        "| etcd (3 endpoints) | request | " + " | ".join(FAULTS) + " |",
        "|---|---|" + "---|" * len(FAULTS),
    ]
    for operation, path in TARGETS:
        cells = [ETCD_CELLS.get((operation, path, fault), "·") for fault in FAULTS]
        lines.append(f"| {operation} | `{path}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the table where the cells ran (under xdist: in that worker)."""
    if not ETCD_CELLS:
        return
    ETCD_ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    ETCD_ARTIFACT.write_text(
        f"# etcd under transport faults ({len(ETCD_CELLS)} cells)\n\n{etcd_table()}\n"
    )


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # type: ignore[no-untyped-def]
    if not ETCD_CELLS:
        return
    terminalreporter.section("etcd fault matrix")
    terminalreporter.write_line(etcd_table())
    terminalreporter.write_line(f"written to {ETCD_ARTIFACT}")
