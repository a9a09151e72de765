"""The example project: `make demo` passes on the embedded default, and its settings pass
`manage.py check`, with `check --deploy` warning only where a demo must differ.

The demo runs as a newcomer runs it (a subprocess, nothing configured, nothing started
beforehand) but in a private folder (``DEMO_VAR_DIR``), so it never meets a developer's
own `make demo`.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "example_project"
#: `make demo` finishes within a minute on a fresh machine.
DEMO_LIMIT = 60.0
#: Variables that would point the demo away from its embedded default.
SERVER_VARIABLES = ("TASK_LOCKS_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")


#: Logs in as the demo says (admin / admin) and opens the pages it points to.
ADMIN_TOUR = """
import json, django
django.setup()
from django.test import Client
from django_app.models import LockEvent
client = Client(HTTP_HOST="127.0.0.1")
assert client.login(username="admin", password="admin"), "admin / admin does not log in"
pages = ["/admin/task_locks/lockholder/", "/admin/task_locks/lockevent/", "/admin/shop/jobrun/"]
seen = {page: client.get(page).status_code for page in pages}
seen["conflicts recorded"] = LockEvent.objects.filter(kind="conflict").count()
print(json.dumps(seen))
"""


def example_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SERVER_VARIABLES}
    env.pop("DJANGO_SETTINGS_MODULE", None)  # pytest-django's; the example has its own
    env.update(DEMO_VAR_DIR=str(tmp_path / "var"), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def manage(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=EXAMPLE,
        env=example_env(tmp_path, **env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def warning_ids(output: str) -> set[str]:
    return set(re.findall(r"\(([\w.]+\.[EW]\d{3})\)", output))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_demo_passes_on_the_embedded_default(tmp_path: Path) -> None:
    started = time.monotonic()
    demo = subprocess.run(
        [sys.executable, "example_project/demo.py"],
        cwd=ROOT,
        env=example_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=110,
    )
    took = time.monotonic() - started
    logs = "\n".join(
        f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}"
        for log in sorted((tmp_path / "var").glob("*.log"))
    )
    assert demo.returncode == 0, f"{demo.stdout}\n{demo.stderr}\n{logs}"
    out = demo.stdout
    assert "task-locks demo: locks on django://default" in out
    assert "broker filesystem://" in out
    assert "starting 2 Celery workers" in out
    assert re.search(r"\[#{20}\] 42/42 done", out), out  # the live progress reached the end
    assert "calls 44, " in out
    assert "max concurrency per key 1, lost leases 0" in out
    assert "verdict: PASS" in out
    assert "exit 75" in out and "is held by command 'manage.py nightly_report'" in out
    assert "http://127.0.0.1:8000/admin/ (login admin / admin)" in out
    assert "PROBLEM" not in out
    # Every key row of the verdict table says 1 at most inside, and no lease lost.
    rows = re.findall(
        r"^(\S+)\s+(skip|raise|wait|retry|wait\+fence|command)\s.*?(\d+)\s+(\d+)$", out, re.M
    )
    assert len(rows) == 8, out
    assert all(peak == "1" and lost == "0" for _, _, peak, lost in rows), out
    # The workers were stopped: nothing of this run is still alive.
    assert "stopped the workers" in out and "exit codes [0, 0]" in out
    assert took < DEMO_LIMIT, f"the demo took {took:.1f}s (limit {DEMO_LIMIT:.0f}s)\n{out}"

    # "Where to look next" holds: the admin login works and its pages show the run.
    look = subprocess.run(
        [sys.executable, "-c", ADMIN_TOUR],
        cwd=EXAMPLE,
        env=example_env(tmp_path, DJANGO_SETTINGS_MODULE="demo_site.settings"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert look.returncode == 0, look.stdout + look.stderr
    tour = json.loads(look.stdout.splitlines()[-1])
    conflicts = tour.pop("conflicts recorded")
    assert tour == {
        "/admin/task_locks/lockholder/": 200,
        "/admin/task_locks/lockevent/": 200,
        "/admin/shop/jobrun/": 200,
    }
    # Every refused run is in the audit log (Celery skips and the second nightly_report),
    # not only the command's: the lock itself reports its conflicts (the event stream).
    assert conflicts > 1, out


def test_example_settings_pass_manage_py_check(tmp_path: Path) -> None:
    check = manage(tmp_path, "check")
    assert check.returncode == 0, check.stderr
    assert "System check identified no issues" in check.stdout


def demo_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    monkeypatch.setenv("DEMO_VAR_DIR", str(tmp_path / "var"))
    for name in ("DJANGO_HTTPS", "DJANGO_DEBUG", "DJANGO_SECRET_KEY"):
        monkeypatch.delenv(name, raising=False)
    return runpy.run_path(str(EXAMPLE / "demo_site" / "settings.py"))


def test_deploy_check_warns_exactly_where_the_demo_must_differ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every warning is in the settings' commented DEPLOY_WARNINGS, and
    every entry there is still needed (the list cannot go stale)."""
    allowlist = demo_settings(tmp_path, monkeypatch)["DEPLOY_WARNINGS"]
    assert isinstance(allowlist, dict)
    assert set(allowlist) == {
        "security.W004",  # HSTS: no HTTPS on runserver
        "security.W008",  # no redirect to https://
        "security.W012",  # session cookie not Secure (plain HTTP)
        "security.W016",  # CSRF cookie not Secure (plain HTTP)
        "security.W018",  # DEBUG on: runserver serves the admin's static files
    }
    settings_text = (EXAMPLE / "demo_site" / "settings.py").read_text()
    for warning in allowlist:
        assert f'"{warning}"' in settings_text  # each one sits next to its explanation
    deploy = manage(tmp_path, "check", "--deploy")
    assert deploy.returncode == 0, deploy.stderr
    assert warning_ids(deploy.stderr + deploy.stdout) == set(allowlist), deploy.stderr


def test_https_mode_passes_the_deploy_check_clean(tmp_path: Path, redis_url: str) -> None:
    """The production switches are real: with them on, `check --deploy` has nothing to say
    but that the embedded default locks in one machine's SQLite (task_locks.W003), and
    nothing at all once the locks live on a shared server."""
    production = {"DJANGO_HTTPS": "1", "DJANGO_SECRET_KEY": secrets.token_urlsafe(50)}
    deploy = manage(tmp_path, "check", "--deploy", **production)
    assert deploy.returncode == 0, deploy.stderr
    assert warning_ids(deploy.stderr + deploy.stdout) == {"task_locks.W003"}, deploy.stderr
    deploy = manage(tmp_path, "check", "--deploy", TASK_LOCKS_URL=redis_url, **production)
    assert deploy.returncode == 0, deploy.stderr
    assert warning_ids(deploy.stderr + deploy.stdout) == set(), deploy.stderr
    assert "System check identified no issues" in deploy.stdout


#: Runs in a subprocess: the demo's start-up with only the `demo` extra's distributions
#: importable (what `make demo` installs), everything else refused as if absent.
DEMO_EXTRA_ONLY = r"""
import ast, importlib, importlib.metadata as md, sys, tomllib
from packaging.requirements import Requirement

project = tomllib.load(open(sys.argv[2], "rb"))["project"]

def ours_requires(extras):
    # The checkout's pyproject.toml, not an installed (maybe stale) copy of its metadata.
    texts, todo, done = list(project["dependencies"]), list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in done:
            continue
        done.add(extra)
        for text in project["optional-dependencies"][extra]:
            req = Requirement(text)
            if req.name == project["name"]:
                todo.extend(req.extras)
            else:
                texts.append(text)
    return texts

def closure(extras):
    seen, todo = set(), [(Requirement(t).name, frozenset(Requirement(t).extras)) for t in ours_requires(extras)]
    while todo:
        dist, extras = todo.pop()
        if (dist, extras) in seen:
            continue
        seen.add((dist, extras))
        for text in md.requires(dist) or []:
            req = Requirement(text)
            if req.marker is None or any(
                req.marker.evaluate({"extra": e}) for e in (extras or {""})
            ):
                todo.append((req.name, frozenset(req.extras)))
    return {md.distribution(d).metadata["Name"].lower().replace("_", "-") for d, _ in seen}

allowed_dists = closure({"demo"})
by_module = md.packages_distributions()
ours = {"task_locks", "django_app", "demo_site", "shop", "manage", "demo"}

class OnlyTheDemoExtra:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in sys.stdlib_module_names or top in ours or top.startswith("_"):
            return None
        dists = {d.lower().replace("_", "-") for d in by_module.get(top, [])}
        if dists and not dists & allowed_dists:
            raise ModuleNotFoundError(f"{name} (from {sorted(dists)}) is not in the demo extra", name=name)
        return None

sys.meta_path.insert(0, OnlyTheDemoExtra())
import django
django.setup()
from demo_site.celery import app
app.backend  # the result backend's own imports (SQLAlchemy for db+sqlite)
for name in ("shop.tasks", "shop.management.commands.nightly_report", "django_app.admin"):
    importlib.import_module(name)
tree = ast.parse(open(sys.argv[1]).read())
for node in ast.walk(tree):
    if isinstance(node, ast.Import):
        for alias in node.names:
            importlib.import_module(alias.name)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        importlib.import_module(node.module)
print("demo extra:", " ".join(sorted(allowed_dists)))
"""


def test_the_demo_extra_is_all_the_demo_needs(tmp_path: Path) -> None:
    """`make demo` installs only the `demo` extra (no test or bench tools): the demo's
    settings, Celery app, result backend, tasks and script import with nothing else."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            DEMO_EXTRA_ONLY,
            str(EXAMPLE / "demo.py"),
            str(ROOT / "pyproject.toml"),
        ],
        cwd=EXAMPLE,
        env=example_env(tmp_path, DJANGO_SETTINGS_MODULE="demo_site.settings"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    installed = done.stdout.split("demo extra:", 1)[1].split()
    assert "sqlalchemy" in installed and "celery" in installed and "django" in installed
    for tool in ("pytest", "playwright", "mypy", "ruff", "matplotlib", "nox"):
        assert tool not in installed, tool
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install -q -e '.[demo]'" in makefile.split("$(DEMO_STAMP):", 1)[1]
    assert "demo: $(DEMO_STAMP)" in makefile


def test_follow_ups_of_the_redis_demo_see_its_locks(redis_url: str, tmp_path: Path) -> None:
    """The README's Redis demo follow-ups: with the demo's TASK_LOCKS_URL exported, the
    site's `locks list` and `task-locks list` show the locks on Redis; without it, not."""
    from task_locks import Lock

    url = f"{redis_url}?prefix=task-locks-demo:"
    with Lock("sync:7", ttl=30, backend=url):
        listed = manage(tmp_path, "locks", "list", TASK_LOCKS_URL=url)
        assert listed.returncode == 0 and "sync:7" in listed.stdout, listed.stderr
        cli = subprocess.run(
            [sys.executable, "-m", "task_locks.cli", "list"],
            env=example_env(tmp_path, TASK_LOCKS_URL=url),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0 and "sync:7" in cli.stdout, cli.stderr
        assert manage(tmp_path, "migrate", "--verbosity", "0").returncode == 0  # as the demo
        without = manage(tmp_path, "locks", "list")
        assert without.returncode == 0, without.stderr
        assert "sync:7" not in without.stdout
    assert "TASK_LOCKS_URL=" in (EXAMPLE / "demo.py").read_text()  # the demo prints it


def test_nightly_report_runs_without_its_lock(tmp_path: Path) -> None:
    """``--no-lock`` on the README's command (it reads ``self.lease``): a warning and a
    run, never an AttributeError."""
    assert manage(tmp_path, "migrate", "-v0").returncode == 0
    run = manage(tmp_path, "nightly_report", "--no-lock", "--seconds", "0")
    assert run.returncode == 0, run.stderr
    assert "nightly report done (fence None)" in run.stdout
    assert "runs without its lock (--no-lock)" in run.stderr
    locked = manage(tmp_path, "nightly_report", "--seconds", "0")
    assert locked.returncode == 0, locked.stderr
    assert re.search(r"nightly report done \(fence \d+\)", locked.stdout), locked.stdout
