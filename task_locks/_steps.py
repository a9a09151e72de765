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

from collections.abc import Callable, Generator
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


class Finished(NamedTuple):
    """A plan's result, as :func:`advance` returns it."""

    value: Any


def advance(plan: Generator[Any, Any, Any], answer: Any, error: BaseException | None) -> Any:
    """Hand an answer (or an error, thrown in at the ``yield``) to a plan: its next
    request, or :class:`Finished` with its result. Shared with :mod:`task_locks._plan`'s
    drivers, so every plan of the package is stepped the same way."""
    try:
        return plan.send(answer) if error is None else plan.throw(error)
    except StopIteration as done:
        return Finished(done.value)


def drive(plan: Generator[Step, Any, Any]) -> Any:
    """Run a plan with blocking I/O; its result."""
    step = advance(plan, None, None)
    while not isinstance(step, Finished):
        try:
            answer = step.run()
        except BaseException as exc:
            step = advance(plan, None, exc)
        else:
            step = advance(plan, answer, None)
    return step.value


async def adrive(plan: Generator[Step, Any, Any]) -> Any:
    """Run a plan with awaited I/O; its result."""
    step = advance(plan, None, None)
    while not isinstance(step, Finished):
        try:
            answer = await step.arun()
        except BaseException as exc:
            step = advance(plan, None, exc)
        else:
            step = advance(plan, answer, None)
    return step.value


__all__ = ["Call", "Finished", "Step", "adrive", "advance", "drive"]
