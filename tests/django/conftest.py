"""Fixtures for the Django app's tests (settings: ``tests/django/settings.py``)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from django_app import audit, conf

# The tests pick their backend through TASK_LOCKS_TEST_BACKEND (tests/django/settings.py).
# A TASK_LOCKS_URL exported in the developer's shell would be BACKEND's default and, where
# it differs, make the app refuse every lock (task_locks.E005): tests that want the
# variable set it themselves, in the environment of the process they start.
os.environ.pop("TASK_LOCKS_URL", None)


@pytest.fixture(autouse=True)
def _django_task_locks() -> Iterator[None]:
    """Re-apply TASK_LOCKS after the root fixture reset task-locks' global config."""
    conf.apply()
    yield
    audit.flush(timeout=5.0)


@pytest.fixture
def redis_settings(redis_url: str, settings: object) -> str:
    """TASK_LOCKS pointing at the test Redis (the Django app re-reads it at once)."""
    settings.TASK_LOCKS = {"BACKEND": redis_url, "DEFAULT_TTL": 30}  # type: ignore[attr-defined]
    return redis_url


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test started: whatever it leaves running is killed and reaped."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
