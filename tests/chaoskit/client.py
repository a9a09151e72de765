"""A chaos client process: acquire -> (check, work, write with the fence) x N -> release.

Run as ``python -m chaoskit.client CONFIG.json SLOT PROCESS``. It loops until the
stop file appears, records every operation in its own history file, and publishes its
state (idle / acquiring / holding / last step / releasing) in one byte of a shared map, so the
nemesis can find the holder without asking the lock service.

The client is careful the way a user would be: it checks its lease (``lease.check()``,
local and free) before each step, and treats a lease that had already expired when the
acquire answered as not acquired. What it cannot avoid is a pause (or a slow clock)
between the check and the write: that is the window fencing exists for, and the
``work`` pause sits exactly there.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

IDLE, ACQUIRING, HOLDING, RELEASING, LAST_STEP, EXITED = 0, 1, 2, 3, 4, 9


class State:
    """One byte per slot in a file both the client and the nemesis map."""

    def __init__(self, path: str, slot: int) -> None:
        self._file = open(path, "r+b")
        self._map = mmap.mmap(self._file.fileno(), 0)
        self.slot = slot

    def set(self, value: int) -> None:
        self._map[self.slot] = value


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def run(config: dict[str, Any], slot: int, process: int) -> None:
    if config.get("django"):
        import django

        django.setup()

    from chaoskit.history import Recorder
    from chaoskit.resources import open_registers
    from task_locks import Lock, LockError, LockHeld, LockLost, NotOwned, StaleFence

    history = Recorder(Path(config["history"]) / f"client-{process}.jsonl", process)
    history.event("process", "start", pid=os.getpid(), slot=slot)
    state = State(config["state"], slot)
    ttl = float(config["ttl"])
    lock = Lock(config["lock"], ttl=ttl, backend=config["backends"][slot])
    registers = open_registers(config)
    stop = Path(config["stop"])
    rng = random.Random(process)
    writes = 0

    while not stop.exists():
        state.set(ACQUIRING)
        history.invoke("acquire", ttl=ttl)
        try:
            lease = lock.acquire(timeout=float(config["acquire_timeout"]))
        except LockHeld:
            history.fail("acquire")
            continue
        except LockError as exc:
            history.info("acquire", error=_error(exc))
            time.sleep(0.05)
            continue
        except Exception as exc:  # not a LockError: a contract violation, reported as such
            history.info("acquire", error=_error(exc), unexpected=True)
            time.sleep(0.05)
            continue
        if not lease.held:
            # The answer came back after the TTL had run out: not ours to act on.
            history.fail("acquire", fence=lease.fence, error="expired before the reply arrived")
            _quiet_release(lease, LockError)
            continue
        history.ok("acquire", fence=lease.fence)
        state.set(HOLDING)
        steps = int(config["writes_per_hold"])
        for step in range(steps):
            if step == steps - 1:
                state.set(LAST_STEP)  # the release is one work period away
            try:
                lease.check()
            except LockLost as exc:
                history.event("lost", "info", fence=lease.fence, error=_error(exc))
                break
            time.sleep(float(config["work"]))  # the work between the check and the write
            for register in registers:
                writes += 1
                write_id = f"{process}.{writes}"
                history.invoke("write", guard=register.guard, fence=lease.fence, id=write_id)
                try:
                    version = register.write(lease.fence, write_id)
                except StaleFence as exc:
                    history.fail("write", current=exc.current)
                except Exception as exc:
                    history.info("write", error=_error(exc), unexpected=True)
                else:
                    history.ok("write", version=version)
        state.set(RELEASING)
        history.invoke("release")
        try:
            lease.release()
        except NotOwned:
            history.fail("release")
        except LockError as exc:
            history.info("release", error=_error(exc))
        except Exception as exc:
            history.info("release", error=_error(exc), unexpected=True)
        else:
            history.ok("release")
        state.set(IDLE)
        time.sleep(rng.uniform(0, float(config["idle"])))

    state.set(EXITED)
    history.event("process", "exit")
    history.close()


def _quiet_release(lease: Any, errors: type[BaseException]) -> None:
    try:
        lease.release()
    except errors:
        pass


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    run(config, int(sys.argv[2]), int(sys.argv[3]))
    os._exit(0)  # do not wait for a renewal stuck on a blackholed socket


if __name__ == "__main__":
    main()
