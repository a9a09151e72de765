"""The audit writer is a batch subscriber of the lock event stream.

Events from any path (here emitted as the core emits them) become ``LockEvent`` rows,
written in batches from the dispatcher, with the job, host, pid and fence; ``AUDIT``
picks the kinds; operator actions are written before the front end says done, once.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from django.core.management import call_command
from django_helpers import cli, finish, manage
from servers import wait_until

from django_app import audit, conf
from django_app.models import LockEvent
from task_locks import Lock, events, owner_context
from task_locks.events import LockEvent as StreamEvent
from task_locks.owner import current_owner


@pytest.fixture
def seen() -> Iterator[list[StreamEvent]]:
    """Every event of the stream, as another subscriber (metrics, logs) receives it."""
    got: list[StreamEvent] = []
    subscription = events.subscribe(got.append)
    yield got
    subscription.close()


@pytest.mark.django_db(transaction=True)
def test_stream_events_become_rows_in_batches_with_job_host_pid_and_fence(
    settings: object, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.TASK_LOCKS = {"BACKEND": redis_url, "AUDIT": True}  # type: ignore[attr-defined]
    batches: list[int] = []
    write = audit._write

    def counting(batch: Sequence[StreamEvent]) -> None:  # wraps the real writer
        batches.append(len(batch))
        write(batch)

    monkeypatch.setattr(audit, "_write", counting)
    audit.install()  # subscribes the wrapper
    with owner_context(command="manage.py nightly"):
        owner = current_owner()
    for i in range(50):
        events.emit(events.Acquired(name=f"sync:{i}", fence=i + 1, owner=owner, waited=0.000155))
    events.emit(
        events.Lost(
            name="sync:0",
            fence=1,
            owner=owner,
            reason=events.LostReason.FORCED,
            message="token gone",
            held=2.5,
        )
    )
    events.emit(events.Renewed(name="sync:1", duration=0.001))  # a metric, never a row
    assert audit.flush(10)
    rows = list(LockEvent.objects.order_by("id"))
    assert len(rows) == 51
    assert len(batches) < 51, "written in batches, not one row per event"
    first = rows[0]
    data = first.owner_data
    assert (first.kind, first.name, first.fence) == ("acquired", "sync:0", 1)
    assert data["command"] == "manage.py nightly"
    assert data["host"] == socket.gethostname() and data["pid"] == os.getpid()
    assert "waited 0ms" in first.detail
    lost = rows[-1]
    assert (
        lost.kind == "lost" and "reason: forced: token gone" in lost.detail and "held 2.5s" in lost.detail
    )
    # No holder named: the row still says which host and process saw it.
    events.emit(events.Error(name="sync:x"))
    assert audit.flush(10)
    error = LockEvent.objects.get(kind="error")
    assert error.actor == f"{socket.gethostname()} pid {os.getpid()}"


@pytest.mark.django_db(transaction=True)
def test_audit_picks_the_kinds_written(settings: object, redis_url: str) -> None:
    settings.TASK_LOCKS = {"BACKEND": redis_url, "AUDIT": ["lost", "renewal_failed"]}  # type: ignore[attr-defined]
    for event in (events.Acquired, events.Conflict, events.Lost, events.RenewalFailed):
        events.emit(event(name="job:1"))
    events.emit(events.Released(name="job:1"))
    assert audit.flush(10)
    assert sorted(LockEvent.objects.values_list("kind", flat=True)) == ["lost", "renewal_failed"]
    settings.TASK_LOCKS = {"BACKEND": redis_url, "AUDIT": False}  # type: ignore[attr-defined]
    events.emit(events.Lost(name="job:1"))
    assert audit.flush(10)
    assert LockEvent.objects.count() == 2


@pytest.mark.django_db(transaction=True)
def test_an_operator_action_is_written_before_record_returns_and_only_once(
    redis_settings: str, seen: list[StreamEvent]
) -> None:
    audit.record(events.Forced(name="report:1", fence=4, actor="ops (admin)"), sync=True)
    assert LockEvent.objects.filter(kind="forced", fence=4).count() == 1  # already there
    assert audit.flush(10)
    assert LockEvent.objects.filter(kind="forced").count() == 1, "not written twice"
    assert [(e.kind, e.name, e.actor) for e in seen] == [("forced", "report:1", "ops (admin)")]


@pytest.mark.django_db(transaction=True)
def test_manage_py_locks_and_locked_command_emit_into_the_stream(
    redis_settings: str, seen: list[StreamEvent]
) -> None:
    from django_app.commands import CommandLockHeld
    from django_app.management.commands.locks import _audit

    with Lock("sleepy:a", ttl=5, backend=redis_settings) as lease:
        with pytest.raises(CommandLockHeld):
            call_command("locked_sleep")
        # What `manage.py locks release --force` reports once the backend freed the lock
        # (the conditional force release itself is tested in test_force_release_changed_hands).
        _audit(events.Forced(name="sleepy:a", fence=lease.fence, owner=current_owner()))
    assert audit.flush(10)
    kinds = [(e.kind, e.name, e.policy) for e in seen]
    assert ("conflict", "sleepy:a", "exit") in kinds
    assert ("forced", "sleepy:a", "") in kinds
    forced = LockEvent.objects.get(kind="forced")
    assert forced.fence == lease.fence and "manage.py locks" in forced.actor


@pytest.mark.django_db(transaction=True)
def test_a_run_conflict_is_an_exit_policy_conflict_row(
    redis_settings: str, tmp_path: Path, spawned: list[subprocess.Popen[str]]
) -> None:
    started = tmp_path / "started"
    first = cli(
        "run", "nightly", "--ttl", "30", "--", "sh", "-c", f"touch {started} && exec sleep 30",
        backend_url=redis_settings,
    )  # fmt: skip
    spawned.append(first)
    wait_until(lambda: started.exists() or first.poll() is not None, 30, "the first program")
    status, _, err = finish(
        manage("locks", "run", "nightly", "--", "true", backend_url=redis_settings)
    )
    assert status == 75, err
    conflict = LockEvent.objects.get(kind="conflict")
    assert conflict.name == "nightly" and "policy exit" in conflict.detail
    assert conflict.owner_data["pid"] == first.pid
    first.send_signal(signal.SIGTERM)  # forwarded to sleep: nothing outlives the test
    finish(first)


@pytest.mark.django_db(transaction=True)
def test_metrics_setting_installs_the_collectors(settings: object, redis_url: str) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from task_locks import metrics

    try:
        settings.TASK_LOCKS = {"BACKEND": redis_url, "METRICS": True}  # type: ignore[attr-defined]
        assert conf.metrics_enabled()
        events.emit(events.Conflict(name="sync:42", policy="skip"))
        assert events.flush(10)
        value = prometheus_client.REGISTRY.get_sample_value(
            "task_locks_acquisitions_total", {"lock": "sync", "outcome": "conflict"}
        )
        assert value == 1.0
    finally:
        metrics.uninstall()


def test_metrics_setting_is_checked(settings: object, redis_url: str) -> None:
    from django_app.checks import check_settings

    settings.TASK_LOCKS = {"BACKEND": redis_url, "METRICS": "yes"}  # type: ignore[attr-defined]
    assert [m.id for m in check_settings()] == ["task_locks.E004"]
    assert not conf.metrics_enabled()
