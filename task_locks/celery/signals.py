"""Celery signal receivers: the idempotent second release of every singleton lock.

Connected once, when :mod:`task_locks.celery` is imported (strong references, so they
live as long as the process). Each release is token-checked, so running after the
task's own ``finally`` costs nothing and can never free someone else's lock.

- ``task_prerun`` (every task, singleton or not): no body starts while a finished run's
  release is unsent (:mod:`task_locks.celery.releaser`).
- ``task_postrun`` / ``task_failure`` (the process that ran the task): leftovers of the run.
- ``worker_ready`` (the worker's main process): warn once about each lock backend of the
  app's singleton tasks that does not answer (:mod:`task_locks.celery.unavailable`).
- ``task_revoked`` (the worker's main process): a message revoked or expired before it
  ran frees the lock taken when it was published (token from its headers).
- ``worker_process_shutdown`` (prefork child) / ``worker_shutdown`` (solo, threads):
  whatever this process still holds.

A killed prefork child is handled by :class:`~task_locks.celery.request.SingletonRequest`.
"""

from __future__ import annotations

from typing import Any

from celery import signals

from ..errors import LockError
from .registry import live_leases, recover_task_locks, release_leftovers
from .releaser import releaser
from .task import TOKEN_HEADER, SingletonTask
from .unavailable import warn_if_unreachable


def _before_task(sender: Any = None, **_: Any) -> None:
    """Send the releases deferred by finished runs before this task's body can keep
    the GIL (and with it the releaser thread) for as long as it likes.

    A singleton task whose run takes its lock on the releases' backend carries them in
    that acquire, before its body: those are left to it.
    """
    if releaser.idle():
        return
    carrier = None
    if isinstance(sender, SingletonTask) and sender.lock_on != "enqueue":
        try:
            carrier = sender.resolved_lock_backend()
        except LockError:  # not configured: its run fails on its own; send them all
            carrier = None
        if releaser.idle_but(carrier):  # back-to-back runs: all ride this run's acquire
            return
    releaser.flush(keep=carrier)


def _after_task(task_id: str | None = None, **_: Any) -> None:
    leftovers = live_leases.pop(task_id)
    if leftovers:
        release_leftovers(leftovers, f"end of task {task_id}")


def _on_revoked(
    sender: Any = None,
    request: Any = None,
    terminated: bool = False,
    expired: bool = False,
    **_: Any,
) -> None:
    if request is None:
        return
    if terminated or not isinstance(sender, SingletonTask):
        return  # a terminated run is recovered by SingletonRequest.terminate (knows the pid)
    token = getattr(request, TOKEN_HEADER, None)
    if token:
        recover_task_locks(
            sender,
            request.id,
            request.args,
            request.kwargs,
            token=token,
            pid=None,
            why="expired" if expired else "revoked before it ran",
        )


def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is not None:
        tasks = [task for task in app.tasks.values() if isinstance(task, SingletonTask)]
        warn_if_unreachable(tasks)


def _on_shutdown(**_: Any) -> None:
    releaser.flush()  # releases deferred by finished runs go out first
    leftovers = live_leases.pop_all()
    if leftovers:
        release_leftovers(leftovers, "worker shutdown")


def connect() -> None:
    signals.task_prerun.connect(_before_task, weak=False, dispatch_uid="task_locks.prerun")
    signals.task_postrun.connect(_after_task, weak=False, dispatch_uid="task_locks.postrun")
    signals.task_failure.connect(_after_task, weak=False, dispatch_uid="task_locks.failure")
    signals.worker_ready.connect(_on_worker_ready, weak=False, dispatch_uid="task_locks.ready")
    signals.task_revoked.connect(_on_revoked, weak=False, dispatch_uid="task_locks.revoked")
    signals.worker_process_shutdown.connect(
        _on_shutdown, weak=False, dispatch_uid="task_locks.process_shutdown"
    )
    signals.worker_shutdown.connect(_on_shutdown, weak=False, dispatch_uid="task_locks.shutdown")


__all__ = ["connect"]
