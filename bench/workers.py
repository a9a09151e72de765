"""Measurement worker: one process per subject, driven by ``bench/run.py`` over stdin.

It runs under the project's ``.venv`` (task-locks, redis-py's ``Lock``) or under the
peers' venv ``bench/.peers`` (python-redis-lock, pottery, sherlock), so it imports only
the standard library and redis-py at the top; each library is imported by its adapter.

Protocol: one JSON object per line in, one per line out (``{"error": ...}`` on failure).
stdout carries nothing else; libraries log to stderr.

Every timestamp is ``time.monotonic()``: CLOCK_MONOTONIC is system-wide on Linux, so the
runner can merge the records of several processes on one time line.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import secrets
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

now = time.monotonic
ns = time.perf_counter_ns


# -- adapters: one per library, the same two calls ------------------------------------


class Adapter:
    """``acquire()`` blocks until the lock is ours; ``release()`` frees it."""

    library = "?"
    client: Any = None  # a raw redis-py client on the same server, for the floor
    lock: Any = None
    make_lock: Callable[[str], Any]  # the library's lock object for another name

    def acquire(self) -> None:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def versions(self) -> dict[str, str]:
        return {}

    def wakeups(self) -> int | None:
        """Background thread wake-ups so far (``None``: the library has no such threads)."""
        return None


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def _redis_versions() -> dict[str, str]:
    return {"redis-py": _version("redis"), "hiredis": _version("hiredis")}


class TaskLocks(Adapter):
    """Ours, with its defaults (the lease joins the renewal watchdog)."""

    library = "task-locks"

    def __init__(self, url: str, name: str, ttl: float, renew: bool = True) -> None:
        from task_locks import Lock, get_backend

        self.backend = get_backend(url)
        self.client = getattr(self.backend, "client", None)
        self.make_lock = lambda name: Lock(name, ttl=ttl, backend=self.backend, renew=renew)
        self.lock = self.make_lock(name)
        self.lease: Any = None

    def acquire(self) -> None:
        self.lease = self.lock.acquire()

    def release(self) -> None:
        self.lease.release()

    def versions(self) -> dict[str, str]:
        return {"task-locks": _version("task-locks"), **_redis_versions()}

    def wakeups(self) -> int | None:
        """The deadline watch's and the renewal lanes' thread wake-ups so far."""
        from task_locks import watchdog

        lanes = watchdog.thread_renewer().lanes.all()
        return watchdog.deadline_watch().wakeups + sum(lane.wakeups for lane in lanes)


class RedisPyLock(Adapter):
    """redis-py's own ``Lock`` with its default settings (blocking, sleep=0.1)."""

    library = "redis-py Lock"

    def __init__(self, url: str, name: str, ttl: float) -> None:
        import redis

        self.client = redis.Redis.from_url(url)
        self.make_lock = lambda name: self.client.lock(name, timeout=ttl)
        self.lock = self.make_lock(name)

    def acquire(self) -> None:
        self.lock.acquire()

    def release(self) -> None:
        self.lock.release()

    def versions(self) -> dict[str, str]:
        return _redis_versions()


class FencedFloor(Adapter):
    """Not a library: the floor of a fenced, resend-safe cycle (``common.FLOOR_ACQUIRE``
    and ``FLOOR_RELEASE``), sent by redis-py's ``evalsha`` as its own ``Lock`` sends its
    release."""

    library = "floor: fenced cycle, no lock code"

    def __init__(self, url: str, name: str, ttl: float) -> None:
        import redis
        from common import FLOOR_ACQUIRE, FLOOR_RELEASE, floor_acquire_args, floor_owner

        self.client = redis.Redis.from_url(url)
        self.ttl_ms = int(ttl * 1000)
        self.acquire_sha = self.client.script_load(FLOOR_ACQUIRE)
        self.release_sha = self.client.script_load(FLOOR_RELEASE)
        self.owner = floor_owner()
        self.make_lock = lambda name: name
        self.lock = name
        self.count = 0  # the release ids
        self.token = ""
        self.acquire_args = floor_acquire_args

    def acquire(self) -> None:
        self.count += 1
        self.token = secrets.token_hex(16)  # as ours: 16 random bytes per acquire
        args = self.acquire_args(self.lock, self.token, self.ttl_ms, self.owner)
        if not self.client.evalsha(self.acquire_sha, *args):
            raise RuntimeError(f"fenced floor: {self.lock!r} is held")

    def release(self) -> None:
        if not self.client.evalsha(self.release_sha, 1, self.lock, self.token, self.count):
            raise RuntimeError(f"fenced floor: {self.lock!r} was not held")

    def versions(self) -> dict[str, str]:
        return _redis_versions()


class _OnLoop(Adapter):
    """An asyncio library's calls, each run to its end on one event loop the adapter
    keeps: both asyncio subjects pay the same loop overhead per call."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, call: Any) -> Any:
        return self.loop.run_until_complete(call)


class TaskLocksAsync(_OnLoop):
    """Ours in asyncio: ``AsyncLock`` with its defaults (the lease renewed by a task)."""

    library = "task-locks AsyncLock"

    def __init__(self, url: str, name: str, ttl: float) -> None:
        super().__init__()
        from task_locks import AsyncLock, get_backend

        self.backend = get_backend(url)
        self.client = getattr(self.backend, "client", None)  # sync, for the floor
        self.make_lock = lambda name: AsyncLock(name, ttl=ttl, backend=self.backend)
        self.lock = self.make_lock(name)
        self.lease: Any = None

    def acquire(self) -> None:
        self.lease = self.run(self.lock.acquire())

    def release(self) -> None:
        self.run(self.lease.release())

    def versions(self) -> dict[str, str]:
        return {"task-locks": _version("task-locks"), **_redis_versions()}


class RedisPyAsyncLock(_OnLoop):
    """redis-py's asyncio ``Lock`` with its default settings."""

    library = "redis.asyncio Lock"

    def __init__(self, url: str, name: str, ttl: float) -> None:
        super().__init__()
        import redis
        import redis.asyncio

        self.client = redis.Redis.from_url(url)  # sync, for the floor
        self.aclient = redis.asyncio.Redis.from_url(url)
        self.make_lock = lambda name: self.aclient.lock(name, timeout=ttl)
        self.lock = self.make_lock(name)

    def acquire(self) -> None:
        self.run(self.lock.acquire())

    def release(self) -> None:
        self.run(self.lock.release())

    def versions(self) -> dict[str, str]:
        return _redis_versions()


class PythonRedisLock(Adapter):
    """python-redis-lock: BLPOP on a signal key hands the lock to a waiter."""

    library = "python-redis-lock"

    def __init__(self, url: str, name: str, ttl: float) -> None:
        import redis
        import redis_lock

        self.client = redis.Redis.from_url(url)
        self.make_lock = lambda name: redis_lock.Lock(self.client, name, expire=int(max(1, ttl)))
        self.lock = self.make_lock(name)

    def acquire(self) -> None:
        self.lock.acquire()

    def release(self) -> None:
        self.lock.release()

    def versions(self) -> dict[str, str]:
        return {"python-redis-lock": _version("python-redis-lock"), **_redis_versions()}


class Pottery(Adapter):
    """pottery's ``Redlock`` on one master (its defaults otherwise)."""

    library = "pottery Redlock"

    def __init__(self, url: str, name: str, ttl: float) -> None:
        import redis
        from pottery import Redlock

        self.client = redis.Redis.from_url(url)
        self.make_lock = lambda name: Redlock(
            key=name, masters={self.client}, auto_release_time=ttl
        )
        self.lock = self.make_lock(name)

    def acquire(self) -> None:
        if not self.lock.acquire():
            raise RuntimeError("pottery: blocking acquire returned False")

    def release(self) -> None:
        self.lock.release()

    def versions(self) -> dict[str, str]:
        return {"pottery": _version("pottery"), **_redis_versions()}


class Sherlock(Adapter):
    """sherlock's ``RedisLock`` (its defaults: retry every 0.1 s)."""

    library = "sherlock"

    def __init__(self, url: str, name: str, ttl: float) -> None:
        import redis
        import sherlock

        self.client = redis.Redis.from_url(url)
        self.make_lock = lambda name: sherlock.RedisLock(
            name, client=self.client, expire=int(max(1, ttl)), timeout=60
        )
        self.lock = self.make_lock(name)

    def acquire(self) -> None:
        if not self.lock.acquire():
            raise RuntimeError("sherlock: blocking acquire returned False")

    def release(self) -> None:
        self.lock.release()

    def versions(self) -> dict[str, str]:
        return {"sherlock": _version("sherlock"), **_redis_versions()}


ADAPTERS: dict[str, Callable[..., Adapter]] = {
    "task-locks": TaskLocks,
    "task-locks-norenew": lambda url, name, ttl: TaskLocks(url, name, ttl, renew=False),
    # The opt-out client hand-off (handoff=client): a release wakes a waiter, which acquires
    # again (the default is the server hand-off: the release grants the lock inside Redis).
    "task-locks-client": lambda url, name, ttl: TaskLocks(
        url + ("&" if "?" in url else "?") + "handoff=client", name, ttl
    ),
    "redis-py": RedisPyLock,
    "fenced-floor": FencedFloor,
    "task-locks-async": TaskLocksAsync,
    "redis-py-async": RedisPyAsyncLock,
    "python-redis-lock": PythonRedisLock,
    "pottery": Pottery,
    "sherlock": Sherlock,
}


# -- measurements ------------------------------------------------------------------------


def cycles(adapter: Adapter, n: int, max_seconds: float | None = None) -> dict[str, Any]:
    """Up to ``n`` uncontended acquire+release cycles (fewer if ``max_seconds`` runs out).

    Nanoseconds per cycle and per half, and this process's CPU time over all of them
    (user + system: the client's share of the cost, including its socket calls).
    """
    acq: list[int] = []
    rel: list[int] = []
    stop = None if max_seconds is None else now() + max_seconds
    woken = adapter.wakeups()
    gc.disable()  # a collection inside one sample is the runtime's noise, not the lock's
    cpu = time.process_time_ns()
    try:
        for _ in range(n):
            t0 = ns()
            adapter.acquire()
            t1 = ns()
            adapter.release()
            t2 = ns()
            acq.append(t1 - t0)
            rel.append(t2 - t1)
            if stop is not None and now() > stop:
                break
    finally:
        cpu = time.process_time_ns() - cpu
        gc.enable()
    after = adapter.wakeups()
    return {
        "cycle": [a + r for a, r in zip(acq, rel, strict=True)],
        "acq": acq,
        "rel": rel,
        "cpu": [cpu, len(acq)],
        # [thread wake-ups, cycles] (deadline watch + renewal lanes; absent for peers)
        **({} if woken is None or after is None else {"wakeups": [after - woken, len(acq)]}),
    }


def floor(adapter: Adapter, n: int) -> dict[str, list[int]]:
    """Raw round trips on the adapter's own client: the physical limit of one call."""
    client = adapter.client
    if client is None:
        return {}
    ping: list[int] = []
    set_: list[int] = []
    gc.disable()
    try:
        for i in range(n):
            t0 = ns()
            client.ping()
            t1 = ns()
            client.set("bench:floor", i)
            t2 = ns()
            ping.append(t1 - t0)
            set_.append(t2 - t1)
    finally:
        gc.enable()
    return {"ping": ping, "set": set_}


def contend(
    adapter: Adapter, start: float, end: float, hold: float, out: float
) -> list[list[float]]:
    """Loop acquire / hold / release / work-outside between ``start`` and ``end``.

    Each record is ``[asked, acquired, releasing]`` on the shared monotonic clock;
    ``releasing`` is taken just before ``release()`` (the end of the useful hold).
    """
    records: list[list[float]] = []
    pause = start - now()
    if pause > 0:
        time.sleep(pause)
    while True:
        asked = now()
        if asked >= end:
            break
        adapter.acquire()
        got = now()
        if hold:
            time.sleep(hold)
        releasing = now()
        adapter.release()
        records.append([asked, got, releasing])
        if out:
            time.sleep(out)
    return records


def renewal(url: str, leases: int, ttl: float, periods: float) -> dict[str, Any]:
    """``leases`` live leases in this process, renewed by the real watchdog thread.

    Reports the watchdog thread's CPU per renewal round (a round = every lease renewed
    once), the ``renew_many`` calls (round trips) per round, what Redis ran per round,
    and the traced memory each held lease costs. Memory is measured first, on leases
    with a long TTL (so no renewal runs meanwhile; they stay held and are never due in
    the window); the renewal figures come from ``leases`` more with ``ttl``.
    """
    import tracemalloc

    import redis

    from task_locks import Lock, get_backend
    from task_locks.watchdog import thread_renewer

    backend: Any = get_backend(url)
    # (leases sent, seconds, leases renewed) per call, noted as the call returns: the
    # window's renewals are counted from the same calls as its round trips (a lease's
    # own count moves a moment later, after a call that may have returned before the
    # window opened).
    calls: list[tuple[int, float, int]] = []
    original = backend.renew_many

    def counted(items: Any, **options: Any) -> Any:  # counts without changing behaviour
        t0 = time.perf_counter()
        renewed = 0
        try:
            answers = original(items, **options)
            renewed = sum(1 for ok in answers if ok)
            return answers
        finally:
            calls.append((len(items), time.perf_counter() - t0, renewed))

    backend.renew_many = counted
    raw = redis.Redis.from_url(url)

    parked = [Lock(f"bench:mem:{leases}:{i}", ttl=3600, backend=backend) for i in range(leases)]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    kept = [lock.acquire() for lock in parked]
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    locks = [Lock(f"bench:renew:{leases}:{i}", ttl=ttl, backend=backend) for i in range(leases)]
    setup_start = now()
    held = [lock.acquire() for lock in locks]
    setup = now() - setup_start
    time.sleep(ttl / 3)  # at least one full round before the window opens
    thread = thread_renewer().lanes.get(held[0], asynchronous=False).thread  # this lane's
    if thread is None or thread.ident is None:
        raise RuntimeError("the renewal thread is not running")
    clock = time.pthread_getcpuclockid(thread.ident)

    def snapshot() -> tuple[float, int, int, float, float]:
        stats = raw.info("commandstats")
        cpu = raw.info("cpu")
        return (
            time.clock_gettime(clock),
            len(calls),
            sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info"),
            float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
            time.process_time(),
        )

    before = snapshot()
    time.sleep(periods * ttl / 3)
    after = snapshot()
    window = calls[before[1] : after[1]]
    renewed = sum(count for _, _, count in window)
    rounds = renewed / leases
    lost = sum(1 for lease in held + kept if lease.lost.is_set())
    if rounds <= 0:
        raise RuntimeError(f"no renewal round completed in the window ({renewed} renewals)")
    return {
        "leases": leases,
        "ttl": ttl,
        "setup_s": setup,
        "rounds": rounds,
        "cpu_per_round_s": (after[0] - before[0]) / rounds,
        "process_cpu_per_round_s": (after[4] - before[4]) / rounds,
        "calls_per_round": (after[1] - before[1]) / rounds,
        "server_commands_per_round": (after[2] - before[2]) / rounds,
        "server_cpu_per_round_s": (after[3] - before[3]) / rounds,
        "batch_sizes": [size for size, _, _ in window],
        "batch_seconds": [seconds for _, seconds, _ in window],
        "memory_per_lease": (current - base) / leases,
        "peak_memory_per_lease": (peak - base) / leases,
        "lost": lost,
    }


# -- the wake-up floor: how long a push takes to wake a process blocked on the list ------


#: Seconds a process blocked in BLPOP waits for a push (the ring's: beyond its run's
#: length), with no socket timeout to race it (redis-py 8's default is 5 s): long enough
#: for a process that the machine's load starts late (CI's smoke run once had a ring
#: member's 5 s read time out).
RING_PATIENCE = 20.0


def wake_pop(url: str, key: str, n: int, timeout: float = RING_PATIENCE) -> dict[str, Any]:
    """Block on ``key`` ``n`` times; each value is the pusher's CLOCK_MONOTONIC (ns, one
    clock for every process), so ``now - value`` is the push-to-wake-up latency."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=None)  # each BLPOP bounds itself
    latencies: list[int] = []
    for _ in range(n):
        got = client.blpop([key], timeout)
        if got is None:
            break
        latencies.append(ns() - int(got[1]))
    client.close()
    return {"wakeup": latencies}


def wake_push(url: str, key: str, n: int, gap: float) -> dict[str, Any]:
    """``n`` pushes, ``gap`` seconds apart (the popper is blocked again by then), and as
    many PINGs from this process, unpinned as the contention runs are."""
    import redis

    client = redis.Redis.from_url(url)
    pings: list[int] = []
    for _ in range(n):
        t0 = ns()
        client.ping()
        pings.append(ns() - t0)
        time.sleep(gap)
        client.lpush(key, ns())
    client.close()
    return {"ping": pings}


def ready(url: str) -> dict[str, Any]:
    """Import redis-py and reach the server, so that a timed run that follows starts
    with no process still loading (a slow start under load once outlasted the ring's
    BLPOP timeouts: every member gave up before the token reached it)."""
    import redis

    client = redis.Redis.from_url(url)
    client.ping()
    client.close()
    return {"pid": os.getpid()}


def ring(url: str, members: int, index: int, start_at: float, seconds: float) -> dict[str, Any]:
    """One member of a ring of processes passing one token by LPUSH and BLPOP, with no
    lock code: the most hand-offs a second any design can make where each hand-off
    wakes a blocked process, on this machine and with this many processes. From
    ``start_at`` (CLOCK_MONOTONIC, one clock for every process) for ``seconds``; member
    0 pushes the token first; the member holding it at the end passes it on and stops,
    and so does each after it."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=None)  # each BLPOP bounds itself
    mine, following = f"bench:ring:{index}", f"bench:ring:{(index + 1) % members}"
    while now() < start_at:
        time.sleep(min(0.01, max(0.0, start_at - now())))
    end, passes = start_at + seconds, 0
    if index == 0:
        client.lpush(following, 1)
    while client.blpop([mine], seconds + RING_PATIENCE) is not None:
        passes += 1
        client.lpush(following, 1)
        if now() >= end:
            break
    client.close()
    return {"passes": passes}


def lasting_keys(admin: Any) -> int:
    """How many keys of ``admin``'s database outlive 60 s (no expiry, or a longer one)."""
    lasting = 0
    for key in admin.scan_iter(count=1000):
        pttl = admin.pttl(key)
        lasting += pttl == -1 or pttl > 60_000
    return lasting


def footprint(adapter: Adapter, url: str, n: int, live: int) -> dict[str, Any]:
    """What this library leaves in Redis (its own database, flushed first).

    ``live`` locks held at once: bytes (``used_memory``) and keys each. Then ``n``
    acquire+release cycles, each of a name of its own: the keys and bytes left right
    after, and how many of those keys outlive 60 s (no expiry, or a longer one).
    """
    import redis

    admin = redis.Redis.from_url(url)

    def used() -> int:
        return int(admin.info("memory")["used_memory"])

    # A first cycle opens the library's connections and loads its scripts: their memory
    # (a connection's buffers are kilobytes) is not the locks'.
    adapter.lock = adapter.make_lock("bench:fp:warm-up")
    adapter.acquire()
    adapter.release()
    admin.flushdb()
    base = used()
    held = []
    for i in range(live):
        adapter.lock = adapter.make_lock(f"bench:fp:live:{i}")
        adapter.acquire()
        held.append(adapter.lock)
    live_bytes, live_keys = (used() - base) / live, admin.dbsize() / live
    key_chars, value_bytes = stored_sizes(admin)
    for lock in held:
        adapter.lock = lock
        adapter.release()
    admin.flushdb()
    base = used()
    for i in range(n):
        adapter.lock = adapter.make_lock(f"bench:fp:{i}")
        adapter.acquire()
        adapter.release()
    left_bytes, left_keys = used() - base, admin.dbsize()
    lasting = lasting_keys(admin)
    admin.flushdb()
    return {
        "live_bytes_per_lock": live_bytes,
        "live_keys_per_lock": live_keys,
        # What one live lock stores, by its keys' names and string values (the target's
        # reason when ours costs more memory than a peer's).
        "live_key_chars_per_lock": key_chars / live,
        "live_value_bytes_per_lock": value_bytes / live,
        "cycles": n,
        "left_keys": left_keys,
        "left_bytes": left_bytes,
        "left_keys_beyond_60s": lasting,
    }


def record_floor(url: str, live: int, ttl: float) -> dict[str, Any]:
    """The least a live lock that names its holder and its fence can cost in Redis here.

    ``live`` keys named as python-redis-lock names them (``lock:<name>``), each a string
    holding only a token (16 random bytes, base64: 22 characters), a fence (the server's
    time in µs) and the owner in its shortest form (``host|pid|thread``), expiring as a
    lease does. Nothing else: no acquire time, waiter count or release id, no prefix of
    our own. Measured as :func:`footprint` measures a live lock (``used_memory``).
    """
    import base64
    import socket
    import threading

    import redis

    admin = redis.Redis.from_url(url)
    admin.flushdb()
    base = int(admin.info("memory")["used_memory"])
    owner = f"{socket.gethostname()}|{os.getpid()}|{threading.current_thread().name}"
    pipe = admin.pipeline(transaction=False)
    for i in range(live):
        token = base64.b64encode(os.urandom(16)).rstrip(b"=").decode()
        fence = time.time_ns() // 1000
        pipe.set(f"lock:bench:fp:live:{i}", f"{token}|{fence}|{owner}", px=int(ttl * 1000))
    pipe.execute()
    used = (int(admin.info("memory")["used_memory"]) - base) / live
    key_chars, value_bytes = stored_sizes(admin)
    admin.flushdb()
    return {
        "live_bytes_per_lock": used,
        "live_key_chars_per_lock": key_chars / live,
        "live_value_bytes_per_lock": value_bytes / live,
    }


def stored_sizes(admin: Any) -> tuple[int, int]:
    """The database's key names' length and its string values' bytes, summed (values of
    other types are not counted: every lock here keeps a string while it is held)."""
    keys = list(admin.scan_iter(count=1000))
    pipe = admin.pipeline(transaction=False)
    for key in keys:
        pipe.strlen(key)
    lengths = pipe.execute(raise_on_error=False)
    return sum(len(k) for k in keys), sum(n for n in lengths if isinstance(n, int))


# -- the command loop --------------------------------------------------------------------


def serve() -> None:
    adapter: Adapter | None = None
    out = sys.stdout
    sys.stdout = sys.stderr  # a library's stray print must not corrupt the protocol
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        try:
            if op == "quit":
                break
            if op == "setup":
                adapter = ADAPTERS[request["adapter"]](
                    request["url"], request["name"], request["ttl"]
                )
                reply: Any = {
                    "pid": os.getpid(),
                    "python": sys.version.split()[0],
                    "versions": adapter.versions(),
                }
            elif op == "renewal":
                reply = renewal(**request)
            elif op == "wake_pop":
                reply = wake_pop(**request)
            elif op == "wake_push":
                reply = wake_push(**request)
            elif op == "ready":
                reply = ready(**request)
            elif op == "record_floor":
                reply = record_floor(**request)
            elif op == "ring":
                reply = ring(**request)
            else:
                assert adapter is not None, "setup first"
                if op == "cycles":
                    reply = cycles(adapter, **request)
                elif op == "floor":
                    reply = floor(adapter, request["n"])
                elif op == "footprint":
                    reply = footprint(adapter, **request)
                elif op == "contend":
                    reply = {"records": contend(adapter, **request)}
                else:
                    raise ValueError(f"unknown op {op!r}")
        except Exception:
            reply = {"error": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    # Leases still registered with the watchdog die with the process: nothing to clean.


if __name__ == "__main__":
    serve()
