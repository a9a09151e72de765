"""Settings for the example site.

Two environment variables pick the servers; with neither set, everything runs embedded
(no server to start): the lock backend is the Django database (SQLite), the Celery broker
is kombu's filesystem transport and results go to SQLite through SQLAlchemy.

- ``TASK_LOCKS_URL``: the lock backend, e.g. ``redis://127.0.0.1:6379/0`` or ``etcd://...``
- ``CELERY_BROKER_URL``: the broker, e.g. ``redis://127.0.0.1:6379/1``

Where this demo differs from production, the setting says why (see ``check --deploy``).
"""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("DEMO_VAR_DIR", BASE_DIR / "var"))
VAR_DIR.mkdir(parents=True, exist_ok=True)

# Demo only: a fixed key and DEBUG so the site runs with no secrets to manage. Production
# reads SECRET_KEY from the environment and sets DEBUG = False.
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "demo-only-not-secret-" + "x" * 40)
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_app",
    "shop",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "demo_site.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
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
WSGI_APPLICATION = None

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": VAR_DIR / "demo.sqlite3",
        # Several worker processes share the file: wait for the write lock instead of
        # failing at once.
        "OPTIONS": {"timeout": 30, "transaction_mode": "IMMEDIATE"},
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"

# Demo only: plain HTTP on localhost. Production sets these to True behind HTTPS, with
# SECURE_SSL_REDIRECT and HSTS.
SESSION_COOKIE_SECURE = False
CSRF_COOKIE_SECURE = False

TASK_LOCKS_URL = os.environ.get("TASK_LOCKS_URL") or "django://default"
TASK_LOCKS = {
    "BACKEND": TASK_LOCKS_URL,
    "DEFAULT_TTL": 30,
}

_broker_dir = VAR_DIR / "broker"
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL") or "filesystem://"
CELERY_BROKER_TRANSPORT_OPTIONS = (
    {"data_folder_in": str(_broker_dir), "data_folder_out": str(_broker_dir)}
    if CELERY_BROKER_URL.startswith("filesystem")
    else {}
)
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND") or (
    f"db+sqlite:///{VAR_DIR / 'results.sqlite3'}"
)
CELERY_TASK_TRACK_STARTED = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ACKS_LATE = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

# HA beat: only the elected leader sends ticks (`celery -A demo_site beat
# -S task_locks.celery.beat:LeaderScheduler`), so running beat on two hosts is safe.
CELERY_BEAT_SCHEDULE = {
    "sync-account-1-every-minute": {
        "task": "shop.tasks.sync_account",
        "schedule": 60.0,
        "args": (1,),
    },
    "nightly-rebuild": {"task": "shop.tasks.rebuild_search_index", "schedule": 3600.0},
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"task_locks": {"handlers": ["console"], "level": "WARNING"}},
}
