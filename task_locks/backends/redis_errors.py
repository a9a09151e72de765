"""What redis-py raises, translated to this package's errors: :func:`translate`.

Used at every boundary where redis-py is called (the Redis and Redlock backends,
:mod:`task_locks.fencing`), so a failure reads the same whoever met it.
"""

from __future__ import annotations

import ssl
from urllib.parse import urlsplit

from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ClusterDownError,
    InvalidResponse,
    NoPermissionError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.sentinel import MasterNotFoundError

from ..errors import BackendMisconfigured, BackendUnavailable, LockError


class PlainRedisOnTLSURL(RedisError):
    """A ``rediss://`` URL whose port answered a plain-text PING: a configuration error.

    A :class:`RedisError` but not a connection error: redis-py does not retry it."""


def _causes(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and seen not in chain and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    return chain


def _misconfiguration(exc: Exception, server: str) -> str | None:
    """A sentence saying how the URL and the server disagree, or ``None`` (not that).

    Retrying cannot fix these, so they are not "unavailable": authentication, TLS where
    the server has none (or the reverse), a server that is not Redis.
    """
    text = str(exc)
    if any(isinstance(cause, PlainRedisOnTLSURL) for cause in _causes(exc)):
        return (
            f"TLS where Redis at {server} has none: the port answers plain Redis, so the URL "
            "must say redis://, not rediss://"
        )
    # Redis refuses a long command from a client that has not authenticated with this
    # protocol error (and hangs up) before it would say NOAUTH: the hand-off's enqueue
    # script call is such a command.
    unauthenticated = "Protocol error: unauthenticated" in text
    if (
        isinstance(exc, AuthenticationError)
        or text.startswith(("NOAUTH", "WRONGPASS"))
        or unauthenticated
    ):
        if not ("invalid username-password" in text or text.startswith("WRONGPASS")):
            # NOAUTH (redis-py drops the word): "Authentication required", "HELLO must be
            # called with the client already authenticated..."
            return (
                f"Redis at {server} requires a password: put it in the URL, "
                "redis://:PASSWORD@host:port/db (or redis://USER:PASSWORD@... with ACLs)"
            )
        return (
            f"Redis at {server} refused the URL's credentials (wrong password, or wrong "
            f"user): {text}"
        )
    if "called without any password configured" in text:
        return f"the URL gives a password but Redis at {server} has none: remove it from the URL"
    if isinstance(exc, InvalidResponse) or "Protocol error" in text:
        tls = (
            " (a TLS port? then the URL must say rediss://)" if server.startswith("redis:") else ""
        )
        return f"the server at {server} does not speak the Redis protocol{tls}: {text}"
    for cause in _causes(exc):
        if isinstance(cause, ssl.SSLError) and not isinstance(cause, ssl.SSLZeroReturnError):
            return (
                f"TLS with {server} failed (a plain, non-TLS port? then the URL must say "
                f"redis://; or a certificate problem): {cause}"
            )
    return None


def _tls_handshake_timed_out(exc: Exception) -> bool:
    return any("handshake" in str(cause) for cause in _causes(exc))


def _hung_up(exc: Exception) -> bool:
    """The server closed the connection on our request: what a TLS-only port does with
    plaintext (also what a server restarting does, so it stays "unavailable")."""
    causes = list(_causes(exc))
    if any(
        isinstance(cause, ConnectionRefusedError) or "Connection refused" in str(cause)
        for cause in causes
    ):
        return False  # nothing listens there (any more): plainly unavailable
    return any(
        isinstance(cause, ConnectionResetError)
        or "Connection reset by peer" in str(cause)
        or "Connection closed by server" in str(cause)
        for cause in causes
    )


def _not_connected(exc: Exception) -> bool:
    """Whether redis-py's last try failed to make the connection (its "Error N connecting
    to" message over the socket's ``OSError``)."""
    return (
        isinstance(exc, RedisConnectionError)
        and isinstance(exc.__context__, OSError)
        and " connecting to " in str(exc)
    )


UNAVAILABLE = (
    RedisConnectionError,
    RedisTimeoutError,
    BusyLoadingError,
    ReadOnlyError,
    ClusterDownError,
    MasterNotFoundError,
    TryAgainError,
    RedisClusterException,  # no reachable node / slot not covered
    OSError,
)
#: What redis-py raises; translated to our errors at this boundary, never let through.
CLIENT_ERRORS = (RedisError, RedisClusterException)


def _access_refused(what: str, server: str, prefix: str, exc: Exception) -> str:
    """A wrong user/password or an ACL refusal: a configuration error, not an outage."""
    user = urlsplit(server).username or "default"
    if isinstance(exc, AuthenticationError):
        return f"{what}: Redis at {server} refused user {user!r}: check the user and password"
    return (
        f"{what}: Redis at {server} refused user {user!r}: {exc}; its ACL must allow the keys "
        f"{prefix + '*'!r} (prefix {prefix!r}) and the commands of the lock-user ACL in docs/security.md"
    )


def translate(
    exc: Exception, *, what: str, name: str | None, server: str, prefix: str = ""
) -> LockError:
    """The error to raise (``raise translate(...) from exc``) for redis-py's ``exc``.

    ``what`` starts the message (``"lock 'x'"``, ``"resource 'y'"``); ``name`` is the
    lock (or resource) the error carries; ``prefix`` names the keys an ACL must allow.
    A refusal retrying cannot fix is :class:`BackendMisconfigured`, an outage
    :class:`BackendUnavailable`, anything else a plain :class:`LockError`.
    """
    if isinstance(exc, NoPermissionError):
        return BackendMisconfigured(
            _access_refused(what, server, prefix, exc), name=name, server=server
        )
    misconfigured = _misconfiguration(exc, server)
    if misconfigured is not None:
        return BackendMisconfigured(f"{what}: {misconfigured}", name=name, server=server)
    if server.startswith("rediss") and _tls_handshake_timed_out(exc):
        return BackendUnavailable(
            f"{what}: the TLS handshake with {server} got no answer: the port may "
            "be a plain (non-TLS) Redis, where the URL must say redis://, or the server "
            f"is frozen: {exc}",
            name=name,
            server=server,
        )
    if server.startswith("redis://") and _hung_up(exc):
        return BackendUnavailable(
            f"{what}: Redis at {server} is unavailable: it hung up on the request "
            "(the port may speak TLS only, then the URL must say rediss://; or the server "
            f"is restarting): {exc}",
            name=name,
            server=server,
        )
    if isinstance(exc, UNAVAILABLE):
        return BackendUnavailable(
            f"{what}: Redis at {server} is unavailable: {exc}",
            name=name,
            server=server,
            timed_out=isinstance(exc, RedisTimeoutError),
            unreachable=_not_connected(exc),
        )
    return LockError(f"{what}: Redis at {server} refused: {exc}", name=name)
