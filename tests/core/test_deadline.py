"""A lease is lost at its local deadline, whatever renewal call is still in flight.

The fault is real: the chaoskit TCP proxy blackholes the link between the client and a
real redis-server, so the renewal call blocks on its socket (timeout 5 s by default)
while the server lets the lock expire. Also: each backend, and each Redis Cluster
primary, is renewed on its own, so one stalled server costs no lease elsewhere.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from chaoskit.proxy import Proxy, ProxyHub
from servers import RedisClusterNodes, RedisServer, finish, wait_until

from task_locks import AsyncLock, BackendUnavailable, Lock, LockLost, get_backend, watchdog
from task_locks.types import RenewItem

from .support import SyncDriver

ROOT = Path(__file__).resolve().parents[2]
#: How late after its local deadline a lease may be seen lost (timer wake-up, a busy box).
LOSS_BOUND = 0.3


@pytest.fixture
def hub() -> Iterator[ProxyHub]:
    proxies = ProxyHub()
    yield proxies
    proxies.close()


@pytest.fixture
def link(hub: ProxyHub, redis_server: RedisServer, redis_url: str) -> Proxy:
    """A proxy in front of the shared (flushed) Redis; the test blackholes it."""
    return hub.proxy(redis_server.port)


def proxy_url(proxy: Proxy, **options: object) -> str:
    query = "&".join(f"{k}={v}" for k, v in options.items())
    return f"redis://127.0.0.1:{proxy.port}/0" + (f"?{query}" if query else "")


def watch_until_lost(lease: Any, timeout: float) -> tuple[float, float]:
    """Poll ``lease`` until ``lost`` is set: (the last deadline seen while held, when lost)."""
    deadline = time.monotonic() + lease.remaining
    give_up = time.monotonic() + timeout
    while not lease.lost.is_set():
        now = time.monotonic()
        assert now < give_up, f"lease still not lost {timeout}s on (deadline {deadline - now:.2f}s)"
        if lease.held:
            deadline = now + lease.remaining
        time.sleep(0.005)
    return deadline, time.monotonic()


def test_lost_at_the_deadline_while_the_renewal_is_blocked(
    driver: SyncDriver, link: Proxy, redis_url: str
) -> None:
    called: list[tuple[Any, float]] = []
    if driver.mode == "async":

        async def on_lost(lease: Any) -> None:
            called.append((lease, time.monotonic()))

    else:

        def on_lost(lease: Any) -> None:
            called.append((lease, time.monotonic()))

    ttl = 1.5  # the socket timeout stays at its default 5 s: far past the TTL
    handle = driver.acquire("blackholed", backend=proxy_url(link), ttl=ttl, on_lost=on_lost)
    wait_until(lambda: handle.renewals >= 1, ttl, "a first renewal through the proxy")
    link.blackhole()
    deadline, lost_at = watch_until_lost(handle.lease, ttl + 3)
    assert lost_at - deadline < LOSS_BOUND, f"lost {lost_at - deadline:.2f}s after the deadline"
    assert not handle.held
    with pytest.raises(LockLost, match="'blackholed' was lost"):
        handle.check()
    wait_until(lambda: called, LOSS_BOUND, "on_lost at the deadline")
    assert called[0][0] is handle.lease
    assert called[0][1] - deadline < LOSS_BOUND
    assert "TTL ran out" in (handle.lost_reason or "")
    # The server let the lock go: someone else may take it now.
    assert Lock("blackholed", ttl=5, backend=redis_url).acquire(timeout=3).fence > handle.fence
    link.heal()  # whatever reply was still queued must not bring the lease back
    time.sleep(0.3)
    assert handle.lost.is_set() and not handle.held


def test_a_reply_after_the_deadline_does_not_resurrect_the_lease(
    link: Proxy, redis_url: str
) -> None:
    ttl = 1.0
    lease = Lock("late", ttl=ttl, backend=proxy_url(link), renew=False).acquire(timeout=2)
    wait_until(lambda: lease.remaining < 0.7, ttl, "the lease to be under way")
    # The renewal reaches the server at once (the lock is still ours there) and its reply
    # comes back 0.8 s later, after the lease's local deadline.
    link.latency(reply_delay=0.8)
    with pytest.raises(LockLost):
        lease.renew()
    assert lease.lost.is_set()
    assert not lease.held
    with pytest.raises(LockLost):
        lease.check()


def test_a_renewal_waiting_for_its_reply_holds_up_no_other_lease(
    driver: SyncDriver, scripted_link: Proxy
) -> None:
    """A renewal call whose reply is slow (or lost: then it waits out the validity left)
    is waited for beside the renewal lane, not on it: a lease of the same backend taken
    meanwhile, with a shorter TTL, is renewed on time. (The lane used to wait for the call
    first, and the short lease ran out behind it.)"""
    url = proxy_url(scripted_link)
    slow = driver.acquire("slow-reply", backend=url, ttl=3)  # renewed about 1 s on
    scripted_link.hold_next_reply(1.8)
    wait_until(lambda: not scripted_link.holds_pending(), 3, "the renewal's reply to be held")
    short = driver.acquire("short-ttl", backend=url, ttl=0.6)  # renewed every 0.2 s
    wait_until(lambda: short.renewals >= 3 or short.lost.is_set(), 2, "three renewals")
    assert short.held, short.lost_reason
    short.release()
    slow.release()


def test_a_renewal_call_waits_no_longer_than_the_validity_left(link: Proxy, redis_url: str) -> None:
    backend = get_backend(proxy_url(link))
    lease = Lock("bounded", ttl=10, backend=backend, renew=False).acquire(timeout=2)
    link.blackhole()
    started = time.monotonic()
    with pytest.raises(BackendUnavailable):
        backend.renew_many([RenewItem("bounded", lease.token, 10_000)], timeout=0.4)
    took = time.monotonic() - started
    assert took < 1.0, f"the call waited {took:.2f}s, not the 0.4 s it was given"
    link.heal()
    # The pool still works, with its own timeout, after the bounded call.
    assert backend.renew_many([RenewItem("bounded", lease.token, 10_000)]) == [True]
    lease.release()


# -- task-locks run -------------------------------------------------------------------

HEARTBEAT = (
    "import sys, time\n"
    "with open(sys.argv[1], 'a') as f:\n"
    "    while True:\n"
    "        f.write(f'{time.time()}\\n'); f.flush(); time.sleep(0.02)\n"
)


def task_locks_cli(url: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, TASK_LOCKS_URL=url)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-m", "task_locks.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@contextmanager
def cut_off_while_running(
    link: Proxy, redis_url: str, name: str, ttl: float, program: str, beats: Path, second_ran: Path
) -> Iterator[tuple[subprocess.Popen[str], float, subprocess.Popen[str]]]:
    """``task-locks run NAME`` of ``program`` (writing to ``beats``) through the proxy;
    once it beats, the link is blackholed and a second ``run`` of NAME, on the server
    directly, waits to write its start time to ``second_ran``. Yields (the first run, when
    the link went, the second run); kills whichever still runs at the end."""
    first = task_locks_cli(
        proxy_url(link), "run", name, "--ttl", str(ttl), "--",
        sys.executable, "-c", program, str(beats),
    )  # fmt: skip
    second: subprocess.Popen[str] | None = None
    try:
        wait_until(
            lambda: beats.exists() and beats.stat().st_size, 15, "the first program", alive=[first]
        )
        link.blackhole()
        blackholed = time.time()
        second = task_locks_cli(
            redis_url, "run", name, "--wait", "30", "--",
            sys.executable, "-c", f"import time; open({str(second_ran)!r}, 'w').write(str(time.time()))",
        )  # fmt: skip
        yield first, blackholed, second
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_run_stops_its_program_before_the_deadline(
    link: Proxy, redis_url: str, tmp_path: Path
) -> None:
    beats, second_ran = tmp_path / "beats", tmp_path / "second"
    ttl = 2.0
    runs = cut_off_while_running(link, redis_url, "nightly", ttl, HEARTBEAT, beats, second_ran)
    with runs as (first, blackholed, second):
        status, _, err = finish(first, ttl + 5)
        assert status == 79, err  # EX_LEASE_LOST, not "held elsewhere"
        assert "lost lock 'nightly'" in err and "SIGTERM" in err, err
        last_beat = float(beats.read_text().split()[-1])
        assert last_beat < blackholed + ttl, "the program ran past the lease's deadline"
        status, _, err = finish(second, 30)
        assert status == 0, err
        assert float(second_ran.read_text()) > last_beat, "two programs ran at once"


#: A program that traps SIGTERM, notes it, and carries on: only SIGKILL stops it.
#: Its lines go out by ``os.write``, one system call each: the SIGTERM handler runs
#: between two bytecodes of the loop, and a buffered file's write interrupted by a
#: handler that writes to it too raises "reentrant call" (seen once in CI), which ended
#: the program before the deadline, and the test saw no SIGKILL.
STUBBORN = (
    "import os, signal, sys, time\n"
    "out = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT)\n"
    "def trapped(signum, frame):\n"
    "    os.write(out, f'TERM {time.time()}\\n'.encode())\n"
    "signal.signal(signal.SIGTERM, trapped)\n"
    "while True:\n"
    "    os.write(out, f'{time.time()}\\n'.encode()); time.sleep(0.02)\n"
)


def test_run_kills_a_program_that_ignores_sigterm_at_the_deadline(
    link: Proxy, redis_url: str, tmp_path: Path
) -> None:
    """SIGTERM a margin before the deadline; a program that ignores it
    is SIGKILLed at the deadline, before a second ``run`` can take the lock."""
    beats, second_ran = tmp_path / "beats", tmp_path / "second"
    ttl = 2.0
    runs = cut_off_while_running(link, redis_url, "stubborn", ttl, STUBBORN, beats, second_ran)
    with runs as (first, blackholed, second):
        status, _, err = finish(first, ttl + 5)
        assert status == 79, err  # EX_LEASE_LOST
        assert "SIGTERM now, SIGKILL in" in err, err
        assert "did not stop by the deadline: sent SIGKILL" in err, err
        lines = beats.read_text().split("\n")
        terms = [float(line.split()[1]) for line in lines if line.startswith("TERM")]
        times = [float(line) for line in lines if line and not line.startswith("TERM")]
        assert terms, "the program never got SIGTERM"
        assert times[-1] > terms[0], "the program did not carry on after SIGTERM"
        assert times[-1] < blackholed + ttl, "the program ran past the lease's deadline"
        status, _, err = finish(second, 30)
        assert status == 0, err
        assert float(second_ran.read_text()) > times[-1], "two programs ran at once"


# -- one backend, one primary, does not hold up another ----------------------------------


def test_a_stalled_server_costs_no_lease_on_another(driver: SyncDriver, redis_factory: Any) -> None:
    stalled, healthy = redis_factory(), redis_factory()
    ttl = 2.0
    doomed = driver.acquire("doomed", backend=stalled.url(), ttl=ttl)
    kept = driver.acquire("kept", backend=healthy.url(), ttl=ttl)
    stalled.pause()  # SIGSTOP
    try:
        end = time.monotonic() + 3 * ttl + 0.5
        while time.monotonic() < end:
            assert kept.held, f"lost while another server stalled: {kept.lost_reason}"
            time.sleep(0.05)
        assert kept.renewals >= 7  # one per third of a TTL: about 9
        assert doomed.lost.is_set()
    finally:
        stalled.resume()
    kept.release()


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterNodes]:
    nodes = RedisClusterNodes(3).start()
    for node in nodes.nodes:  # the healthy primaries keep serving while one is stopped
        redis.Redis(port=node.port).config_set("cluster-require-full-coverage", "no")
    yield nodes
    nodes.cleanup()


def names_by_node(cluster: RedisClusterNodes) -> dict[int, str]:
    """One lock name per primary (by port)."""
    client = redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    try:
        found: dict[int, str] = {}
        for i in range(1000):
            name = f"spread:{i}"
            node = client.get_node_from_key(f"task_locks:{{{name}}}")
            found.setdefault(node.port, name)
            if len(found) == len(cluster.nodes):
                return found
    finally:
        client.close()
    raise AssertionError("no name for every primary")


def test_a_stalled_cluster_primary_costs_no_lease_on_another(
    driver: SyncDriver, cluster: RedisClusterNodes
) -> None:
    cluster.flushall()
    url = cluster.url()
    ttl = 2.0
    by_port = names_by_node(cluster)
    stalled = cluster.nodes[0]
    handles = {port: driver.acquire(name, backend=url, ttl=ttl) for port, name in by_port.items()}
    stalled.pause()
    try:
        end = time.monotonic() + 3 * ttl + 0.5
        while time.monotonic() < end:
            for port, handle in handles.items():
                if port != stalled.port:
                    assert handle.held, f"{handle.name} lost: {handle.lost_reason}"
            time.sleep(0.05)
        deadline_passed = handles[stalled.port]
        assert deadline_passed.lost.is_set()
    finally:
        stalled.resume()
    for port, handle in handles.items():
        if port != stalled.port:
            handle.release()


def test_async_on_lost_runs_on_the_lease_loop(link: Proxy) -> None:
    async def main() -> tuple[bool, float, float]:
        loop = asyncio.get_running_loop()
        seen: list[tuple[bool, float]] = []

        def on_lost(lease: Any) -> None:
            seen.append((asyncio.get_running_loop() is loop, time.monotonic()))

        lock = AsyncLock("async-deadline", ttl=1.0, backend=proxy_url(link), on_lost=on_lost)
        lease = await lock.acquire(timeout=2)
        link.blackhole()
        deadline = time.monotonic() + lease.remaining
        await asyncio.wait_for(asyncio.to_thread(lease.lost.wait, 3), 4)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        assert seen
        return seen[0][0], seen[0][1], deadline

    on_loop, called_at, deadline = asyncio.run(main())
    assert on_loop
    assert called_at - deadline < 3 * LOSS_BOUND


def test_lost_flag_wait_returns_at_the_deadline(redis_url: str) -> None:
    lease = Lock("wait-deadline", ttl=0.5, backend=redis_url, renew=False).acquire(timeout=1)
    started = time.monotonic()
    assert lease.lost.wait(3)
    assert time.monotonic() - started < 0.5 + LOSS_BOUND
    assert bool(lease.lost)


def test_released_leases_do_not_pile_up_in_the_deadline_watch(redis_url: str) -> None:
    lock = Lock("churn", ttl=30, backend=redis_url)
    for _ in range(500):
        lock.acquire(timeout=1).release()
    assert len(watchdog.deadline_watch()) <= 130  # compacted, not 500 until their deadlines


def test_a_celery_task_sees_its_lease_lost_at_the_deadline(link: Proxy) -> None:
    """The Celery task's lease is the same Lease: ``lost`` is set at the deadline."""
    from celery import Celery

    from task_locks.celery import current_lease, singleton_task

    app = Celery("deadline", broker="memory://", backend="cache+memory://", set_as_current=False)
    seen: dict[str, Any] = {}

    @singleton_task(
        app=app,
        shared=False,
        key="celery-deadline",
        ttl=1.5,
        backend=proxy_url(link),
        on_lost="ignore",  # the lease itself is under test, not the task's outcome
    )
    def job() -> None:
        lease = current_lease()
        assert lease is not None
        link.blackhole()
        deadline = time.monotonic() + lease.remaining
        seen["lost"] = lease.lost.wait(5)
        seen["late_by"] = time.monotonic() - deadline
        try:
            lease.check()
        except LockLost as exc:
            seen["check"] = exc

    try:
        job()
    finally:
        app.close()
    assert seen["lost"] and seen["late_by"] < LOSS_BOUND, seen
    assert isinstance(seen.get("check"), LockLost)
