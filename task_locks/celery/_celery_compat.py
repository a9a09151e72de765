"""What differs between the Celery versions we support (5.3 to the newest).

``get_actual_ignore_result(task, request)`` (whether a run's result is stored) is in
``celery.app.task`` from 5.7 and ``celery.app.trace`` in 5.6; before 5.6 a worker stores
a result unless the task's ``ignore_result`` or the request's says not to.
"""

from __future__ import annotations

from typing import Any

__all__ = ["get_actual_ignore_result"]


def _before_5_6(task: Any, request: Any) -> bool:
    return bool(task.ignore_result) or bool(getattr(request, "ignore_result", False))


try:
    from celery.app.task import get_actual_ignore_result
except ImportError:  # Celery < 5.7
    try:
        from celery.app.trace import get_actual_ignore_result
    except ImportError:  # Celery < 5.6
        get_actual_ignore_result = _before_5_6
