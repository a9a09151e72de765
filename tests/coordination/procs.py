"""Child processes for the coordination tests, and helpers the tests share.

Run as ``python procs.py ROLE ARGS...``; every child writes what it saw to a Redis
(``log_url``) so the test can check it after the fact:

- ``candidate``: campaigns in a loop, logs each term it led as an interval
  ``[start, end]`` (``end`` is the last moment it had checked it still led), resigns after
  a short while (or holds on while the test sets ``<name>:hold``), until ``<name>:stop``.
- ``permits``: once ``<name>:go`` is set, takes a semaphore permit ``rounds`` times,
  counting how many are inside (INCR/DECR, the maximum kept by a script) and the
  finished rounds.
- ``hold-permit``: takes one permit, says which slot, and holds it until killed.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import redis

from task_locks import Election, LockHeld, Semaphore

# KEYS[1] inside counter, KEYS[2] highest value seen; returns the new count.
ENTER = """
local inside = redis.call('incr', KEYS[1])
if inside > tonumber(redis.call('get', KEYS[2]) or '0') then redis.call('set', KEYS[2], inside) end
return inside
"""


def expiry_slack(url: str) -> float:
    """How late past its TTL a dead holder's lock may end on this backend (documented).

    Redis expires keys to the millisecond; etcd rounds lease TTLs up to whole seconds and
    its leader checks expiry every 500 ms (see ``task_locks/backends/etcd.py``).
    """
    return 1.0 if url.startswith("etcd") else 0.5


def output(child: subprocess.Popen[bytes]) -> str:
    """What a finished child printed (for assertion messages)."""
    if child.stdout is None or child.poll() is None:
        return ""
    return child.stdout.read().decode(errors="replace")[-3000:]


def candidate(url: str, log_url: str, name: str, ttl: str) -> None:
    log = redis.Redis.from_url(log_url, decode_responses=True)
    pid = os.getpid()
    election = Election(name, ttl=float(ttl), backend=url, identity=f"candidate-{pid}")
    log.rpush(f"{name}:ready", pid)
    while not log.exists(f"{name}:stop"):
        try:
            leadership = election.campaign(timeout=0.5)
        except LockHeld:
            continue
        key = f"{name}:term:{leadership.term}"
        start = time.time()
        log.hset(key, mapping={"pid": pid, "start": repr(start), "end": repr(start)})
        log.rpush(f"{name}:terms", leadership.term)
        rotate_at = time.monotonic() + random.uniform(0.05, 0.25)
        while not log.exists(f"{name}:stop"):
            if time.monotonic() >= rotate_at and not log.exists(f"{name}:hold"):
                break
            seen = time.time()
            if not leadership.held:  # checked after `seen`: we led at least until then
                log.hset(key, "lost", repr(seen))
                break
            log.hset(key, "end", repr(seen))
            time.sleep(0.02)
        election.resign()
        time.sleep(0.03)  # let a woken candidate win the hand-over, not us again


def permits(url: str, log_url: str, name: str, limit: str, ttl: str, rounds: str) -> None:
    log = redis.Redis.from_url(log_url, decode_responses=True)
    enter = log.register_script(ENTER)
    semaphore = Semaphore(name, limit=int(limit), ttl=float(ttl), backend=url, timeout=30)
    log.incr(f"{name}:ready")
    deadline = time.monotonic() + 60
    while not log.exists(f"{name}:go"):  # all start together, so they contend
        assert time.monotonic() < deadline, "never told to go"
        time.sleep(0.01)
    for _ in range(int(rounds)):
        with semaphore as permit:
            enter(keys=[f"{name}:inside", f"{name}:max"])
            time.sleep(random.uniform(0.05, 0.15))
            permit.check()
            log.decr(f"{name}:inside")
        log.incr(f"{name}:done")


def hold_permit(url: str, log_url: str, name: str, limit: str, ttl: str) -> None:
    log = redis.Redis.from_url(log_url, decode_responses=True)
    permit = Semaphore(name, limit=int(limit), ttl=float(ttl), backend=url).acquire(timeout=10)
    log.set(f"{name}:victim-slot", permit.slot)
    while True:
        time.sleep(1)


ROLES = {"candidate": candidate, "permits": permits, "hold-permit": hold_permit}

if __name__ == "__main__":
    if sys.argv[2].startswith("django://"):
        import django

        django.setup()  # as a Django project's process would, before its first lock
    ROLES[sys.argv[1]](*sys.argv[2:])
