"""Read-only operators (README "Who may act"): they can list and show locks, and a force
release from them is refused by the server, on Redis (the README's viewer ACL) and etcd
(a role with ``read`` on the prefix)."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest
from secure_fixtures import ETCD_RBAC_PREFIX, SECRET
from servers import AuthEtcdServer, SecureRedisServer

from task_locks import Lock, get_backend
from task_locks.cli import main as cli
from task_locks.errors import InvalidArgument


def _viewer_sees_but_cannot_release(
    lock_url: str, viewer_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with Lock("nightly", ttl=30, backend=lock_url) as lease:
        capsys.readouterr()
        assert cli(["--url", viewer_url, "list", "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert [(h["name"], h["fence"]) for h in listed] == [("nightly", lease.fence)]
        assert cli(["--url", viewer_url, "show", "nightly"]) == 0
        # The server refuses: the role/ACL has no write (the CLI's release --force makes
        # the same backend call, with the fence it showed).
        with pytest.raises(InvalidArgument) as refused:
            get_backend(viewer_url).force_release("nightly")
        assert "viewer" in str(refused.value) and SECRET not in str(refused.value)
        holder = get_backend(lock_url).holder("nightly")
        assert holder is not None and holder.fence == lease.fence  # nothing was released
        capsys.readouterr()


def test_redis_viewer_acl(acl_redis: SecureRedisServer, capsys: pytest.CaptureFixture[str]) -> None:
    prefix = "task_locks:viewer:"
    viewer = f"redis://viewer:{quote(SECRET + '-viewer')}@127.0.0.1:{acl_redis.port}/0"
    _viewer_sees_but_cannot_release(
        acl_redis.url(prefix=prefix), f"{viewer}?prefix={prefix}", capsys
    )
    acl_redis.redis_client("admin", SECRET + "-admin").acl_log_reset()  # type: ignore[attr-defined]


def test_etcd_read_only_role(rbac_etcd: AuthEtcdServer, capsys: pytest.CaptureFixture[str]) -> None:
    prefix = ETCD_RBAC_PREFIX + "viewer/"
    rbac_etcd.grant("viewer", ETCD_RBAC_PREFIX, perm="READ")
    rbac_etcd.add_user("viewer", SECRET + "-viewer", "viewer")
    viewer = f"etcd://viewer:{quote(SECRET + '-viewer')}@127.0.0.1:{rbac_etcd.port}"
    _viewer_sees_but_cannot_release(
        rbac_etcd.url(prefix=prefix), f"{viewer}?prefix={prefix}", capsys
    )
