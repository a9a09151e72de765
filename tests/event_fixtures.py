"""Fixtures for tests that read the event stream and the metrics it feeds.

Registered for the whole suite by ``tests/conftest.py``; a module that subscribes marks
itself ``pytest.mark.usefixtures("only_logging_stays")`` so that each test leaves only
the logging subscriber behind (the Django audit writer is another module's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from task_locks import events
from task_locks.events import LockEvent

#: ``metric(name, **labels)``: a sample of the test's registry (0 if never set).
Value = Callable[..., float]


@pytest.fixture
def only_logging_stays() -> Iterator[None]:
    yield
    for subscription in events.subscriptions():
        if subscription is not events.logging_subscription:
            subscription.close()
    assert events.flush(5.0)


@pytest.fixture
def seen() -> list[LockEvent]:
    got: list[LockEvent] = []
    events.subscribe(got.append)
    return got


@pytest.fixture
def metric() -> Iterator[Value]:
    """A fresh prometheus_client registry with the collectors installed."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from task_locks import metrics

    registry = prometheus_client.CollectorRegistry()
    metrics.install(registry)

    def value(name: str, **labels: str) -> float:
        assert events.flush(5.0)
        return registry.get_sample_value(name, labels) or 0.0

    value.registry = registry  # type: ignore[attr-defined]
    yield value
    metrics.uninstall(registry)
