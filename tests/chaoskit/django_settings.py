"""Django settings for chaos client processes: just ``django_app`` and PostgreSQL.

``locks`` is the database the ``django://locks`` backend uses (through the client's
fault-injecting proxy when the fault needs one: ``CHAOS_PG_PORT``); ``resource`` is the
same database reached directly, for the ``fenced()`` register the nemesis never touches.
"""

import os

SECRET_KEY = "chaos-tests-only"
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django_app"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

_database = {
    "ENGINE": "django.db.backends.postgresql",
    "HOST": "127.0.0.1",
    "PORT": 5432,
    "USER": "postgres",
    "NAME": os.environ.get("CHAOS_PG_DB", "postgres"),
    "OPTIONS": {"connect_timeout": 2},
}
DATABASES = {
    "default": dict(_database),
    "locks": dict(_database, PORT=int(os.environ.get("CHAOS_PG_PORT", "5432"))),
    "resource": dict(_database),
}
TASK_LOCKS = {"BACKEND": "django://locks", "DEFAULT_TTL": 1}
