"""Leases held by the tasks running in this process, and the clean-up that uses them.

The ``finally`` of a run releases its lease; this registry is the second line: Celery's
``task_postrun`` / ``task_failure`` / ``task_revoked`` and process-shutdown signals release
whatever a run left behind, token-checked and idempotently. :func:`recover_task_locks`
is the third line, run by the worker's *main* process for a child that died mid-task.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Final

from ..errors import LockError
from ..lock import Lease

if TYPE_CHECKING:
    from ..backends.base import Backend
    from ..lock import AsyncLease
    from ._common import LockingTask

log = logging.getLogger("task_locks.celery")

#: How long the main process waits for a killed child to be gone before releasing.
CHILD_EXIT_WAIT: Final = 10.0
_host = socket.gethostname()


class LiveLeases:
    """(task id, thread) -> leases that run holds in this process (thread-safe).

    Keyed by thread as well: a redelivered copy of a running message has the same task
    id, and in the threads pool it may finish in this process while the first runs.
    Celery sends ``task_postrun``/``task_failure`` in the thread that ran the task.
    """

    def __init__(self) -> None:
        self._by_task: dict[tuple[str, int], list[Lease | AsyncLease]] = {}
        self._guard = threading.Lock()

    def add(self, task_id: str | None, lease: Lease | AsyncLease) -> None:
        if task_id is None:
            return
        with self._guard:
            self._by_task.setdefault((task_id, threading.get_ident()), []).append(lease)

    def discard(self, task_id: str | None, lease: Lease | AsyncLease) -> None:
        if task_id is None:
            return
        slot = (task_id, threading.get_ident())
        with self._guard:
            leases = self._by_task.get(slot)
            if leases and lease in leases:
                leases.remove(lease)
                if not leases:
                    del self._by_task[slot]

    def pop(self, task_id: str | None) -> list[Lease | AsyncLease]:
        """What the run of ``task_id`` in this thread still holds."""
        if task_id is None or not self._by_task:  # the usual case after a clean run
            return []
        with self._guard:
            return self._by_task.pop((task_id, threading.get_ident()), [])

    def pop_all(self) -> list[Lease | AsyncLease]:
        with self._guard:
            leases = [lease for group in self._by_task.values() for lease in group]
            self._by_task.clear()
        return leases

    def __len__(self) -> int:
        with self._guard:
            return sum(len(group) for group in self._by_task.values())


live_leases = LiveLeases()


def release_leftovers(leases: list[Lease | AsyncLease], why: str) -> None:
    """Release leases a run left behind (token-checked; a lost one is just logged)."""
    for lease in leases:
        try:
            if isinstance(lease, Lease):
                lease.release()  # also stops its renewal
                released = True
            else:  # its event loop is gone: release with the sync client
                released = lease.backend.release(lease.name, lease.token)
        except LockError as exc:
            log.warning("releasing lock %r on %s failed: %s", lease.name, why, exc)
            continue
        if released:
            log.info("released lock %r on %s", lease.name, why)


def process_gone(pid: int) -> bool:
    """``True`` once ``pid`` has exited (a zombie waiting to be reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def _release_if_ours(backend: Backend, name: str, task_id: str, pid: int, why: str) -> None:
    """Release ``name`` if the dead child ``pid`` still holds it for ``task_id``."""
    holder = backend.holder(name)
    if holder is None or not holder.token:
        return
    owner = holder.owner
    if owner.task_id != task_id or owner.pid != pid or (owner.host and owner.host != _host):
        return
    if backend.release(name, holder.token):
        log.warning("released lock %r of task %s (pid %s): %s", name, task_id, pid, why)


def _release_queued_if_never_taken(backend: Backend, name: str, token: str, why: str) -> None:
    """``"both"``: free the publish-time lock of a run that died before taking it over.

    Taken over, the lock names a worker (the run's owner); still queued, it names none.
    A redelivered copy could take it over between this read and the release (same
    token): the window is one round trip, and only with a copy already running.
    """
    holder = backend.holder(name)
    if holder is None or holder.token != token or holder.owner.worker:
        return
    if backend.release(name, token):
        log.warning("released queued lock %r of a run that died before taking it: %s", name, why)


def recover_task_locks(
    task: LockingTask,
    task_id: str,
    args: Any,
    kwargs: Any,
    *,
    token: str | None,
    pid: int | None,
    why: str,
) -> None:
    """Main process: free what a task that will never reach its ``finally`` holds.

    ``token`` (from the message headers) frees the lock taken at publish, if the task
    never started (``pid`` None) or dropped that lock as it started (``"enqueue"``);
    a ``"both"`` run took that lock over, so it is its run lock. ``pid`` is the child that
    ran the task, whose run lock (with ``limit`` > 1: its permit; and its run guard) is
    released once the child is gone and only if the lock's owner metadata still names
    that task and that pid: a redelivered copy may hold the same token by then.
    """
    try:
        name = task.lock_name(*(args or ()), **(kwargs or {}))
        held_names = task.held_lock_names(name, task_id)
        backend = task.resolved_lock_backend()
    except LockError as exc:
        log.warning("cannot recover the lock of %s[%s]: %s", task.name, task_id, exc)
        return
    if token and (pid is None or task.lock_on == "enqueue"):
        try:
            if backend.release(name, token):
                log.info("released queued lock %r of %s[%s]: %s", name, task.name, task_id, why)
        except LockError as exc:
            log.warning("releasing queued lock %r failed: %s", name, exc)
    if pid is None or pid == os.getpid():
        return  # never started, or ran in this process (its own finally releases)

    def release_when_gone() -> None:
        deadline = time.monotonic() + CHILD_EXIT_WAIT
        while not process_gone(pid):
            if time.monotonic() >= deadline:
                log.warning(
                    "pid %s still alive %.0fs after %s; lock %r left to its TTL",
                    pid,
                    CHILD_EXIT_WAIT,
                    why,
                    name,
                )
                return
            time.sleep(0.02)
        for held in held_names:
            try:
                _release_if_ours(backend, held, task_id, pid, why)
            except LockError as exc:
                log.warning("releasing lock %r of dead pid %s failed: %s", held, pid, exc)
        if token and task.lock_on == "both":
            try:
                _release_queued_if_never_taken(backend, name, token, why)
            except LockError as exc:
                log.warning("releasing queued lock %r failed: %s", name, exc)

    if process_gone(pid):
        release_when_gone()  # now, before the message can be redelivered
    else:
        threading.Thread(target=release_when_gone, name="task-locks-recover", daemon=True).start()


__all__ = ["LiveLeases", "live_leases", "process_gone", "recover_task_locks", "release_leftovers"]
