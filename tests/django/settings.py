"""Django settings for the test suite (``DJANGO_SETTINGS_MODULE=tests.django.settings``).

Databases:

- ``default``: SQLite in a file (not in memory), so the ``django://`` backend's own
  connections and subprocesses see the same database. The test database's path is
  unique per pytest process; a subprocess is pointed at it with
  ``TASK_LOCKS_TEST_SQLITE`` (see ``tests/django/django_helpers.py``).
- ``pg``: PostgreSQL on 127.0.0.1:5432 (user postgres, trust auth), present only when the
  port answers; the test database is ``test_task_locks_<pid>`` so parallel runs never
  share one. A subprocess gets the name through ``TASK_LOCKS_TEST_PG``.
- ``mysql``: MariaDB/MySQL on 127.0.0.1:3306 (root, no password), present only when the
  port answers and PyMySQL or mysqlclient is installed; ``TASK_LOCKS_TEST_MYSQL``.

``TASK_LOCKS["BACKEND"]`` comes from ``TASK_LOCKS_TEST_BACKEND`` (default
``django://default``), so a subprocess can be told to lock on a test Redis.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.3):
            return True
    except OSError:
        return False


def _mysql_driver() -> bool:
    try:
        import MySQLdb  # noqa: F401
    except ImportError:
        try:
            import pymysql
        except ImportError:
            return False
        pymysql.install_as_MySQLdb()
    return True


HERE = Path(__file__).resolve().parent
_RUN = os.getpid()
_SQLITE_TEST = os.path.join(tempfile.gettempdir(), f"task-locks-test-{_RUN}.sqlite3")

SECRET_KEY = "task-locks-tests-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "tests.django.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
STATIC_URL = "/static/"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_app",
    "tests.django.testapp",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast logins

DATABASES: dict[str, dict[str, object]] = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get(
            "TASK_LOCKS_TEST_SQLITE", os.path.join(tempfile.gettempdir(), "task-locks-dev.sqlite3")
        ),
        "TEST": {"NAME": _SQLITE_TEST},
        "OPTIONS": {"timeout": 30},
    }
}
if _port_open(5432):
    DATABASES["pg"] = {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": "127.0.0.1",
        "PORT": 5432,
        "USER": "postgres",
        "NAME": os.environ.get("TASK_LOCKS_TEST_PG", "test"),
        "TEST": {"NAME": f"test_task_locks_{_RUN}"},
    }
if _port_open(3306) and _mysql_driver():
    DATABASES["mysql"] = {
        "ENGINE": "django.db.backends.mysql",
        "HOST": "127.0.0.1",
        "PORT": 3306,
        "USER": "root",
        "NAME": os.environ.get("TASK_LOCKS_TEST_MYSQL", "test"),
        "OPTIONS": {"charset": "utf8mb4"},
        "TEST": {"NAME": f"test_task_locks_{_RUN}", "CHARSET": "utf8mb4"},
    }

TASK_LOCKS = {
    "BACKEND": os.environ.get("TASK_LOCKS_TEST_BACKEND", "django://default"),
    "DEFAULT_TTL": 30,
}
