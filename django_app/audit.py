"""Lock events as ``LockEvent`` rows: one batch subscriber of :mod:`task_locks.events`.

Every lock event of the process (``Lock()``, ``@singleton_task``, ``Election``, the beat
scheduler, the CLIs, the admin) goes through the one event stream; this module subscribes
its writer to the kinds ``TASK_LOCKS["AUDIT"]`` keeps (default ``lost``, ``forced``,
``conflict``: the ones an operator asks about). The stream's dispatcher thread hands it
events in batches, written with one ``bulk_create`` each: taking and releasing a lock
never waits for the audit table, and a database hiccup costs events, never locks. Each
row has the job, host and pid (the holder as JSON in ``owner``; the process that saw it
in ``actor`` when nobody is named) and the fence.

:func:`record` is how the Django front ends report (it emits into the stream, so metrics
and log subscribers see the same events). Operator actions pass ``sync=True``: their row
is written in the caller's thread before the admin or the command says "done", and the
writer skips that event when the dispatcher brings it. :func:`flush` waits for the
stream to drain (commands call it before they exit).

:func:`install` (called from the app's ``ready()``, and again when ``TASK_LOCKS``
changes) subscribes the writer; ``TASK_LOCKS["METRICS"] = True`` also installs the
Prometheus collectors (:func:`task_locks.metrics.install`).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from django.core.signals import setting_changed
from django.dispatch import receiver

from task_locks import events
from task_locks.events import LockEvent as StreamEvent
from task_locks.listing import format_duration
from task_locks.types import Owner

from . import conf

log = logging.getLogger("django_app.audit")

#: Events the caller already wrote (``record(sync=True)``): (kind, name, at).
_written: set[tuple[str, str, float]] = set()
_written_guard = threading.Lock()
_subscription: events.Subscription | None = None
_install_guard = threading.Lock()
_here = f"{socket.gethostname()} pid {{pid}}"


def _rounded(seconds: float) -> str:
    return format_duration(seconds) if seconds >= 0.1 else f"{seconds * 1000:.0f}ms"


def _detail(event: StreamEvent) -> str:
    """The row's free text: what the front end said, then the event's typed fields."""
    parts = [event.detail] if event.detail else []
    if event.policy:
        parts.append(f"policy {event.policy}")
    if event.reason:
        parts.append(f"reason: {event.reason}")
    if event.waited is not None:
        parts.append(f"waited {_rounded(event.waited)}")
    if event.held is not None:
        parts.append(f"held {_rounded(event.held)}")
    if event.backend:
        parts.append(f"backend {event.backend}")
    return "; ".join(parts)


def _row(event: StreamEvent, pid: int) -> Any:
    from .models import LockEvent

    row = LockEvent(
        kind=event.kind,
        name=event.name[:512],
        fence=event.fence,
        owner=event.owner.to_json() if event.owner else "",
        # Written in the process that saw it (a forked worker has its own dispatcher).
        actor=(event.actor or _here.format(pid=pid))[:255],
        detail=_detail(event),
    )
    # When it happened, not when the batch was written.
    row.created_at = dt.datetime.fromtimestamp(event.at, tz=dt.UTC)
    return row


def _write(batch: Sequence[StreamEvent]) -> None:
    """The subscriber: one ``bulk_create`` per batch, in the dispatcher thread."""
    from django.db import connection

    from .models import LockEvent

    with _written_guard:
        fresh = [e for e in batch if (e.kind, e.name, e.at) not in _written]
        _written.difference_update((e.kind, e.name, e.at) for e in batch)
    fresh = [e for e in fresh if e.kind in conf.audit_kinds()]
    if not fresh:
        return
    pid = os.getpid()
    try:
        LockEvent.objects.bulk_create([_row(e, pid) for e in fresh], batch_size=500)
    except Exception as exc:  # audit must never break locking
        log.warning("could not write %d lock event(s): %s", len(fresh), exc)
    finally:
        # The dispatcher thread may end when idle: never leave its connection behind.
        connection.close()


def install() -> None:
    """Subscribe the writer to the kinds ``AUDIT`` keeps (again: when it changes)."""
    global _subscription
    with _install_guard:
        if _subscription is not None:
            _subscription.close()
            _subscription = None
        kinds = conf.audit_kinds()
        if kinds:
            _subscription = events.subscribe(_write, kinds, batch=True, name="django_app.audit")
    if conf.metrics_enabled():
        try:
            from task_locks import metrics

            metrics.install()
        except ImportError as exc:  # reported by the system check task_locks.E004
            log.warning("TASK_LOCKS['METRICS'] is True but %s", exc)


@receiver(setting_changed)
def _setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting == conf.SETTING:
        install()


def enabled(kind: str) -> bool:
    """Whether ``TASK_LOCKS["AUDIT"]`` keeps events of ``kind`` as Lock events rows."""
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
    policy: str = "",
    backend: str = "",
) -> None:
    """Report that ``kind`` happened to lock ``name``: an event of the stream.

    It becomes a row if ``AUDIT`` keeps that kind; with ``sync=True`` the row is written
    here and now (operator actions: recorded before the UI says done).
    """
    if kind not in conf.EVENT_KINDS:
        raise ValueError(f"unknown lock event kind {kind!r}; known: {list(conf.EVENT_KINDS)}")
    at = time.time()
    if sync and enabled(kind):
        event = StreamEvent(
            kind, name, backend=backend, fence=fence, owner=owner, policy=policy,
            actor=actor, detail=detail, at=at,
        )  # fmt: skip
        from .models import LockEvent

        LockEvent.objects.bulk_create([_row(event, os.getpid())])
        if _subscription is not None and kind in _subscription.kinds:
            with _written_guard:
                _written.add((kind, name, at))
    events.emit(
        kind, name, backend=backend, fence=fence, owner=owner, policy=policy,
        actor=actor, detail=detail, at=at,
    )  # fmt: skip


def flush(timeout: float = 5.0) -> bool:
    """Wait until the stream's queued events are written; ``False`` if ``timeout`` ran out."""
    return events.flush(timeout)


__all__ = ["enabled", "flush", "install", "record"]
