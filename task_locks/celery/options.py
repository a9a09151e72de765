"""Per-call lock options of a singleton task: ``apply_async(..., lock_options={...})``.

celery-once users pass ``once={"timeout": ..., "graceful": ...}`` per call; this is the
task-locks equivalent::

    sync_account.apply_async((42,), lock_options={"ttl": 600, "on_conflict": "raise"})

Keys (each replaces the task's option for this call only; :data:`PER_CALL`):

- ``ttl``: the run lock's TTL (``@singleton_task(ttl=)``);
- ``on_conflict``: ``"skip"``, ``"retry"``, ``"wait"`` or ``"raise"``; also decides, for
  ``lock_on="enqueue"``/``"both"``, whether ``apply_async`` raises ``DuplicateTask``
  (``"raise"``) or returns the queued task's handle;
- ``timeout``: how long ``on_conflict="wait"`` waits (``wait_timeout``);
- ``max_hold``: seconds after which renewal stops (``max_hold``);
- ``enqueue_ttl``: for ``lock_on="enqueue"``/``"both"``, how long the lock taken when
  this message is published lasts (``@singleton_task(enqueue_ttl=)``, counted from the
  message's ETA): celery-once's ``once={"timeout": ...}``.

They are validated in ``apply_async`` (a bad key or value raises
:class:`~task_locks.InvalidArgument` there, and nothing is sent) and travel in the
message's headers (:data:`OPTIONS_HEADER`), so they reach the worker, eager runs and the
task's own retries. The publish guard reads them from the message too, but takes only
``enqueue_ttl`` (:func:`for_this_publish`): whether a publish waits for a queued
duplicate stays the task's choice (its ``on_conflict`` and ``wait_timeout``), while
``on_conflict="raise"`` for the call still makes ``apply_async`` raise ``DuplicateTask``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from ..config import validate_ttl
from ..errors import InvalidArgument
from ..lock import validate_timeout
from ..policies import ON_CONFLICT, check_on_conflict

if TYPE_CHECKING:
    from .task import SingletonTask

#: Message header carrying a call's lock options.
OPTIONS_HEADER: Final = "task_locks_options"
#: ``lock_options`` key -> the task attribute it replaces for one call.
PER_CALL: Final = {
    "ttl": "lock_ttl",
    "on_conflict": "on_conflict",
    "timeout": "wait_timeout",
    "max_hold": "max_hold",
    "enqueue_ttl": "enqueue_ttl",
}
_APPLIED: Final = "_task_locks_per_call"


def check_lock_options(task_name: str, options: object) -> dict[str, Any]:
    """``options`` validated (a plain dict, JSON-able), or :class:`InvalidArgument`."""
    if not isinstance(options, Mapping):
        raise InvalidArgument(
            f"task {task_name}: lock_options must be a dict, got {type(options).__name__}"
        )
    unknown = sorted(map(str, set(options) - PER_CALL.keys()))
    if unknown:
        raise InvalidArgument(
            f"task {task_name}: unknown lock_options {unknown}; known: {sorted(PER_CALL)}"
        )
    checked = dict(options)
    what = f"task {task_name}: lock_options"
    if "on_conflict" in checked:
        check_on_conflict(checked["on_conflict"], what, ON_CONFLICT)
    for key in ("ttl", "max_hold", "enqueue_ttl"):
        if checked.get(key) is not None:
            checked[key] = validate_ttl(checked[key], f"{what}: {key}")
    if "timeout" in checked:
        try:
            checked["timeout"] = validate_timeout(checked["timeout"])
        except InvalidArgument as exc:
            raise InvalidArgument(f"{what}: {exc}") from None
    return checked


def with_lock_options(
    task_name: str, lock_options: object, headers: Mapping[str, Any] | None
) -> dict[str, Any]:
    """``apply_async``'s ``headers`` with the validated ``lock_options`` added."""
    return {**(headers or {}), OPTIONS_HEADER: check_lock_options(task_name, lock_options)}


def call_options(task: SingletonTask) -> dict[str, Any] | None:
    """The lock options the message being run carries (``None``: none, or applied)."""
    if task.__dict__.get(_APPLIED):
        return None
    request = task.request
    found = getattr(request, OPTIONS_HEADER, None)  # a worker: headers are attributes
    if found is None:
        headers = getattr(request, "headers", None)  # eager runs keep them in .headers
        found = headers.get(OPTIONS_HEADER) if isinstance(headers, Mapping) else None
    return found or None


def for_this_call(task: SingletonTask, options: Mapping[str, Any]) -> SingletonTask:
    """A copy of ``task`` with ``options`` in place of its own, for one run.

    Celery shares one task object between the threads of a worker, so the options are
    not set on it. The copy shares its class, hence its request stack, app and key.
    (``copy.copy`` would not do: a Celery task pickles as a reference to itself.)
    """
    clone = _copy(task)
    for key, value in check_lock_options(task.name, options).items():
        setattr(clone, PER_CALL[key], value)
    setattr(clone, _APPLIED, True)
    return clone


def for_this_publish(
    task: SingletonTask, headers: Mapping[str, Any], options: Mapping[str, Any]
) -> SingletonTask:
    """``task`` as the publish-time lock of one message sees it: with the call's
    ``enqueue_ttl``, if it set one (else ``task`` itself).

    The guard runs inside ``send_task_message``, before Celery merges
    ``options["headers"]`` into the message's headers: look in both (a retry's message
    carries them in its own headers).
    """
    extra = options.get("headers")
    found = (extra if isinstance(extra, Mapping) else {}).get(OPTIONS_HEADER)
    if found is None:
        found = headers.get(OPTIONS_HEADER)
    if not isinstance(found, Mapping) or "enqueue_ttl" not in found:
        return task
    clone = _copy(task)
    clone.enqueue_ttl = check_lock_options(task.name, found)["enqueue_ttl"]
    return clone


def _copy(task: SingletonTask) -> SingletonTask:
    clone = object.__new__(type(task))
    clone.__dict__.update(task.__dict__)
    return clone


__all__ = [
    "OPTIONS_HEADER",
    "PER_CALL",
    "call_options",
    "check_lock_options",
    "for_this_call",
    "for_this_publish",
]
