"""``pip install 'task-locks[celery]'`` is enough for a worker on a Redis broker:
kombu's Redis transport needs what ``celery[redis]`` brings (redis-py in the
range that kombu accepts and, from kombu 5.7, ``packaging``), and the extra brings it.

A virtualenv with only the package and that extra (built from this checkout's wheel, no
editable install, nothing from the checkout on ``sys.path``) runs the README's plain
Celery app: its worker on a Redis broker runs the singleton task once and skips the
duplicate. The virtualenv is kept under ``build/`` and rebuilt when the package's
declared dependencies change; each run reinstalls only the package itself (seconds).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from test_readme import run_plain_celery_app

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / "build" / "celery-extra-venv"
#: What the package is built from (the wheel's sources).
SOURCES = ["pyproject.toml", "README.md", "LICENSE", "task_locks", "django_app"]


def _pip(venv: Path, *args: str) -> None:
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "-q", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"pip {' '.join(args)}:\n{done.stdout}\n{done.stderr}"


def _wheel(venv: Path, tmp_path: Path) -> Path:
    """This checkout's wheel, built by the virtualenv's setuptools from a copy of the
    sources (the checkout itself is left as it is)."""
    source = tmp_path / "source"
    source.mkdir(parents=True)
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, source / name)
    _pip(venv, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source))
    return next(tmp_path.glob("task_locks-*.whl"))


def _celery_extra_venv(tmp_path: Path) -> Path:
    """The cached virtualenv with ``task-locks[celery]`` from this checkout installed."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = [
        project["build-system"]["requires"],
        project["project"]["dependencies"],
        project["project"]["optional-dependencies"]["celery"],
    ]
    stamp = VENV / ".declared"
    digest = hashlib.sha256(repr(declared).encode()).hexdigest()
    fresh = not stamp.exists() or stamp.read_text() != digest
    if fresh:
        shutil.rmtree(VENV, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=120)
        _pip(VENV, "install", *project["build-system"]["requires"])  # to build the wheel
    wheel = _wheel(VENV, tmp_path)
    if fresh:
        _pip(VENV, "install", f"{wheel}[celery]")
        stamp.write_text(digest)
    else:  # the dependencies are there already: only this checkout's code changed
        _pip(VENV, "install", "--force-reinstall", "--no-deps", str(wheel))
    return VENV


def test_a_worker_runs_on_a_redis_broker_with_only_the_celery_extra(
    redis_url: str, tmp_path: Path
) -> None:
    venv = _celery_extra_venv(tmp_path / "wheel")
    found = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import django"], capture_output=True, cwd=tmp_path
    )
    assert found.returncode != 0, "the virtualenv has more than the celery extra (Django)"
    app = tmp_path / "app"
    app.mkdir()
    run_plain_celery_app(redis_url, app, venv / "bin", [])
