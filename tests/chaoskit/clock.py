"""History timestamps: CLOCK_MONOTONIC read by a raw system call.

``time.monotonic()`` is system-wide on Linux, so timestamps from different processes
compare directly. A client run under libfaketime (the clock-skew fault) must still
stamp its history with the *real* clock, and libfaketime intercepts the libc call
(and the vDSO path behind it), not the system call itself; so we make the system call.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable

CLOCK_MONOTONIC = 1
_SYSCALL_CLOCK_GETTIME = {"x86_64": 228, "aarch64": 113}


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _raw_clock() -> Callable[[], float] | None:
    number = _SYSCALL_CLOCK_GETTIME.get(os.uname().machine)
    if number is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
    except (OSError, AttributeError):
        return None

    def read() -> float:
        spec = _Timespec()  # one per call: threads stamp events concurrently
        if syscall(number, CLOCK_MONOTONIC, ctypes.byref(spec)) != 0:
            raise OSError(ctypes.get_errno(), "clock_gettime(CLOCK_MONOTONIC) failed")
        return spec.tv_sec + spec.tv_nsec / 1e9

    return read


#: Seconds on the real, system-wide monotonic clock.
now: Callable[[], float] = _raw_clock() or time.monotonic
