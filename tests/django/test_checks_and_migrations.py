"""System checks and migration drift."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.core import checks
from django.core.management import call_command
from django_helpers import ROOT, finish, manage
from servers import free_port

from django_app import conf
from django_app.checks import check_app_import_name, check_settings
from django_app.conf import MisconfiguredBackend
from task_locks import InvalidArgument, Lock


def ids(settings: object, value: object) -> list[str]:
    settings.TASK_LOCKS = value  # type: ignore[attr-defined]
    return sorted(m.id for m in check_settings())


def test_check_ids(settings: object, redis_url: str) -> None:
    assert ids(settings, {"BACKEND": redis_url, "DEFAULT_TTL": 30}) == []
    assert ids(settings, {"BACKEND": "nosuch://x"}) == ["task_locks.E001"]
    assert ids(settings, {"BACKEND": "not a url"}) == ["task_locks.E001"]
    assert ids(settings, {"BACKEND": "django://missing-alias"}) == ["task_locks.E001"]
    assert ids(settings, {"BACKEND": redis_url, "DEFAULT_TTL": 0}) == ["task_locks.E002"]
    assert ids(settings, {"BACKEND": redis_url, "DEFAULT_TTL": -5}) == ["task_locks.E002"]
    assert ids(settings, {"BACKEND": redis_url, "DEFAUL_TTL": 5}) == ["task_locks.E003"]
    assert ids(settings, {"BACKEND": redis_url, "AUDIT": ["lots"]}) == ["task_locks.E004"]
    assert ids(settings, "redis://x") == ["task_locks.E004"]
    down = f"redis://127.0.0.1:{free_port()}/0"
    assert ids(settings, {"BACKEND": down}) == ["task_locks.W001"]
    assert ids(settings, {"BACKEND": "memory://", "KEY_PREFIX": "app:"}) == [
        "task_locks.W002",
        "task_locks.W004",  # DEBUG is off here
    ]


def test_one_machine_backends_are_warned_outside_debug(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite (also the silent default, django://default) and memory:// lock one machine
    or one process; said outside DEBUG, where several hosts may run."""
    monkeypatch.delenv("TASK_LOCKS_URL", raising=False)
    settings.DEBUG = False
    assert ids(settings, {"BACKEND": "memory://"}) == ["task_locks.W004"]
    assert ids(settings, {"BACKEND": "django://default"}) == ["task_locks.W003"]
    del settings.TASK_LOCKS
    [default] = check_settings()
    assert default.id == "task_locks.W003" and "the default" in default.msg, default.msg
    if "pg" in django_settings.DATABASES:  # a shared database is no warning
        assert ids(settings, {"BACKEND": "django://pg"}) == []
    settings.DEBUG = True
    assert ids(settings, {"BACKEND": "memory://"}) == []
    assert ids(settings, {"BACKEND": "django://default"}) == []


def test_a_project_package_named_django_app_fails_loudly(tmp_path: Path) -> None:
    """A project's own django_app/ hides task-locks' app (same import name): nothing of
    ours loads, so it is said where task-locks runs: a RuntimeWarning at import in a
    Django project, and the django:// backend refuses to load, both with the fix."""
    (tmp_path / "django_app").mkdir()
    (tmp_path / "django_app" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "DJANGO_SETTINGS_MODULE": "nosuch"}
    code = "import task_locks; task_locks.get_backend('django://default')"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 1
    assert "RuntimeWarning: the import name 'django_app' is not task-locks' Django app" in (
        run.stderr
    ), run.stderr
    assert str(tmp_path / "django_app") in run.stderr and "Rename your" in run.stderr
    assert "InvalidArgument: the django:// backend cannot load" in run.stderr
    # Ours carries the marker: no word about it here.
    assert check_app_import_name() == []


def test_a_typo_in_a_url_option_is_named_by_the_check(settings: object, redis_url: str) -> None:
    settings.TASK_LOCKS = {"BACKEND": f"{redis_url}?prefx=shop:"}  # type: ignore[attr-defined]
    [message] = check_settings()
    assert message.id == "task_locks.E001"
    assert "unknown option 'prefx' (did you mean 'prefix'?)" in message.msg, message.msg


def test_a_refused_password_is_a_configuration_error_not_silence(
    settings: object, redis_factory: Any
) -> None:
    """The server answered, and refused the URL: not W001's "did not answer" (an outage
    a retry may fix) but E006 (the URL is wrong: what the CLIs exit 78 for)."""
    server = redis_factory(extra=["--requirepass", "s3cret"])
    settings.TASK_LOCKS = {"BACKEND": f"redis://:wrong@127.0.0.1:{server.port}/0"}  # type: ignore[attr-defined]
    [message] = check_settings()
    assert message.id == "task_locks.E006" and message.level == checks.ERROR
    assert "did not answer" not in message.msg and "refuses the URL" in message.msg
    assert "wrong@" not in message.msg  # the password stays out of it


def test_a_bad_setting_fails_loudly_at_use_not_silently_elsewhere(settings: object) -> None:
    settings.TASK_LOCKS = {"BACKEND": "nosuch://x"}  # type: ignore[attr-defined]
    assert isinstance(conf.backend(), MisconfiguredBackend)
    with pytest.raises(InvalidArgument, match=r"misconfigured.*nosuch"):
        Lock("x", ttl=1).acquire(timeout=0)


def test_key_prefix_goes_into_redis_urls(settings: object, redis_url: str) -> None:
    settings.TASK_LOCKS = {"BACKEND": redis_url, "KEY_PREFIX": "shop:"}  # type: ignore[attr-defined]
    assert conf.lock_settings().backend_url == f"{redis_url}?prefix=shop%3A"


def test_manage_py_check_reports_ids(redis_url: str) -> None:
    status, out, err = finish(manage("check", backend_url="nosuch://x"))
    assert status == 1 and "task_locks.E001" in err
    status, out, err = finish(manage("check", backend_url=redis_url))
    assert status == 0, err
    assert "System check identified no issues" in out


def test_example_project_check_is_clean() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "TASK_LOCKS"))}
    proc = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT / "example_project",
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "task_locks." not in proc.stdout + proc.stderr


@pytest.mark.django_db
def test_no_missing_migrations() -> None:
    """Fails when a model changes without a migration (``makemigrations --check``)."""
    out = io.StringIO()
    try:
        call_command("makemigrations", "task_locks", check=True, dry_run=True, stdout=out)
    except SystemExit as exc:  # pragma: no cover - the failure this test exists for
        raise AssertionError(f"models changed without a migration:\n{out.getvalue()}") from exc


def test_every_model_has_a_migration() -> None:
    migrations = Path(conf.__file__).parent / "migrations"
    assert (migrations / "0001_initial.py").exists()
