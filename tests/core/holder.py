"""A lock holder in its own process, steered by the tests over stdin/stdout.

Run as ``python holder.py URL NAME TTL sync|async``. Each stdin line is a JSON command
(``{"op": "acquire", "timeout": 5}``); each answer is one JSON line on stdout. The test
stops, continues and kills this process with signals while it holds the lock, so that
what it reports afterwards (``release`` -> ``NotOwned``...) is what a real paused or
crashed worker would see. ``sync`` uses :class:`Lock` (watchdog thread); ``async`` uses
:class:`AsyncLock` in one event loop (watchdog task) that keeps running while this
process waits for the next command.

The hammer functions are also imported by the tests, so threads and processes run the
very same critical section.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from typing import Any

import redis
import redis.asyncio

from task_locks import AsyncLock, Lock, LockError
from task_locks.watchdog import async_renewer, thread_renewer


def critical_section_sync(client: redis.Redis, counter: str, fence: int) -> bool:
    """Non-atomic read-modify-write; ``False`` if a fence went backwards (overlap)."""
    value = int(client.get(counter) or 0)
    last = int(client.get(counter + ":fence") or 0)
    client.set(counter, value + 1)
    client.set(counter + ":fence", fence)
    return fence > last


async def critical_section_async(client: redis.asyncio.Redis, counter: str, fence: int) -> bool:
    value = int(await client.get(counter) or 0)
    last = int(await client.get(counter + ":fence") or 0)
    await client.set(counter, value + 1)
    await client.set(counter + ":fence", fence)
    return fence > last


def hammer_sync(url: str, name: str, counter: str, iterations: int, threads: int) -> int:
    """``threads`` threads each take the lock ``iterations`` times; returns fence faults."""
    client = redis.Redis.from_url(url.split("?", 1)[0])  # not our options (handoff...)
    faults = [0]

    def work() -> None:
        lock = Lock(name, ttl=10, backend=url, timeout=30)
        for _ in range(iterations):
            with lock as lease:
                if not critical_section_sync(client, counter, lease.fence):
                    faults[0] += 1

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    client.close()
    return faults[0]


async def hammer_async(url: str, name: str, counter: str, iterations: int, tasks: int) -> int:
    client = redis.asyncio.Redis.from_url(url.split("?", 1)[0])
    faults = 0

    async def work() -> None:
        nonlocal faults
        lock = AsyncLock(name, ttl=10, backend=url, timeout=30)
        for _ in range(iterations):
            async with lock as lease:
                if not await critical_section_async(client, counter, lease.fence):
                    faults += 1

    await asyncio.gather(*(work() for _ in range(tasks)))
    await client.aclose()
    await Lock(name, backend=url).backend.aclose()
    return faults


def error(exc: BaseException) -> dict[str, Any]:
    return {"error": type(exc).__name__, "message": str(exc)}


class Holder:
    """The state behind the commands; the sync/async differences are in ``run_*``."""

    def __init__(self, url: str, name: str, ttl: float) -> None:
        self.url, self.name, self.ttl = url, name, ttl
        self.lease: Any = None

    def state(self) -> dict[str, Any]:
        lease = self.lease
        return {
            "pid": os.getpid(),
            "held": lease.held,
            "lost": lease.lost.is_set(),
            "renewals": lease.renewals,
            "lost_reason": lease.lost_reason,
        }

    def granted(self) -> dict[str, Any]:
        return {"ok": True, "fence": self.lease.fence, "pid": os.getpid()}


def child_report(holder: Holder, scheduled: int, extra: dict[str, Any]) -> dict[str, Any]:
    """What a forked child sees of the parent's lease (sent to the parent over a pipe)."""
    lease = holder.lease
    report: dict[str, Any] = {"pid": os.getpid(), "scheduled": scheduled, "held": lease.held}
    try:
        lease.check()
        report["check"] = "ok"
    except LockError as exc:
        report["check"] = type(exc).__name__
    report.update(extra)
    return report


def fork() -> dict[str, Any]:
    """Fork. The parent returns the child's report (read from a pipe); the child gets
    ``{"child": True, "write_end": fd}`` and writes its report there."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        return {"child": True, "write_end": write_end}
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        line = pipe.readline()
    if not line:
        return {"error": "ForkFailed", "message": "the forked child died before reporting"}
    return {"ok": True, "grandchild": json.loads(line)}


def run_sync(holder: Holder) -> None:
    lock = Lock(holder.name, ttl=holder.ttl, backend=holder.url)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "acquire":
                holder.lease = lock.acquire(timeout=command.get("timeout", 5))
                answer = holder.granted()
            elif op == "release":
                holder.lease.release()
                answer = {"ok": True}
            elif op == "check":
                holder.lease.check()
                answer = {"ok": True}
            elif op == "state":
                answer = holder.state()
            elif op == "hammer":
                faults = hammer_sync(
                    holder.url, holder.name, command["counter"], command["n"], command["workers"]
                )
                answer = {"ok": True, "faults": faults}
            elif op == "fork":
                answer = fork()
                if answer.get("child"):
                    # The grandchild: take a lock of its own (this starts its own renewal
                    # thread), then report what it sees of the parent's lease.
                    own = Lock(holder.name + ":own", ttl=holder.ttl, backend=holder.url).acquire(
                        timeout=5
                    )
                    holder.lease.release()  # must not free the parent's lock
                    report = child_report(
                        holder, len(thread_renewer().schedule), {"own_fence": own.fence}
                    )
                    os.write(answer["write_end"], (json.dumps(report) + "\n").encode())
                    threading.Event().wait()  # stay alive, renewing "own", until killed
            else:
                answer = {"error": "unknown op", "message": op}
        except LockError as exc:
            answer = error(exc)
        print(json.dumps(answer), flush=True)


async def async_grandchild(holder: Holder, write_end: int) -> None:
    own_lock = AsyncLock(holder.name + ":own", ttl=holder.ttl, backend=holder.url)
    own = await own_lock.acquire(timeout=5)
    await holder.lease.release()  # must not free the parent's lock
    report = child_report(holder, len(async_renewer().schedule), {"own_fence": own.fence})
    os.write(write_end, (json.dumps(report) + "\n").encode())
    while True:  # stay alive, renewing "own", until killed
        await asyncio.sleep(3600)


async def run_async(holder: Holder) -> None:
    lock = AsyncLock(holder.name, ttl=holder.ttl, backend=holder.url)
    loop = asyncio.get_running_loop()
    while True:
        # Read stdin in a worker thread, so the renewal task keeps running meanwhile.
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "acquire":
                holder.lease = await lock.acquire(timeout=command.get("timeout", 5))
                answer = holder.granted()
            elif op == "release":
                await holder.lease.release()
                answer = {"ok": True}
            elif op == "check":
                holder.lease.check()
                answer = {"ok": True}
            elif op == "state":
                answer = holder.state()
            elif op == "hammer":
                faults = await hammer_async(
                    holder.url, holder.name, command["counter"], command["n"], command["workers"]
                )
                answer = {"ok": True, "faults": faults}
            elif op == "fork":
                answer = fork()
                if answer.get("child"):
                    # The grandchild cannot go on with the parent's event loop (asyncio
                    # reports no running loop after a fork), so it starts its own and
                    # takes a lock of its own there (its own renewal task).
                    asyncio.run(async_grandchild(holder, answer["write_end"]))
            else:
                answer = {"error": "unknown op", "message": op}
        except LockError as exc:
            answer = error(exc)
        print(json.dumps(answer), flush=True)
    await lock.backend.aclose()


def main() -> None:
    url, name, ttl, mode = sys.argv[1:5]
    holder = Holder(url, name, float(ttl))
    print(json.dumps({"ready": os.getpid()}), flush=True)
    if mode == "sync":
        run_sync(holder)
    else:
        asyncio.run(run_async(holder))


if __name__ == "__main__":
    main()
