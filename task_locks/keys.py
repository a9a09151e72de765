"""Lock names for tasks and functions: a template, a callable or a hash, over the bound
arguments of one call.

Shared by ``@singleton_task`` (:mod:`task_locks.celery`) and ``@locked``
(:mod:`task_locks.decorators`); ``task_locks.celery.keys`` re-exports it.

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

from .errors import InvalidArgument
from .lock import validate_name

KeySpec = str | Callable[..., str] | None

_ROOT = re.compile(r"[.\[]")


def _template_fields(template: str, task_name: str, kind: str = "task") -> list[str]:
    """The root argument names a ``str.format`` template refers to (``{a.b[0]}`` -> ``a``)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise InvalidArgument(
            f"{kind} {task_name}: malformed key template {template!r}: {exc}"
        ) from exc
    roots: list[str] = []
    for _literal, field, spec, _conversion in parsed:
        if field is None:
            continue
        root = _ROOT.split(field, maxsplit=1)[0]
        if not root or root.isdigit():
            raise InvalidArgument(
                f"{kind} {task_name}: key template {template!r} has a positional field "
                f"{{{field}}}; name the argument instead, e.g. {{account_id}}"
            )
        roots.append(root)
        if spec and "{" in spec:
            roots.extend(_template_fields(spec, task_name, kind))
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


_PLAIN_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class _FastBinder:
    """``Signature.bind`` + ``apply_defaults`` for signatures without ``*``/``**``/``/``.

    A worker renders a key per task run; ``inspect`` binding costs several microseconds
    of that. This does the same for the common plain signature and declines (``None``)
    whatever it is not sure about, so errors still come from ``inspect`` with its message.
    """

    def __init__(self, parameters: list[inspect.Parameter]) -> None:
        self.names = tuple(p.name for p in parameters)
        self.positional = tuple(
            p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        self.keyword_only = tuple(
            p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY
        )
        self.known = frozenset(self.names)
        self.defaults = {
            p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty
        }
        self.required = frozenset(self.names) - self.defaults.keys()

    @classmethod
    def for_parameters(cls, parameters: list[inspect.Parameter]) -> _FastBinder | None:
        if all(p.kind in _PLAIN_KINDS for p in parameters):
            return cls(parameters)
        return None

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
        """Values by name in signature order, or ``None`` to let ``inspect`` decide."""
        positional = self.positional
        if len(args) > len(positional):
            return None
        given = dict(zip(positional, args, strict=False))
        for key in kwargs:
            if key not in self.known or key in given:
                return None
        given.update(kwargs)
        if not self.required <= given.keys():
            return None
        defaults = self.defaults
        return {n: given[n] if n in given else defaults[n] for n in self.names}

    def positional_values(self, values: Mapping[str, Any]) -> list[Any]:
        return [values[n] for n in self.positional]

    def keyword_values(self, values: Mapping[str, Any]) -> dict[str, Any]:
        return {n: values[n] for n in self.keyword_only}


class TaskKey:
    """Renders a task's (or, with ``kind="function"``, a function's) lock name from the
    arguments of one call. ``kind`` only names the thing in error messages."""

    def __init__(
        self,
        spec: KeySpec,
        function: Callable[..., Any],
        task_name: str,
        *,
        bound: bool,
        kind: str = "task",
    ):
        self.spec = spec
        self.task_name = task_name
        self.kind = kind
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"{kind} {task_name}: cannot read its signature: {exc}") from exc
        parameters = list(signature.parameters.values())
        if bound and parameters:
            parameters = parameters[1:]  # ``self`` of a bind=True task
        self.signature = signature.replace(parameters=parameters)
        self._var_keyword = next(
            (p.name for p in parameters if p.kind is inspect.Parameter.VAR_KEYWORD), None
        )
        self._fast = _FastBinder.for_parameters(parameters)
        if spec is None:
            return
        if isinstance(spec, str):
            if not spec.strip():
                raise InvalidArgument(f"{kind} {task_name}: the lock key must not be empty")
            known = {p.name for p in parameters}
            for root in _template_fields(spec, task_name, kind):
                if root not in known and self._var_keyword is None:
                    takes = ", ".join(sorted(known)) or "no arguments"
                    raise InvalidArgument(
                        f"{kind} {task_name}: key template {spec!r} names unknown argument "
                        f"{root!r}; the {kind} takes: {takes}"
                    )
        elif not callable(spec):
            raise InvalidArgument(
                f"{kind} {task_name}: key must be a format string, a callable or None, "
                f"got {type(spec).__name__}"
            )

    def arguments(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> inspect.BoundArguments:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise InvalidArgument(
                f"{self.kind} {self.task_name}: cannot compute the lock key, the call does not "
                f"match the task's signature {self.signature}: {exc}"
            ) from exc
        bound.apply_defaults()
        return bound

    def __call__(self, args: tuple[Any, ...] | list[Any], kwargs: Mapping[str, Any]) -> str:
        args, kwargs = tuple(args or ()), kwargs or {}
        fast = self._fast
        values = fast.bind(args, kwargs) if fast is not None else None
        bound = None
        if values is None:
            bound = self.arguments(args, kwargs)
            values = bound.arguments
        spec = self.spec
        if spec is None:
            return self._hashed(values)
        if isinstance(spec, str):
            if self._var_keyword is not None:
                values = dict(values)
                values = {**values.pop(self._var_keyword, {}), **values}
            try:
                name = spec.format_map(values)
            except (KeyError, AttributeError, IndexError, TypeError, ValueError) as exc:
                raise InvalidArgument(
                    f"{self.kind} {self.task_name}: key template {spec!r} cannot be rendered "
                    f"for this call: {type(exc).__name__}: {exc}"
                ) from exc
        elif bound is not None:
            name = spec(*bound.args, **bound.kwargs)
        else:
            assert fast is not None
            name = spec(*fast.positional_values(values), **fast.keyword_values(values))
        if not isinstance(name, str):
            raise InvalidArgument(
                f"{self.kind} {self.task_name}: the key callable returned "
                f"{type(name).__name__}, expected a str"
            )
        return validate_name(name)

    def _hashed(self, arguments: Mapping[str, Any]) -> str:
        try:
            text = json.dumps(arguments, sort_keys=True, separators=(",", ":"), default=_canonical)
        except TypeError as exc:
            raise InvalidArgument(
                f"{self.kind} {self.task_name}: cannot hash an argument of type {exc} into the "
                f"default lock key; give the {self.kind} an explicit key=..."
            ) from exc
        return f"{self.task_name}:{hashlib.sha1(text.encode()).hexdigest()}"


__all__ = ["KeySpec", "TaskKey"]
