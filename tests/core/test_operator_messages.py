"""Errors and messages an operator or a cron wrapper acts on (the front ends)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from task_locks import (
    BackendMisconfigured,
    BackendUnavailable,
    Lock,
    LockHeld,
    get_backend,
)
from task_locks.types import Holder, Owner
from task_locks.verbs import conflict_message, positive_seconds


def test_a_holder_without_a_job_reads_as_a_process() -> None:
    owner = Owner(host="vm", pid=42)
    assert owner.describe() == "a process on vm pid 42"
    line = conflict_message("x", Holder("x", 3, owner, None, None))
    assert "held by a process on vm pid 42" in line and "held by on" not in line
    assert Owner(command="cron", host="vm", pid=1).describe() == "command 'cron' on vm pid 1"


def test_ttl_minus_one_is_refused_as_not_positive() -> None:
    import argparse

    for text in ("-1", "0"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"> 0") as caught:
            positive_seconds(text)
        assert ">= 0" not in str(caught.value)


def test_waits_in_messages_are_rounded(redis_url: str) -> None:
    with Lock("busy", ttl=30, backend=redis_url):
        with pytest.raises(LockHeld) as caught:
            Lock("busy", ttl=30, backend=redis_url, timeout=0.0002).acquire()
    message = str(caught.value)
    assert "after waiting" in message
    waited = message.rsplit("after waiting ", 1)[1]
    assert waited in {"<1ms", "1ms"} or (waited.endswith("ms") and "." not in waited), message


@pytest.fixture
def password_redis(redis_factory) -> Iterator[int]:  # type: ignore[no-untyped-def]
    server = redis_factory(extra=["--requirepass", "s3cret"])
    yield server.port


def test_redis_auth_required_is_a_configuration_error(password_redis: int) -> None:
    backend = get_backend(f"redis://127.0.0.1:{password_redis}/0")
    with pytest.raises(BackendMisconfigured) as caught:
        backend.holder("x")
    assert not isinstance(caught.value, BackendUnavailable)
    assert "requires a password" in str(caught.value)


def test_redis_wrong_password_is_a_configuration_error(password_redis: int) -> None:
    backend = get_backend(f"redis://:wrong@127.0.0.1:{password_redis}/0")
    with pytest.raises(BackendMisconfigured) as caught:
        backend.holder("x")
    assert "wrong password" in str(caught.value) and "wrong@" not in str(caught.value)
    assert get_backend(f"redis://:s3cret@127.0.0.1:{password_redis}/0").holder("x") is None


def test_rediss_against_a_plain_port_is_a_configuration_error_at_once(redis_url: str) -> None:
    backend = get_backend(redis_url.replace("redis://", "rediss://", 1))
    # A plain port may never answer the ClientHello: a handshake still running after
    # TLS_PROBE_AFTER probes the port in plain text, and a Redis answer there is the URL's
    # fault (78 in the CLIs), said at once, not an outage after socket_timeout (5 s).
    started = time.monotonic()
    with pytest.raises(BackendMisconfigured, match="must say redis://"):
        backend.holder("x")
    assert time.monotonic() - started < 2.0


@pytest.fixture
def http_port() -> Iterator[int]:
    """A real server that is not Redis: answers every connection with an HTTP 400."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(1024)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(5)
    listener.close()


def test_a_server_that_is_not_redis_is_named_a_protocol_mismatch(http_port: int) -> None:
    backend = get_backend(f"redis://127.0.0.1:{http_port}/0?socket_timeout=2")
    with pytest.raises(BackendMisconfigured, match=r"does not speak the Redis protocol"):
        backend.holder("x")


def test_not_owned_after_a_force_release_says_so(redis_url: str) -> None:
    from task_locks import NotOwned

    lease = Lock("taken-away", ttl=30, backend=redis_url).acquire()
    assert get_backend(redis_url).force_release("taken-away")  # an operator, meanwhile
    with pytest.raises(NotOwned) as caught:
        lease.release()
    message = str(caught.value)
    assert "force-released" in message and "expired" not in message, message


def test_not_owned_after_the_ttl_ran_out_says_expired(redis_url: str) -> None:
    import redis
    from servers import wait_until

    from task_locks import NotOwned

    lease = Lock("ran-out", ttl=0.3, backend=redis_url, renew=False).acquire()
    key = get_backend(redis_url)._key("ran-out")  # type: ignore[attr-defined]
    client = redis.Redis.from_url(redis_url)
    # The server's own expiry, not holder(): under load a late reply makes holder() call
    # the lock gone a few ms before Redis deletes it, and the release would then succeed.
    wait_until(lambda: not client.exists(key), 5, "the server to expire the lock")
    client.close()
    with pytest.raises(NotOwned, match="expired"):
        lease.release()


def test_plain_redis_against_a_tls_port_is_named_a_tls_mismatch(tls_redis) -> None:  # type: ignore[no-untyped-def]
    """``redis://`` to a TLS-only port: the server hangs up on the plaintext. A restarting
    server does the same, so it stays unavailable (a retry may help), with the likely cause."""
    host_port = tls_redis.url().split("@", 1)[1].split("/", 1)[0]
    backend = get_backend(f"redis://{host_port}/0?socket_timeout=2&connect_timeout=2")
    with pytest.raises(BackendUnavailable, match=r"TLS only, then the URL must say rediss://"):
        backend.holder("x")
