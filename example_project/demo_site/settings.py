"""Settings for the example site.

Two environment variables pick the servers; with neither set, everything runs embedded
(no server to start): the lock backend is the Django database (SQLite, ``django://default``),
the Celery broker is a folder of files (kombu's filesystem transport) and task results go
to SQLite through SQLAlchemy.

- ``TASK_LOCKS_URL``: the lock backend, e.g. ``redis://127.0.0.1:6379/0?prefix=shop:`` or
  ``etcd://...``; its ``prefix`` option is the namespace. ``task-locks`` reads the same
  variable, so a name is one lock whether this site or the CLI takes it.
- ``CELERY_BROKER_URL``: the broker, e.g. ``redis://127.0.0.1:6379/1`` or ``amqp://...``

``DEMO_VAR_DIR`` moves the databases and the broker folder (default ``example_project/var``).

Where a demo must differ from production, ``manage.py check --deploy`` warns, and
``DEPLOY_WARNINGS`` below lists each warning with the reason. ``DJANGO_HTTPS=1`` (with
``DJANGO_SECRET_KEY`` set) switches every one of them to its production value.
"""

import os
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("DEMO_VAR_DIR", BASE_DIR / "var"))
VAR_DIR.mkdir(parents=True, exist_ok=True)

# -- where the demo differs from production --------------------------------------------
# The demo is served by `manage.py runserver`: plain HTTP on localhost, no TLS. Production
# runs behind HTTPS; `DJANGO_HTTPS=1` turns on exactly what it needs.
HTTPS = os.environ.get("DJANGO_HTTPS") == "1"

#: `check --deploy` warnings the demo raises on purpose, and why each must stay in a demo.
#: tests/test_example_project.py checks that `check --deploy` reports exactly these.
DEPLOY_WARNINGS = {
    # DEBUG: runserver serves the admin's CSS/JS only with DEBUG on, and a newcomer wants
    # tracebacks. Production: DEBUG = False and a real static files server.
    "security.W018": "DEBUG is True",
    # No TLS on `runserver`: a Secure cookie would never come back over http://, so the
    # admin login would fail (no session, CSRF check fails).
    "security.W012": "SESSION_COOKIE_SECURE is False",
    "security.W016": "CSRF_COOKIE_SECURE is False",
    # Redirecting to https:// would send the browser to a port nothing listens on.
    "security.W008": "SECURE_SSL_REDIRECT is False",
    # HSTS only means something once the site is served over HTTPS; a localhost demo must
    # not teach a browser to insist on https://127.0.0.1.
    "security.W004": "SECURE_HSTS_SECONDS is not set",
}

if HTTPS:
    SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "")
    if not SECRET_KEY:
        raise ImproperlyConfigured("DJANGO_HTTPS=1 needs DJANGO_SECRET_KEY in the environment")
    DEBUG = False
    SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = SECURE_SSL_REDIRECT = True
    SECURE_HSTS_SECONDS = 31536000
    SECURE_HSTS_INCLUDE_SUBDOMAINS = SECURE_HSTS_PRELOAD = True
    DEPLOY_WARNINGS = {}
else:
    # A fixed key so the demo runs with no secret to manage (check --deploy cannot see
    # this one: it is long and random-looking). Production reads it from the environment.
    SECRET_KEY = os.environ.get(
        "DJANGO_SECRET_KEY", "demo-only-never-use-in-production-4f9c2b7e1a6d8053c7e2b9f4a1d6"
    )
    DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
    SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = SECURE_SSL_REDIRECT = False
    if not DEBUG:
        DEPLOY_WARNINGS = {k: v for k, v in DEPLOY_WARNINGS.items() if k != "security.W018"}

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
        "OPTIONS": {
            # Several worker processes share the file, and the django:// lock backend
            # writes to it on every acquire: wait for the write lock instead of failing
            # at once, take it at BEGIN (no deadlock on upgrade), and let readers (the
            # admin, the demo's progress line) read while a writer commits (WAL).
            "timeout": 30,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        },
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"

# -- task-locks --------------------------------------------------------------------------
# One variable picks the lock backend, for this site and for the `task-locks` CLI alike;
# the default needs no server (the database above). The namespace is part of the URL
# (`?prefix=task-locks-demo:` keeps a shared Redis's other keys untouched), never a
# separate KEY_PREFIX the CLI could not see: one lock name is then one lock everywhere.
TASK_LOCKS_URL = os.environ.get("TASK_LOCKS_URL") or "django://default?prefix=task-locks-demo:"
TASK_LOCKS = {
    "BACKEND": TASK_LOCKS_URL,
    "DEFAULT_TTL": 30,
    "AUDIT": ["lost", "forced", "conflict"],
}

# -- Celery ------------------------------------------------------------------------------
# One variable picks the broker; the default is a folder (demo_site/broker.py).
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL") or "filesystem://"
if CELERY_BROKER_URL.startswith("filesystem"):
    _broker = VAR_DIR / "broker"
    for _folder in ("queue", "processed", "control"):
        (_broker / _folder).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT = "demo_site.broker:Transport"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker / "queue"),
        "data_folder_out": str(_broker / "queue"),
        "store_processed": True,
        "processed_folder": str(_broker / "processed"),
        "control_folder": str(_broker / "control"),
        "polling_interval": 0.1,  # a folder cannot wake a consumer: poll it often
    }
    # Remote control (`celery inspect`, broadcast) needs fan-out across processes,
    # which a folder does badly; the demo does not use it. A real broker keeps it on.
    CELERY_WORKER_ENABLE_REMOTE_CONTROL = False
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND") or (
    f"db+sqlite:///{VAR_DIR / 'results.sqlite3'}"
)
# SQLite results are written by every worker process: wait for the file's write lock.
CELERY_DATABASE_ENGINE_OPTIONS = (
    {"connect_args": {"timeout": 30}} if CELERY_RESULT_BACKEND.startswith("db+sqlite") else {}
)
CELERY_TASK_TRACK_STARTED = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

# HA beat: `celery -A demo_site beat` on several hosts is safe, only the elected leader
# sends, and a tick is never sent twice (task_locks.celery.beat).
CELERY_BEAT_SCHEDULER = "task_locks.celery.beat:LeaderScheduler"
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")
CELERY_BEAT_SCHEDULE = {
    "sync-account-1-every-minute": {
        "task": "shop.tasks.sync_account",
        "schedule": 60.0,
        "args": (1,),
    },
    "rebuild-search-index-hourly": {
        "task": "shop.tasks.rebuild_search_index",
        "schedule": 3600.0,
    },
}

# task-locks logs under `task_locks.*` (`task_locks.lock`: lost leases; `task_locks.celery`:
# conflicts, retries, locks of killed children); the audit writer under `django_app.audit`.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "task_locks": {"handlers": ["console"], "level": "WARNING"},
        "django_app": {"handlers": ["console"], "level": "WARNING"},
    },
}
