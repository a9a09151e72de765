"""Backend x fault runs: real client processes, real servers, real faults, then the checker.

What is asserted is what the package promises whatever the backend and the fault:
a fenced register (``task_locks.fencing`` and ``django_app.fencing.fenced``) never
accepts a stale write and never loses an acknowledged one. Overlaps and
the unfenced register's stale writes are *measured*, not asserted: they are the honest
answer to "where does a lock alone fail", and they go to the report.
"""

from __future__ import annotations

import shutil

import pytest
from chaoskit import clusters, report
from chaoskit.scenario import Run, Settings

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(240)]

WAIT_REPLICAS = "wait_replicas=1&wait_timeout=100"

BACKENDS = {
    "redis": lambda db: clusters.SingleRedis(),
    "redis+client": lambda db: clusters.SingleRedis("handoff=client"),
    "sentinel": lambda db: clusters.SentinelRedis(),
    "sentinel+wait": lambda db: clusters.SentinelRedis(WAIT_REPLICAS),
    "redlock": lambda db: clusters.Redlock(),
    "etcd": lambda db: clusters.Etcd(),
    "django": lambda db: clusters.DjangoDatabase(db),
}
FAULTS_OF = {
    "redis": clusters.SingleRedis.faults,
    "redis+client": clusters.SingleRedis.faults,
    "sentinel": clusters.SentinelRedis.faults,
    # wait_replicas only changes what happens when the master's data is lost
    "sentinel+wait": frozenset({"pause-server", "restart-server", "failover"}),
    "redlock": clusters.Redlock.faults,
    "etcd": clusters.Etcd.faults,
    "django": clusters.DjangoDatabase.faults,
}
FAULT_ORDER = [
    "pause-holder",
    "pause-acquirer",
    "kill-holder",
    "pause-server",
    "restart-server",
    "failover",
    "kill-leader",
    "proxy-latency",
    "proxy-blackhole",
    "proxy-reset",
    "clock-skew",
]

#: ``make test``: the faults that break something somewhere, once each (< 2 minutes).
SHORT = [
    ("redis", "pause-holder"),
    ("redis", "restart-server"),
    ("redis", "kill-holder"),
    ("redis", "proxy-blackhole"),
    ("redis", "clock-skew"),
    # the server hand-off (the default): a waiter paused between its queueing try and
    # its pop, a holder killed with waiters queued; the client hand-off (the opt-out)
    ("redis", "pause-acquirer"),
    ("redis+client", "kill-holder"),
    ("sentinel", "failover"),
    ("redlock", "restart-server"),
    ("etcd", "kill-leader"),
    ("django", "pause-holder"),
]
#: ``make chaos``: every backend with every fault it supports (plus a paused acquirer).
LONG = [
    (backend, fault)
    for backend in BACKENDS
    for fault in FAULT_ORDER
    if fault in FAULTS_OF[backend] or (fault == "pause-acquirer" and backend != "sentinel+wait")
]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "scenario" not in metafunc.fixturenames:
        return
    long_form = metafunc.config.getoption("--chaos-long", default=False)
    pairs = LONG if long_form else SHORT
    metafunc.parametrize("scenario", pairs, ids=[f"{b}-{f}" for b, f in pairs])


def test_fenced_resources_never_accept_a_stale_write(
    scenario: tuple[str, str],
    chaos_long: bool,
    chaos_resource_redis: str,
    chaos_database: str | None,
) -> None:
    backend, fault = scenario
    if backend == "django" and chaos_database is None:
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432")
    settings = Settings(duration=8.0 if chaos_long else 3.0)
    if fault == "failover":
        settings.duration *= 2  # one failover cycle takes about 4 s
    service = BACKENDS[backend](chaos_database)
    outcome = Run(service, fault, settings, chaos_resource_redis, chaos_database).execute()
    outcome.backend = backend
    report.OUTCOMES.append(outcome)
    result = outcome.result

    where = f"(histories and client logs in {outcome.workdir})"
    assert not outcome.errors, f"the harness failed: {outcome.errors} {where}"
    assert result.faults >= 1, f"the nemesis injected no {fault} fault"
    assert result.holds >= 1, "no client ever held the lock"
    for guard in ("fenced", "django"):
        if guard in result.guards:
            g = result.guards[guard]
            assert g.stale_accepted == 0, f"{guard}: {g.stale_accepted} stale accepted {where}"
            assert g.lost == 0, f"{guard}: acknowledged writes lost: {g.lost_ids[:5]}"
    shutil.rmtree(outcome.workdir, ignore_errors=True)  # kept only when a run failed
