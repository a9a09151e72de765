"""The app's Celery task: ``task_locks.prune_lock_events``, for a beat schedule.

Celery's ``autodiscover_tasks()`` finds it in a Django project whose Celery app loads
installed apps' ``tasks`` modules (the usual ``proj/celery.py``); it is imported only
there, so the app works without Celery installed. The schedule the docs show::

    CELERY_BEAT_SCHEDULE = {
        "prune-lock-events": {
            "task": "task_locks.prune_lock_events",
            "schedule": crontab(hour=3, minute=17),  # daily
        },
    }

``manage.py locks prune`` (from cron) does the same.
"""

from __future__ import annotations

from celery import shared_task

from . import audit

#: The task's registered name (the beat entry's ``task``).
PRUNE_TASK = "task_locks.prune_lock_events"


@shared_task(name=PRUNE_TASK, ignore_result=True)
def prune_lock_events(days: float | None = None) -> int:
    """Delete lock events older than ``days`` (default ``TASK_LOCKS["EVENT_RETENTION_DAYS"]``);
    how many rows went."""
    return audit.prune(days)


__all__ = ["PRUNE_TASK", "prune_lock_events"]
