"""One lock name is one lock, whichever front end takes it.

The README's Operations snippet exports ``TASK_LOCKS_URL`` and runs ``task-locks run
nightly-report`` and the example project's ``manage.py nightly_report``: the two must
meet on one lock, and so must a plain ``Lock()`` and a Celery ``@singleton_task`` run
with the same environment. The namespace's one source of truth is the backend URL (its
``prefix`` option): a Django app whose ``TASK_LOCKS`` would lock elsewhere than
``$TASK_LOCKS_URL`` refuses loudly (system check ``task_locks.E005``, and a backend
that fails at first use) instead of locking in another namespace; ``list``, ``show``
and ``--help`` name the backend and namespace they use.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.core.management import call_command
from django.test import Client
from django_helpers import ROOT, finish, manage, staff
from servers import wait_until

from django_app import conf
from django_app.checks import check_settings
from django_app.conf import MisconfiguredBackend
from task_locks import InvalidArgument, Lock

EXAMPLE = ROOT / "example_project"


def example_env(tmp_path: Path, url: str) -> dict[str, str]:
    """The environment of an operator who followed the README: only TASK_LOCKS_URL set."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TASK_LOCKS", "CELERY_", "DJANGO_"))
    }
    env.update(
        TASK_LOCKS_URL=url,
        DEMO_VAR_DIR=str(tmp_path / "var"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(EXAMPLE), str(ROOT), env.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    if url.startswith("django://"):  # the CLI reads the project's DATABASES
        env["DJANGO_SETTINGS_MODULE"] = "demo_site.settings"
    return env


def start(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv,
        cwd=str(EXAMPLE),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


#: The core API with nothing but the environment: ``TASK_LOCKS_URL`` (and, for
#: ``django://``, the project's settings module, as the CLI reads them).
CORE_LOCK = """
import os
if os.environ.get("DJANGO_SETTINGS_MODULE"):
    import django
    django.setup()
from task_locks import Lock, LockHeld
try:
    Lock("nightly-report", ttl=5).acquire(timeout=0).release()
    print("core: acquired")
except LockHeld as exc:
    print("core: held:", exc)
"""

#: A Celery ``@singleton_task`` keyed ``nightly-report``, applied in-process (eager):
#: the run goes through the task's singleton path (its run lock), with no worker.
CELERY_TASK = """
import os
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_site.settings")
import django
django.setup()
from celery import Celery
from task_locks import LockHeld
from task_locks.celery import current_lease, singleton_task

app = Celery("one-namespace", set_as_current=False)
app.conf.task_always_eager = True
app.conf.task_eager_propagates = True


@singleton_task(app=app, name="one_namespace_report", key="nightly-report", ttl=30,
                on_conflict="raise")
def report():
    return current_lease().name


try:
    print(f"celery: ran under {report.delay().get()!r}")
except LockHeld as exc:
    print("celery: held:", exc)
"""


@pytest.fixture(params=["redis", "django"])
def operator_env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    url = request.getfixturevalue("redis_url") if request.param == "redis" else "django://default"
    env = example_env(tmp_path, url)
    status, out, err = finish(start([sys.executable, "manage.py", "migrate", "-v0"], env), 120)
    assert status == 0, out + err
    yield env


@pytest.mark.timeout(180)
def test_readme_operations_cli_and_locked_command_take_one_lock(
    operator_env: dict[str, str], tmp_path: Path
) -> None:
    started = tmp_path / "started"
    cli = start(
        [
            sys.executable, "-m", "task_locks.cli", "run", "nightly-report", "--ttl", "30", "--",
            "sh", "-c", f"touch {started} && exec sleep 60",
        ],
        operator_env,
    )  # fmt: skip
    try:
        wait_until(lambda: started.exists() or cli.poll() is not None, 30, "task-locks run")
        assert started.exists(), finish(cli)

        status, out, err = finish(
            start([sys.executable, "manage.py", "nightly_report", "--seconds", "0"], operator_env),
            60,
        )
        assert status == 75, out + err
        assert "lock 'nightly-report' is held by command " in err and "sleep 60" in err
        assert f"pid {cli.pid}" in err
        assert "nightly report done" not in out

        status, out, err = finish(
            start([sys.executable, "manage.py", "locks", "list"], operator_env)
        )
        assert status == 0, err
        [row] = [line for line in out.splitlines() if line.startswith("nightly-report ")]
        assert f"pid {cli.pid}" in row and "sleep 60" in row

        # Plain Lock() and a Celery singleton task, configured by the same environment,
        # meet the CLI's lock too.
        status, out, err = finish(start([sys.executable, "-c", CORE_LOCK], operator_env), 60)
        assert status == 0, out + err
        assert out.startswith("core: held") and f"pid {cli.pid}" in out, out
        status, out, err = finish(start([sys.executable, "-c", CELERY_TASK], operator_env), 60)
        assert status == 0, out + err
        assert out.startswith("celery: held") and f"pid {cli.pid}" in out, out
    finally:
        cli.send_signal(signal.SIGTERM)
        finish(cli)

    # Once the CLI is gone, the same task runs, under the lock of that same name.
    status, out, err = finish(start([sys.executable, "-c", CELERY_TASK], operator_env), 60)
    assert status == 0, out + err
    assert out.strip() == "celery: ran under 'nightly-report'", out + err


# -- refusing to lock in another namespace ----------------------------------------------


def check_ids() -> list[str]:
    return sorted(m.id for m in check_settings())


def test_django_refuses_a_namespace_other_than_task_locks_url(
    settings: object, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret_url = redis_url.replace("redis://", "redis://:s3cret@")
    monkeypatch.setenv("TASK_LOCKS_URL", secret_url)
    settings.TASK_LOCKS = {"BACKEND": secret_url, "KEY_PREFIX": "shop:"}  # type: ignore[attr-defined]

    [message] = [m for m in check_settings() if m.id == "task_locks.E005"]
    text = f"{message.msg} {message.hint}"
    assert "TASK_LOCKS_URL" in text and "prefix=shop" in text and "?prefix=" in text
    assert "s3cret" not in text
    backend = conf.backend()
    assert isinstance(backend, MisconfiguredBackend)
    assert "TASK_LOCKS_URL" in backend.problem and "s3cret" not in backend.problem
    with pytest.raises(InvalidArgument, match="TASK_LOCKS_URL"):
        Lock("nightly-report", ttl=5).acquire(timeout=0)

    # Another server, same prefix: refused as well.
    other = redis_url.rsplit("/", 1)[0] + "/3"
    settings.TASK_LOCKS = {"BACKEND": other}  # type: ignore[attr-defined]
    assert "task_locks.E005" in check_ids()
    assert isinstance(conf.backend(), MisconfiguredBackend)

    # The namespace in the URL both sides read: one lock, no complaint.
    monkeypatch.setenv("TASK_LOCKS_URL", f"{redis_url}?prefix=shop:")
    settings.TASK_LOCKS = {"BACKEND": redis_url, "KEY_PREFIX": "shop:"}  # type: ignore[attr-defined]
    assert check_ids() == []
    assert not isinstance(conf.backend(), MisconfiguredBackend)


def test_an_unusable_task_locks_url_is_blamed_and_a_bad_backend_is_e001(
    settings: object, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TASK_LOCKS_URL", "nosuch://x")
    settings.TASK_LOCKS = {"BACKEND": redis_url}  # type: ignore[attr-defined]
    [message] = check_settings()
    assert message.id == "task_locks.E005" and "$TASK_LOCKS_URL (nosuch://x)" in message.msg
    monkeypatch.setenv("TASK_LOCKS_URL", redis_url)
    settings.TASK_LOCKS = {"BACKEND": "nosuch://y"}  # type: ignore[attr-defined]
    assert check_ids() == ["task_locks.E001"]
    problem = getattr(conf.backend(), "problem", "")
    assert "unknown lock backend scheme" in problem and "TASK_LOCKS_URL" not in problem


def test_django_backend_defaults_to_task_locks_url(
    settings: object, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TASK_LOCKS_URL", redis_url)
    settings.TASK_LOCKS = {"DEFAULT_TTL": 10}  # type: ignore[attr-defined]
    assert conf.lock_settings().backend_url == redis_url
    assert check_ids() == []
    lease = Lock("one-env-var", ttl=5).acquire()  # the app's configured default backend
    try:
        assert conf.backend().holder("one-env-var") is not None
    finally:
        lease.release()


def test_key_prefix_and_a_different_url_prefix_are_refused(
    settings: object, redis_url: str
) -> None:
    settings.TASK_LOCKS = {"BACKEND": f"{redis_url}?prefix=a:", "KEY_PREFIX": "b:"}  # type: ignore[attr-defined]
    assert "task_locks.E001" in check_ids()
    assert isinstance(conf.backend(), MisconfiguredBackend)


# -- list, show and --help name the backend and the namespace ---------------------------


def test_cli_help_list_and_show_name_backend_and_namespace(redis_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TASK_LOCKS", "DJANGO_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    secret_url = redis_url.replace("redis://", "redis://:s3cret@") + "?prefix=shop:"

    def cli(*args: str, url: str) -> tuple[int, str, str]:
        done = subprocess.run(
            [sys.executable, "-m", "task_locks.cli", *args],
            env={**env, "TASK_LOCKS_URL": url},
            capture_output=True,
            text=True,
            timeout=60,
        )
        # Help text wraps at spaces: compare it with single spaces.
        return done.returncode, " ".join(done.stdout.split()), done.stderr

    status, out, _ = cli("--help", url=secret_url)
    assert status == 0
    address = redis_url.split("//", 1)[1].rsplit("/", 1)[0]
    assert address in out and "namespace 'shop:'" in out and "s3cret" not in out
    status, out, _ = cli("--url", redis_url, "--help", url=secret_url)
    assert "namespace 'task_locks:'" in out, "--url wins over TASK_LOCKS_URL"
    status, out, _ = cli("list", "--help", url=secret_url)
    assert "namespace 'shop:'" in out

    Lock("seen", ttl=30, backend=redis_url).acquire()
    status, out, err = cli("list", url=redis_url)
    assert status == 0 and out.startswith("NAME HOLDER")
    assert f"backend: {redis_url} (namespace 'task_locks:')" in err
    status, out, err = cli("show", "seen", url=redis_url)
    assert status == 0 and f"backend: {redis_url} (namespace 'task_locks:')" in err
    status, out, err = cli("list", url=f"{redis_url}?prefix=other:")
    assert status == 0 and "no locks held" in out and "namespace 'other:'" in err


@pytest.mark.django_db(transaction=True)
def test_manage_py_locks_help_and_list_name_backend_and_namespace(
    redis_settings: str, settings: object
) -> None:
    status, out, err = finish(manage("locks", "--help", backend_url=f"{redis_settings}?prefix=x:"))
    assert status == 0, err
    out = " ".join(out.split())
    assert redis_settings.split("//", 1)[1] in out and "namespace 'x:'" in out
    status, out, err = finish(manage("locks", "list", "--help", backend_url=redis_settings))
    assert "namespace 'task_locks:'" in " ".join(out.split())

    settings.TASK_LOCKS = {"BACKEND": redis_settings, "KEY_PREFIX": "shop:"}  # type: ignore[attr-defined]
    err_buffer = io.StringIO()
    call_command("locks", "list", stdout=io.StringIO(), stderr=err_buffer)
    assert "namespace 'shop:'" in err_buffer.getvalue()


@pytest.mark.django_db(transaction=True)
def test_admin_holders_page_names_backend_and_namespace(
    client: Client, redis_settings: str, settings: object
) -> None:
    settings.TASK_LOCKS = {"BACKEND": redis_settings, "KEY_PREFIX": "shop:"}  # type: ignore[attr-defined]
    client.force_login(staff("viewer", "view_lockholder"))
    page = client.get("/admin/task_locks/lockholder/")
    assert page.status_code == 200
    assert "namespace &#x27;shop:&#x27;" in page.text and redis_settings in page.text
