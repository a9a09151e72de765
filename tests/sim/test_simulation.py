"""The deterministic simulation's short form (``make sim`` runs the long one).

A few thousand seeded schedules of the real lock code (both Redis hand-off modes, every
fault kind), each checked after every step; a failure prints the seed and the story of
its shrunk schedule, replayable with ``make sim SEED=<n>``.
"""

from __future__ import annotations

import os
import time

import pytest

from . import scenario as sim
from .scenario import Fault, Iteration, Scenario

SHORT_SEEDS = int(os.environ.get("SIM_SHORT_SEEDS", "1200"))


def _story(seed: int, **options: object) -> str:
    scenario = sim.shrink(sim.generate(seed, **options))  # type: ignore[arg-type]
    violation, lines = sim.story(scenario)
    return f"seed {seed} (replay: make sim SEED={seed}): {violation}\n" + "\n".join(lines)


def test_short_form_every_schedule_holds_every_invariant() -> None:
    began = time.perf_counter()
    failing, steps, seconds = sim.explore(range(SHORT_SEEDS))
    rate = SHORT_SEEDS / seconds
    print(f"{SHORT_SEEDS} schedules, {steps} steps in {seconds:.1f} s: {rate:.0f} schedules/s")
    assert not failing, _story(failing[0])
    assert time.perf_counter() - began < 120


def test_the_short_form_covers_every_protocol_and_fault() -> None:
    scenarios = [sim.generate(seed) for seed in range(SHORT_SEEDS)]
    assert {s.protocol for s in scenarios} == set(sim.PROTOCOLS)
    kinds = {f.kind for s in scenarios for f in s.faults}
    details = {f.detail for s in scenarios for f in s.faults if f.kind == "msg"}
    assert kinds == {
        "msg", "pause", "partition", "kill", "jump", "wall_jump", "restart", "failover",
        "clock_step", "force", "lose_renew",
    }  # fmt: skip
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

    real_plan = lock_module.LockBase._plan

    def counted_from_the_reply(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        token, fence, _ = yield from real_plan(self, *args, **kwargs)
        return token, fence, lock_module.time.monotonic()

    monkeypatch.setattr(lock_module.LockBase, "_plan", counted_from_the_reply)
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
