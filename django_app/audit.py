"""Lock events, written off the hot path.

Only the kinds listed in ``TASK_LOCKS["AUDIT"]`` are kept (default: ``lost``, ``forced``,
``conflict``: the ones an operator asks about). :func:`record` puts the event on a queue
and returns; one daemon thread per process writes queued events in batches with
``bulk_create``. So taking and releasing a lock never waits for the audit table, and a
database hiccup costs events, never locks. Operator actions pass ``sync=True`` so the
record exists before the admin or the command says "done". :func:`flush` waits for the
queue to drain (commands call it before they exit).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from dataclasses import dataclass

from task_locks.types import Owner

from . import conf

log = logging.getLogger("django_app.audit")

BATCH = 200


@dataclass(frozen=True, slots=True)
class _Event:
    kind: str
    name: str
    fence: int | None
    owner: str
    actor: str
    detail: str


class _Writer:
    def __init__(self) -> None:
        self.queue: queue.Queue[_Event] = queue.Queue()
        self.pending = 0
        self.idle = threading.Condition()
        self.thread: threading.Thread | None = None
        self.pid = os.getpid()

    def put(self, event: _Event) -> None:
        if self.pid != os.getpid():  # forked: the parent's thread is not ours
            self.__init__()  # type: ignore[misc]
        with self.idle:
            self.pending += 1
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self._run, name="task-locks-audit", daemon=True
                )
                self.thread.start()
        self.queue.put(event)

    def _run(self) -> None:
        from django.db import close_old_connections, connection

        try:
            while True:
                try:
                    batch = [self.queue.get(timeout=5.0)]
                except queue.Empty:
                    with self.idle:
                        if self.pending == 0:
                            self.thread = None
                            return
                    continue
                while len(batch) < BATCH:
                    try:
                        batch.append(self.queue.get_nowait())
                    except queue.Empty:
                        break
                try:
                    _write(batch)
                except Exception as exc:  # audit must never break locking
                    log.warning("could not write %d lock event(s): %s", len(batch), exc)
                    close_old_connections()
                with self.idle:
                    self.pending -= len(batch)
                    self.idle.notify_all()
        finally:
            connection.close()

    def flush(self, timeout: float) -> bool:
        with self.idle:
            return self.idle.wait_for(lambda: self.pending <= 0, timeout)


def _write(events: list[_Event]) -> None:
    from .models import LockEvent

    LockEvent.objects.bulk_create(
        [
            LockEvent(
                kind=e.kind,
                name=e.name[:512],
                fence=e.fence,
                owner=e.owner,
                actor=e.actor[:255],
                detail=e.detail,
            )
            for e in events
        ]
    )


_writer = _Writer()


def enabled(kind: str) -> bool:
    return kind in conf.audit_kinds()


def record(
    kind: str,
    name: str,
    *,
    fence: int | None = None,
    owner: Owner | None = None,
    actor: str = "",
    detail: str = "",
    sync: bool = False,
) -> None:
    """Remember that ``kind`` happened to lock ``name`` (if ``AUDIT`` keeps that kind)."""
    if kind not in conf.EVENT_KINDS:
        raise ValueError(f"unknown lock event kind {kind!r}; known: {list(conf.EVENT_KINDS)}")
    if not enabled(kind):
        return
    event = _Event(kind, name, fence, owner.to_json() if owner else "", actor, detail)
    if sync:
        _write([event])
    else:
        _writer.put(event)


def flush(timeout: float = 5.0) -> bool:
    """Wait until queued events are written; ``False`` if ``timeout`` ran out."""
    return _writer.flush(timeout)


atexit.register(flush, 2.0)

__all__ = ["enabled", "flush", "record"]
