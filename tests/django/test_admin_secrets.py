"""The admin never shows the backend's password: its pages, its confirm page,
its messages and its audit rows (every kind audited), on a working ACL-protected Redis
and on failing ones; and on etcd with RBAC and Redis over TLS, with ``manage.py locks``
too, neither the password nor etcd's token nor the client key's contents."""

from __future__ import annotations

import io
import json
import logging

import pytest
from django.core.management import call_command
from django.test import Client
from django_helpers import staff
from secure_fixtures import ETCD_RBAC_PREFIX, SECRET, key_body
from servers import Certs, SecureRedisServer, free_port

from django_app import audit
from django_app.models import LockEvent
from task_locks import Lock, get_backend
from task_locks.errors import LockError

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
    # Every event kind is audited: the rows searched below must exist.
    settings.TASK_LOCKS = {"BACKEND": url, "AUDIT": True}  # type: ignore[attr-defined]
    client.force_login(staff("ops", "view_lockholder", "force_release_lock", "view_lockevent"))
    pages: list[str] = []
    lease = Lock("report:1", ttl=30, backend=url).acquire()
    pages.append(client.get(HOLDERS).text)
    pages.append(client.get(FORCE, {"name": "report:1"}).text)
    assert "report:1" in pages[-1]
    lease.release()
    for broken, fails in (
        (f"redis://locker:wrong-{SECRET}@127.0.0.1:{acl_redis.port}/0", True),
        (f"redis://locker:{SECRET}@127.0.0.1:{free_port()}/0?connect_timeout=0.5", True),
        (acl_redis.url(prefix="not-ours:"), False),  # SCAN finds nothing it may not read
    ):
        settings.TASK_LOCKS = {"BACKEND": broken, "AUDIT": True}  # type: ignore[attr-defined]
        page = client.get(HOLDERS)
        assert ("could not be read" in page.text) is fails, broken.rsplit("@", 1)[-1]
        pages += [page.text, client.get(FORCE, {"name": "x"}, follow=True).text]
        with pytest.raises(LockError):  # an error event, audited, with the failure's text
            Lock("report:2", ttl=5, backend=broken).acquire(timeout=0)
    assert audit.flush(timeout=5.0)
    rows = list(LockEvent.objects.all())
    kinds = {row.kind for row in rows}
    assert {"acquired", "released", "error"} <= kinds, kinds
    pages.append(client.get("/admin/task_locks/lockevent/").text)
    pages += [client.get(f"/admin/task_locks/lockevent/{row.pk}/change/").text for row in rows]
    pages += [repr(row.__dict__) for row in rows]
    pages.append(caplog.text)
    leaks = [page for page in pages if SECRET in page]
    assert not leaks, leaks[0][:3000]
    acl_redis.redis_client("admin", SECRET + "-admin").acl_log_reset()  # type: ignore[attr-defined]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("server", ["rbac_etcd", "tls_redis", "acl_redis"])
def test_admin_and_manage_py_on_secured_urls_never_show_a_secret(
    client: Client,
    settings: object,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
    certs: Certs,
    server: str,
) -> None:
    """etcd with an RBAC password, Redis over TLS with a password and a client key, Redis
    with an ACL user: the admin's pages and ``manage.py locks list --json`` / ``show``
    show the lock, never the password, etcd's auth token or the key file's contents."""
    caplog.set_level(logging.DEBUG)
    url = {
        "rbac_etcd": lambda s: s.url(prefix=ETCD_RBAC_PREFIX + "admin/"),
        "tls_redis": lambda s: s.url(prefix="admin:"),
        "acl_redis": lambda s: s.url(prefix="task_locks:admin2:"),
    }[server](request.getfixturevalue(server))
    settings.TASK_LOCKS = {"BACKEND": url, "AUDIT": True}  # type: ignore[attr-defined]
    client.force_login(staff("ops", "view_lockholder", "force_release_lock", "view_lockevent"))
    outputs: list[str] = []
    with Lock("report:1", ttl=30, backend=url):
        outputs.append(client.get(HOLDERS).text)
        outputs.append(client.get(FORCE, {"name": "report:1"}).text)
        assert "report:1" in outputs[-1]
        for argv in (["list", "--json"], ["show", "report:1", "--json"], ["list"]):
            out, err = io.StringIO(), io.StringIO()
            call_command("locks", *argv, stdout=out, stderr=err)
            outputs += [out.getvalue(), err.getvalue()]
        assert any(row["name"] == "report:1" for row in json.loads(outputs[2])), outputs[2]
    assert audit.flush(timeout=5.0)
    outputs.append(client.get("/admin/task_locks/lockevent/").text)
    outputs += [repr(row.__dict__) for row in LockEvent.objects.all()]
    outputs.append(caplog.text)
    secrets = [SECRET, *key_body(certs.client_key)]
    token = getattr(get_backend(url), "_token", None)
    if token:
        secrets.append(token)
    leaks = [(s[:8], text[:300]) for text in outputs for s in secrets if s in text]
    assert not leaks, leaks[0]
    if server == "acl_redis":
        request.getfixturevalue(server).redis_client(  # type: ignore[attr-defined]
            "admin", SECRET + "-admin"
        ).acl_log_reset()
