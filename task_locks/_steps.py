"""A front end's run as one plan: decisions in a generator, I/O in steps, two drivers.

Internal interface of ``@singleton_task`` and ``@locked`` (the lock's own acquire
engine, one level down, is :mod:`task_locks._plan`).

``@singleton_task`` and ``@locked`` wrap plain and ``async def`` functions alike. Their
decisions (which lock, what a conflict means, how a failed release is reported) are
written once, as a generator (the *plan*) that yields each piece of I/O as a *step*;
:func:`drive` performs the steps with blocking calls and :func:`adrive` with awaited
ones. An error of a step is thrown back into the plan, which handles it where the
decision is made. So no sync code is copied into async code: only the steps differ.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any, NamedTuple, Protocol


class Step(Protocol):
    """One piece of a plan's I/O, in its blocking and its awaited form."""

    def run(self) -> Any: ...

    async def arun(self) -> Any: ...


class Call(NamedTuple):
    """Call the wrapped function (awaited by :func:`adrive`: an ``async def`` one)."""

    function: Callable[..., Any]
    args: Any
    kwargs: Any

    def run(self) -> Any:
        return self.function(*self.args, **self.kwargs)

    async def arun(self) -> Any:
        return await self.function(*self.args, **self.kwargs)


class _Finished(NamedTuple):
    """A plan's result, as :func:`_advance` returns it."""

    value: Any


def _advance(plan: Generator[Any, Any, Any], answer: Any, error: BaseException | None) -> Any:
    """Hand an answer (or an error, thrown in at the ``yield``) to a plan: its next
    request, or :class:`_Finished` with its result."""
    try:
        return plan.send(answer) if error is None else plan.throw(error)
    except StopIteration as done:
        return _Finished(done.value)


def run(plan: Generator[Any, Any, Any], answer: Callable[[Any], Any]) -> Any:
    """Step ``plan`` to its end, each request answered by ``answer`` (blocking); a request
    that fails, an interrupt included, is thrown into the plan. Its result.

    The one stepping loop of the package: front-end plans (steps, below), the lock's own
    acquire plans (:mod:`task_locks._plan`, ops answered by a backend) and Redlock's
    fan-out plans (:mod:`task_locks.backends.redlock`) all use it. It imports nothing of
    the package, so the backends may import it."""
    request = _advance(plan, None, None)
    while not isinstance(request, _Finished):
        try:
            reply = answer(request)
        except BaseException as exc:
            request = _advance(plan, None, exc)
        else:
            request = _advance(plan, reply, None)
    return request.value


async def arun(plan: Generator[Any, Any, Any], answer: Callable[[Any], Awaitable[Any]]) -> Any:
    """:func:`run` with awaited answers."""
    request = _advance(plan, None, None)
    while not isinstance(request, _Finished):
        try:
            reply = await answer(request)
        except BaseException as exc:
            request = _advance(plan, None, exc)
        else:
            request = _advance(plan, reply, None)
    return request.value


def drive(plan: Generator[Step, Any, Any]) -> Any:
    """Run a plan with blocking I/O; its result."""
    return run(plan, _run_step)


async def adrive(plan: Generator[Step, Any, Any]) -> Any:
    """Run a plan with awaited I/O; its result."""
    return await arun(plan, _arun_step)


def _run_step(step: Step) -> Any:
    return step.run()


def _arun_step(step: Step) -> Awaitable[Any]:
    return step.arun()


__all__ = ["Call", "Step", "adrive", "arun", "drive", "run"]
