"""What a singleton task does when its lock service does not answer.

``lock_unavailable`` says what a run does when taking its lock raises
:class:`~task_locks.BackendUnavailable` (the server is down, unreachable or too slow),
before its body has run:

- ``"fail"`` (the default): the run fails with ``BackendUnavailable``, as any task whose
  exception is not in its ``autoretry_for``. Nothing ran, so nothing needs undoing.
- ``"retry"``: ``self.retry()``, exactly as Celery's ``autoretry_for`` would for that
  error, with the task's own ``retry_backoff``, ``retry_backoff_max``, ``retry_jitter``,
  ``retry_kwargs``, ``default_retry_delay`` and ``max_retries``; once the retries run
  out the run fails with the last ``BackendUnavailable``.

The body never runs without the lock, whatever the option: a lock service that does not
answer is never taken for a free lock. (``autoretry_for`` itself wraps only the body:
it never sees an acquire's error.)

At worker start (``worker_ready``), every lock backend of the app's singleton tasks is
probed once, off the worker's thread; one that does not answer is logged at WARNING,
one line per backend, its URL without the password.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final

from celery.utils.time import get_exponential_backoff_interval

from ..backends.base import Backend
from ..errors import BackendUnavailable, InvalidArgument, LockError

if TYPE_CHECKING:
    from ._common import LockingTask

log = logging.getLogger("task_locks.celery")

#: The values of ``lock_unavailable``.
LOCK_UNAVAILABLE: Final = ("fail", "retry")
#: The lock name the start-up probe reads (never written).
PROBE_NAME: Final = "task-locks:worker-start-probe"


def check_lock_unavailable(task_name: str, value: object) -> None:
    if value not in LOCK_UNAVAILABLE:
        raise InvalidArgument(
            f"task {task_name}: lock_unavailable must be one of "
            f"{', '.join(map(repr, LOCK_UNAVAILABLE))}, got {value!r}"
        )


def on_unavailable(task: Any, exc: BackendUnavailable) -> None:
    """Raise what the run ends with when its acquire met ``exc``: Celery's ``Retry``
    (``lock_unavailable="retry"``, retries left), else nothing (the caller re-raises)."""
    if task.lock_unavailable != "retry":
        return
    options = dict(getattr(task, "retry_kwargs", None) or {})
    backoff = float(getattr(task, "retry_backoff", False))
    if backoff:  # as celery.app.autoretry computes it
        options["countdown"] = get_exponential_backoff_interval(
            factor=int(max(1.0, backoff)),
            retries=task.request.retries,
            maximum=int(getattr(task, "retry_backoff_max", 600)),
            full_jitter=getattr(task, "retry_jitter", True),
        )
    raise task.retry(exc=exc, **options)


def probe(backend: Backend) -> str | None:
    """``None`` if ``backend`` answers a read, else what went wrong (bounded by the
    backend's own connect and socket timeouts)."""
    try:
        backend.holder(PROBE_NAME)
    except LockError as exc:
        return str(exc)
    except Exception as exc:  # a probe must report, never crash the worker
        return f"{type(exc).__name__}: {exc}"
    return None


def lock_backends(tasks: Iterable[LockingTask]) -> dict[str, Backend]:
    """The distinct lock backends of ``tasks`` (singleton tasks), by redacted URL."""
    found: dict[str, Backend] = {}
    for task in tasks:
        try:
            backend = task.resolved_lock_backend()
        except LockError as exc:  # not configured: the run would fail the same way
            log.warning("task %s: no usable lock backend: %s", task.name, exc)
            continue
        found.setdefault(backend.server, backend)
    return found


def warn_if_unreachable(tasks: Iterable[Any]) -> threading.Thread:
    """Probe the lock backends of ``tasks`` (singleton tasks) in a daemon thread; log each one that does
    not answer, once. The thread (started) is returned."""
    backends = lock_backends(tasks)

    def run() -> None:
        for server, backend in backends.items():
            problem = probe(backend)
            if problem is not None:
                log.warning(
                    "lock backend %s is unreachable at worker start (%s): singleton tasks "
                    "on it fail (or retry, lock_unavailable='retry') until it answers",
                    server,
                    problem,
                )

    thread = threading.Thread(target=run, name="task-locks-start-probe", daemon=True)
    thread.start()
    return thread


__all__ = [
    "LOCK_UNAVAILABLE",
    "check_lock_unavailable",
    "lock_backends",
    "on_unavailable",
    "probe",
    "warn_if_unreachable",
]
