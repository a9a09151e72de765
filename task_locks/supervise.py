"""How ``run`` (:mod:`task_locks.verbs`) keeps a program inside its lease: the process
supervisor, apart from the verbs and their parser.

The program never outlives the lease. While it runs, :func:`watch` polls the lease's local
deadline: when renewals stop getting through, the program gets SIGTERM
:data:`STOP_MARGIN` seconds before the deadline and SIGKILL at it, so it has stopped
before the server lets anyone else take the lock; a lease found lost outright gets
SIGKILL after :data:`LOST_GRACE` at most. Signals sent to ``run`` are forwarded to the
program (:func:`forwarding`). Each step is said on stderr, and the status is then
:data:`EX_LEASE_LOST`.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Final, TextIO

from .errors import BackendUnavailable, LockLost
from .lock import Lease

#: ``run`` stopped its program because the lease was lost (its work may overlap another
#: holder's): not 75, which means "held elsewhere, nothing ran". Past ``sysexits.h``'s
#: range, below the shell's 126/127 and the 128 + N of a signal.
EX_LEASE_LOST: Final = 79
#: Signals ``run`` forwards to its program.
FORWARDED_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
#: How long ``run`` lets its program stop after the lock was lost before killing it
#: (never past the lease's local deadline).
LOST_GRACE: Final = 10.0
#: ``run`` sends SIGTERM this long (at most; a quarter of the TTL for short TTLs) before
#: the lease's local deadline when no renewal has extended it, and SIGKILL at the deadline.
STOP_MARGIN: Final = 1.0


class Interrupted(BaseException):
    """A forwarded signal arrived before the program started: ``run`` stops waiting."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def forwarding(child: list[subprocess.Popen[bytes]]) -> Iterator[None]:
    """Forward signals to the program once it runs; before that, stop waiting."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        if child and child[0].poll() is None:
            child[0].send_signal(signum)
        elif not child:
            raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def exit_status(returncode: int) -> int:
    """The program's status as a shell reports it: 128 + N when it died of signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _stop_margin(lease: Lease) -> float:
    return min(STOP_MARGIN, lease.ttl / 4)


def watch(
    proc: subprocess.Popen[bytes],
    lease: Lease,
    lost: threading.Event,
    err: TextIO,
) -> str | None:
    """Wait for ``proc``; ``None`` if it ended on its own, else why ``run`` stopped it."""
    margin = _stop_margin(lease)
    while True:
        left = lease.remaining
        try:
            proc.wait(timeout=min(0.05, max(0.001, left - margin)))
            return None
        except subprocess.TimeoutExpired:
            pass
        left = lease.remaining
        if lost.is_set() or lease.lost.is_set() or left <= margin:
            return _stop(proc, lease, left, err)


def _stop(proc: subprocess.Popen[bytes], lease: Lease, left: float, err: TextIO) -> str:
    """SIGTERM now, SIGKILL at the lease's local deadline (or after LOST_GRACE)."""
    if lease.lost.is_set():
        why = f"lost lock {lease.name!r} ({lease.lost_reason})"
        left = min(left, LOST_GRACE)
    else:
        why = (
            f"lost lock {lease.name!r}: not renewed, it expires in {left:.2f}s "
            f"(fence {lease.fence})"
        )
    err.write(
        f"task-locks: {why}; stopping {_program(proc)}: SIGTERM now, SIGKILL in {left:.2f}s "
        f"at the lease's deadline; exit status {EX_LEASE_LOST}\n"
    )
    err.flush()
    proc.terminate()
    try:
        proc.wait(timeout=max(0.0, left))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        err.write(f"task-locks: {_program(proc)} did not stop by the deadline: sent SIGKILL\n")
    else:
        err.write(f"task-locks: {_program(proc)} stopped (status {proc.returncode})\n")
    return why


def _program(proc: subprocess.Popen[bytes]) -> str:
    """The program as the operator typed it (a shell line, not a Python list)."""
    args = proc.args
    return shlex.join(map(str, args)) if isinstance(args, list | tuple) else repr(args)


def release(lease: Lease, err: TextIO) -> bool:
    """Release ``lease``; ``False`` (said on stderr) when it turned out lost before."""
    if lease.lost.is_set():
        err.write(
            f"task-locks: lost lock {lease.name!r} while the program ran "
            f"({lease.lost_reason}); exit status {EX_LEASE_LOST}\n"
        )
        return False
    try:
        lease.release()
    except LockLost as exc:
        err.write(f"task-locks: {exc}; exit status {EX_LEASE_LOST}\n")
        return False
    except BackendUnavailable as exc:
        # Not known lost: the program ran under a lease that was still ours.
        err.write(f"task-locks: could not release {lease.name!r} (it expires by its TTL): {exc}\n")
    return True


__all__ = [
    "EX_LEASE_LOST",
    "FORWARDED_SIGNALS",
    "LOST_GRACE",
    "STOP_MARGIN",
    "Interrupted",
    "exit_status",
    "forwarding",
    "release",
    "watch",
]
