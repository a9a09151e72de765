"""Helpers for running Django commands, the CLI and lock workers in subprocesses.

A subprocess gets the same test databases as the pytest process through environment
variables read by ``tests/django/settings.py``; ``TASK_LOCKS_TEST_BACKEND`` picks the
lock backend it uses.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from servers import finish as finish  # the django tests import it from here

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MANAGE = HERE / "manage.py"


def subprocess_env(backend_url: str | None = None) -> dict[str, str]:
    """Environment for a child that must see this test run's databases."""
    from django.db import connections

    env = dict(os.environ)
    env["DJANGO_SETTINGS_MODULE"] = "tests.django.settings"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["TASK_LOCKS_TEST_SQLITE"] = str(connections["default"].settings_dict["NAME"])
    for alias, var in [("pg", "TASK_LOCKS_TEST_PG"), ("mysql", "TASK_LOCKS_TEST_MYSQL")]:
        if alias in connections.settings:
            env[var] = str(connections[alias].settings_dict["NAME"])
    if backend_url is not None:
        env["TASK_LOCKS_TEST_BACKEND"] = backend_url
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    return env


def manage(*args: str, backend_url: str, **kwargs: object) -> subprocess.Popen[str]:
    """Start ``manage.py ARGS`` (text mode, stdout and stderr piped)."""
    return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
        [sys.executable, str(MANAGE), *args],
        env=subprocess_env(backend_url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(ROOT),
        **kwargs,
    )


def cli(*args: str, backend_url: str, **kwargs: object) -> subprocess.Popen[str]:
    """Start the ``task-locks`` console script's code (``python -m task_locks.cli``)."""
    env = subprocess_env(backend_url)
    env["TASK_LOCKS_URL"] = backend_url
    return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
        [sys.executable, "-m", "task_locks.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(ROOT),
        **kwargs,
    )


def staff(username: str, *codenames: str) -> Any:
    """A staff user (password ``pw``) with exactly the permissions ``codenames``."""
    from django.contrib.auth.models import Permission, User

    user = User.objects.create_user(username, password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    return user
