"""Every canvas finishes whatever a held key makes its members do.

Chain, group, chord and ``chunks`` of a singleton task whose key is held, for each
``on_conflict`` (and ``skip_as="failure"``), on real prefork workers and two real result
backends: Redis (in this process) and the Django database through django-celery-results
(PostgreSQL; worker and client in their own processes, as a Django project runs them).
What each ``.get()`` returns is what README's Celery section states.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from servers import wait_until

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SKIP = "Skipped"

#: policy -> canvas -> what .get() gives: {"value": ...} or {"error": exception class}.
EXPECTED: dict[str, dict[str, dict[str, Any]]] = {
    "skip": {
        "chain": {"value": SKIP},  # the next link got the marker and returned it
        "group": {"value": [SKIP, SKIP, SKIP]},
        "chord": {"value": [SKIP, 1]},  # the callback ran with the marker in its list
        "chunks": {"value": [[None, None], [None, None]]},  # items are direct calls
    },
    "skip_failure": {
        "chain": {"error": "DuplicateTask"},
        "group": {"error": "DuplicateTask"},
        "chord": {"error": "DuplicateTask"},  # or ChordError naming it: see check()
        "chunks": {"error": "DuplicateTask"},
    },
    "raise": {
        "chain": {"error": "LockHeld"},
        "group": {"error": "LockHeld"},
        "chord": {"error": "LockHeld"},
        "chunks": {"error": "LockHeld"},
    },
    "wait": {
        "chain": {"value": 1},
        "group": {"value": [0, 1, 2]},
        "chord": {"value": [0, 1]},
        "chunks": {"value": [[0, 1], [2, 3]]},
    },
}
EXPECTED["retry"] = EXPECTED["wait"]


def check(cluster: Any, policy: str, key: str, found: dict[str, Any]) -> None:
    got = {name: {k: v for k, v in found[name].items() if k != "message"} for name in found}
    expected = EXPECTED[policy]
    if got.get("chord", {}).get("error") == "ChordError":  # the backend's wrapper of it
        assert expected["chord"]["error"] in found["chord"]["message"], found
        got["chord"] = expected["chord"]
    assert got == expected, found
    if policy in ("raise", "skip_failure"):  # the chord's errback ran
        wait_until(lambda: cluster.store.llen(f"log:{key}") == 1, 10, "the chord's errback to run")
        errback = json.loads(cluster.store.lindex(f"log:{key}", 0))["errback"]
        assert errback in ("ChordError", expected["chord"]["error"])
    for name in ("chain", "group", "chord", "chunks"):
        assert cluster.store.exists(f"t:{key}-{name}") == 0  # every key free again


@pytest.mark.parametrize("policy", list(EXPECTED))
def test_canvases_finish_with_redis_results(
    cluster: Any, prefork_workers: Any, key: str, policy: str
) -> None:
    import canvases

    check(cluster, policy, key, canvases.run(policy, key, cluster.locks_url))


@pytest.fixture(scope="session")
def results_db() -> Iterator[str]:
    """A PostgreSQL database with django-celery-results' tables, for this session."""
    psycopg = pytest.importorskip("psycopg")
    pytest.importorskip("django_celery_results")
    name = f"tl_celery_results_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    try:
        admin = psycopg.connect("host=127.0.0.1 port=5432 user=postgres", autocommit=True)
    except psycopg.OperationalError as exc:
        pytest.skip(f"PostgreSQL on 127.0.0.1:5432 is needed: {exc}")
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        env = {**os.environ, **db_env(name)}
        subprocess.run(
            [sys.executable, "-m", "django", "migrate", "django_celery_results", "-v", "0"],
            cwd=HERE, env=env, check=True, timeout=120,
        )  # fmt: skip
        yield name
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def db_env(name: str) -> dict[str, str]:
    return {
        "TL_RESULTS_DB": name,
        "TL_CELERY_RESULTS": "django-db",
        "TL_CELERY_QUEUE": "tl_dbresults",
        "DJANGO_SETTINGS_MODULE": "dbresults_settings",
        "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]),
    }


@pytest.fixture(scope="session")
def dbresults_worker(cluster: Any, results_db: str) -> Any:
    options = ["-P", "prefork", "-c", "4", "-Q", "tl_dbresults"]
    return cluster.start([("dbresults", options, db_env(results_db))])[0]


@pytest.mark.parametrize("policy", list(EXPECTED))
def test_canvases_finish_with_django_database_results(
    cluster: Any, dbresults_worker: Any, results_db: str, key: str, policy: str
) -> None:
    client = subprocess.run(
        [sys.executable, "canvases.py", policy, key, cluster.locks_url],
        cwd=HERE, env={**os.environ, **cluster.env, **db_env(results_db)},
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert client.returncode == 0, client.stderr[-3000:] + dbresults_worker.tail()
    found = json.loads(client.stdout.strip().splitlines()[-1])
    assert found.pop("backend") == "DatabaseBackend"  # django-celery-results' backend
    check(cluster, policy, key, found)
