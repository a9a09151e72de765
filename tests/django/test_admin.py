"""The admin's Lock holders and Lock events pages, with real Redis."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django_helpers import cli, finish, staff
from servers import wait_until

from django_app.models import LockEvent
from task_locks import Lock, events, get_backend, owner_context

HOLDERS = "/admin/task_locks/lockholder/"
FORCE = "/admin/task_locks/lockholder/force-release/"


def text(html: str) -> str:
    """The page's words without its markup (a date and its time are two spans)."""
    return re.sub(r"<[^>]+>", "", html)


@pytest.fixture
def held_elsewhere(redis_settings: str, tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """``report:7`` held by another process (``task-locks run``) for the test's length."""
    started = tmp_path / "started"
    proc = cli(
        "run", "report:7", "--ttl", "30", "--",
        "sh", "-c", f"touch {started} && exec sleep 60",
        backend_url=redis_settings,
    )  # fmt: skip
    wait_until(lambda: started.exists() or proc.poll() is not None, 20, "the holder to start")
    assert proc.poll() is None, proc.communicate()
    yield proc
    proc.send_signal(signal.SIGTERM)
    finish(proc)


@pytest.mark.django_db(transaction=True)
def test_holders_page_lists_the_lock_and_force_release_is_audited(
    client: Client, held_elsewhere: subprocess.Popen[str], redis_settings: str
) -> None:
    client.force_login(staff("ops", "view_lockholder", "force_release_lock", "view_lockevent"))

    index = client.get("/admin/")
    assert "Task locks" in index.text and "Lock holders" in index.text
    assert "Lock events" in index.text

    page = client.get(HOLDERS)
    assert page.status_code == 200
    html = page.text
    assert 'data-lock="report:7"' in html
    assert f"<td>{held_elsewhere.pid}</td>" in html
    assert f'<td class="lock-host">{socket.gethostname()}</td>' in html
    assert "sleep 60" in html  # the holder's command
    assert "Force release" in html
    assert 'id="changelist"' in html, "the admin's own change-list markup"

    assert "report:7" not in client.get(HOLDERS, {"q": "invoice:"}).text
    assert "No lock matching these filters" in client.get(HOLDERS, {"q": "invoice:"}).text
    assert 'data-lock="report:7"' in client.get(HOLDERS, {"q": "report:"}).text

    confirm = client.get(FORCE, {"name": "report:7"})
    assert confirm.status_code == 200
    assert "Are you sure?" in confirm.text and "Yes, force release" in confirm.text
    holder = get_backend(redis_settings).holder("report:7")
    assert holder is not None and get_backend(redis_settings).holder("report:7") is not None

    stale = client.post(FORCE, {"name": "report:7", "fence": "1"})
    assert stale.status_code == 302, "a fence that changed hands is refused"
    assert get_backend(redis_settings).holder("report:7") is not None

    done = client.post(FORCE, {"name": "report:7", "fence": str(holder.fence)}, follow=True)
    assert done.status_code == 200
    assert "Released lock “report:7”" in done.text
    assert get_backend(redis_settings).holder("report:7") is None
    assert "No locks are held right now." in done.text

    event = LockEvent.objects.get(kind="forced")
    assert (event.name, event.fence, event.actor) == ("report:7", holder.fence, "ops (admin)")
    assert event.owner_data["pid"] == held_elsewhere.pid

    events = client.get(reverse("admin:task_locks_lockevent_changelist"))
    assert events.status_code == 200 and "report:7" in events.text
    assert (
        client.get(reverse("admin:task_locks_lockevent_change", args=[event.pk])).status_code == 200
    )
    assert (
        client.post(reverse("admin:task_locks_lockevent_delete", args=[event.pk])).status_code
        == 403
    )


@pytest.mark.django_db(transaction=True)
def test_staff_without_the_permission_cannot_force_release(
    client: Client, held_elsewhere: subprocess.Popen[str], redis_settings: str
) -> None:
    client.force_login(staff("viewer", "view_lockholder"))
    page = client.get(HOLDERS)
    assert page.status_code == 200 and 'data-lock="report:7"' in page.text
    assert "Force release" not in page.text
    assert client.get(FORCE, {"name": "report:7"}).status_code == 403
    holder = get_backend(redis_settings).holder("report:7")
    assert holder is not None
    assert client.post(FORCE, {"name": "report:7", "fence": str(holder.fence)}).status_code == 403
    assert get_backend(redis_settings).holder("report:7") is not None
    assert not LockEvent.objects.exists()

    client.force_login(staff("nobody"))
    assert client.get(HOLDERS).status_code == 403


@pytest.mark.django_db(transaction=True)
def test_empty_state_and_backend_down(client: Client, settings: object) -> None:
    client.force_login(User.objects.create_superuser("root", password="pw"))
    assert "No locks are held right now." in client.get(HOLDERS).text  # django://default
    settings.TASK_LOCKS = {"BACKEND": "redis://127.0.0.1:1/0"}  # type: ignore[attr-defined]
    page = client.get(HOLDERS)
    assert page.status_code == 200
    assert "The lock backend could not be read" in page.text


@pytest.mark.django_db(transaction=True)
def test_times_name_their_time_zone(client: Client, redis_settings: str, settings: object) -> None:
    """Times are shown in TIME_ZONE, to the second, and say which zone that is."""
    from django_app import audit

    settings.TIME_ZONE = "Asia/Tokyo"  # type: ignore[attr-defined]
    client.force_login(staff("tz", "view_lockholder", "view_lockevent"))
    with Lock("tz:1", ttl=30, backend=redis_settings):
        html = text(client.get(HOLDERS).text)
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d JST", html), html
    assert not re.search(r"\d\d:\d\d:\d\d UTC", html)
    audit.record(events.Forced(name="tz:1"), sync=True)
    html = text(client.get("/admin/task_locks/lockevent/").text)
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d JST", html), html


@pytest.mark.django_db(transaction=True)
def test_the_librarys_own_records_are_not_listed(client: Client, redis_settings: str) -> None:
    """A record marked ``Owner.internal`` (a Celery run's task-id guard) is not the user's
    lock: no row, no Force release button, nothing to push the columns aside."""
    client.force_login(staff("ops", "view_lockholder"))
    with Lock("rebuild-index", ttl=30, backend=redis_settings):
        with owner_context(internal=True):
            guard = Lock("rebuild-index#task:0f3a", ttl=30, backend=redis_settings).acquire()
        try:
            html = client.get(HOLDERS).text
        finally:
            guard.release()
    assert 'data-lock="rebuild-index"' in html
    assert "#task:" not in html
