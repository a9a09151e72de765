"""Building redis-py clients from a URL: plain, ``unix://``, Sentinel and Cluster, sync
and asyncio alike (:class:`ClientFactory`), and the connection classes they need.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import socket
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Final
from urllib.parse import SplitResult, unquote

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.cluster
import redis.connection
import redis.retry
import redis.sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..errors import InvalidArgument
from ._redis_compat import aget_connection, get_connection, pack_command, set_socket_timeout
from .base import unknown_options
from .redis_errors import PlainRedisOnTLSURL

#: A TLS handshake not done by then is checked for a plain Redis on the port (a plain
#: port may never answer a ClientHello: the handshake would wait out socket_timeout).
TLS_PROBE_AFTER: Final = 0.5


def _speaks_plain_redis(host: str, port: int, timeout: float) -> bool:
    """Whether ``host:port`` answers a plain-text ``PING`` the way a Redis server does
    (``+PONG``, or an error such as ``-NOAUTH``); a TLS server drops it or sends an alert."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as probe:
            probe.sendall(b"PING\r\n")
            reply = probe.recv(64)
    except OSError:
        return False
    return reply.startswith((b"+", b"-"))


class _ShortHandshake(redis.connection.Connection):
    """The TCP half of :class:`_TLSConnection`: once connected (with the full connect
    timeout), the TLS handshake redis-py runs next waits no longer than the probe's short
    timeout, unless a full handshake was asked for. Both ways redis-py sets it are
    covered: the socket's own timeout (redis-py 5 and 6) and ``socket_connect_timeout``,
    which newer versions apply to the socket again just before the handshake (restored
    by :class:`_TLSConnection` once the handshake is over)."""

    _full_handshake = False
    _tcp: socket.socket | None = None
    #: ``socket_connect_timeout`` while the handshake runs short (``_UNSET`` otherwise:
    #: ``None`` is a timeout too, "wait for ever").
    _UNSET: Any = object()
    _connect_timeout: Any = _UNSET

    def _connect(self) -> Any:
        sock: socket.socket = super()._connect()  # type: ignore[no-untyped-call]
        if not self._full_handshake:
            short = _probe_after(self)
            sock.settimeout(short)
            self._connect_timeout = self.socket_connect_timeout
            self.socket_connect_timeout = short
        self._tcp = sock
        return sock


def _probe_after(connection: Any) -> float:
    return min(TLS_PROBE_AFTER, connection.socket_timeout or TLS_PROBE_AFTER)


class _TLSConnection(redis.connection.SSLConnection, _ShortHandshake):
    """redis-py's TLS connection, telling a plain Redis port from a slow TLS server fast.

    A handshake still running after :data:`TLS_PROBE_AFTER` seconds makes a plain-text
    probe of the port: a Redis answer there fails at once as a configuration error (the
    URL says rediss:// where the server has no TLS), instead of a timeout seconds later;
    anything else (a TLS server that is just slow) is connected again with the full
    timeouts. The short timeout is set between the TCP connect and the handshake by
    :class:`_ShortHandshake`, which the method order puts under ``SSLConnection``'s
    ``super()._connect()``: no private redis-py method is called (they differ by version).
    """

    def _connect(self) -> Any:
        self._full_handshake = False
        try:
            tls = super()._connect()  # type: ignore[no-untyped-call]
        except BaseException as exc:
            self._restore_connect_timeout()
            if self._tcp is not None:
                self._tcp.close()  # redis-py 5.0 leaves it open when the handshake fails
            if not isinstance(exc, TimeoutError):
                raise
            if _speaks_plain_redis(self.host, self.port, _probe_after(self)):
                raise PlainRedisOnTLSURL(
                    f"{self.host}:{self.port} answered a plain-text PING: it has no TLS"
                ) from None
            self._full_handshake = True
            return super()._connect()  # type: ignore[no-untyped-call]
        finally:
            self._tcp = None
            self._restore_connect_timeout()
        tls.settimeout(self.socket_timeout)
        return tls

    def _restore_connect_timeout(self) -> None:
        if self._connect_timeout is not self._UNSET:
            self.socket_connect_timeout = self._connect_timeout
            self._connect_timeout = self._UNSET


@functools.cache
def _connection_options(connection_class: type) -> frozenset[str]:
    """The keyword arguments redis-py's ``connection_class`` takes (its URL options)."""
    names: set[str] = set()
    for cls in connection_class.__mro__:
        init = cls.__dict__.get("__init__")
        if init is not None:
            names.update(
                p.name
                for p in inspect.signature(init).parameters.values()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
            )
    return frozenset(names)


def _share_tls_context(pool: Any) -> None:
    """Give every TLS connection of an asyncio ``pool`` one shared context.

    redis.asyncio builds a fresh ``ssl.create_default_context()`` for each new
    connection: loading the system CA store costs about 70 ms of CPU, in the event
    loop's thread. A dozen waiters opening connections at once blocked the loop for
    about a second, long enough for the holder's renewal to miss a short TTL.
    """
    base = pool.connection_class
    if not issubclass(base, redis.asyncio.connection.SSLConnection):
        return
    shared: list[Any] = []

    class SharedContextSSLConnection(base):  # type: ignore[misc, valid-type]
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            if shared:
                self.ssl_context = shared[0]
            else:
                shared.append(self.ssl_context)

    pool.connection_class = SharedContextSSLConnection


class _SentinelConnection(redis.sentinel.SentinelManagedConnection):
    """A sentinel-managed connection that is dropped after any read error.

    redis-py's sync class reads with ``disconnect_on_error=False``: after a socket timeout
    the connection returns to the pool with the late reply unread, and the next command
    (say, someone's acquire) would read it as its own answer. The asyncio class already
    disconnects.
    """

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["disconnect_on_error"] = True
        return super().read_response(*args, **kwargs)


#: Argument types hiredis packs byte for byte as redis-py's encoder does (UTF-8 text,
#: bytes, decimal integers: checked by ``tests/core/test_redis_wire.py``).
_PACKED_AS_IS: Final = frozenset({str, bytes, int})


def _pack(connection: Any, commands: list[tuple[Any, ...]]) -> list[bytes]:
    """``commands`` in the wire protocol, packed by hiredis in C when it can.

    redis-py's own packer encodes each argument in Python first: for a script call of
    a dozen arguments that cost more client CPU than the round trip's system calls.
    It is still used for anything hiredis might pack differently (another encoding, a
    float, a command name with a space, which redis-py splits).
    """
    if (
        pack_command is not None
        and connection.encoder.encoding == "utf-8"
        and connection.encoder.encoding_errors == "strict"
        and _PACKED_AS_IS.issuperset(map(type, chain.from_iterable(commands)))
        and not any(" " in str(command[0]) for command in commands)
    ):
        return [b"".join(map(pack_command, commands))]
    packed: list[bytes] = connection.pack_commands(commands)
    return packed


def _exchange(connection: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Send ``commands`` in one write and read their replies; an error reply is returned
    in its place (the connection is still in step), any other error raised."""
    connection.send_packed_command(_pack(connection, commands))
    replies: list[Any] = []
    for _ in commands:
        try:
            replies.append(connection.read_response())
        except ResponseError as exc:
            replies.append(exc)
    return replies


def can_send_direct(client: Any) -> bool:
    """Whether :func:`send_commands` may stand in for ``client``'s own command path: a
    plain or Sentinel-managed sync client (not a cluster client, whose commands route
    by slot, nor one pinned to a single connection)."""
    return isinstance(client, redis.Redis) and client.connection is None


def send_commands(client: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """``commands`` pipelined down one connection of ``client``'s pool, their replies in
    order (an error reply in its place): what ``client.pipeline(transaction=False)
    .execute(raise_on_error=False)`` answers, with the connection's own retry policy
    (one quick retry on a dropped connection, never on a timeout).

    This is the hot path of every lock operation. redis-py's command path (its
    pipeline object, per-argument encoding in Python, per-command observability
    bookkeeping) took more client CPU than the round trip's system calls; this keeps
    only what a script call needs: a pooled connection, one packed write, the replies
    read through redis-py's own parser (the same exception classes). A connection
    that fails mid-exchange is dropped, never handed back with a reply unread.
    """
    pool = client.connection_pool
    connection = checkout(pool, str(commands[0][0]))
    try:
        replies: list[Any] = connection.retry.call_with_retry(
            lambda: _exchange(connection, commands), lambda _error: connection.disconnect()
        )
    except BaseException:
        connection.disconnect()
        pool.release(connection)
        raise
    checkin(pool, connection)
    return _answers(client, commands, replies)


#: The pool attribute holding the connections our exchanges keep checked out of it
#: between them: ``(fork generation, list)``, the list ``None`` for a pool they hand
#: every connection back to. On the pool, so that it goes with the pool: a kept
#: connection refers to its pool (redis-py 8's maintenance handler), and a registry
#: keyed by pool would keep every pool alive that way.
_KEPT = "task_locks_kept"
#: Bumped in a forked child: the lists its parent kept are not its own.
_generation = [0]


def checkout(pool: Any, command: str) -> Any:
    """A connection of ``pool`` for one exchange, handed back with :func:`checkin` (or,
    after a failure, closed and handed to ``pool.release``).

    redis-py's checkout and check-in of a pooled connection (its lock, the connection
    counts it records, a poll of the socket for unread data) cost as much client CPU
    as the rest of a lock's request. Our exchanges never leave a reply unread (one that
    fails closes its connection), so a connection kept checked out between them is
    ready as it is: still the pool's (counted in use, closed by ``disconnect()``),
    reconnected by redis-py if it was closed, and one the server closed while idle costs
    the connection's one retry. Only a plain ``ConnectionPool`` without client-side
    caching: a Sentinel pool checks at check-in whether a connection still reaches the
    master, a blocking pool counts its waiters.
    """
    connection = _take(_kept_for(pool))
    if connection is None:
        return get_connection(pool, command)
    if _must_reconnect(connection):
        connection.disconnect()  # it reconnects as it sends
    return connection


def checkin(pool: Any, connection: Any) -> None:
    """Keep ``connection`` (in step: every reply read) for the next :func:`checkout`."""
    kept = _kept_for(pool)
    if kept is None:
        pool.release(connection)
    else:
        kept.append(connection)


def _kept_for(pool: Any) -> list[Any] | None:
    entry = getattr(pool, _KEPT, None)
    if entry is not None and entry[0] == _generation[0]:
        return entry[1]  # type: ignore[no-any-return]
    plain = type(pool) in _PLAIN_POOLS and getattr(pool, "cache", None) is None
    kept: list[Any] | None = [] if plain else None
    setattr(pool, _KEPT, (_generation[0], kept))
    return kept


def _take(kept: list[Any] | None) -> Any:
    """A kept connection, or ``None``: none kept, or another thread took the last one
    first."""
    try:
        return kept.pop() if kept else None
    except IndexError:
        return None


def _must_reconnect(connection: Any) -> bool:
    """Whether redis-py asked ``connection`` to reconnect (its maintenance
    notifications): the taker closes it first, and it reconnects as it sends."""
    return bool(getattr(connection, "should_reconnect", _never)())


def _never() -> bool:
    return False


#: The pools whose connections our exchanges keep (:func:`checkout`, :func:`acheckout`).
_PLAIN_POOLS = (redis.ConnectionPool, redis.asyncio.ConnectionPool)


async def acheckout(pool: Any, command: str) -> Any:
    """:func:`checkout` for a ``redis.asyncio`` pool (one per event loop: a kept
    connection never crosses loops). Its checkout is dearer still: a lock, connection
    counts, and a check of the socket for unread data."""
    connection = _take(_kept_for(pool))
    if connection is None:
        return await aget_connection(pool, command)
    if _must_reconnect(connection):
        try:
            await connection.disconnect()  # it reconnects as it sends
        except BaseException:  # cancelled, or its close timed out: the pool's again
            await pool.release(connection)
            raise
    return connection


async def acheckin(pool: Any, connection: Any) -> None:
    """:func:`checkin` for a ``redis.asyncio`` pool."""
    kept = _kept_for(pool)
    if kept is None:
        await pool.release(connection)
    else:
        kept.append(connection)


async def areturn_kept(pool: Any) -> None:
    """Hand the connections kept from ``pool`` back to it (idle, every reply read): a
    closing event loop's client then closes them with its idle ones."""
    kept = _kept_for(pool)
    while kept:
        await pool.release(kept.pop())


def kept_count(pool: Any) -> int:
    """How many of ``pool``'s connections in use are only kept (idle, between exchanges)."""
    return len(_kept_for(pool) or ())


def _forget_kept() -> None:
    """A forked child must not write to its parent's sockets: its pools start afresh."""
    _generation[0] += 1


os.register_at_fork(after_in_child=_forget_kept)


#: Commands redis-py has no response callback for: the script calls, every lock request.
#: (Its callback table is case-insensitive: a look-up costs as much as the rest of this.)
_NO_CALLBACK = frozenset({"EVALSHA", "EVAL"})


def _answers(client: Any, commands: list[tuple[Any, ...]], replies: list[Any]) -> list[Any]:
    """``replies`` through ``client``'s response callbacks, as its command path has them
    (none for script calls; ``SET`` -> ``True``, ...); error replies stay as they are."""
    callbacks = client.response_callbacks
    for index, command in enumerate(commands):
        if command[0] in _NO_CALLBACK:  # a script's reply is as it came
            continue
        callback = callbacks.get(command[0])
        if callback is not None and not isinstance(replies[index], BaseException):
            replies[index] = callback(replies[index])
    return replies


def only_reply(replies: list[Any]) -> Any:
    """The reply of a one-command exchange, an error reply raised (as redis-py's own
    command path raises it): what :meth:`RedisBackend._call` and its asyncio twin answer."""
    (reply,) = replies
    if isinstance(reply, BaseException):
        raise reply
    return reply


async def aexchange(connection: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """The asyncio twin of :func:`_exchange` (the same packing, awaited I/O), on a
    connection the caller checked out and drops if this raises."""
    await _asend(connection, _pack(connection, commands))
    replies: list[Any] = []
    for _ in commands:
        try:
            replies.append(await connection.read_response())
        except ResponseError as exc:
            replies.append(exc)
    return replies


async def _asend(connection: Any, packed: list[bytes]) -> None:
    """``connection.send_packed_command(packed)``, without its task per call.

    redis-py bounds every write with ``asyncio.wait_for``, which makes a task and a
    timer for each request: about a tenth of an asyncio lock cycle's client CPU. A
    write the transport takes at once needs no bound; only a drain that has to wait
    (a server that stopped reading) gets one, the socket timeout, and failures end
    as redis-py's do (the connection closed, its errors). A connection not connected,
    or with a health check due, goes through redis-py's own send.
    """
    writer = getattr(connection, "_writer", None)
    timeout = getattr(connection, "socket_timeout", None)
    if writer is None or not timeout or getattr(connection, "health_check_interval", True):
        await connection.send_packed_command(packed)
        return
    try:
        if writer.transport.is_closing():
            raise RedisConnectionError("Connection closed by the server before write")
        writer.writelines(packed)
        if writer.transport.get_write_buffer_size():  # not all taken: wait, bounded
            async with asyncio.timeout(timeout):
                await writer.drain()
    except BaseException as exc:
        closed = writer.transport.is_closing()
        # Any unsent bytes go with the connection (a close would wait to flush them).
        writer.transport.abort()
        await connection.disconnect(nowait=True)
        if isinstance(exc, TimeoutError) and exc.errno is None:  # our bound ran out
            raise RedisTimeoutError("Timeout writing to socket") from exc
        if isinstance(exc, OSError):  # ETIMEDOUT from the OS too: dead, not slow
            raise RedisConnectionError(f"Error while writing to socket: {exc}") from exc
        if isinstance(exc, TypeError | AttributeError) and closed:
            # Some Pythons leak these from a transport the server closed meanwhile
            # (CPython gh-136234), as redis-py's own send notes.
            raise RedisConnectionError("Connection closed by the server while writing") from exc
        raise


def can_send_direct_async(client: Any) -> bool:
    """:func:`can_send_direct` for a ``redis.asyncio`` client (a cluster client is another
    class; a single-connection client keeps its own path and lock, and takes its one
    connection only at its first command, so its flag is what tells)."""
    return (
        isinstance(client, redis.asyncio.Redis)
        and client.connection is None
        and not client.single_connection_client
    )


async def asend_commands(client: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """The asyncio twin of :func:`send_commands`, for a ``redis.asyncio`` client.

    A call cancelled while it waits for its replies (``asyncio.timeout``, a task
    cancelled) leaves its connection closed when it goes back to the pool: its replies
    may still come, and must never be read as the next call's. redis-py's read closes it
    itself when interrupted; a failure anywhere else in the exchange closes it here.
    """
    pool = client.connection_pool
    connection = await acheckout(pool, str(commands[0][0]))
    try:
        replies: list[Any] = await connection.retry.call_with_retry(
            lambda: aexchange(connection, commands), lambda _error: connection.disconnect()
        )
    except BaseException:
        await connection.disconnect(nowait=True)
        await pool.release(connection)
        raise
    await acheckin(pool, connection)
    return _answers(client, commands, replies)


def send_bounded(pool: Any, timeout: float, commands: list[tuple[Any, ...]]) -> list[Any]:
    """``commands`` pipelined down one connection of ``pool``, waiting at most ``timeout``.

    The connection's socket timeout is lowered for this call only and restored before the
    connection goes back to the pool; after a timeout it is dropped (its reply may still
    come, and must not be read as someone else's).
    """
    connection = checkout(pool, str(commands[0][0]))
    try:
        # A kept connection may have been closed meanwhile (the pool's disconnect()):
        # connected first, so that the bound applies to this exchange's read too. (Only
        # a redis-py connection, whose socket is ``_sock``; the pool connects any other.)
        if getattr(connection, "_sock", False) is None:
            connection.connect()
        set_socket_timeout(connection, timeout)
        replies = _exchange(connection, commands)
        set_socket_timeout(connection, None)  # back to the pool's own timeout
    except BaseException:
        connection.disconnect()
        pool.release(connection)
        raise
    checkin(pool, connection)
    return replies


@dataclass(frozen=True)
class Flavour:
    """The redis-py modules for one I/O style: the sync and asyncio clients mirror each other."""

    plain: Any
    sentinel: Any
    cluster: Any
    retry: Any
    sentinel_options: dict[str, Any]


SYNC = Flavour(
    redis,
    redis.sentinel,
    redis.cluster,
    redis.retry.Retry,
    {"connection_class": _SentinelConnection},
)
ASYNC = Flavour(
    redis.asyncio, redis.asyncio.sentinel, redis.asyncio.cluster, redis.asyncio.retry.Retry, {}
)


@dataclass(frozen=True)
class ClientFactory:
    """What a client is made from: the URL (``parts``; ``client_url`` without our own
    options), its scheme, and the timeouts. ``server`` names it in errors."""

    parts: SplitResult
    client_url: str
    server: str
    socket_timeout: float
    connect_timeout: float
    #: The backend's own URL options (removed from ``client_url``), named in errors.
    own_options: frozenset[str] = field(default=frozenset())

    @property
    def scheme(self) -> str:
        return self.parts.scheme.lower()

    @property
    def cluster(self) -> bool:
        return self.scheme == "redis+cluster"

    def hosts(self) -> list[tuple[str, int]]:
        default_port = 26379 if self.scheme == "redis+sentinel" else 6379
        netloc = self.parts.netloc.rsplit("@", 1)[-1]
        hosts = []
        for item in filter(None, (part.strip() for part in netloc.split(","))):
            host, port = item, str(default_port)
            if item.startswith("["):  # [IPv6]:port
                host, _, rest = item[1:].partition("]")
                port = rest[1:] if rest.startswith(":") else port
            elif ":" in item:
                host, _, port = item.rpartition(":")
            try:
                number = int(port)
            except ValueError:
                number = -1
            if not host or not 0 < number < 65536:
                raise InvalidArgument(f"malformed host:port {item!r} in {self.server}")
            hosts.append((host, number))
        if not hosts:
            raise InvalidArgument(f"no host:port in {self.server}")
        return hosts

    def _user(self) -> str | None:
        """The URL's ACL user for Sentinel and Cluster clients (redis-py takes it apart)."""
        return unquote(self.parts.username) if self.parts.username else None

    def _password(self) -> str | None:
        """The URL's password, percent-decoded (``from_url`` does this for plain URLs)."""
        return unquote(self.parts.password) if self.parts.password is not None else None

    def make(self, flavour: Flavour) -> Any:
        common: dict[str, Any] = {
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": self.connect_timeout,
        }
        # One quick retry on a dropped connection (a restarted server, a stale pooled
        # socket); never on a timeout, so a paused server fails within socket_timeout.
        retry = flavour.retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
        if self.scheme == "redis+sentinel":
            path = [p for p in self.parts.path.split("/") if p]
            if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
                raise InvalidArgument(
                    f"malformed sentinel URL {self.server}: expected "
                    "redis+sentinel://host:port[,host:port]/service_name[/db]"
                )
            kwargs = dict(
                common,
                username=self._user(),
                password=self._password(),
                retry=retry,
                **flavour.sentinel_options,
            )
            if len(path) > 1:
                kwargs["db"] = int(path[1])
            # The sentinels get the same single quick retry: redis-py's default (three
            # retries with backoff) made an unreachable sentinel take 8 s to report.
            sentinel = flavour.sentinel.Sentinel(
                self.hosts(), sentinel_kwargs=dict(common, retry=retry), **common
            )
            master = sentinel.master_for(path[0], **kwargs)
            master.task_locks_sentinels = sentinel.sentinels  # closed with the client
            return master
        if self.cluster:
            nodes = [flavour.cluster.ClusterNode(h, p) for h, p in self.hosts()]
            # The same single retry (after the client refreshed its slot map): redis-py's
            # default (three, with backoff) made a frozen primary take 11 s to report.
            return flavour.cluster.RedisCluster(
                startup_nodes=nodes,
                username=self._user(),
                password=self._password(),
                retry=retry,
                **common,
            )
        database = self.parts.path.strip("/")
        if self.scheme != "unix" and database and not database.isdigit():
            # redis-py would silently use db 0 here
            raise InvalidArgument(
                f"malformed Redis URL {self.server}: the path must be a database number, "
                f"got {database!r}"
            )
        if flavour is SYNC and self.scheme == "rediss":
            common["connection_class"] = _TLSConnection
        try:
            client = flavour.plain.Redis.from_url(self.client_url, retry=retry, **common)
        except ValueError as exc:
            raise InvalidArgument(f"malformed Redis URL {self.server}: {exc}") from exc
        pool = client.connection_pool
        if flavour is ASYNC:
            _share_tls_context(pool)
        # An unknown query option would otherwise fail at the first command, in
        # redis-py's words (AbstractConnection.__init__() got an unexpected keyword...).
        unknown = set(pool.connection_kwargs) - _connection_options(pool.connection_class)
        if unknown:
            raise InvalidArgument(
                unknown_options(
                    self.server,
                    unknown,
                    self.own_options,
                    " and redis-py's connection options (socket_keepalive, ssl_ca_certs...)",
                )
            )
        try:
            pool.connection_class(**pool.connection_kwargs)
        except TypeError as exc:
            raise InvalidArgument(f"unsupported option in Redis URL {self.server}: {exc}") from exc
        return client
