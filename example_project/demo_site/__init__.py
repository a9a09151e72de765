"""The example site: Django + Celery using every part of task-locks."""

from .celery import app as celery_app

__all__ = ["celery_app"]
