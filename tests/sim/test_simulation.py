"""The deterministic simulation in the suite (``make sim`` runs the long form).

``make test`` runs the short form before the suite (``make sim-short``: a few thousand
seeded schedules over every front end, in two processes); here a few hundred of them
check that the exploration itself works, beside the coverage of the short form's seeds
and the replayed findings. A failure prints the seed and the story of its shrunk
schedule, replayable with ``make sim SEED=<n>``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from . import scenario as sim
from .celery_world import CeleryOptions
from .redlock_world import MasterFault
from .scenario import Fault, Iteration, Scenario

MAKEFILE = (Path(__file__).resolve().parents[2] / "Makefile").read_text()


def _make(pattern: str) -> str:
    found = re.search(pattern, MAKEFILE, re.M)
    assert found, pattern
    return found[1]


#: ``make sim-short``'s seeds: the ones the coverage tests below look at.
SHORT_SEEDS = int(_make(r"^SIM_SHORT_SEEDS \?= (\d+)$"))
#: The in-suite run (the short form runs them all before the suite).
SUITE_SEEDS = 300


def _story(seed: int, **options: object) -> str:
    scenario = sim.shrink(sim.generate(seed, **options))  # type: ignore[arg-type]
    violation, lines = sim.story(scenario)
    return f"seed {seed} (replay: make sim SEED={seed}): {violation}\n" + "\n".join(lines)


def test_every_schedule_holds_every_invariant() -> None:
    failing, steps, seconds = sim.explore(range(SUITE_SEEDS))
    rate = SUITE_SEEDS / seconds
    print(f"{SUITE_SEEDS} schedules, {steps} steps in {seconds:.1f} s: {rate:.0f} schedules/s")
    assert not failing, _story(failing[0])


def test_make_test_runs_the_short_form_before_the_suite() -> None:
    assert "sim-short" in _make(r"^test: (.*)$").split()
    assert SHORT_SEEDS >= 2000


def test_the_short_form_covers_every_protocol_and_fault() -> None:
    scenarios = [sim.generate(seed) for seed in range(SHORT_SEEDS)]
    assert {s.protocol for s in scenarios} == set(sim.PROTOCOLS)
    kinds = {f.kind for s in scenarios for f in s.faults}
    details = {f.detail for s in scenarios for f in s.faults if f.kind == "msg"}
    assert kinds == {
        "msg", "pause", "partition", "kill", "jump", "wall_jump", "restart", "failover",
        "clock_step", "force", "lose_renew", "lose_lane", "late_lane",
        "master_restart", "master_pause", "master_partition", "master_clock_step",
        "redeliver", "duplicate", "peer",
    }  # fmt: skip
    redlock = [s for s in scenarios if s.protocol == "redlock"]
    assert {len(s.masters) for s in redlock} == {3, 5}
    assert any(s.fair for s in redlock)
    assert details == {
        "drop_request", "drop_reply", "reset_before", "reset_after", "delay_request", "delay_reply"
    }  # fmt: skip
    assert sum(s.fair for s in scenarios) > SHORT_SEEDS / 10  # liveness is checked on these


def test_a_seed_replays_exactly() -> None:
    first = sim.story(sim.generate(17))
    assert first == sim.story(sim.generate(17))
    assert any("client0" in line and " ms " in line for line in first[1])


def test_a_thousand_operations_take_milliseconds() -> None:
    scenario = sim.generate(3)
    began = time.perf_counter()
    outcome = sim.run(scenario)
    seconds = time.perf_counter() - began
    assert outcome.violation is None
    # About 1 ms per 100 steps on an idle machine; generous for a loaded one.
    assert outcome.steps >= 100
    assert seconds < 0.5, (seconds, outcome.steps)


def test_the_checker_catches_a_lease_counted_from_its_reply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checker is not vacuous: the classic mistake (counting a lease from the reply)
    is found at once (``make sim-mutants`` does this for every fixed bug)."""
    import task_locks.lock as lock_module

    # Where every acquire (its first try's fast path and the plan's later tries alike)
    # decides from when its lease counts.
    real_in_time = lock_module._Attempt.in_time

    def counted_from_the_reply(self, fence, sent_at):  # type: ignore[no-untyped-def]
        granted = real_in_time(self, fence, sent_at)
        return None if granted is None else (granted[0], granted[1], self.clock.monotonic())

    monkeypatch.setattr(lock_module._Attempt, "in_time", counted_from_the_reply)
    failing, _, _ = sim.explore(range(20))
    assert failing


#: renew(ttl=LONGER) overtaken by a renewal in flight, found by the simulation (``generate(376 / 327, renew_ttl=True)``,
#: shrunk), kept as literals so that changes to the generator do not lose them: a
#: ``renew(ttl=LONGER)`` whose reply comes first while a watchdog renewal of the old TTL,
#: in flight, reaches the server last.
RENEW_TTL_RACES = [
    Scenario(
        seed=376,
        protocol="redis",
        programs=(
            (Iteration("job", 1.0, 0.2, 1.0, 3, 0.5027292060233458, None, True),),
            (Iteration("job", 0.3, 3.0, 0.03, 1, None, None, True),),
            (
                Iteration("job", 2.0, 0.2, 1.2, 1, None, None, True),
                Iteration("job", 0.5, 1.0, 2.0, 0, 0.283739731530364, 1.5, False),
            ),
        ),
        rates=(1.0001, 1.0, 1.0001),
        faults=(),
        delay=(0.001, 0.05),
        socket_timeout=0.5,
    ),
    Scenario(
        seed=327,
        protocol="election",
        programs=(
            (
                Iteration("leader", 1.0, 0.2, 0.1, 3, None, None, True),
                Iteration("leader", 0.3, 6.0, 0.3, 3, 0.02014382474111187, 0.9, True),
            ),
            (Iteration("leader", 0.5, 0.0, 0.5, 3, None, None, True),),
        ),
        rates=(1.0, 1.001),
        faults=(Fault("partition", 0, 0.40210835955343815, 2.5),),
        delay=(0.001, 0.05),
        socket_timeout=5.0,
    ),
]


@pytest.mark.parametrize("scenario", RENEW_TTL_RACES, ids=lambda s: f"seed{s.seed}")
def test_renew_with_a_longer_ttl_raced_by_the_watchdog(scenario: Scenario) -> None:
    violation, story = sim.story(scenario)
    assert violation is None, "\n".join(story)


#: A slow on_lost on the renewal lane, found by the simulation (``generate(61, slow_on_lost=True)``, shrunk):
#: a lease force-released from under client1 calls its 3 s ``on_lost`` on the renewal
#: lane, and client1's next lease (TTL 0.5 s) is not renewed in that time.
SLOW_ON_LOST_FINDING = Scenario(
    seed=61,
    protocol="redis-handoff",
    programs=(
        (Iteration("job", 1.0, 3.0, 0.6, 0, 0.405500042895381, None, True, 0.0),),
        (
            Iteration("job", 1.0, 3.0, 1.2, 1, None, None, True, 3.0),
            Iteration("job", 0.5, 3.0, 0.5, 0, None, None, True, 3.0),
        ),
        (Iteration("job", 0.3, 6.0, 0.36, 1, None, None, True, 0.5),),
    ),
    rates=(1.0001, 1.001, 1.001),
    faults=(Fault("force", -1, 2.130930733893041, 3.0, "job"),),
    delay=(0.001, 0.05),
    socket_timeout=1.0,
)


def test_a_slow_on_lost_callback_stops_no_other_lease_renewal() -> None:
    violation, story = sim.story(SLOW_ON_LOST_FINDING)
    assert violation is None, "\n".join(story)


#: Found with ``renew(ttl=...)`` in the schedules (``generate(336, renew_ttl=True,
#: slow_on_lost=False)``, shrunk): ``renew(ttl=0.1)`` over links of up to 50 ms each way,
#: NOSCRIPT doubling the round trip, while the lane's renewal is in flight too. The lease
#: is rightly lost at its deadline (no answer can come in time); the checker's renewal
#: rule said "no renewal tried" although the lane's call was waiting for its answer.
RENEW_SHORTER_THAN_THE_ROUND_TRIP = Scenario(
    seed=336,
    protocol="redis",
    programs=(
        (Iteration("report", 2.0, 6.0, 0.6, 3, 0.9880927529824346, 0.667, True, 0.0),),
        (Iteration("job", 0.3, 3.0, 0.0, 1, 0.4958280415659154, 0.1, True, 0.0),),
    ),
    rates=(1.001, 1.0),
    faults=(),
    delay=(0.001, 0.05),
    socket_timeout=1.0,
)

#: Found the same way (``generate(8211, renew_ttl=True, slow_on_lost=False)``, shrunk): the
#: operator force-releases a hand-off grant its waiter has not popped, and the waiter's
#: next try takes the lock again with the same token; the checker kept who removed a
#: grant by token, so the second grant wiped out what the operator's release had done.
FORCED_GRANT_TAKEN_AGAIN = Scenario(
    seed=8211,
    protocol="election",
    programs=(
        (
            Iteration("leader", 0.3, 0.0, 0.015, 1, 0.38541340179980976, 0.1, True, 0.0),
            Iteration("leader", 0.3, 3.0, 0.18, 3, None, None, True, 0.0),
        ),
        (Iteration("leader", 0.5, 0.0, 0.5, 1, None, None, True, 0.0),),
    ),
    rates=(1.0, 1.001),
    faults=(Fault("force", -1, 0.33890957556533796, 10.0, "election:leader"),),
    delay=(0.001, 0.05),
    socket_timeout=5.0,
)


#: Found by the simulation (``generate(5274)``, shrunk): a renewal whose request was lost
#: held the renewal lane for the validity left to its lease (1.3 s); a 0.3 s lease taken
#: meanwhile was not renewed and ran out behind it.
LANE_HELD_BY_A_LOST_RENEWAL = Scenario(
    seed=5274,
    protocol="semaphore",
    programs=(
        (
            Iteration("pool", 2.0, 1.0, 8.0, 1, None, None, True, 3.0),
            Iteration("pool", 0.3, 3.0, 0.0, 3, 0.12828494180751815, None, False, 3.0),
        ),
        (Iteration("pool", 0.3, 0.0, 0.06, 0, None, None, True, 3.0),),
    ),
    rates=(1.0, 1.0001),
    faults=(Fault("msg", 0, 14.0, 0.0, "drop_request"),),
    delay=(0.0001, 0.001),
    socket_timeout=1.0,
    limit=2,
)

#: Found by the simulation (``generate(690)``, shrunk): a ``renew()`` whose reply was lost
#: stayed open for its socket timeout, and counted from its send the next renewal was
#: always due: the lane renewed back to back (15 calls in 16 ms) until one of them, lost,
#: held the lane, and the next lease ran out behind it.
RENEWALS_BACK_TO_BACK_BEHIND_A_LOST_REPLY = Scenario(
    seed=690,
    protocol="semaphore",
    programs=(
        (
            Iteration("pool", 2.0, 0.0, 8.0, 1, 0.8114792717318394, None, True, 0.0),
            Iteration("pool", 0.3, 3.0, 0.36, 3, None, None, True, 0.0),
        ),
        (Iteration("pool", 1.0, 0.0, 1.2, 0, 0.4543074143385861, 3.0, True, 0.5),),
        (Iteration("pool", 0.3, 0.0, 1.2, 1, None, None, True, 0.5),),
    ),
    rates=(1.0, 1.0, 1.001),
    faults=(
        Fault("msg", 0, 28.0, 0.0, "drop_request"),
        Fault("lose_renew", 0, 0.0, 0.0, "drop_reply"),
    ),
    delay=(0.0001, 0.001),
    socket_timeout=1.0,
    limit=3,
)


@pytest.mark.parametrize(
    "scenario",
    [
        RENEW_SHORTER_THAN_THE_ROUND_TRIP,
        FORCED_GRANT_TAKEN_AGAIN,
        LANE_HELD_BY_A_LOST_RENEWAL,
        RENEWALS_BACK_TO_BACK_BEHIND_A_LOST_REPLY,
    ],
    ids=lambda s: f"seed{s.seed}",
)
def test_the_renewal_lane_and_checker_findings(scenario: Scenario) -> None:
    """The checker no longer fails a lease that did what it could (the first two); a
    renewal without an answer holds up no other renewal (the last two)."""
    violation, story = sim.story(scenario)
    assert violation is None, "\n".join(story)


#: Found by the long run (``generate(44632)``, shrunk): the watchdog's renewal (TTL 1 s)
#: times out with its request delayed on its way; ``renew(ttl=3.0)`` and the renewals after
#: it are granted, then the late request lands and cuts the server's expiry back to 1 s
#: from its arrival, while the lease counted with 3 s (the deadline past the expiry).
TIMED_OUT_RENEWAL_LANDS_AFTER_AN_EXTENSION = Scenario(
    seed=44632,
    protocol="redis-mixed",
    programs=(
        (Iteration("job", 1.0, 0.0, 0.3, 3, None, None, True, 0.0),),
        (Iteration("job", 1.0, 3.0, 2.0, 0, 0.9180846710502996, 3.0, False, 0.0),),
    ),
    rates=(1.0001, 1.0),
    faults=(Fault("msg", 1, 9.0, 1.0, "delay_request"),),
    delay=(0.0005, 0.005),
    socket_timeout=0.5,
)


def test_a_timed_out_renewal_landing_late_cuts_no_lease_short() -> None:
    violation, story = sim.story(TIMED_OUT_RENEWAL_LANDS_AFTER_AN_EXTENSION)
    assert violation is None, "\n".join(story)


#: Found by the simulation on Redlock (``generate(30 / 458, "redlock")``, shrunk), fair
#: schedules: the holder missed the master a waiter's name hashes to, the waiter blocked
#: on that master's release signal, and its release signalled only where it held the lock:
#: the lock stayed free for 770 ms while the waiters slept until their retry.
REDLOCK_WAITERS_ON_THE_WRONG_MASTER = [
    Scenario(
        seed=30,
        protocol="redlock",
        programs=(
            (Iteration("job", 0.5, 3.0, 2.0, 0, None, None, False, 0.5),),
            (Iteration("job", 0.5, 6.0, 2.0, 1, 0.535204782203361, None, True, 0.0),),
            (Iteration("job", 1.0, 6.0, 0.0, 0, None, None, True, 0.0),),
            (Iteration("job", 2.0, 0.2, 0.2, 3, None, None, True, 0.5),),
        ),
        rates=(1.0001, 1.0001, 1.0, 1.0),
        faults=(),
        delay=(0.0005, 0.005),
        socket_timeout=1.0,
        masters=(0.999, 1.001, 1.0, 1.001, 0.999),
    ),
    Scenario(
        seed=458,
        protocol="redlock",
        programs=(
            (Iteration("report", 0.3, 6.0, 0.6, 3, 0.5189045206693849, 0.9, True, 0.5),),
            (Iteration("report", 2.0, 6.0, 2.4, 0, None, None, True, 0.0),),
        ),
        rates=(1.0001, 1.0001),
        faults=(),
        delay=(0.0001, 0.001),
        socket_timeout=1.0,
        masters=(0.999, 1.0, 1.0),
    ),
]

#: Found by the simulation on Redlock (``generate(1207, "redlock")``, shrunk): a failed
#: try's undo on one master is delayed past its node timeout, the next try's grant of the
#: same token there lands first and counts, then the undo lands and deletes it; with a
#: second master partitioned, the lease counted 760 ms past its last majority.
REDLOCK_LATE_UNDO = Scenario(
    seed=1207,
    protocol="redlock",
    programs=(
        (
            Iteration("job", 0.5, 0.2, 0.025, 3, 0.8900972913247436, None, True, 0.0),
            Iteration("job", 0.3, 1.0, 0.06, 0, None, None, True, 0.5),
        ),
        (
            Iteration("job", 1.0, 0.2, 0.0, 0, None, None, True, 0.5),
            Iteration("job", 2.0, 3.0, 0.6, 0, None, None, True, 0.5),
            Iteration("job", 1.0, 6.0, 2.0, 0, None, None, True, 0.0),
        ),
    ),
    rates=(1.0, 1.0001),
    faults=(
        Fault("msg", 1, 29.0, 1.0, "delay_request"),
        Fault("msg", 1, 21.0, 0.0, "drop_request"),
        MasterFault("master_partition", 2, 1.091536292780002, 1.0),
    ),
    delay=(0.0005, 0.005),
    socket_timeout=0.5,
    masters=(1.001, 1.0, 1.0001),
)


#: Found by the long run on Redlock (``generate(52959, "redlock")``, shrunk): a grant of a
#: failed try, delayed 3 s on its way to master 0 (its undo overtook it), lands after the
#: lease's ``renew(ttl=0.9)`` and restarts master 0's copy at the acquire's 0.3 s; master 1
#: is paused, and the lease counted 650 ms past its last majority.
REDLOCK_LATE_GRANT_AFTER_A_LONGER_RENEW = Scenario(
    seed=52959,
    protocol="redlock",
    programs=(
        (Iteration("job", 0.3, 3.0, 0.36, 1, 0.33137931892849504, 0.9, False, 3.0),),
        (
            Iteration("job", 1.0, 0.2, 0.3, 0, None, None, True, 0.5),
            Iteration("job", 2.0, 3.0, 1.2, 3, 0.7470614060263494, None, True, 0.0),
        ),
        (Iteration("job", 0.3, 6.0, 0.0, 0, None, None, True, 0.0),),
    ),
    rates=(1.0, 1.0, 1.001),
    faults=(
        Fault("msg", 0, 28.0, 3.0, "delay_request"),
        MasterFault("master_pause", 1, 0.6498376659229267, 2.5),
    ),
    delay=(0.0001, 0.001),
    socket_timeout=5.0,
    masters=(1.0, 1.0, 1.0),
)


#: Found by the long run on Redlock (``generate(3234, "redlock")``): the lane's renewal
#: (0.3 s) is delayed 3 s on its way to master 0 while two masters grant it; the lease's
#: ``renew(ttl=0.9)`` is then granted by all three, and the late 0.3 s renewal cuts master
#: 0's copy short. A renewal a master did not answer now counts like a straggling grant.
REDLOCK_LATE_RENEWAL_AFTER_A_LONGER_RENEW = Scenario(
    seed=3234,
    protocol="redlock",
    programs=(
        (
            Iteration(
                name="report",
                ttl=0.5,
                timeout=3.0,
                hold=0.0,
                writes=1,
                renew_at=0.7617485044708769,
                renew_ttl=0.167,
                release=True,
                on_lost=0.0,
            ),
        ),
        (
            Iteration(
                name="report",
                ttl=0.5,
                timeout=6.0,
                hold=0.6,
                writes=0,
                renew_at=0.13723369306049082,
                renew_ttl=0.167,
                release=True,
                on_lost=0.0,
            ),
        ),
        (
            Iteration(
                name="report",
                ttl=0.3,
                timeout=0.0,
                hold=0.0,
                writes=1,
                renew_at=0.802963995797725,
                renew_ttl=0.9,
                release=False,
                on_lost=0.5,
            ),
        ),
        (
            Iteration(
                name="job",
                ttl=0.5,
                timeout=0.0,
                hold=0.05,
                writes=1,
                renew_at=None,
                renew_ttl=None,
                release=True,
                on_lost=3.0,
            ),
        ),
    ),
    rates=(0.999, 1.001, 1.0, 1.0001),
    faults=(
        Fault(kind="late_lane", client=2, at=0.0, amount=3.0, detail="delay_request"),
        MasterFault(kind="master_restart", client=1, at=0.306688996970918, amount=0.0, detail=""),
    ),
    delay=(0.0005, 0.005),
    socket_timeout=0.5,
    limit=1,
    masters=(1.0, 1.0001, 0.999),
    celery=None,
)

#: Found by the long run on Redlock (``generate(2178, "redlock")``): two operators force-
#: release one holder while master 0 is partitioned; each deletes one copy and both say
#: "freed" (the backend can only guess; docs/backends/redlock.md says so). The checker
#: counts a call still waiting for its reply as unanswered.
REDLOCK_TWO_FORCE_RELEASES_WITH_A_MASTER_AWAY = Scenario(
    seed=2178,
    protocol="redlock",
    programs=(
        (
            Iteration(
                name="job",
                ttl=2.0,
                timeout=1.0,
                hold=2.4,
                writes=1,
                renew_at=None,
                renew_ttl=None,
                release=True,
                on_lost=0.0,
            ),
        ),
        (
            Iteration(
                name="job",
                ttl=2.0,
                timeout=3.0,
                hold=0.1,
                writes=0,
                renew_at=None,
                renew_ttl=None,
                release=True,
                on_lost=3.0,
            ),
        ),
    ),
    rates=(1.0, 0.999),
    faults=(
        Fault(kind="force", client=-1, at=1.6582328652101914, amount=3.0, detail="job"),
        Fault(kind="kill", client=1, at=0.16658825101782748, amount=0.0, detail=""),
        Fault(kind="msg", client=1, at=4.0, amount=1.0, detail="delay_reply"),
        MasterFault(kind="master_partition", client=0, at=1.834321680609312, amount=2.5, detail=""),
        Fault(kind="force", client=-1, at=1.6497942276225388, amount=30.0, detail="job"),
    ),
    delay=(0.001, 0.05),
    socket_timeout=1.0,
    limit=1,
    masters=(1.0, 1.001, 1.001),
    celery=None,
)


@pytest.mark.parametrize(
    "scenario",
    [
        *REDLOCK_WAITERS_ON_THE_WRONG_MASTER,
        REDLOCK_LATE_UNDO,
        REDLOCK_LATE_GRANT_AFTER_A_LONGER_RENEW,
        REDLOCK_LATE_RENEWAL_AFTER_A_LONGER_RENEW,
        REDLOCK_TWO_FORCE_RELEASES_WITH_A_MASTER_AWAY,
    ],
    ids=lambda s: f"redlock-seed{s.seed}",
)
def test_the_redlock_findings(scenario: Scenario) -> None:
    violation, story = sim.story(scenario)
    assert violation is None, "\n".join(story)


def test_the_sql_protocol_runs_the_django_backend_over_the_model() -> None:
    """The ``sql`` schedules run the production ``DjangoBackend`` (its acquire statement,
    renewals, token-checked release and LISTEN) against the PostgreSQL model, and a
    restart of the database keeps the lock rows (it is durable)."""
    scenario = next(
        s
        for s in map(sim.generate, range(SHORT_SEEDS))
        if s.protocol == "sql" and any(f.kind == "restart" for f in s.faults)
    )
    violation, story = sim.story(scenario)
    assert violation is None, "\n".join(story)
    text = "\n".join(story)
    for said in ("postgres  client", "acquire sim_", "RESTART, every commit kept"):
        assert said in text, said


#: A fair sql schedule (``generate(4587)`` with nine protocols) in which a statement waits
#: for a row lock: client0 holds two leases, renewed in one transaction, and its release
#: of 'report' waits for that transaction's COMMIT. Its finding, a modelling error: the
#: model ran the waiting release before telling the world of the COMMIT it waited for, so
#: the checker, which had seen the committed expiry pass meanwhile (the row locked, not
#: free), said "released; expiry removed it". The model now frees a transaction's row
#: locks after its commit is told.
SQL_RELEASE_BEHIND_A_RENEWAL_TRANSACTION = Scenario(
    seed=4587,
    protocol="sql",
    programs=(
        (
            Iteration("job", 0.5, 6.0, 0.1, 1, None, None, False, 0.0),
            Iteration("report", 0.5, 0.0, 0.3, 0, 0.6782158626637113, 0.167, True, 3.0),
            Iteration("job", 1.0, 1.0, 0.2, 0, 0.4904058839304417, 3.0, True, 0.5),
        ),
        (
            Iteration("job", 0.5, 3.0, 1.0, 1, 0.7587501215814284, 0.167, True, 0.5),
            Iteration("job", 1.0, 1.0, 4.0, 0, None, None, True, 0.0),
        ),
    ),
    rates=(1.0001, 1.001),
    faults=(),
    delay=(0.001, 0.05),
    socket_timeout=0.5,
)


def test_a_statement_waits_for_a_renewal_transaction_in_the_sql_world() -> None:
    violation, story = sim.story(SQL_RELEASE_BEHIND_A_RENEWAL_TRANSACTION)
    assert violation is None, "\n".join(story)
    assert any("waits for the row lock" in line for line in story), "\n".join(story)


#: Found by a long sql run (``generate(6564)``, shrunk): client1's release of 'job' waits
#: for the row lock of its own renewal transaction, whose call the connection cutter gives
#: up on; the committed expiry passes, the transaction rolls back, and the release, whose
#: ``now()`` is its start, deletes the row and answers "released". PostgreSQL does the
#: same (``test_a_delete_that_waited_past_the_expiry_still_deletes``), and nobody could
#: take the locked row meanwhile: the checker had counted the row as removed by its
#: expiry; it now counts a deleted row as removed by the statement that deleted it.
SQL_RELEASE_DELETES_A_ROW_EXPIRED_WHILE_IT_WAITED = Scenario(
    seed=6564,
    protocol="sql",
    programs=(
        (
            Iteration("job", 0.5, 0.2, 0.15, 1, None, None, True, 3.0),
            Iteration("job", 2.0, 0.2, 0.0, 0, None, None, True, 0.0),
        ),
        (
            Iteration("job", 2.0, 0.0, 4.0, 1, None, None, True, 0.0),
            Iteration("report", 0.5, 0.2, 0.05, 0, 0.09198683327158996, None, False, 0.5),
            Iteration("job", 0.5, 6.0, 0.5, 1, None, None, True, 0.5),
        ),
    ),
    rates=(1.0, 1.0001),
    faults=(
        Fault("msg", 0, 12.0, 3.0, "delay_reply"),
        Fault("force", -1, 2.082271765631027, 3.0, "report"),
    ),
    delay=(0.001, 0.05),
    socket_timeout=0.5,
)


def test_a_release_that_waited_past_the_expiry_is_the_holders() -> None:
    violation, story = sim.story(SQL_RELEASE_DELETES_A_ROW_EXPIRED_WHILE_IT_WAITED)
    assert violation is None, "\n".join(story)
    assert any("waits for the row lock" in line for line in story), "\n".join(story)


#: Found by the simulation (``generate(144, "celery-both")``, shrunk): a whole worker killed
#: (RabbitMQ: its message back at once) a second into a run whose locks had been renewed;
#: the redelivered copy meets its own task id and watches the dead run's lock, but the
#: refusal it met reports no renewal count, so the renewals the run made before it died
#: counted as a renewal at the first look: the copy was refused, the message lost.
CELERY_DEAD_RUN_RENEWED_BEFORE_IT_DIED = Scenario(
    seed=144,
    protocol="celery-both",
    programs=((Iteration("job", 1.0, 0.0, 0.0, 0, None, None, True, 0.0),), (), ()),
    rates=(1.0, 1.0, 1.001),
    faults=(Fault("kill", 1, 1.0688617965328615), Fault("msg", 1, 4.0, 0.0, "drop_request")),
    delay=(0.0005, 0.005),
    socket_timeout=5.0,
    celery=CeleryOptions(
        lock_on="both", ttl=1.0, acks_late=True, ignore_result=False, broker="rabbitmq"
    ),
)

#: Found the same way (``generate(175, "celery-both")``, shrunk), with that fixed: the watch
#: sees the dead run's lock gone by its own estimate of the expiry (counted from when its
#: read was sent), but the server keeps the key a few milliseconds longer; the copy's next
#: acquire met the same dead holder again and was refused without watching: lost again.
CELERY_DEAD_HOLDER_MET_AGAIN_AFTER_ITS_WATCH = Scenario(
    seed=175,
    protocol="celery-both",
    programs=(
        (
            Iteration("job", 0.3, 0.0, 0.06, 0, None, None, True, 0.0),
            Iteration("job", 0.3, 0.1, 0.36, 0, None, None, False, 0.0),
            Iteration("job", 0.3, 1.0, 0.18, 1, None, None, True, 0.0),
            Iteration("job", 0.3, 1.0, 0.3, 0, None, None, True, 0.0),
        ),
        (),
        (),
    ),
    rates=(1.0, 1.0001, 1.001),
    faults=(Fault("kill", 1, 2.616290843285616),),
    delay=(0.001, 0.05),
    socket_timeout=1.0,
    celery=CeleryOptions(
        lock_on="both",
        ttl=0.3,
        on_lost="fail",
        acks_late=True,
        ignore_result=False,
        wait_timeout=3.0,
        retry_countdown=0.5,
        max_retries=1,
        broker="rabbitmq",
        visibility_timeout=1.0,
    ),
)


def test_a_celery_seed_replays_exactly() -> None:
    for protocol in sim.CELERY:
        first = sim.story(sim.generate(29, protocol))
        assert first == sim.story(sim.generate(29, protocol))
        assert any("runs message #1" in line for line in first[1])


#: Found by the simulation (``generate(1765, "celery-both")`` with ``lock_unavailable="fail"``,
#: shrunk): a run's take-over of its publish-time lock got no answer (its request lost:
#: ``BackendUnavailable`` after the socket timeout) and the run failed, leaving that lock
#: for the whole ``enqueue_ttl``: every later publish of the key was dropped as a
#: duplicate of the failed message (as a refused run's lock was before it was freed).
CELERY_FAILED_TAKE_OVER_KEEPS_THE_PUBLISH_LOCK = Scenario(
    seed=1765,
    protocol="celery-both",
    programs=(
        (
            Iteration("job", 1.0, 0.0, 0.05, 1, None, None, True, 0.0),
            Iteration("job", 1.0, 0.01, 0.2, 1, None, None, False, 0.0),
            Iteration("job", 1.0, 0.01, 1.2, 1, None, None, False, 0.0),
        ),
        (
            Iteration("job", 1.0, 1.0, 2.0, 0, None, None, True, 0.0),
            Iteration("job", 1.0, 0.1, 2.0, 0, None, None, True, 0.0),
            Iteration("job", 1.0, 0.1, 0.0, 3, None, None, True, 0.0),
            Iteration("job", 1.0, 1.0, 1.0, 0, None, None, True, 0.0),
        ),
        (),
        (),
    ),
    rates=(1.0001, 1.0, 1.0001, 1.001),
    faults=(Fault("duplicate", 0, 0.0, 2.0), Fault("msg", 2, 12.0, 0.0, "drop_request")),
    delay=(0.0001, 0.001),
    socket_timeout=5.0,
    celery=CeleryOptions(
        lock_on="both",
        on_conflict="wait",
        ttl=1.0,
        skip_as="failure",
        wait_timeout=3.0,
        max_retries=5,
        broker="rabbitmq",
        visibility_timeout=10.0,
        publishers=2,
    ),
)


#: Found by the simulation (``generate(2811, "celery")``, shrunk): a ``PeerCheckedTask``
#: run takes the key, and its second look at the peer keys gets no answer: the error went
#: out of ``PeerCheckedLock.acquire`` with the lease it had just taken still held and
#: renewed by nobody's run; the retry (``lock_unavailable="retry"``) met its own task id on
#: the key and was refused as a copy: the message lost, the key held for good.
CELERY_PEER_CHECK_FAILS_AFTER_THE_ACQUIRE = Scenario(
    seed=2811,
    protocol="celery",
    programs=(
        (
            Iteration("job", 0.3, 0.0, 0.0, 0, None, None, True, 0.0),
            Iteration("job", 0.3, 3.0, 0.05, 0, None, None, True, 0.0),
        ),
        (),
    ),
    rates=(1.001, 1.001),
    faults=(Fault("msg", 1, 9.0, 0.0, "drop_request"),),
    delay=(0.0005, 0.005),
    socket_timeout=5.0,
    celery=CeleryOptions(
        ttl=0.3,
        on_lost="fail",
        skip_as="failure",
        ignore_result=False,
        wait_timeout=3.0,
        retry_countdown=0.05,
        lock_unavailable="retry",
        peers=True,
        broker="rabbitmq",
        visibility_timeout=3.0,
    ),
)


#: Found by the long run (``generate(7187)``, shrunk): a worker running a ``lock_on="both"``
#: message is killed; RabbitMQ redelivers it to client3 at once, whose copy meets its own
#: task id and watches the dead run's lock. client3's wall clock jumps 1 s ahead 300 ms
#: before that lock expires: the watch read the holder's wall-clock expiry as moved on (a
#: renewal: alive), refused the copy, and the message was lost. The watch now keeps its
#: times on the monotonic clock.
CELERY_REDELIVERY_WATCH_WALL_JUMP = Scenario(
    seed=7187,
    protocol="celery-both",
    programs=(
        (Iteration("job", 2.0, 0.01, 8.0, 0, None, None, True, 0.0),),
        (Iteration("job", 2.0, 0.0, 2.0, 0, None, None, True, 0.0),),
        (),
        (),
    ),
    rates=(1.001, 1.001, 1.001, 1.0001),
    faults=(Fault("kill", 2, 1.1216365916314885), Fault("wall_jump", 3, 2.5126298679661137, 1.0)),
    delay=(0.001, 0.05),
    socket_timeout=1.0,
    celery=CeleryOptions(
        lock_on="both",
        ttl=2.0,
        on_lost="ignore",
        acks_late=True,
        ignore_result=False,
        wait_timeout=3.0,
        max_retries=5,
        lock_unavailable="retry",
        broker="rabbitmq",
        visibility_timeout=3.0,
        publishers=2,
        concurrency=2,
    ),
)


@pytest.mark.parametrize(
    "scenario",
    [
        CELERY_DEAD_RUN_RENEWED_BEFORE_IT_DIED,
        CELERY_REDELIVERY_WATCH_WALL_JUMP,
        CELERY_DEAD_HOLDER_MET_AGAIN_AFTER_ITS_WATCH,
        CELERY_FAILED_TAKE_OVER_KEEPS_THE_PUBLISH_LOCK,
        CELERY_PEER_CHECK_FAILS_AFTER_THE_ACQUIRE,
    ],
    ids=lambda s: f"seed{s.seed}",
)
def test_the_celery_findings(scenario: Scenario) -> None:
    """A message whose whole worker died is run by its redelivery (the first two, and the
    wall-clock jump); a
    'both' run that could not take its publish-time lock over frees it; a peer check that
    fails after the acquire gives the lock back (the last)."""
    violation, story = sim.story(scenario)
    assert violation is None, "\n".join(story)
