"""The server hand-off's waiter count at a lock's last millisecond, on the production scripts.

A record never counts fewer waiters than the server hand-off has queued (the simulation
checks it after every step: ``Checker._counted``), since a taker that finds none counted
leaves no place in line behind. A try that finds the record in its last millisecond
(PTTL 0) cannot be counted in it, so it must not be queued either. That millisecond
cannot be hit at will on a real redis-server, so this runs the scripts on the simulator's
Redis model (checked against a real server by ``test_redis_model_differential.py``)
with its clock set by hand.
"""

from __future__ import annotations

from typing import Any

import pytest

from task_locks.backends.redis import RedisBackend
from task_locks.backends.redis_scripts import SCRIPTS, record_fields
from task_locks.types import Owner

from .redis_model import RedisModel

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BACKEND = RedisBackend("redis://127.0.0.1:1/0?prefix=sim:&handoff=server")
OWNER = Owner(host="h", pid=1, thread="t")
TTL_MS = 1000
WAIT_MS = 300


class _Server:
    """The production scripts on the Redis model, with a clock set by hand (µs)."""

    def __init__(self) -> None:
        self.clock = 1_700_000_000_000_000
        self.model = RedisModel(lambda: self.clock)

    def run(self, which: str, args: list[Any]) -> Any:
        return self.model.execute(["EVAL", SCRIPTS.source[which], *args])


def test_a_try_in_the_records_last_millisecond_is_not_left_in_line() -> None:
    server = _Server()
    model, run = server.model, server.run
    key = BACKEND._key("job")

    def enqueue(token: str) -> Any:
        return run("enqueue", BACKEND._enqueue_args("job", token, TTL_MS, OWNER, WAIT_MS))

    def queued() -> list[str]:
        members = model.get_value(key + ":queue") or {}
        return [m for m in members if model.get_value(f"{key}:wait:{m}") is not None]

    def counted() -> int:
        raw = model.get_value(key)
        if raw.startswith("r"):
            return int(raw[1:].split("|", 1)[0])
        return int(record_fields(raw)["waiters"])

    assert isinstance(enqueue("holder"), int)  # taken free
    server.clock += TTL_MS * 1000  # the record's last millisecond: PTTL 0
    assert model.pttl(key) == 0
    refused = enqueue("waiter")
    assert isinstance(refused, list) and refused[0] == 0
    assert len(queued()) <= counted()
    # The holder's release in that same millisecond finds nobody counted: a tombstone.
    assert run("release_handoff", list(BACKEND._release_args("job", "holder"))) == 1
    assert len(queued()) <= counted() == 0
    # The waiter's next try takes the lock free and leaves nothing of its own queued.
    server.clock += 1000
    assert isinstance(enqueue("waiter"), int)
    assert queued() == []


def test_a_force_release_of_an_earlier_versions_record_counts_the_queue() -> None:
    """During a rolling upgrade a name may be held by an earlier version's record (a hash,
    which counts no waiters); an operator's force release hands it to the first queued
    waiter, and the record it writes counts the others still in line."""
    server = _Server()
    model, run = server.model, server.run
    key = BACKEND._key("job")
    model.execute(["HSET", key, "token", "old", "fence", "7", "owner", "{}", "acquired", "1"])
    model.execute(["PEXPIRE", key, 5000])

    for waiter in ("w1", "w2", "w3"):
        assert isinstance(
            run("enqueue", BACKEND._enqueue_args("job", waiter, TTL_MS, OWNER, WAIT_MS)), list
        )
    assert run("release_handoff", list(BACKEND._release_args("job", "", None))) == 1
    fields = record_fields(model.get_value(key))
    assert fields is not None and fields["token"] == "w1"
    assert int(fields["waiters"]) >= 2  # w2 and w3 are still in line
