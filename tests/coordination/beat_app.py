"""The Celery app the HA beat tests run ``celery beat`` on (configured by environment)."""

from __future__ import annotations

import os

from celery import Celery

app = Celery("beat_app", broker=os.environ.get("BEAT_TEST_BROKER", "memory://"))
app.conf.update(
    beat_schedule={"every-second": {"task": "beat_app.tick", "schedule": 1.0}},
    task_locks_beat_ttl=float(os.environ.get("BEAT_TEST_TTL", "3")),
    task_locks_beat_backend=os.environ.get("BEAT_TEST_LOCKS"),
    task_locks_beat_election=os.environ.get("BEAT_TEST_ELECTION", "beat-test"),
    broker_connection_retry_on_startup=True,
    enable_utc=True,
)


@app.task(name="beat_app.tick")
def tick() -> None:
    """Never run by these tests: they count the messages beat leaves in the broker."""
