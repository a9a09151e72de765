"""No password ever shows: a known one goes through every backend URL and every
failure path we can produce, and everything task-locks printed is searched for it.

Searched: each exception's message, repr and whole chain (``raise ... from``, as a
traceback prints it), every log record at DEBUG (with its traceback), ``repr(backend)``,
and the output of ``task-locks list --json``, ``show`` and ``--help``; events (through a
subscriber); and besides the password, etcd's auth token and the TLS private keys'
contents.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterator

import pytest
from secure_fixtures import ETCD_RBAC_PREFIX, SECRET, key_body
from servers import AuthEtcdServer, Certs, SecureRedisServer, TLSEtcdServer, free_port

from task_locks import Lock, events, get_backend
from task_locks.cli import main as cli
from task_locks.errors import LockError


@pytest.fixture
def outputs(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> Iterator[list[str]]:
    """Collects what a test produced; at the end, nothing of it may contain the password."""
    caplog.set_level(logging.DEBUG)
    seen: list[str] = []
    yield seen
    captured = capsys.readouterr()
    seen += [captured.out, captured.err, caplog.text]
    seen += [str(r.__dict__) for r in caplog.records]
    leaks = [text for text in seen if SECRET in text]
    assert not leaks, f"the password leaked into: {leaks[0][:2000]}"


def _failure(seen: list[str], action: Callable[[], object]) -> BaseException | None:
    """Run ``action``; record its exception's message, repr and printed chain."""
    try:
        action()
    except SystemExit:  # argparse's --help and usage errors: their text is in capsys
        return None
    except Exception as exc:  # any error is searched, whatever its type
        seen += [str(exc), repr(exc), "".join(traceback.format_exception(exc))]
        return exc
    return None


def _exercise(seen: list[str], url: str) -> BaseException | None:
    """Make the backend (repr), lock, list: whatever fails is recorded."""

    def lock() -> None:
        backend = get_backend(url)
        seen.append(repr(backend))
        seen.append(str(getattr(backend, "server", "")))
        with Lock("secret-probe", ttl=5, backend=url, timeout=0):
            backend.holders()

    error = _failure(seen, lock)
    for argv in (["list", "--json"], ["show", "secret-probe"], ["--help"]):
        _failure(seen, lambda argv=argv: cli(["--url", url, *argv]))
    return error


def _closed() -> int:
    return free_port()  # nothing listens there


def test_unreachable_servers_of_every_scheme(outputs: list[str], certs: Certs) -> None:
    p1, p2, p3 = _closed(), _closed(), _closed()
    short = "socket_timeout=0.5&connect_timeout=0.5"
    urls = [
        f"redis://user:{SECRET}@127.0.0.1:{p1}/0?{short}",
        f"redis://:{SECRET}@127.0.0.1:{p1}/0?{short}",
        f"rediss://user:{SECRET}@127.0.0.1:{p1}/0?ssl_ca_certs={certs.ca}&{short}",
        f"redis+sentinel://user:{SECRET}@127.0.0.1:{p1}/mymaster?{short}",
        f"redis+cluster://user:{SECRET}@127.0.0.1:{p1}?{short}",
        f"redlock://user:{SECRET}@127.0.0.1:{p1},127.0.0.1:{p2},127.0.0.1:{p3}?node_timeout=0.2",
        f"etcd://user:{SECRET}@127.0.0.1:{p1}?timeout=0.5",
        f"etcds://user:{SECRET}@127.0.0.1:{p1}?ca={certs.ca}&cert={certs.client_cert}"
        f"&key={certs.client_key}&timeout=0.5",
    ]
    for url in urls:
        error = _exercise(outputs, url)
        assert isinstance(error, LockError), (url.split(":")[0], error)


@pytest.mark.parametrize(
    "url",
    [
        f"redis://user:{SECRET}@127.0.0.1:notaport/0",
        f"redis://user:{SECRET}@127.0.0.1:6379/0?socket_timeout=soon",
        f"rediss://user:{SECRET}@127.0.0.1:6379/0?bogus=1",
        f"redis://user:{SECRET}@127.0.0.1:6379/notadb",
        f"redis+sentinel://user:{SECRET}@127.0.0.1:26379",
        f"redis+cluster://user:{SECRET}@127.0.0.1:x",
        f"redlock://user:{SECRET}@127.0.0.1:1?bogus=1",
        f"etcd://user:{SECRET}@127.0.0.1:notaport",
        f"etcd://user:{SECRET}@127.0.0.1:2379?bogus=1",
        f"etcd://user:{SECRET}@127.0.0.1:2379/a/path",
        f"etcds://user:{SECRET}@127.0.0.1:2379?ca=/no/such/file",
        f"etcd://user:{SECRET}@[::1",
        f"redis://user:{SECRET}@[::1",
        f"bogus://user:{SECRET}@host",
        f"user:{SECRET}@host",
    ],
    ids=lambda url: url.split(":", 1)[0] + "-" + url.rsplit("@", 1)[-1],  # never the password
)
def test_malformed_urls_and_bad_options(outputs: list[str], url: str) -> None:
    assert _exercise(outputs, url) is not None


def test_wrong_passwords(
    outputs: list[str], acl_redis: SecureRedisServer, rbac_etcd: AuthEtcdServer
) -> None:
    wrong = "wrong-" + SECRET
    redis_url = f"redis://locker:{wrong}@127.0.0.1:{acl_redis.port}/0"
    etcd_url = f"etcd://locker:{wrong}@127.0.0.1:{rbac_etcd.port}"
    redlock_url = f"redlock://locker:{wrong}@127.0.0.1:{acl_redis.port}"
    for url in (redis_url, etcd_url, redlock_url):
        assert _exercise(outputs, url) is not None


def test_permission_errors(
    outputs: list[str], acl_redis: SecureRedisServer, rbac_etcd: AuthEtcdServer
) -> None:
    """The user is right, the namespace is not theirs."""
    assert _exercise(outputs, acl_redis.url(prefix="not-ours:")) is not None
    assert _exercise(outputs, rbac_etcd.url(prefix="not-ours/")) is not None
    acl_redis.redis_client("admin", SECRET + "-admin").acl_log_reset()  # type: ignore[attr-defined]


def test_working_secured_backends(
    outputs: list[str],
    acl_redis: SecureRedisServer,
    rbac_etcd: AuthEtcdServer,
    tls_redis: SecureRedisServer,
) -> None:
    """A held lock listed, shown and described by the CLI, on every secured backend."""
    for url in (
        acl_redis.url(prefix="task_locks:secrets:"),
        rbac_etcd.url(prefix=ETCD_RBAC_PREFIX + "secrets/"),
        tls_redis.url(prefix="secrets:"),
    ):
        with Lock("held", ttl=5, backend=url):
            outputs.append(repr(get_backend(url)))
            for argv in (["list", "--json"], ["show", "held", "--json"], ["list"], ["--help"]):
                _failure(outputs, lambda argv=argv, url=url: cli(["--url", url, *argv]))


def test_no_auth_token_key_contents_or_password_in_any_output(
    outputs: list[str],
    rbac_etcd: AuthEtcdServer,
    tls_etcd: TLSEtcdServer,
    tls_redis: SecureRedisServer,
    certs: Certs,
) -> None:
    """etcd's auth token and the TLS private keys' contents are secrets as well: through a
    working lock, a renewed token, events, bad key files and the CLI, none of them shows.

    Events are searched too (every kind, through a subscriber), not only logs."""
    seen_events: list[str] = []
    subscription = events.subscribe(lambda event: seen_events.append(repr(event)))
    try:
        etcd_url = rbac_etcd.url(prefix=ETCD_RBAC_PREFIX + "token/")
        backend = get_backend(etcd_url)
        with Lock("token-probe", ttl=5, backend=etcd_url) as lease:
            token = backend._token  # type: ignore[attr-defined]
            assert token, "the RBAC user never authenticated"
            rbac_etcd.invalidate_tokens()  # the next call renews it, and may log why
            lease.renew()  # raises if it failed
            tokens = {token, backend._token}  # type: ignore[attr-defined]
            outputs.append(repr(backend))
            for argv in (["list", "--json"], ["show", "token-probe", "--json"], ["list"]):
                _failure(outputs, lambda argv=argv: cli(["--url", etcd_url, *argv]))
        # Key files in the wrong places: TLS libraries read them and complain.
        swapped = (
            f"etcds://127.0.0.1:{tls_etcd.port}?ca={certs.ca}&cert={certs.client_key}"
            f"&key={certs.client_cert}&timeout=1",
            f"etcds://127.0.0.1:{tls_etcd.port}?ca={certs.client_key}&cert={certs.client_cert}"
            f"&key={certs.client_key}&timeout=1",
            tls_redis.url(ssl_keyfile=certs.ca, socket_timeout=1),
            tls_redis.url(ssl_ca_certs=certs.client_key, socket_timeout=1),
        )
        for url in swapped:
            assert _exercise(outputs, url) is not None, url.split("?")[0]
        for url in (tls_etcd.url(prefix="keys/"), tls_redis.url(prefix="keys:")):
            with Lock("key-probe", ttl=5, backend=url):
                _failure(outputs, lambda url=url: cli(["--url", url, "list", "--json"]))
        events.flush()
    finally:
        events.unsubscribe(subscription)
    assert seen_events, "no event was emitted: the event search is vacuous"
    outputs += seen_events
    secrets = [*tokens, *key_body(certs.client_key), *key_body(certs.server_key)]
    leaks = [(s[:8], text[:300]) for text in outputs for s in secrets if s in text]
    assert not leaks, leaks[0]
