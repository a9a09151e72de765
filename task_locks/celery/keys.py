"""Lock names for tasks: a template, a callable or a hash, over the task's bound arguments.

The lock name IS the rendered key, so any code can inspect or take the same lock with
``Lock("sync:42")``. Arguments are bound to the task function's signature with defaults
applied, so ``sync(42)``, ``sync(account_id=42)`` and ``sync(42, full=False)`` (the default)
all name the same lock. Templates are checked against the signature when the task is
defined: a field naming an argument the function does not take is an error then, not a
lock silently keyed on something else.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import hashlib
import inspect
import json
import re
import string
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import InvalidArgument
from ..lock import validate_name

KeySpec = str | Callable[..., str] | None

_ROOT = re.compile(r"[.\[]")


def _template_fields(template: str, task_name: str) -> list[str]:
    """The root argument names a ``str.format`` template refers to (``{a.b[0]}`` -> ``a``)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise InvalidArgument(
            f"task {task_name}: malformed key template {template!r}: {exc}"
        ) from exc
    roots: list[str] = []
    for _literal, field, spec, _conversion in parsed:
        if field is None:
            continue
        root = _ROOT.split(field, maxsplit=1)[0]
        if not root or root.isdigit():
            raise InvalidArgument(
                f"task {task_name}: key template {template!r} has a positional field "
                f"{{{field}}}; name the argument instead, e.g. {{account_id}}"
            )
        roots.append(root)
        if spec and "{" in spec:
            roots.extend(_template_fields(spec, task_name))
    return roots


def _canonical(value: Any) -> Any:
    """A JSON-able, order-independent stand-in for values json cannot encode."""
    if isinstance(value, set | frozenset):
        return sorted((_canonical(v) for v in value), key=repr)
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal | uuid.UUID):
        return str(value)
    if isinstance(value, enum.Enum):
        return _canonical(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(type(value).__name__)


class TaskKey:
    """Renders a task's lock name from the arguments of one call."""

    def __init__(self, spec: KeySpec, function: Callable[..., Any], task_name: str, *, bound: bool):
        self.spec = spec
        self.task_name = task_name
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"task {task_name}: cannot read its signature: {exc}") from exc
        parameters = list(signature.parameters.values())
        if bound and parameters:
            parameters = parameters[1:]  # ``self`` of a bind=True task
        self.signature = signature.replace(parameters=parameters)
        self._var_keyword = next(
            (p.name for p in parameters if p.kind is inspect.Parameter.VAR_KEYWORD), None
        )
        if spec is None:
            return
        if isinstance(spec, str):
            if not spec.strip():
                raise InvalidArgument(f"task {task_name}: the lock key must not be empty")
            known = {p.name for p in parameters}
            for root in _template_fields(spec, task_name):
                if root not in known and self._var_keyword is None:
                    takes = ", ".join(sorted(known)) or "no arguments"
                    raise InvalidArgument(
                        f"task {task_name}: key template {spec!r} names unknown argument "
                        f"{root!r}; the task takes: {takes}"
                    )
        elif not callable(spec):
            raise InvalidArgument(
                f"task {task_name}: key must be a format string, a callable or None, "
                f"got {type(spec).__name__}"
            )

    def arguments(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> inspect.BoundArguments:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise InvalidArgument(
                f"task {self.task_name}: cannot compute the lock key, the call does not "
                f"match the task's signature {self.signature}: {exc}"
            ) from exc
        bound.apply_defaults()
        return bound

    def __call__(self, args: tuple[Any, ...] | list[Any], kwargs: Mapping[str, Any]) -> str:
        bound = self.arguments(tuple(args or ()), kwargs or {})
        spec = self.spec
        if spec is None:
            return self._hashed(bound)
        if isinstance(spec, str):
            values = dict(bound.arguments)
            if self._var_keyword is not None:
                values = {**values.pop(self._var_keyword, {}), **values}
            try:
                name = spec.format_map(values)
            except (KeyError, AttributeError, IndexError, TypeError, ValueError) as exc:
                raise InvalidArgument(
                    f"task {self.task_name}: key template {spec!r} cannot be rendered "
                    f"for this call: {type(exc).__name__}: {exc}"
                ) from exc
        else:
            name = spec(*bound.args, **bound.kwargs)
            if not isinstance(name, str):
                raise InvalidArgument(
                    f"task {self.task_name}: the key callable returned "
                    f"{type(name).__name__}, expected a str"
                )
        return validate_name(name)

    def _hashed(self, bound: inspect.BoundArguments) -> str:
        try:
            text = json.dumps(
                bound.arguments, sort_keys=True, separators=(",", ":"), default=_canonical
            )
        except TypeError as exc:
            raise InvalidArgument(
                f"task {self.task_name}: cannot hash an argument of type {exc} into the "
                "default lock key; give the task an explicit key=..."
            ) from exc
        return f"{self.task_name}:{hashlib.sha1(text.encode()).hexdigest()}"


__all__ = ["KeySpec", "TaskKey"]
