"""Bad input fails at call time with a message saying what was wrong."""

from __future__ import annotations

from typing import Any

import pytest

from task_locks import InvalidArgument, LockError, configure, get_backend

from .support import SyncDriver

#: Nothing listens here: a call that reached the network would fail differently.
NOWHERE = "redis://127.0.0.1:1/0"

LOCK_CASES: list[tuple[dict[str, Any], str]] = [
    ({"name": ""}, "empty"),
    ({"name": "   "}, "empty or blank"),
    ({"name": 42}, "must be a string"),
    ({"name": "x" * 600}, "at most 512"),
    ({"name": "a\x00b"}, "must not contain control characters, got '\\x00' at position 1"),
    ({"name": "line\nbreak"}, "must not contain control characters"),
    ({"name": "half\ud800"}, "must be valid unicode text"),
    ({"backend": "redis://127.0.0.1:6379/0?prefix=a{b}"}, "must not contain '{' or '}'"),
    ({"ttl": 0}, "ttl must be a finite number of seconds > 0, got 0"),
    ({"ttl": -5}, "ttl must be a finite number of seconds > 0, got -5"),
    ({"ttl": float("nan")}, "ttl must be a finite number"),
    ({"ttl": "30"}, "ttl must be a number of seconds, got '30'"),
    ({"timeout": -1}, "timeout must be >= 0 seconds, got -1"),
    ({"timeout": "5"}, "timeout must be seconds"),
    ({"max_hold": 0}, "max_hold must be a finite number of seconds > 0"),
    ({"backend": "nosuch://host"}, "unknown lock backend scheme 'nosuch://'"),
    ({"backend": "redis//127.0.0.1:6379"}, "malformed backend URL"),
    ({"backend": "redis://127.0.0.1:notaport/0"}, "malformed Redis URL"),
    ({"backend": "redis://127.0.0.1:6379/notadb"}, "malformed Redis URL"),
    ({"backend": "redis://[::1/0"}, "malformed backend URL"),
    ({"backend": "redis://127.0.0.1:6379/0?socket_timeout=soon"}, "socket_timeout='soon'"),
    ({"backend": "redis://127.0.0.1:6379/0?socket_timeout=0"}, "socket_timeout must be > 0"),
    ({"backend": "redis://127.0.0.1:6379/0?colour=blue"}, "unknown option 'colour'"),
    ({"backend": "redis+sentinel://127.0.0.1:26379"}, "service_name"),
    ({"backend": "redis+sentinel://127.0.0.1:26379/m/x"}, "malformed sentinel URL"),
    ({"backend": "redis+cluster://"}, "no host:port"),
    ({"backend": "redis+cluster://127.0.0.1:port"}, "malformed host:port '127.0.0.1:port'"),
    ({"backend": "redis+cluster://127.0.0.1:7000?colour=blue"}, "unknown option"),
]


@pytest.mark.parametrize(("bad", "message"), LOCK_CASES, ids=[m for _, m in LOCK_CASES])
def test_bad_lock_arguments_fail_when_the_lock_is_made(
    driver: SyncDriver, bad: dict[str, Any], message: str
) -> None:
    arguments = {"name": "valid", "ttl": 5, "backend": NOWHERE, **bad}
    name = arguments.pop("name")
    with pytest.raises(InvalidArgument) as caught:
        driver.lock_class(name, **arguments)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, LockError)
    assert message in str(caught.value)


def test_bad_acquire_timeout_fails_before_any_io(driver: SyncDriver) -> None:
    lock = driver.lock("valid", ttl=5, backend=NOWHERE)  # nothing listens: no I/O may happen
    with pytest.raises(InvalidArgument, match=r"timeout must be >= 0 seconds, got -0.5"):
        driver.call(lock.acquire, timeout=-0.5)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("", "must be a non-empty string"),
        ("nosuch://x", "unknown lock backend scheme"),
        ("127.0.0.1:6379", "malformed backend URL"),
    ],
)
def test_bad_backend_urls(url: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        get_backend(url)
    with pytest.raises(InvalidArgument, match=message):
        configure(backend=url)


def test_bad_configured_ttl() -> None:
    with pytest.raises(InvalidArgument, match="default_ttl must be a finite number"):
        configure(default_ttl=-1)


def test_password_never_appears_in_messages() -> None:
    with pytest.raises(InvalidArgument) as caught:
        get_backend("redis://user:hunter2@127.0.0.1:6379/0?socket_timeout=x")
    assert "hunter2" not in str(caught.value)
    assert "***" in str(caught.value)


def test_a_lock_without_any_configured_backend_says_how_to_configure_one(
    driver: SyncDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No silent default server: two hosts that forgot the setting would each lock on
    their own local Redis, and nothing would say so."""
    from task_locks.errors import NotConfigured

    monkeypatch.delenv("TASK_LOCKS_URL", raising=False)
    lock = driver.lock_class("nightly", ttl=5)  # made at import, configured later: fine
    with pytest.raises(NotConfigured) as caught:
        driver.call(lock.acquire, timeout=0)
    assert isinstance(caught.value, LockError) and caught.value.name == "nightly"
    message = str(caught.value)
    for hint in ("configure(backend=", "TASK_LOCKS_URL", "TASK_LOCKS['BACKEND']"):
        assert hint in message
    configure(backend="memory://configured-later")
    lease = driver.call(lock.acquire, timeout=0)
    driver.call(lease.release)


def test_an_empty_task_locks_url_is_not_a_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    from task_locks.config import resolve_backend
    from task_locks.errors import NotConfigured

    monkeypatch.setenv("TASK_LOCKS_URL", "")
    with pytest.raises(NotConfigured, match="no lock backend is configured"):
        resolve_backend()
    monkeypatch.setenv("TASK_LOCKS_URL", "memory://from-env")
    assert resolve_backend().url == "memory://from-env"


def test_require_refuses_unknown_capability_names_at_construction(driver: SyncDriver) -> None:
    from task_locks.backends.base import CAPABILITIES

    with pytest.raises(InvalidArgument) as caught:  # NOWHERE: no I/O may happen
        driver.lock_class("valid", ttl=5, backend=NOWHERE, require={"fencing", "consenus", "x"})
    message = str(caught.value)
    assert "['consenus', 'x']" in message
    assert str(sorted(CAPABILITIES)) in message
    driver.lock_class("valid", ttl=5, backend=NOWHERE, require={"fencing", "consensus"})


def test_semaphore_require_refuses_unknown_capability_names_at_construction() -> None:
    from task_locks.semaphore import AsyncSemaphore, Semaphore

    for semaphore in (Semaphore, AsyncSemaphore):
        with pytest.raises(InvalidArgument, match=r"unknown capabilities.*\['teleport'\]"):
            semaphore("valid", 2, ttl=5, backend=NOWHERE, require={"fencing", "teleport"})
        semaphore("valid", 2, ttl=5, backend=NOWHERE, require={"fencing"})
