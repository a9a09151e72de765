"""HA Celery beat: only the leader sends, hand-over within one TTL, no tick sent twice.

Messages are counted where Celery leaves them: the Redis broker's ``celery`` list (no
worker consumes them), each with the ``task_locks_*`` headers the leader stamped.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from beat_driver import drive_beat
from celery import Celery
from celery.beat import PersistentScheduler, Scheduler
from procs import output
from servers import wait_until

from task_locks import Election, InvalidArgument, LockError, notices
from task_locks.celery.beat import (
    TERM_HEADER,
    TICK_HEADER,
    LeaderScheduler,
    beat_tick,
    leader_scheduler,
)

HERE = Path(__file__).resolve().parent
CELERY = Path(sys.executable).with_name("celery")


def broker_of(redis_url: str) -> str:
    return redis_url.rsplit("/", 1)[0] + "/1"


def sent_ticks(broker: str) -> list[tuple[int, int, dict[str, Any]]]:
    """``(tick ms, term, headers)`` of every message in the queue, by tick."""
    client = redis.Redis.from_url(broker)
    found = []
    for raw in client.lrange("celery", 0, -1):
        headers = json.loads(raw)["headers"]
        found.append((int(headers[TICK_HEADER].rsplit("@", 1)[1]), headers[TERM_HEADER], headers))
    client.close()
    return sorted(found, key=lambda item: item[0])


def make_app(redis_url: str, election: str, ttl: float = 2.0, period: float = 0.5) -> Celery:
    app = Celery("beat_unit", broker=broker_of(redis_url), set_as_current=False)
    app.conf.update(
        beat_schedule={"often": {"task": "beat_unit.often", "schedule": period}},
        task_locks_beat_ttl=ttl,
        task_locks_beat_backend=redis_url,
        task_locks_beat_election=election,
        broker_connection_retry_on_startup=True,
    )
    return app


def run_until(scheduler: Any, predicate: Any, timeout: float) -> None:
    """Drive ``scheduler`` the way ``celery beat`` does, until ``predicate()``."""
    drive_beat(scheduler, predicate, timeout, "the scheduler did not get there", nap=0.2)


def test_only_the_leader_sends_and_a_clean_shutdown_hands_over_at_once(
    redis_url: str, tmp_path: Path
) -> None:
    app = make_app(redis_url, f"beat-{uuid.uuid4().hex[:6]}")
    broker = broker_of(redis_url)
    first = LeaderScheduler(app=app, schedule_filename=str(tmp_path / "first"))
    second = LeaderScheduler(app=app, schedule_filename=str(tmp_path / "second"))
    try:
        run_until(first, lambda: len(sent_ticks(broker)) >= 2, 5)
        assert first.leadership is not None
        assert second.tick() == 0  # waited up to a second as a candidate, sent nothing
        assert second.leadership is None
        count = len(sent_ticks(broker))

        first.close()  # resigns
        started = time.monotonic()
        run_until(second, lambda: second.leadership is not None, 3)
        # At once: the resignation freed the name for the next tick's campaign, rather than
        # the 2 s TTL running out (0.51 s once, on a loaded machine).
        assert time.monotonic() - started < 0.9
        run_until(second, lambda: len(sent_ticks(broker)) >= count + 2, 5)
    finally:
        first.close()
        second.close()

    ticks = sent_ticks(broker)
    ids = [headers[TICK_HEADER] for *_, headers in ticks]
    assert len(ids) == len(set(ids)), f"a tick was sent twice: {ids}"
    steps = {b[0] - a[0] for a, b in itertools.pairwise(ticks)}
    assert steps <= {500, 1000}, f"ticks off the 0.5 s grid or missing: {ids}"
    terms = [term for _, term, _ in ticks]
    assert terms == sorted(terms) and len(set(terms)) == 2


def test_a_deposed_leader_cannot_resend_the_same_tick(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A zombie is a leader that has not heard it was deposed (paused, or its release
    # notice lost): in this one process it would hear at once, so notices are off.
    monkeypatch.setattr(notices, "listen", lambda lease: None)
    app = make_app(redis_url, f"beat-{uuid.uuid4().hex[:6]}", period=5)
    broker = broker_of(redis_url)
    zombie = LeaderScheduler(app=app, schedule_filename=str(tmp_path / "zombie"))
    heir = LeaderScheduler(app=app, schedule_filename=str(tmp_path / "heir"))
    try:
        zombie.tick()
        assert zombie.leadership is not None
        entry = zombie.schedule["often"]
        zombie.apply_async(entry, advance=False)
        # The zombie pauses; an operator (or its TTL) ends its term and the heir leads...
        zombie.election.backend.force_release(zombie.election.lock_name)
        heir.tick()
        assert heir.leadership is not None
        assert heir.leadership.term > zombie.leadership.term
        # ...then both send the entry's current tick: the zombie still believes it leads.
        assert zombie.leadership.held
        assert zombie.apply_async(entry, advance=False) is None
        assert heir.apply_async(heir.schedule["often"], advance=False) is None
    finally:
        zombie.close()
        heir.close()
    ticks = sent_ticks(broker)
    assert len(ticks) == 1
    tick = beat_tick(ticks[0][2])
    assert tick is not None and tick.term == ticks[0][1]
    assert tick.election == zombie.election.name and tick.tick.startswith("often@")


def test_the_wrapped_scheduler_can_be_named(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(redis_url, "named")
    plain = LeaderScheduler(app=app, lazy=True)
    assert isinstance(plain, PersistentScheduler)
    assert "leader election -> named (ttl 2s)" in plain.info

    monkeypatch.setenv("TASK_LOCKS_BEAT_SCHEDULER", "celery.beat:Scheduler")
    from_env = LeaderScheduler(app=app, lazy=True)
    assert type(from_env) is leader_scheduler(Scheduler)
    assert not isinstance(from_env, PersistentScheduler)
    assert from_env.election.name == "named"

    app.conf.task_locks_beat_scheduler = "default"  # the Celery setting wins over the env
    assert isinstance(LeaderScheduler(app=app, lazy=True), PersistentScheduler)
    with pytest.raises(LockError, match="not a Celery beat scheduler"):
        leader_scheduler("task_locks:Lock")
    app.conf.task_locks_beat_ttl = "soon"
    with pytest.raises(InvalidArgument, match="task_locks_beat_ttl must be a number"):
        LeaderScheduler(app=app, lazy=True)
    app.conf.task_locks_beat_ttl = 0
    with pytest.raises(InvalidArgument, match="ttl"):
        LeaderScheduler(app=app, lazy=True)


def test_beat_tick_reads_request_attributes() -> None:
    class Request:
        task_locks_election = "beat"
        task_locks_term = "7"
        task_locks_tick = "often@1000"
        headers = None

    assert beat_tick(Request()) == beat_tick(
        {"task_locks_election": "beat", "task_locks_term": 7, "task_locks_tick": "often@1000"}
    )
    assert beat_tick({"headers": {}}) is None
    assert (
        beat_tick({"task_locks_election": "b", "task_locks_term": "x", "task_locks_tick": "t"})
        is None
    )


# -- two `celery beat` processes, the leader SIGKILLed half-way ------------------------------


def start_beat(redis_url: str, election: str, ttl: float, tmp: Path, n: int) -> Any:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parents[1])]),
        BEAT_TEST_BROKER=broker_of(redis_url),
        BEAT_TEST_LOCKS=redis_url,
        BEAT_TEST_ELECTION=election,
        BEAT_TEST_TTL=str(ttl),
    )
    command = [str(CELERY), "-A", "beat_app", "beat", "-l", "INFO"]
    command += ["-S", "task_locks.celery.beat:LeaderScheduler", "-s", str(tmp / f"beat-{n}")]
    return subprocess.Popen(
        command, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


@pytest.mark.slow
def test_two_beat_processes_leader_killed_half_way(redis_url: str, tmp_path: Path) -> None:
    election, ttl, half = f"beat-{uuid.uuid4().hex[:6]}", 3.0, 6
    broker = broker_of(redis_url)
    observer = Election(election, backend=redis_url)
    beats = [start_beat(redis_url, election, ttl, tmp_path, n) for n in range(2)]
    try:
        wait_until(lambda: len(sent_ticks(broker)) >= half, 20, f"{half} ticks", alive=beats)
        leader = observer.leader()
        assert leader is not None
        victim = next(b for b in beats if leader.identity.endswith(f":{b.pid}"))
        survivor = next(b for b in beats if b is not victim)
        victim.send_signal(signal.SIGKILL)
        killed_at = time.time()
        successor = wait_until(
            lambda: (info := observer.leader()) is not None and info.term > leader.term and info,
            ttl + 3,
            "the surviving beat to lead",
        )
        assert successor.identity.endswith(f":{survivor.pid}")
        assert successor.since is not None
        handover = successor.since - killed_at
        assert handover <= ttl + 0.5, f"the survivor took over after {handover:.2f}s"
        wait_until(lambda: len(sent_ticks(broker)) >= 2 * half, 20, f"{2 * half} ticks")
        survivor.send_signal(signal.SIGTERM)
        assert survivor.wait(15) == 0, output(survivor)
    finally:
        for beat in beats:
            if beat.poll() is None:
                beat.kill()
            beat.wait(10)
            if sys.exc_info()[0] is not None:  # shown by pytest with the failure
                print(f"--- beat {beat.pid} ---\n{output(beat)}")
            beat.stdout.close()

    ticks = sent_ticks(broker)
    seen = [(tick % 100_000, term) for tick, term, _ in ticks]
    ids = Counter(headers[TICK_HEADER] for *_, headers in ticks)
    assert max(ids.values()) == 1, f"ticks sent twice: {[t for t, n in ids.items() if n > 1]}"
    gaps = [(b[0] - a[0]) // 1000 - 1 for a, b in itertools.pairwise(ticks)]
    missed = sum(gaps)
    assert missed <= ttl, f"{missed} ticks missed around the fail-over: {seen}"
    assert sum(1 for gap in gaps if gap) <= 1, f"ticks missed outside the fail-over: {seen}"
    terms = [term for _, term, _ in ticks]
    assert terms == sorted(terms), seen
    assert terms[0] == leader.term and terms[-1] == successor.term
