"""Lock events as ``LockEvent`` rows: one batch subscriber of :mod:`task_locks.events`.

Every lock event of the process (``Lock()``, ``@singleton_task``, ``Election``, the beat
scheduler, the CLIs, the admin) goes through the one event stream; this module subscribes
its writer to the kinds ``TASK_LOCKS["AUDIT"]`` keeps (default ``lost``, ``forced``,
``conflict``: the ones an operator asks about). The stream's dispatcher thread hands it
events in batches, written with one ``bulk_create`` each: taking and releasing a lock
never waits for the audit table, and a database hiccup costs events, never locks. Each
row has the job, host and pid (the holder as JSON in ``owner``; the process that saw it
in ``actor`` when nobody is named) and the fence.

**Repeats are counted, not listed.** A ``conflict`` or ``duplicate`` like one already
written (same lock, policy, holder and its fence) within :data:`REPEAT_WINDOW` of that
row's first is folded into it: its ``count`` goes up and ``last_at`` moves on. A storm of
skipped duplicates against one running task is one row saying how many, and the next
holder starts a row of its own.

:func:`prune` deletes rows older than ``TASK_LOCKS["EVENT_RETENTION_DAYS"]`` (``manage.py
locks prune``, or the ``task_locks.prune_lock_events`` Celery task on a beat schedule).

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
from collections.abc import Sequence
from typing import Any

from django.core.signals import setting_changed
from django.dispatch import receiver

from task_locks import events
from task_locks.events import LockEvent as StreamEvent
from task_locks.listing import format_duration

from . import conf

log = logging.getLogger("django_app.audit")

#: Events the caller already wrote (``record(sync=True)``): (kind, name, at).
_written: set[tuple[str, str, float]] = set()
_written_guard = threading.Lock()
_subscription: events.Subscription | None = None
_install_guard = threading.Lock()
_here = f"{socket.gethostname()} pid {{pid}}"
#: Kinds whose repeats fold into one row (see the module's docstring).
REPEATED_KINDS = frozenset({"conflict", "duplicate"})
#: How long after a row's first event a repeat still folds into it.
REPEAT_WINDOW = dt.timedelta(hours=1)


def _rounded(seconds: float) -> str:
    return format_duration(seconds) if seconds >= 0.1 else f"{seconds * 1000:.0f}ms"


def _detail(event: StreamEvent) -> str:
    """The row's free text: what the front end said, then the event's typed fields."""
    parts = [event.detail] if event.detail else []
    if event.policy:
        parts.append(f"policy {event.policy}")
    match event:
        case events.Lost(reason=reason, message=message):
            parts.append(f"reason: {reason}" + (f": {message}" if message else ""))
        case _ if event.reason:
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
        policy=event.policy[:16],
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
        rows = _fold_repeats([_row(e, pid) for e in fresh])
        LockEvent.objects.bulk_create(rows, batch_size=500)
    except Exception as exc:  # audit must never break locking
        log.warning("could not write %d lock event(s): %s", len(fresh), exc)
    finally:
        # The dispatcher thread may end when idle: never leave its connection behind.
        connection.close()


def _repeat_key(row: Any) -> tuple[str, str, str, int | None, str] | None:
    if row.kind not in REPEATED_KINDS:
        return None
    return (row.kind, row.name, row.policy, row.fence, row.owner)


def _fold_repeats(rows: list[Any]) -> list[Any]:
    """Fold repeats into one row each: within the batch, then into the newest matching
    row already written (an ``UPDATE`` of its count). The rows still to insert."""
    from django.db.models import F, Value
    from django.db.models.functions import Coalesce, Greatest

    from .models import LockEvent

    firsts: dict[tuple[Any, ...], Any] = {}
    kept = []
    for row in sorted(rows, key=lambda r: r.created_at):
        key = _repeat_key(row)
        first = firsts.get(key) if key is not None else None
        if first is not None and row.created_at - first.created_at <= REPEAT_WINDOW:
            first.count += 1
            first.last_at = row.created_at
            continue
        if key is not None:
            firsts[key] = row
        kept.append(row)
    for key, row in firsts.items():
        kind, name, policy, fence, owner = key
        earlier = (
            LockEvent.objects.filter(kind=kind, name=name, policy=policy, fence=fence, owner=owner)
            .filter(created_at__gte=row.created_at - REPEAT_WINDOW, created_at__lte=row.created_at)
            .order_by("-created_at")
            .values_list("pk", flat=True)
            .first()
        )
        if earlier is not None:
            # Batches of several processes come in any order: last_at never goes back.
            last = Greatest(Coalesce("last_at", "created_at"), Value(row.last_at or row.created_at))
            LockEvent.objects.filter(pk=earlier).update(count=F("count") + row.count, last_at=last)
            kept.remove(row)
    return kept


def prune(days: float | None = None) -> int:
    """Delete the lock events older than ``days`` (default: ``EVENT_RETENTION_DAYS``), a
    folded row by its last repeat; how many rows went."""
    from django.db.models import Q
    from django.utils import timezone

    from .models import LockEvent

    if days is None:
        days = conf.lock_settings().event_retention_days
    if not days >= 0:
        raise ValueError(f"days must be >= 0, got {days}")
    cutoff = timezone.now() - dt.timedelta(days=days)
    old = Q(last_at__lt=cutoff) | Q(last_at__isnull=True, created_at__lt=cutoff)
    deleted, _ = LockEvent.objects.filter(old).delete()
    return deleted


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


def record(event: StreamEvent, *, sync: bool = False) -> None:
    """Report ``event`` (an operator's :class:`~task_locks.events.Forced`, a refused
    release's :class:`~task_locks.events.Conflict`...): an event of the stream.

    It becomes a row if ``AUDIT`` keeps its kind; with ``sync=True`` the row is written
    here and now (operator actions: recorded before the UI says done).
    """
    if sync and enabled(event.kind):
        from .models import LockEvent

        LockEvent.objects.bulk_create([_row(event, os.getpid())])
        if _subscription is not None and event.kind in _subscription.kinds:
            with _written_guard:
                _written.add((event.kind, event.name, event.at))
    events.emit(event)


def flush(timeout: float = 5.0) -> bool:
    """Wait until the stream's queued events are written; ``False`` if ``timeout`` ran out."""
    return events.flush(timeout)


__all__ = ["REPEATED_KINDS", "REPEAT_WINDOW", "enabled", "flush", "install", "prune", "record"]
