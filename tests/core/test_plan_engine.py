"""The typed acquire engine (``task_locks._plan``): a closed set of ops, answered alike by run_against and arun_against."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from task_locks import get_backend
from task_locks._plan import (
    MIN_PAUSE,
    UNKNOWN_TTL_POLL,
    Acquire,
    Enqueue,
    Plan,
    Release,
    Wait,
    WaitAny,
    arun_against,
    pause,
    run_against,
)
from task_locks.backends.base import Backend
from task_locks.owner import current_owner


async def arun(plan: Plan[Any], backend: Backend) -> Any:
    """``arun_against`` on a fresh loop, closing the backend's async connections before it ends."""
    try:
        return await arun_against(plan, backend)
    finally:
        await backend.aclose()


def stray_plan() -> Plan[str]:
    """A plan that yields the old tuple protocol: no longer an op."""
    yield ("wait_any", ("a", "b"), 0.0)  # type: ignore[misc]
    return "unreachable"


def test_run_against_refuses_an_unknown_op(redis_url: str) -> None:
    backend = get_backend(redis_url)
    with pytest.raises(TypeError, match="not an op"):
        run_against(stray_plan(), backend)


def test_arun_against_refuses_an_unknown_op(redis_url: str) -> None:
    backend = get_backend(redis_url)
    with pytest.raises(TypeError, match="not an op"):
        asyncio.run(arun(stray_plan(), backend))


def every_op(prefix: str) -> Plan[list[Any]]:
    """One of each op against real keys; returns the answers, with fences made comparable."""
    owner = current_owner()
    first, second = f"{prefix}:a", f"{prefix}:b"
    seen: list[Any] = []
    mine = yield Acquire(first, "t1", 5000, owner)
    seen.append(("acquired", mine.fence is not None))
    other = yield Acquire(first, "t2", 5000, owner)
    seen.append(("held", other.fence, other.holder_fence == mine.fence))
    seen.append(("retry_after>0", other.retry_after is not None and other.retry_after > 0))
    seen.append(("wait", (yield Wait(first, 0.01))))
    seen.append(("wait_any", (yield WaitAny((first, second), 0.01))))
    seen.append(("release other", (yield Release(first, "t2"))))
    seen.append(("release mine", (yield Release(first, "t1"))))
    again = yield Acquire(first, "t2", 5000, owner)
    seen.append(("after release", again.fence is not None and again.fence > mine.fence))
    seen.append(("release again", (yield Release(first, "t2"))))
    return seen


def test_run_against_and_arun_against_answer_the_same_plan_alike(redis_url: str) -> None:
    backend = get_backend(redis_url)
    sync = run_against(every_op("sync"), backend)
    asynchronous = asyncio.run(arun(every_op("async"), backend))
    assert sync == asynchronous
    assert sync == [
        ("acquired", True),
        ("held", None, True),
        ("retry_after>0", True),
        ("wait", None),
        ("wait_any", None),
        ("release other", False),
        ("release mine", True),
        ("after release", True),
        ("release again", True),
    ]


def test_pause_rule() -> None:
    assert pause(None, 0.0, None) == UNKNOWN_TTL_POLL
    assert pause(0.0, 0.0, None) == MIN_PAUSE
    assert pause(3.0, 10.0, 11.0) == 1.0  # never past the deadline


def test_a_failed_op_is_thrown_into_the_plan() -> None:
    """The plan sees the failure at its ``yield`` and may clean up (or let it through)."""
    backend = get_backend("memory://plan-engine")  # no server hand-off: Enqueue is refused

    def plan() -> Plan[str]:
        try:
            yield Enqueue("thrown", "t", 1000, current_owner(), 1000)
        except NotImplementedError:
            released = yield Release("thrown", "t")
            return f"caught, then released={released}"
        return "not thrown"

    assert run_against(plan(), backend) == "caught, then released=False"
    assert asyncio.run(arun(plan(), backend)) == "caught, then released=False"
