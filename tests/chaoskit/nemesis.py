"""The faults. Each function injects one fault and heals it; the nemesis repeats it.

Every fault and every heal is recorded in the history (``f: nemesis``) with its time,
and every fault heals in a ``finally``: a run never ends with a process stopped or a
proxy cut.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .client import ACQUIRING, HOLDING, LAST_STEP
from .clock import now

if TYPE_CHECKING:
    from .scenario import Run


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def pause_holder(run: Run) -> None:
    """SIGSTOP the holder (renewals stop too) past its TTL, until another holder wrote."""
    slot = run.wait_for_state(HOLDING, 3 * run.ttl)
    if slot is None:
        return
    client = run.clients[slot]
    _signal(client.pid, signal.SIGSTOP)
    run.record("pause", target=client.process)
    try:
        run.sleep(1.5 * run.ttl)
        run.wait_for_state(HOLDING, 3 * run.ttl, exclude=slot)
        run.sleep(0.3 * run.ttl)  # let the new holder write before the old one wakes
    finally:
        _signal(client.pid, signal.SIGCONT)
        run.record("resume", target=client.process)


def pause_acquirer(run: Run) -> None:
    """SIGSTOP a client while it is acquiring (replies in flight), past the TTL."""
    slot = run.wait_for_state(ACQUIRING, 3 * run.ttl)
    if slot is None:
        return
    client = run.clients[slot]
    _signal(client.pid, signal.SIGSTOP)
    run.record("pause", target=client.process, acquiring=True)
    try:
        run.sleep(1.5 * run.ttl)
    finally:
        _signal(client.pid, signal.SIGCONT)
        run.record("resume", target=client.process)


def kill_holder(run: Run) -> None:
    """SIGKILL the holder; a new client process takes its slot."""
    slot = run.wait_for_state(HOLDING, 3 * run.ttl)
    if slot is None:
        return
    client = run.clients[slot]
    _signal(client.pid, signal.SIGKILL)
    run.record("kill", target=client.process)
    client.popen.wait(10)
    run.sleep(0.2)
    run.spawn(slot)


def pause_server(run: Run) -> None:
    """SIGSTOP the lock servers (a partition from everyone) for 1.5 TTL."""
    run.service.pause()
    run.record("pause-server")
    try:
        run.sleep(1.5 * run.ttl)
    finally:
        run.service.resume()
        run.record("heal", fault="pause-server")


def restart_server(run: Run) -> None:
    """While a lock is held: the server (one Redlock master) restarts empty."""
    run.wait_for_state(HOLDING, 3 * run.ttl)
    run.service.restart(run.record)
    run.record("restart-server")


def failover(run: Run) -> None:
    """Sentinel promotes a replica that never received the newest lock."""

    def handover_due() -> bool:
        run.wait_for_state(LAST_STEP, 3 * run.ttl)
        return not run.stopping  # no failover while the run winds down

    def fresh_acquire() -> bool:
        return run.wait_for_new_holder(run.settings.work + 0.5)

    run.service.failover(run.record, handover_due, fresh_acquire)  # type: ignore[attr-defined]


def kill_leader(run: Run) -> None:
    run.service.kill_leader(run.record)  # type: ignore[attr-defined]


def _proxy_fault(
    run: Run, action: str, apply: Callable[[Any], None], hold: float, prefer: int
) -> None:
    slot = run.wait_for_state(prefer, 2 * run.ttl)
    if slot is None:
        slot = random.randrange(len(run.clients))
    client = run.clients[slot]
    for proxy in run.proxies[slot]:
        apply(proxy)
    run.record(action, target=client.process)
    try:
        run.sleep(hold)
    finally:
        for proxy in run.proxies[slot]:
            proxy.heal()
        run.record("heal", fault=action, target=client.process)


def proxy_latency(run: Run) -> None:
    """Replies to one acquiring client arrive 0.2 s late (under every socket timeout)."""
    _proxy_fault(run, "latency", lambda p: p.latency(reply_delay=0.2), 3 * run.ttl, ACQUIRING)


def proxy_blackhole(run: Run) -> None:
    """The holder is cut off from the lock service for 2 TTL; its bytes arrive late."""
    _proxy_fault(run, "blackhole", lambda p: p.blackhole(), 2 * run.ttl, HOLDING)


def proxy_reset(run: Run) -> None:
    """The holder's connections are reset, and reconnecting fails for a moment."""
    _proxy_fault(run, "reset", lambda p: p.reset(), 0.3 * run.ttl, HOLDING)


def clock_skew(run: Run) -> None:
    """Nothing to do while running: clients 0 and 1 were started under libfaketime."""
    if not run.skew_recorded:
        run.skew_recorded = True
        run.record("skew", slow=run.clients[0].process, fast=run.clients[1].process)
    run.sleep(run.ttl)


FAULTS: dict[str, Callable[[Run], None]] = {
    "none": lambda run: run.sleep(run.ttl),
    "pause-holder": pause_holder,
    "pause-acquirer": pause_acquirer,
    "kill-holder": kill_holder,
    "pause-server": pause_server,
    "restart-server": restart_server,
    "failover": failover,
    "kill-leader": kill_leader,
    "proxy-latency": proxy_latency,
    "proxy-blackhole": proxy_blackhole,
    "proxy-reset": proxy_reset,
    "clock-skew": clock_skew,
}

#: libfaketime settings per client slot for the clock-skew fault.
SKEW = {0: "+0 x0.3", 1: "+0 x3"}
FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"


def nemesis(run: Run, fault: str, stop: threading.Event) -> None:
    """Inject ``fault`` again and again, with a quiet gap after each, until ``stop``."""
    inject = FAULTS[fault]
    run.sleep(0.5 * run.ttl)  # let the clients get going
    while not stop.is_set():
        started = now()
        try:
            inject(run)
        except Exception as exc:  # a fault that could not be injected is a finding, not a crash
            run.record("error", fault=fault, error=f"{type(exc).__name__}: {exc}")
            run.errors.append(f"{fault}: {type(exc).__name__}: {exc}")
        if now() - started < 0.05:
            run.sleep(0.1)  # nothing happened (no holder yet): do not spin
        run.sleep(random.uniform(0.5, 1.0) * run.ttl)
