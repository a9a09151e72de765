"""A ready ``/metrics`` view for a Django site (extra ``metrics``: prometheus_client).

::

    # urls.py
    from django.urls import path
    from django_app.metrics import metrics_view

    urlpatterns = [..., path("metrics", metrics_view)]

It serves what :func:`task_locks.metrics.install` counts (``TASK_LOCKS["METRICS"] = True``
installs it at start-up), beside anything else the site put in prometheus_client's
default registry. A site served by several processes (gunicorn workers) runs
prometheus_client's multiprocess mode: with ``PROMETHEUS_MULTIPROC_DIR`` set, the view
sums every process's files instead, since the default registry would show one worker's
values only. The view has no access control of its own: route it where only the
scraper reaches it, or wrap it (``staff_member_required``, a token check).
"""

from __future__ import annotations

import os

from django.http import HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

#: prometheus_client's variable: set, it selects multiprocess mode (read at scrape time).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


@never_cache
@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """The Prometheus text exposition of the ``task_locks_*`` families (and the rest of
    the default registry, or of every process's files in multiprocess mode)."""
    from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, multiprocess
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    registry = REGISTRY
    if os.environ.get(MULTIPROC_ENV):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)


__all__ = ["MULTIPROC_ENV", "metrics_view"]
