"""The admin never shows the backend's password (issue 18): its pages, its confirm page,
its messages and its audit rows, on a working ACL-protected Redis and on failing ones."""

from __future__ import annotations

import logging

import pytest
from django.test import Client
from django_helpers import staff
from secure_fixtures import SECRET
from servers import SecureRedisServer, free_port

from django_app import audit
from django_app.models import LockEvent
from task_locks import Lock

HOLDERS = "/admin/task_locks/lockholder/"
FORCE = "/admin/task_locks/lockholder/force-release/"


@pytest.mark.django_db(transaction=True)
def test_admin_pages_and_audit_rows_never_show_the_password(
    client: Client,
    settings: object,
    acl_redis: SecureRedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    url = acl_redis.url(prefix="task_locks:admin:")
    settings.TASK_LOCKS = {"BACKEND": url}  # type: ignore[attr-defined]
    client.force_login(staff("ops", "view_lockholder", "force_release_lock", "view_lockevent"))
    pages: list[str] = []
    lease = Lock("report:1", ttl=30, backend=url).acquire()
    pages.append(client.get(HOLDERS).text)
    pages.append(client.get(FORCE, {"name": "report:1"}).text)
    assert "report:1" in pages[-1]
    lease.release()
    audit.flush(timeout=5.0)
    pages.append(client.get("/admin/task_locks/lockevent/").text)
    pages += [repr(e.__dict__) for e in LockEvent.objects.all()]
    for broken, fails in (
        (f"redis://locker:wrong-{SECRET}@127.0.0.1:{acl_redis.port}/0", True),
        (f"redis://locker:{SECRET}@127.0.0.1:{free_port()}/0?connect_timeout=0.5", True),
        (acl_redis.url(prefix="not-ours:"), False),  # SCAN finds nothing it may not read
    ):
        settings.TASK_LOCKS = {"BACKEND": broken}  # type: ignore[attr-defined]
        page = client.get(HOLDERS)
        assert ("could not be read" in page.text) is fails, broken.rsplit("@", 1)[-1]
        pages += [page.text, client.get(FORCE, {"name": "x"}, follow=True).text]
    pages.append(caplog.text)
    leaks = [page for page in pages if SECRET in page]
    assert not leaks, leaks[0][:3000]
    acl_redis.redis_client("admin", SECRET + "-admin").acl_log_reset()  # type: ignore[attr-defined]
