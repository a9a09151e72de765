"""Django settings of the Celery workers and clients whose result backend is the Django
database (django-celery-results, ``result_backend="django-db"``): PostgreSQL on
127.0.0.1:5432, database ``TL_RESULTS_DB`` (made by ``test_celery_canvas.py``)."""

from __future__ import annotations

import os

SECRET_KEY = "task-locks-tests-only"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django_celery_results"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("TL_RESULTS_DB", "tl_celery_results"),
        "USER": "postgres",
        "HOST": "127.0.0.1",
        "PORT": 5432,
    }
}
