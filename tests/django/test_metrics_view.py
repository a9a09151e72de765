"""The ready ``/metrics`` view (``django_app.metrics.metrics_view``): a scrape shows the
locks this site took, from the default registry or, in prometheus_client's multiprocess
mode, summed over every process's files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")
from django.test import Client

from task_locks import Lock, events, metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def collectors() -> Iterator[None]:
    metrics.install()  # the default registry, as TASK_LOCKS["METRICS"] = True does
    yield
    metrics.uninstall()


@pytest.mark.usefixtures("collectors")
def test_a_scrape_shows_the_locks_this_site_took() -> None:
    with Lock("views:1", ttl=5, backend="memory://metrics-view"):
        pass
    assert events.flush(10)
    response = Client().get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=")  # the text format
    assert "no-cache" in response["Cache-Control"]
    body = response.content.decode()
    assert 'task_locks_acquisitions_total{lock="views",outcome="acquired"} 1.0' in body
    assert 'task_locks_held{lock="views"} 0.0' in body
    assert Client().post("/metrics").status_code == 405


def test_in_multiprocess_mode_it_sums_every_process(tmp_path: Path) -> None:
    """Two processes take a lock each; the view (in a third) counts both."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    take = textwrap.dedent(
        """
        from task_locks import Lock, events, metrics
        metrics.install()
        with Lock("views:2", ttl=5, backend="memory://mp"):
            pass
        assert events.flush(10)
        """
    )
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", take], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    scrape = textwrap.dedent(
        """
        import django
        from django.conf import settings
        settings.configure(ALLOWED_HOSTS=["*"])
        django.setup()
        from django.test import RequestFactory
        from django_app.metrics import metrics_view
        print(metrics_view(RequestFactory().get("/metrics")).content.decode())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", scrape], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert 'task_locks_acquisitions_total{lock="views",outcome="acquired"} 2.0' in done.stdout
