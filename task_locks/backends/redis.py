"""Redis: ``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://``, ``redis+cluster://``.

A lock is one key, ``<prefix>{name}`` (the name is the cluster hash tag): a string with
its holder's token, fence, owner and renewals, or for a short while after a release the
release's tombstone; beside it one fence counter for the whole database (per hash slot on
a cluster), and a signal list only while someone waits. The layout, and every script, is
in :mod:`.redis_scripts`.

Acquire, renew and release are one script call (one round trip) each; the watchdog's
batches renew hundreds of leases per script call, all calls in one pipeline. Waiters
block on the signal list, so a release hands the lock to the longest waiter in about one
round trip, without polling; they also wake when the holder's TTL runs out (on time:
see :data:`BLOCK_TICK`). Other query options (``db``, ``ssl_*``, ``max_connections``...)
go to redis-py; one it does not know is refused when the backend is made.

URL options (query string, removed before the URL reaches redis-py): ``prefix``
(default ``task_locks:``), ``socket_timeout`` (seconds, default 5), ``connect_timeout``
(default 2), ``wait_replicas`` and ``wait_timeout`` (ms) to demand that a replica has the
lock before an acquire counts, ``fence_ttl`` (seconds the database's fence counter
outlives the last acquire in it, default 7 days), ``handoff`` (``server``, the default,
or ``client``).

The server hand-off (the default): a waiter that finds the lock held queues itself in
the same script (FIFO), and a release hands the lock to the first live waiter in the same
script (new fence, the waiter's TTL and owner), pushing the fence to that waiter's own
list, where its short BLPOP picks it up: no second acquire round trip, and strict FIFO.
For a name whose last try here was refused, the try and that BLPOP go as one request.
The client hand-off (a release wakes a waiter, which acquires again) is used where the
server's cannot be: with ``wait_replicas`` (a grant made inside a release has no WAIT of
its own), or when the URL says ``handoff=client``. Every client of a lock name should use
the same mode (mixing is safe, only slower: a waiter is not woken by a release of the
other mode until its next try). See ``ENQUEUE`` in :mod:`.redis_scripts`.

Sentinel: ``redis+sentinel://[:password@]host:port[,host:port]/service[/db]``.
Cluster: ``redis+cluster://host:port[,host:port]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import secrets
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from functools import partial
from typing import Any, NoReturn, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

from redis.backoff import NoBackoff
from redis.exceptions import (
    AskError,
    ClusterCrossSlotError,
    MovedError,
    NoScriptError,
    ResponseError,
    TryAgainError,
)
from redis.retry import Retry

from ..errors import BackendUnavailable, InvalidArgument, LockError
from ..types import AcquireResult, Holder, Owner, RenewItem, RunCheck
from .base import (
    MAX_TTL,
    Backend,
    Capability,
    DeferredRelease,
    RunChecked,
    ServerHandoff,
    check_ttl_ms,
    log_forced,
    unknown_options,
)
from .notices import Notice, NoticeStream, close_streams, retired, track
from .redis_clients import (
    ASYNC,
    SYNC,
    ClientFactory,
    aexchange,
    areturn_kept,
    asend_commands,
    can_send_direct,
    can_send_direct_async,
    kept_count,
    only_reply,
    send_bounded,
    send_commands,
)
from .redis_errors import CLIENT_ERRORS, translate
from .redis_scripts import (
    Commands,
    counter_key,
    hash_tag,
    key_slot,
    record_fields,
    script_command,
    untag,
)

T = TypeVar("T")
#: Replies that mean "ask another node": a bounded renewal sent straight to one primary
#: hands these to the cluster client, which follows them.
_REDIRECTS = (MovedError, AskError, TryAgainError)

log = logging.getLogger("task_locks.backends.redis")

#: Redis's timer tick at the default ``hz 10``: how late a BLPOP timeout may fire.
BLOCK_TICK = 0.1
#: How many names a server hand-off backend remembers as contended (its last try refused):
#: a waiter for one of those sends its first try and its first pop as one request.
CONTENDED_NAMES = 1024
#: Leases per RENEW_MANY call (a few ms of server time at most); a batch is pipelined.
RENEW_CHUNK = 500

_OUR_OPTIONS = {
    "prefix",
    "socket_timeout",
    "connect_timeout",
    "wait_replicas",
    "wait_timeout",
    "fence_ttl",
    "handoff",
}
_GLOB = re.compile(r"([*?\[\]\\])")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _owned_by(task_id: str) -> str:
    """The text an owner JSON of ``task_id`` holds (:meth:`Owner.to_json`'s separators)."""
    return f'"task_id": {json.dumps(task_id)}'


def _wants_server_handoff(url: str) -> bool:
    """Whether ``url`` makes a server hand-off backend: unless its ``handoff`` option says
    ``client``, or it asks for ``wait_replicas`` (a grant made inside a release has no
    WAIT of its own) without naming ``handoff=server`` (refused then, by the backend).
    Values are checked by the backend the URL makes."""
    try:
        query = dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))
    except ValueError:  # a malformed URL: the backend's own parsing says what is wrong
        return False
    handoff = query.get("handoff")
    if handoff is not None:
        return handoff == "server"
    try:
        return not float(query.get("wait_replicas") or 0)
    except ValueError:
        return False


def _clocks() -> tuple[float, float]:
    """Now, on the wall clock (epoch s) and on the monotonic clock."""
    return time.time(), time.monotonic()


class _RedisNotices:
    """Release notices of one Redis database: a SUBSCRIBE on a client of its own.

    Its connection retries nothing by itself: a dropped connection is reported to the
    listener, which reconnects and has the leases renewed at once, since notices sent
    meanwhile are gone (pub/sub keeps nothing for absent subscribers).
    """

    def __init__(self, backend: RedisBackend) -> None:
        self._backend = backend
        self._client: Any = None
        self._pubsub: Any = None

    def open(self, since: int | None) -> None:
        backend = self._backend
        channel = backend.notice_channel
        track(backend, self)  # closed with the backend
        try:
            self._client = backend._clients.make(SYNC)
            self._pubsub = self._client.pubsub()
            self._pubsub.subscribe(channel)
            self._pubsub.connection.retry = Retry(NoBackoff(), 0)
            # Subscribed once the server confirms: every PUBLISH after that reaches us.
            deadline = time.monotonic() + backend.connect_timeout + backend.socket_timeout
            while True:
                message = self._pubsub.get_message(timeout=deadline - time.monotonic())
                if message is not None and message["type"] == "subscribe":
                    break
                if time.monotonic() >= deadline:
                    raise BackendUnavailable(
                        f"{backend.server}: no answer to SUBSCRIBE {channel}", server=backend.server
                    )
        except CLIENT_ERRORS as exc:
            self.close()
            raise translate(
                exc, what=f"release notices ({channel})", name=None, server=backend.server
            ) from exc
        except BaseException:
            self.close()
            raise
        if retired(self):  # the backend's close() ran meanwhile: it may have missed these
            self.close()
            raise BackendUnavailable(f"{backend.server}: closed", server=backend.server)

    def read(self, timeout: float) -> list[Notice]:
        backend = self._backend
        notices: list[Notice] = []
        pubsub = self._pubsub
        connection = pubsub.connection
        try:
            message = pubsub.get_message(timeout=timeout)
            while message is not None:
                if message["type"] == "message":
                    fence, _, key = _text(message["data"]).partition("|")
                    if fence.isdigit() and key.startswith(backend.prefix + "{"):
                        notices.append(Notice(backend._name(key), int(fence), FORCED_NOTICE))
                message = pubsub.get_message(timeout=0)
        except CLIENT_ERRORS as exc:
            raise translate(exc, what="release notices", name=None, server=backend.server) from exc
        finally:
            if self._pubsub is None and connection is not None:
                # Closed while this read waited: the read failed, and redis-py's error
                # handler connected that connection again, after close() had let it go.
                connection.disconnect()
        return notices

    def close(self) -> None:
        pubsub, client, self._pubsub, self._client = self._pubsub, self._client, None, None
        sentinels = getattr(client, "task_locks_sentinels", ())
        for closing in (pubsub, *sentinels, client):
            if closing is not None:
                with contextlib.suppress(Exception):
                    closing.close()


#: Why a lease is lost when its lock's release was announced.
FORCED_NOTICE = "it was force-released (an operator's release, announced by the server)"


class RedisBackend(Backend, RunChecked):
    """A lock per key, over one connection pool (the module's docstring says how).

    ``RedisBackend(url)`` makes a :class:`RedisHandoffBackend` (the default hand-off)
    unless the URL says ``handoff=client`` or asks for ``wait_replicas``, as
    ``pathlib.Path`` makes a ``PosixPath``: the server hand-off's methods exist exactly on
    the backends that declare it. This class itself is the client hand-off.
    """

    capabilities = frozenset(
        {
            Capability.FENCING,
            Capability.MULTIPROCESS,
            Capability.WAKEUP,
            Capability.HOLDERS,
            Capability.RELEASE_NOTICE,
            Capability.RUN_CHECK,
        }
    )

    def __new__(cls, url: str = "", *args: Any, **kwargs: Any) -> RedisBackend:
        # No URL: copy.copy or pickle rebuilding an instance of the class it already is.
        chosen: type[RedisBackend] = cls
        if cls is RedisBackend and url and _wants_server_handoff(url):
            chosen = RedisHandoffBackend
        return super().__new__(chosen)

    def __init__(self, url: str) -> None:
        super().__init__(url)
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        options = {k: query.pop(k) for k in list(query) if k in _OUR_OPTIONS}
        self.prefix = options.get("prefix", "task_locks:")
        if "{" in self.prefix or "}" in self.prefix:
            raise InvalidArgument(
                f"{self.server}: option prefix={self.prefix!r} must not contain '{{' or '}}' "
                "(the lock name is the key's cluster hash tag)"
            )
        self.socket_timeout = self._number(options, "socket_timeout", 5.0, positive=True)
        self.connect_timeout = self._number(options, "connect_timeout", 2.0, positive=True)
        self.wait_replicas = int(self._number(options, "wait_replicas", 0))
        self.wait_timeout_ms = int(self._number(options, "wait_timeout", 100))
        fence_ttl = self._number(options, "fence_ttl", 7 * 86400, positive=True)
        if fence_ttl > MAX_TTL:
            raise InvalidArgument(
                f"{self.server}: option fence_ttl must be at most {MAX_TTL:,.0f} seconds "
                f"(1 year), got {fence_ttl:g}"
            )
        self.fence_ttl_ms = max(1, int(fence_ttl * 1000))
        # How long a release is remembered: longer than redis-py's resend of it can take.
        self.tombstone_ms = int(min(max(60.0, 4 * self.socket_timeout), MAX_TTL) * 1000)
        # A waiter's BLPOP never blocks longer than the socket timeout (_block_for): a
        # signal nobody popped by then has no one left to wake.
        self.signal_ms = max(1, int(min(self.socket_timeout, MAX_TTL) * 1000))
        handoff = options.get("handoff", "server" if self.server_handoff else "client")
        if handoff not in ("client", "server"):
            raise InvalidArgument(
                f"{self.server}: option handoff must be 'client' or 'server', got {handoff!r}"
            )
        if (handoff == "server") != self.server_handoff:  # a subclass made directly
            raise InvalidArgument(
                f"{self.server}: option handoff={handoff} does not fit {type(self).__name__}"
            )
        if self.server_handoff and self.wait_replicas:
            # A grant made inside a release has no WAIT of its own to count replicas.
            raise InvalidArgument(
                f"{self.server}: option handoff=server cannot be combined with wait_replicas"
            )
        #: How a release reaches a waiter, and why (``--help``, ``list``, ``show``).
        self.handoff_mode = (
            "server (a release grants the lock to the first waiter inside Redis, FIFO)"
            if self.server_handoff
            else "client (wait_replicas: a grant inside a release would have no WAIT; "
            "waiters are woken to try again)"
            if self.wait_replicas and "handoff" not in options
            else "client (handoff=client: waiters are woken to try again)"
        )
        self.scheme = parts.scheme.lower()
        self.cluster = self.scheme == "redis+cluster"
        if self.cluster:  # a cluster's pub/sub is not tried yet: renewal finds the loss
            self.capabilities = type(self).capabilities - {Capability.RELEASE_NOTICE}  # type: ignore[misc]
        #: Fence counters per hash slot: on a cluster, or once a plain URL met a node.
        self._slotted = self.cluster
        # (not urlunsplit: it would turn unix:///path into unix:/path)
        base = url.split("?", 1)[0].split("#", 1)[0]
        self._clients = ClientFactory(
            parts,
            base + (f"?{urlencode(query)}" if query else ""),
            self.server,
            self.socket_timeout,
            self.connect_timeout,
            frozenset(_OUR_OPTIONS),
        )
        if query and self.scheme in ("redis+sentinel", "redis+cluster"):
            raise InvalidArgument(unknown_options(self.server, query, _OUR_OPTIONS))
        self._client_guard = threading.Lock()
        self._sync_client: Any = None
        if self.cluster:
            self._clients.hosts()  # a bad host list fails now; the client connects on first use
        else:
            self._sync_client = self._clients.make(SYNC)  # no I/O yet: checks the URL now
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = (
            weakref.WeakKeyDictionary()
        )
        self._async_pid = os.getpid()
        #: Releases to send ahead of the next acquire (:meth:`defer_release`).
        self._riders: list[DeferredRelease] = []
        self._riders_guard = threading.Lock()
        self._riders_pid = os.getpid()

    # -- construction -----------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The sync client (a cluster client connects when it is built, so: on first use)."""
        client = self._sync_client
        if client is None:
            with self._client_guard:
                if self._sync_client is None:
                    self._sync_client = self._clients.make(SYNC)
                client = self._sync_client
        return client

    def _async_client(self) -> Any:
        if self._async_pid != os.getpid():
            # A forked child must not share the parent's sockets (redis-py's asyncio pool,
            # unlike the sync one, does not check): start afresh, leave the parent's alone.
            self._async = weakref.WeakKeyDictionary()
            self._async_pid = os.getpid()
        loop = asyncio.get_running_loop()
        client = self._async.get(loop)
        if client is None:
            for ended in [other for other in self._async if other.is_closed()]:
                _disarm(self._async.pop(ended))  # closed without shutdown_asyncgens
            client = self._async[loop] = self._clients.make(ASYNC)
            client.task_locks_closer = _close_with_loop(client)
        return client

    # -- keys ---------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return f"{self.prefix}{{{hash_tag(name)}}}"

    def _counter(self, name: str) -> str:
        """The fence counter for ``name``: the database's, or on a cluster its slot's."""
        return counter_key(self.prefix, name if self._slotted else None)

    def _reslot(self, args: list[Any]) -> list[Any]:
        """Script arguments with the database's counter replaced by the slot's."""
        plain, keys = counter_key(self.prefix), int(args[0])
        name = self._name(args[1])
        return [counter_key(self.prefix, name) if 0 < i <= keys and a == plain else a
                for i, a in enumerate(args)]  # fmt: skip

    def _name(self, key: Any) -> str:
        return untag(_text(key)[len(self.prefix) + 1 : -1])

    def _signals(self, names: Sequence[str]) -> list[str]:
        """The lists a release pushes to, one per name: waiters BLPOP them."""
        return [self._key(name) + ":signal" for name in names]

    @functools.cached_property
    def notice_channel(self) -> str:
        """The pub/sub channel an operator's release announces itself on: one per prefix
        and database (channels are server-wide, databases are not)."""
        if self.cluster:
            return f"{self.prefix}released:0"
        kwargs = getattr(self.client.connection_pool, "connection_kwargs", {})
        return f"{self.prefix}released:{int(kwargs.get('db') or 0)}"

    def release_notices(self) -> NoticeStream:
        """Subscribed to :attr:`notice_channel` on a client of its own (one connection)."""
        return _RedisNotices(self)

    # -- errors -------------------------------------------------------------------------

    def _fail(self, name: str | None, exc: Exception) -> NoReturn:
        if isinstance(exc, ClusterCrossSlotError):  # a pipeline's: the next call is slotted
            self._slotted = True
        what = f"lock {name!r}" if name else "listing locks"
        raise translate(exc, what=what, name=name, server=self.server, prefix=self.prefix) from exc

    # -- request shaping shared by sync and async paths ----------------------------------

    def _acquire_args(
        self, name: str, token: str, ttl_ms: int, owner: Owner, run: RunCheck | None = None
    ) -> list[Any]:
        check_ttl_ms(ttl_ms, name)
        key = self._key(name)
        if run is None:
            return [2, key, self._counter(name), token, ttl_ms, owner.to_json(), self.fence_ttl_ms]
        others = [self._key(other) for other in run.names if other != name]
        return [2 + len(others), key, self._counter(name), *others, token, ttl_ms,
                owner.to_json(), self.fence_ttl_ms, _owned_by(run.task_id), run.take_over or "",
                run.mark or ""]  # fmt: skip

    def checks_together(self, names: Sequence[str]) -> bool:
        """One script sees every name on one server; on a cluster only names of one slot."""
        if not (self.cluster or self._slotted):
            return True
        return len({key_slot(hash_tag(name)) for name in names}) <= 1

    def _acquire_commands(self, args: list[Any], run: RunCheck | None) -> Commands:
        """The acquire script (its ``args``) and, with ``wait_replicas``, WAIT after it.

        Sent as one pipeline, so on one connection: WAIT answers only for the writes of
        the connection it runs on; on any other pooled connection it would count
        replicas for someone else's writes (or none), not for this lock.
        """
        script = "acquire" if run is None else "acquire_run"
        wait = [("WAIT", self.wait_replicas, self.wait_timeout_ms)] if self.wait_replicas else []
        return lambda by_sha: [script_command(script, by_sha, args), *wait]

    def _acquired(
        self, name: str, replies: list[Any], args: list[Any] | None = None
    ) -> tuple[AcquireResult, int | None]:
        """The acquire's result and, if it was granted without enough replicas, how many
        acknowledged it (else ``None``)."""
        for reply in replies:
            if isinstance(reply, Exception):
                self._fail(name, reply)
        result = self._acquire_result(replies[0], args)
        if result.acquired and self.wait_replicas and int(replies[1]) < self.wait_replicas:
            return result, int(replies[1])
        return result, None

    @property
    def _plain_acquire(self) -> bool:
        """An acquire is one script call, sent as such (no pipeline): nothing has to share
        its connection (no WAIT), and no cluster redirection has to be followed by hand."""
        return not self.wait_replicas and not self.cluster

    def _on_primary(self, name: str) -> bool:
        """Whether the acquire goes straight to the lock's primary, bypassing the cluster
        client: WAIT has no key, so the cluster client would send it elsewhere."""
        return self.cluster and bool(self.wait_replicas)

    def _release_args(self, name: str, token: str, fence: int | None = None) -> list[Any]:
        """A new release id per call: redis-py's resend of this call repeats it, so the
        resend finds the id the first attempt left and reports that release."""
        key = self._key(name)
        fence_arg = "" if fence is None else str(int(fence))
        release_id = secrets.token_hex(8)
        # Only an operator's release announces itself: a holder's own is sent as before.
        notice = [] if token else [self.notice_channel]
        if self.server_handoff:  # the release_handoff script
            keys = [key, self._counter(name), key + ":queue", key + ":signal"]
            return [4, *keys, token, fence_arg, release_id, self.tombstone_ms,
                    self.fence_ttl_ms, self.signal_ms, *notice]  # fmt: skip
        return [3, key, key + ":signal", key + ":queue", token, fence_arg, release_id,
                self.tombstone_ms, self.signal_ms, *notice]  # fmt: skip

    @property
    def _release_script(self) -> str:
        return "release_handoff" if self.server_handoff else "release"

    def _acquire_result(self, reply: Any, args: list[Any] | None = None) -> AcquireResult:
        """An acquire script's reply; ``args`` (the script's) name a run check's holder."""
        if isinstance(reply, int):
            return AcquireResult(int(reply))
        pttl, owner, fence, acquired, *index = reply
        return AcquireResult(
            None,
            retry_after=max(0, int(pttl)) / 1000 if int(pttl) >= 0 else None,
            holder=Owner.from_json(owner),
            holder_fence=int(fence) if fence else None,
            holder_acquired_at=int(acquired) / 1000 if acquired else None,
            holder_name=self._name(args[int(index[0])]) if index and args else None,
        )

    def _too_few_replicas(self, name: str, acked: int) -> BackendUnavailable:
        return BackendUnavailable(
            f"lock {name!r}: only {acked} of {self.wait_replicas} replicas acknowledged the "
            f"acquire within {self.wait_timeout_ms} ms at {self.server}",
            name=name,
            server=self.server,
        )

    def _renew_chunks(self, items: Sequence[RenewItem]) -> list[Sequence[RenewItem]]:
        # A cluster spreads the keys over slots, and one script call must stay in one.
        size = 1 if self.cluster else RENEW_CHUNK
        return [items[start : start + size] for start in range(0, len(items), size)]

    def _renew_commands(self, chunks: Sequence[Sequence[RenewItem]]) -> Commands:
        calls = []
        for chunk in chunks:
            arguments: list[Any] = [len(chunk), *(self._key(i.name) for i in chunk)]
            for item in chunk:
                arguments += (item.token, item.ttl_ms)
            calls.append(("renew_many", arguments))
        return lambda by_sha: [script_command(w, by_sha, a) for w, a in calls]

    @staticmethod
    def _missing_scripts(replies: list[Any]) -> list[int]:
        return [index for index, reply in enumerate(replies) if isinstance(reply, NoScriptError)]

    def _renew_results(
        self, chunks: Sequence[Sequence[RenewItem]], replies: list[Any]
    ) -> list[bool]:
        results: list[bool] = []
        for chunk, reply in zip(chunks, replies, strict=True):
            if isinstance(reply, Exception):
                self._fail(chunk[0].name, reply)
            results.extend(bool(renewed) for renewed in reply)
        return results

    def _renew_args(self, name: str, token: str, ttl_ms: int) -> list[Any]:
        return [1, self._key(name), token, ttl_ms]

    def _block_for(self, timeout: float) -> float | None:
        """Seconds to block in BLPOP, or ``None``: sleep ``_nap(timeout)`` locally instead.

        Redis looks at blocked clients' timeouts only on its timer tick, so a BLPOP can
        return up to :data:`BLOCK_TICK` late. The block therefore ends a tick early (the
        caller retries, and sleeps the last stretch locally, waking on time when the
        holder's TTL ends), and a tick before the socket timeout, which would otherwise
        read a late reply as an outage. BLPOP 0 would block forever: never sent.
        """
        block = min(timeout - BLOCK_TICK, self.socket_timeout - 2 * BLOCK_TICK)
        return block if block >= 0.01 else None

    @staticmethod
    def _nap(timeout: float) -> float:
        return max(0.0, min(timeout, BLOCK_TICK))

    def _holder(self, key: Any, record: Any, pttl: Any, sent: tuple[float, float]) -> Holder | None:
        """The holder from its record and PTTL; ``sent``: when the request left (epoch s,
        and on the monotonic clock).

        The expiry counts from the send, not from the reply's arrival: a reply that was
        delayed must not show a lock as living longer than it does. A lock whose expiry
        has passed by the time the reply arrived (on the monotonic clock: a wall clock
        stepped meanwhile says nothing of it) is no holder.
        """
        data = record_fields(record)
        if isinstance(pttl, Exception):
            return None
        wall, mono = sent
        if not data or pttl == -2 or (pttl >= 0 and mono + pttl / 1000 <= time.monotonic()):
            return None
        acquired = data.get("acquired")
        return Holder(
            name=self._name(key),
            fence=int(data.get("fence") or 0),
            owner=Owner.from_json(data.get("owner")),
            acquired_at=int(acquired) / 1000 if acquired else None,
            expires_at=wall + pttl / 1000 if pttl >= 0 else None,
            renewals=int(data.get("renewals") or 0),
            token=data.get("token", ""),
        )

    def _lock_keys(self, keys: Any) -> list[Any]:
        """The lock records among scanned keys (not a lock's signal, queue or waiters)."""
        return [key for key in keys if _text(key).endswith("}")]

    @staticmethod
    def _read_commands(keys: Sequence[Any]) -> list[tuple[Any, ...]]:
        return [command for key in keys for command in (("GET", key), ("PTTL", key))]

    @staticmethod
    def _legacy(keys: Sequence[Any], replies: list[Any]) -> list[Any]:
        """The keys whose GET was refused: hashes an earlier version wrote."""
        return [key for i, key in enumerate(keys) if isinstance(replies[2 * i], ResponseError)]

    def _holders(
        self, keys: list[Any], replies: list[Any], legacy: dict[Any, Any], sent: tuple[float, float]
    ) -> list[Holder]:
        found = (
            self._holder(k, legacy.get(k, replies[2 * i]), replies[2 * i + 1], sent)
            for i, k in enumerate(keys)
        )
        return sorted((h for h in found if h is not None), key=lambda h: h.name)

    def _match(self, prefix: str) -> str:
        return _GLOB.sub(r"\\\1", f"{self.prefix}{{{hash_tag(prefix)}") + "*"

    def _forced(self, name: str, released: bool) -> bool:
        if released:
            log_forced(log, name, self.server)
        return released

    # -- sync I/O -----------------------------------------------------------------------

    def _eval(self, client: Any, script: str, args: list[Any]) -> Any:
        try:
            try:
                return self._call(client, script_command(script, True, args))
            except NoScriptError:  # a fresh or flushed server: EVAL also caches the script
                return self._call(client, script_command(script, False, args))
        except ClusterCrossSlotError:
            if self._slotted:
                raise
            self._slotted = True  # a cluster node behind a plain URL (refused unrun)
            return self._eval(client, script, self._reslot(args))

    @staticmethod
    def _call(client: Any, command: tuple[Any, ...]) -> Any:
        """One command's reply (an error reply raised), down the direct path if it can
        (a BLPOP's timeout goes as ``repr(seconds)``: redis-py's own spelling of a float,
        in text, which hiredis packs)."""
        if not can_send_direct(client):
            return client.execute_command(*command)
        return only_reply(send_commands(client, [command]))

    @staticmethod
    def _pipeline(client: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
        if can_send_direct(client):
            return send_commands(client, commands)
        pipe = client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(pipe.execute(raise_on_error=False))

    def _scripts(
        self,
        name: str,
        commands: Commands,
        send: Callable[[list[tuple[Any, ...]]], list[Any]] | None = None,
    ) -> list[Any]:
        """Script calls in one pipeline by SHA; a second one resends those NOSCRIPT refused.

        Each reply is the script's answer or the error it raised (for the caller to judge).
        ``send`` replaces the client's pipeline (a connection with a shorter timeout).
        """
        try:
            if send is None:
                client = self.client
                send = functools.partial(self._pipeline, client)
            replies = send(commands(True))
            missing = self._missing_scripts(replies)
            if missing:
                source = commands(False)
                again = send([source[i] for i in missing])
                for index, reply in zip(missing, again, strict=True):
                    replies[index] = reply
            return replies
        except CLIENT_ERRORS as exc:
            self._fail(name, exc)

    def _one_connection(self, client: Any, commands: Commands) -> list[Any]:
        """``commands`` in one pipeline (one connection); all again by source after NOSCRIPT."""
        replies = self._pipeline(client, commands(True))
        if any(isinstance(reply, NoScriptError) for reply in replies):
            replies = self._pipeline(client, commands(False))
        return replies

    def renewal_lane(self, name: str, asynchronous: bool = False) -> Hashable:
        """On a cluster, the primary serving ``name``: each primary is renewed on its own,
        so a stalled one holds up no other's leases. One lane otherwise."""
        if not self.cluster:
            return None
        try:
            client = self._async_client() if asynchronous else self.client
            node = client.get_node_from_key(self._key(name))
        except Exception:  # no slot map yet: the shared lane (renewals still route by key)
            return None
        return None if node is None else node.name

    def _bounded_send(
        self, items: Sequence[RenewItem], timeout: float
    ) -> Callable[[list[tuple[Any, ...]]], list[Any]] | None:
        """A sender whose socket timeout is ``timeout`` (``None``: use the client's pipeline).

        redis-py has no per-call timeout, so the commands go down one pooled connection
        whose socket timeout is lowered for the call and restored before it returns to
        the pool. On a cluster this is done when the batch has one primary (the watchdog's
        lanes make it so): the commands go to that primary's own pool.
        """
        if timeout >= self.socket_timeout:
            return None
        try:
            client = self.client
            if not self.cluster:
                return functools.partial(send_bounded, client.connection_pool, timeout)
            nodes = {client.get_node_from_key(self._key(item.name)) for item in items}
        except Exception:  # no slot map yet: the cluster client's own path
            return None
        node = nodes.pop() if len(nodes) == 1 else None
        if node is None or node.redis_connection is None:
            return None
        pool = node.redis_connection.connection_pool

        def send(commands: list[tuple[Any, ...]]) -> list[Any]:
            replies = send_bounded(pool, timeout, commands)
            moved = [i for i, r in enumerate(replies) if isinstance(r, _REDIRECTS)]
            if moved:  # the slot moved: the cluster client follows the redirection
                again = self._pipeline(client, [commands[i] for i in moved])
                for index, reply in zip(moved, again, strict=True):
                    replies[index] = reply
            return replies

        return send

    def defer_release(self, release: DeferredRelease) -> bool:
        """Pipelined ahead of the next acquire or, with the server hand-off, enqueue (not on
        a cluster: one pipeline goes to one node)."""
        if self.cluster:
            return False
        with self._riders_guard:
            if self._riders_pid != os.getpid():  # a forked child never sends its parent's
                self._riders, self._riders_pid = [], os.getpid()
            self._riders.append(release)
        return True

    def _take_riders(self) -> list[DeferredRelease]:
        """The deferred releases this acquire is to carry (claimed: no one else sends them)."""
        with self._riders_guard:
            riders, self._riders = self._riders, []
            if self._riders_pid != os.getpid():
                self._riders_pid = os.getpid()
                return []
        return [rider for rider in riders if rider.claim()]

    def _with_releases(self, riders: list[DeferredRelease], commands: Commands) -> Commands:
        """``riders``' releases first, then ``commands``: one pipeline, run in that order."""
        script = self._release_script
        # The release ids are drawn once: a resend (NOSCRIPT, redis-py's retry) repeats
        # them, and finds the tombstone of a release that already went through.
        releases = [self._release_args(rider.name, rider.token) for rider in riders]
        return lambda by_sha: [
            *(script_command(script, by_sha, args) for args in releases),
            *commands(by_sha),
        ]

    def _answer_riders(
        self, riders: list[DeferredRelease], replies: list[Any] | BaseException
    ) -> None:
        for index, rider in enumerate(riders):
            outcome: bool | LockError
            reply = replies if isinstance(replies, BaseException) else replies[index]
            if not isinstance(reply, BaseException):
                outcome = bool(reply)
            elif isinstance(reply, LockError):
                outcome = reply
            elif isinstance(reply, Exception):
                try:
                    self._fail(rider.name, reply)
                except LockError as exc:
                    outcome = exc
            else:  # interrupted: the release may or may not have gone out
                outcome = BackendUnavailable(
                    f"lock {rider.name!r}: the release was interrupted ({reply!r})",
                    name=rider.name,
                    server=self.server,
                )
            try:
                rider.answer(outcome)
            except Exception:  # the acquire carrying it must not fail for it
                log.exception("answering the deferred release of %r failed", rider.name)

    def acquire(self, name: str, token: str, ttl_ms: int, owner: Owner) -> AcquireResult:
        return self._acquire(name, token, ttl_ms, owner, None)

    def acquire_run(
        self, name: str, token: str, ttl_ms: int, owner: Owner, run: RunCheck
    ) -> AcquireResult:
        return self._acquire(name, token, ttl_ms, owner, run)

    def _acquire(
        self, name: str, token: str, ttl_ms: int, owner: Owner, run: RunCheck | None
    ) -> AcquireResult:
        riders = self._take_riders() if self._riders else None
        args = self._acquire_args(name, token, ttl_ms, owner, run)
        if not riders and self._plain_acquire:
            script = "acquire" if run is None else "acquire_run"
            try:
                return self._acquire_result(self._eval(self.client, script, args), args)
            except CLIENT_ERRORS as exc:
                self._fail(name, exc)
        commands = self._acquire_commands(args, run)
        if riders:  # finished runs' releases ride this acquire (defer_release)
            replies = self._after_releases(name, riders, commands)
        else:
            replies = self._acquire_replies(name, commands)
        result, acked = self._acquired(name, replies, args)
        if acked is not None:
            # Granted on the master only: give it back rather than block every other
            # client until its TTL. A failover may already have lost it.
            with contextlib.suppress(LockError):
                self.release(name, token)
            raise self._too_few_replicas(name, acked)
        return result

    def _acquire_replies(self, name: str, commands: Commands) -> list[Any]:
        """The acquire pipeline's replies (with WAIT: on the lock's primary, one connection)."""
        try:
            client = self.client
            if self._on_primary(name):
                client = client.get_redis_connection(client.get_node_from_key(self._key(name)))
            replies = self._one_connection(client, commands)
            if self.cluster and isinstance(replies[0], MovedError | AskError):
                self.client.nodes_manager.initialize()  # the slot moved: once more, anew
                client = self.client.get_redis_connection(
                    self.client.get_node_from_key(self._key(name))
                )
                replies = self._one_connection(client, commands)
        except CLIENT_ERRORS as exc:
            self._fail(name, exc)
        return replies

    def _after_releases(
        self, name: str, riders: list[DeferredRelease], commands: Commands
    ) -> list[Any]:
        """The riders' releases, then ``commands``, in one pipelined round trip; the
        riders are answered, and the replies to ``commands`` returned."""
        try:
            replies = self._one_connection(self.client, self._with_releases(riders, commands))
        except BaseException as exc:
            self._answer_riders(riders, exc)
            if isinstance(exc, CLIENT_ERRORS):
                self._fail(name, exc)
            raise
        self._answer_riders(riders, replies)
        return replies[len(riders) :]

    def renew(self, name: str, token: str, ttl_ms: int) -> bool:
        check_ttl_ms(ttl_ms, name)
        args = self._renew_args(name, token, ttl_ms)
        try:
            return bool(self._eval(self.client, "renew_many", args)[0])
        except CLIENT_ERRORS as exc:
            self._fail(name, exc)

    def renew_many(self, items: Sequence[RenewItem], timeout: float | None = None) -> list[bool]:
        """All ``items`` in one pipelined round trip (a second one only after NOSCRIPT).

        With ``timeout`` shorter than ``socket_timeout`` the call waits at most that long.
        """
        if not items:
            return []
        for item in items:
            check_ttl_ms(item.ttl_ms, item.name)
        chunks = self._renew_chunks(items)
        send = None if timeout is None else self._bounded_send(items, timeout)
        replies = self._scripts(items[0].name, self._renew_commands(chunks), send)
        return self._renew_results(chunks, replies)

    def release(self, name: str, token: str) -> bool:
        return self._release(name, token, None)

    def _release(self, name: str, token: str, fence: int | None) -> bool:
        args = self._release_args(name, token, fence)
        try:
            return bool(self._eval(self.client, self._release_script, args))
        except CLIENT_ERRORS as exc:
            self._fail(name, exc)

    def force_release(self, name: str, fence: int | None = None) -> bool:
        return self._forced(name, self._release(name, "", fence))

    def _blpop(self, names: Sequence[str], timeout: float) -> None:
        block = self._block_for(timeout)
        if block is None:
            time.sleep(self._nap(timeout))
            return
        try:
            self._call(self.client, ("BLPOP", *self._signals(names), repr(block)))
        except CLIENT_ERRORS as exc:
            self._fail(names[0], exc)

    def wait_release(self, name: str, timeout: float) -> None:
        self._blpop([name], timeout)

    def wait_any(self, names: Sequence[str], timeout: float) -> None:
        if self.cluster:  # the signal lists live in different hash slots
            return super().wait_any(names, timeout)
        return self._blpop(names, timeout)

    def holders(self, prefix: str = "") -> list[Holder]:
        """Live locks by SCAN (never KEYS); in a cluster, SCAN visits every primary."""
        try:
            client = self.client
            keys = self._lock_keys(client.scan_iter(match=self._match(prefix), count=1000))
            sent = _clocks()
            replies = self._pipeline(client, self._read_commands(keys)) if keys else []
            old = self._legacy(keys, replies)
            legacy = (
                dict(zip(old, self._pipeline(client, [("HGETALL", k) for k in old]), strict=True))
                if old
                else {}
            )
        except CLIENT_ERRORS as exc:
            self._fail(prefix or None, exc)
        return self._holders(keys, replies, legacy, sent)

    def holder(self, name: str) -> Holder | None:
        key = self._key(name)
        sent = _clocks()
        try:
            record, pttl = self._pipeline(self.client, self._read_commands([key]))
            if isinstance(record, ResponseError):
                record = self.client.hgetall(key)
        except CLIENT_ERRORS as exc:
            self._fail(name, exc)
        return self._holder(key, record, pttl, sent)

    def close(self) -> None:
        """Close the sync client; a later call reconnects. Async clients: :meth:`aclose`."""
        close_streams(self)
        with self._client_guard:
            client, self._sync_client = self._sync_client, None
        if client is not None:
            for sentinel in getattr(client, "task_locks_sentinels", ()):
                sentinel.close()
            client.close()

    # -- async I/O: the same requests, awaited --------------------------------------------

    async def _aeval(self, client: Any, script: str, args: list[Any]) -> Any:
        try:
            try:
                return await self._acall_one(client, script_command(script, True, args))
            except NoScriptError:
                return await self._acall_one(client, script_command(script, False, args))
        except ClusterCrossSlotError:
            if self._slotted:
                raise
            self._slotted = True
            return await self._aeval(client, script, self._reslot(args))

    @staticmethod
    async def _acall_one(client: Any, command: tuple[Any, ...]) -> Any:
        """The asyncio twin of :meth:`_call`."""
        if not can_send_direct_async(client):
            return await client.execute_command(*command)
        return only_reply(await asend_commands(client, [command]))

    @staticmethod
    async def _apipeline(client: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
        if can_send_direct_async(client):
            return await asend_commands(client, commands)
        pipe = client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(await pipe.execute(raise_on_error=False))

    async def _acall(self, name: str | None, call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await call()
        except CLIENT_ERRORS as exc:
            self._fail(name, exc)

    async def _ascripts(self, name: str, commands: Commands) -> list[Any]:
        """The asyncio twin of :meth:`_scripts`."""
        client = self._async_client()

        async def run() -> list[Any]:
            replies = await self._apipeline(client, commands(True))
            missing = self._missing_scripts(replies)
            if missing:
                source = commands(False)
                again = await self._apipeline(client, [source[i] for i in missing])
                for index, reply in zip(missing, again, strict=True):
                    replies[index] = reply
            return replies

        return await self._acall(name, run)

    async def _aone_connection(
        self, run: Callable[[list[tuple[Any, ...]]], Awaitable[list[Any]]], commands: Commands
    ) -> list[Any]:
        """The asyncio twin of :meth:`_one_connection`; ``run`` sends one pipeline."""
        replies = await run(commands(True))
        if any(isinstance(reply, NoScriptError) for reply in replies):
            replies = await run(commands(False))
        return replies

    async def _aprimary_pipeline(self, name: str, commands: list[tuple[Any, ...]]) -> list[Any]:
        """``commands`` on one connection to the lock's cluster primary (asyncio).

        redis.asyncio has no per-node client: take one of the node's connections, send
        everything, read every reply; a connection left mid-reply is closed, never reused.
        """
        client = self._async_client()
        await client.initialize()
        node = client.get_node_from_key(self._key(name))
        connection = node.acquire_connection()
        try:
            replies = await aexchange(connection, commands)
        except BaseException:
            await connection.disconnect()
            raise
        finally:
            node.release(connection)
        return replies

    async def aacquire(self, name: str, token: str, ttl_ms: int, owner: Owner) -> AcquireResult:
        return await self._aacquire(name, token, ttl_ms, owner, None)

    async def aacquire_run(
        self, name: str, token: str, ttl_ms: int, owner: Owner, run: RunCheck
    ) -> AcquireResult:
        return await self._aacquire(name, token, ttl_ms, owner, run)

    async def _aacquire(
        self, name: str, token: str, ttl_ms: int, owner: Owner, run: RunCheck | None
    ) -> AcquireResult:
        client = self._async_client()
        args = self._acquire_args(name, token, ttl_ms, owner, run)
        if self._plain_acquire:
            script = "acquire" if run is None else "acquire_run"
            reply = await self._acall(name, lambda: self._aeval(client, script, args))
            return self._acquire_result(reply, args)
        commands = self._acquire_commands(args, run)

        async def send() -> list[Any]:
            if not self._on_primary(name):
                return await self._aone_connection(
                    lambda batch: self._apipeline(client, batch), commands
                )
            direct = partial(self._aprimary_pipeline, name)
            replies = await self._aone_connection(direct, commands)
            if isinstance(replies[0], MovedError | AskError):
                await client.nodes_manager.initialize()  # the slot moved: once more, anew
                replies = await self._aone_connection(direct, commands)
            return replies

        result, acked = self._acquired(name, await self._acall(name, send), args)
        if acked is not None:
            with contextlib.suppress(LockError):
                await self.arelease(name, token)
            raise self._too_few_replicas(name, acked)
        return result

    async def arenew(self, name: str, token: str, ttl_ms: int) -> bool:
        check_ttl_ms(ttl_ms, name)
        client = self._async_client()
        args = self._renew_args(name, token, ttl_ms)
        return bool((await self._acall(name, lambda: self._aeval(client, "renew_many", args)))[0])

    async def arenew_many(
        self, items: Sequence[RenewItem], timeout: float | None = None
    ) -> list[bool]:
        # ``timeout`` is applied by the caller (asyncio.wait_for; redis-py's asyncio
        # connections disconnect when a read is cancelled).
        if not items:
            return []
        for item in items:
            check_ttl_ms(item.ttl_ms, item.name)
        chunks = self._renew_chunks(items)
        replies = await self._ascripts(items[0].name, self._renew_commands(chunks))
        return self._renew_results(chunks, replies)

    async def _arelease(self, name: str, token: str, fence: int | None) -> bool:
        client = self._async_client()
        args = self._release_args(name, token, fence)
        script = self._release_script
        return bool(await self._acall(name, lambda: self._aeval(client, script, args)))

    async def arelease(self, name: str, token: str) -> bool:
        return await self._arelease(name, token, None)

    async def aforce_release(self, name: str, fence: int | None = None) -> bool:
        return self._forced(name, await self._arelease(name, "", fence))

    async def _ablpop(self, names: Sequence[str], timeout: float) -> None:
        block = self._block_for(timeout)
        if block is None:
            await asyncio.sleep(self._nap(timeout))
            return
        client = self._async_client()
        command = ("BLPOP", *self._signals(names), repr(block))
        await self._acall(names[0], lambda: self._acall_one(client, command))

    async def await_release(self, name: str, timeout: float) -> None:
        await self._ablpop([name], timeout)

    async def await_any(self, names: Sequence[str], timeout: float) -> None:
        if self.cluster:
            return await super().await_any(names, timeout)
        return await self._ablpop(names, timeout)

    async def aholders(self, prefix: str = "") -> list[Holder]:
        client = self._async_client()

        async def run() -> tuple[list[Any], list[Any], dict[Any, Any], tuple[float, float]]:
            match = self._match(prefix)
            keys = self._lock_keys([k async for k in client.scan_iter(match=match, count=1000)])
            sent = _clocks()
            if not keys:
                return keys, [], {}, sent
            replies = await self._apipeline(client, self._read_commands(keys))
            old = self._legacy(keys, replies)
            hashes = await self._apipeline(client, [("HGETALL", k) for k in old]) if old else []
            return keys, replies, dict(zip(old, hashes, strict=True)), sent

        keys, replies, legacy, sent = await self._acall(prefix or None, run)
        return self._holders(keys, replies, legacy, sent)

    async def aholder(self, name: str) -> Holder | None:
        client = self._async_client()
        key = self._key(name)
        sent = _clocks()

        async def run() -> list[Any]:
            replies = await self._apipeline(client, self._read_commands([key]))
            if isinstance(replies[0], ResponseError):
                replies[0] = await client.hgetall(key)
            return replies

        record, pttl = await self._acall(name, run)
        return self._holder(key, record, pttl, sent)

    async def aclose(self) -> None:
        """Close this event loop's client now. Not needed before a loop that
        ``asyncio.run`` made ends: the client is closed then (:func:`_close_with_loop`)."""
        client = self._async.pop(asyncio.get_running_loop(), None)
        if client is not None:
            _disarm(client)
            await _aclose_client(client)


async def _aclose_client(client: Any) -> None:
    for sentinel in getattr(client, "task_locks_sentinels", ()):
        await sentinel.aclose()
    pool = getattr(client, "connection_pool", None)  # a cluster client has none
    if pool is not None:
        await areturn_kept(pool)  # closed with the rest, not left kept
    await client.aclose()


def _close_with_loop(client: Any) -> AsyncIterator[None] | None:
    """An async generator, started and parked, that closes ``client``'s idle connections
    when its event loop shuts down: ``asyncio.run`` (like any loop's
    ``shutdown_asyncgens``) closes every async generator still open, while the loop
    still runs. Without it, each loop's connections would stay open until the garbage
    collector found the sockets (``ResourceWarning: unclosed``).

    At ``shutdown_asyncgens`` other generators are finalized beside this one, and one
    may be releasing a lock on a connection of this client (an ``async with`` left open
    in a generator): the closer then lets them start, waits up to ``CLOSE_WAIT`` seconds
    for the connections in use to come back, and closes the idle ones (one still in use
    after that is left to the collector). Finalized earlier (the client collected while
    its loop runs), it closes the idle ones at once: nothing would wait for it. The
    client keeps the generator (the loop holds it weakly) and drops it once done, so
    nothing keeps the loop alive. ``None`` where the loop has no async
    generator hooks: nothing would ever close the generator."""
    if sys.get_asyncgen_hooks().firstiter is None:
        return None

    async def closer() -> AsyncIterator[None]:
        try:
            yield
        finally:
            if client.task_locks_closer is not None:  # not disarmed
                client.task_locks_closer = None
                pools = [s.connection_pool for s in getattr(client, "task_locks_sentinels", ())]
                pools.append(client.connection_pool)
                if getattr(asyncio.get_running_loop(), "_asyncgens_shutdown_called", False):
                    await _until_idle(pools)  # other generators are being closed beside it
                for pool in pools:
                    await areturn_kept(pool)  # idle, kept between exchanges
                    await pool.disconnect(inuse_connections=False)

    generator = closer()
    step: Any = generator.__anext__()  # the loop's hook registers it here
    try:
        step.send(None)  # runs to the ``yield`` at once: nothing is awaited before it
    except StopIteration:
        pass
    return generator


#: How long a closing loop's client waits for its connections in use (a lock released
#: by another generator the loop is finalizing) before it closes the idle ones.
CLOSE_WAIT = 1.0


async def _until_idle(pools: list[Any]) -> None:
    """Return once no connection of ``pools`` is in use, or after ``CLOSE_WAIT``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CLOSE_WAIT
    for _ in range(3):  # the generators finalized beside this one start first
        await asyncio.sleep(0)
    while loop.time() < deadline and any(
        len(getattr(pool, "_in_use_connections", ())) > kept_count(pool) for pool in pools
    ):
        await asyncio.sleep(0.005)


def _disarm(client: Any) -> None:
    """Finish ``client``'s closer without closing anything (its loop is closed, or
    ``aclose`` closes the client itself): a closer left parked would be finalized on its
    loop when collected, closed or not."""
    closer = getattr(client, "task_locks_closer", None)
    client.task_locks_closer = None
    if closer is not None:
        step: Any = closer.aclose()
        try:
            step.send(None)  # the ``finally`` sees it disarmed: nothing is awaited
        except StopIteration:
            pass


class RedisHandoffBackend(RedisBackend, ServerHandoff):
    """The server hand-off (the default): a waiter that finds the lock held queues itself
    in the same script, and a release grants the lock to the first live waiter (the
    module's docstring; ``ENQUEUE`` in :mod:`.redis_scripts`). Made by
    ``RedisBackend(url)`` (``get_backend``) unless the URL says ``handoff=client`` or
    asks for ``wait_replicas``.
    """

    capabilities = RedisBackend.capabilities | {Capability.SERVER_HANDOFF}

    def __init__(self, url: str) -> None:
        super().__init__(url)
        #: Names whose last try here was refused, the oldest first (:meth:`_pop_for`).
        self._contended: dict[str, None] = {}

    # -- request shaping shared by sync and async paths ----------------------------------

    def _enqueue_args(
        self, name: str, token: str, ttl_ms: int, owner: Owner, wait_ms: int
    ) -> list[Any]:
        check_ttl_ms(ttl_ms, name)
        key = self._key(name)
        keys = [key, self._counter(name), key + ":queue"]
        return [3, *keys, token, ttl_ms, owner.to_json(), self.fence_ttl_ms, max(0, wait_ms)]

    def _dequeue_args(self, name: str, token: str) -> list[Any]:
        key = self._key(name)
        keys = [key, self._counter(name), key + ":queue", key + ":signal"]
        return [4, *keys, token, self.fence_ttl_ms, secrets.token_hex(8), self.tombstone_ms,
                self.signal_ms]  # fmt: skip

    def _grant_key(self, name: str, token: str) -> str:
        return f"{self._key(name)}:grant:{token}"

    def _pop_for(self, name: str, wait_ms: int, pop: float) -> float | None:
        """How long an enqueue's BLPOP of its grant blocks in the same request, or
        ``None``: the enqueue goes alone.

        Only for a name whose last try here was refused: a waiter then saves a round
        trip, while a try that takes the lock pays its script's push and the pop (three
        commands) for nothing. Not on a cluster (its client routes commands itself; a
        cluster node behind a plain URL, once found out, moves its counter keys). A
        refused try also says the script was loaded; one that the server has forgotten
        since (a restart) leaves that pop blocking its whole slice, once: the try then
        goes alone, by source, and loads it again.
        """
        if pop <= 0 or wait_ms <= 0 or self._slotted or name not in self._contended:
            return None
        return self._block_for(pop)

    def _contention(self, name: str, result: AcquireResult) -> AcquireResult:
        """Remember whether ``name``'s try here was refused (:meth:`_pop_for`)."""
        contended = self._contended
        if result.fence is not None:
            contended.pop(name, None)
        elif name not in contended:
            contended[name] = None
            if len(contended) > CONTENDED_NAMES:
                with contextlib.suppress(KeyError, StopIteration, RuntimeError):
                    del contended[next(iter(contended))]
        return result

    def _enqueue_popping(
        self, name: str, token: str, args: list[Any], block: float
    ) -> list[tuple[Any, ...]]:
        """The enqueue by SHA (told how long the pop blocks, so that a try which must not
        wait that long unblocks it) and the pop. After NOSCRIPT the enqueue goes alone."""
        enqueue = [*args, max(1, int(block * 1000))]
        pop = ("BLPOP", self._grant_key(name, token), repr(block))
        return [script_command("enqueue", True, enqueue), pop]

    def _popped(self, name: str, replies: list[Any]) -> AcquireResult | None:
        """The try's result from the enqueue's and the pop's replies: the lock taken at
        once, a grant popped (as the lock taken), or a refusal that awaited its grant in
        vain. ``None`` if the script was not run (NOSCRIPT): the caller sends it alone."""
        reply, popped = replies
        if isinstance(reply, NoScriptError):
            return None
        if isinstance(reply, Exception):
            self._fail(name, reply)
        result = self._acquire_result(reply)
        if result.fence is not None:  # the lock, whatever the pop answered
            return self._contention(name, result)
        if isinstance(popped, Exception):
            self._fail(name, popped)
        granted = self._granted(popped, result.holder_fence)
        if granted is not None:
            return AcquireResult(granted)
        return dataclasses.replace(result, grant_awaited=True)

    @staticmethod
    def _granted(reply: Any, above: int | None) -> int | None:
        """The fence a grant list held (LPOP's answer, or BLPOP's ``[key, value]``), if it
        is above ``above``: a grant at or below the holder's fence the last ENQUEUE saw is
        stale (made before that try, and the lock taken back since), and is dropped."""
        if isinstance(reply, list | tuple):
            reply = reply[1]
        if reply is None or above is None:
            return None
        fence = int(reply)
        return fence if fence > above else None

    # -- blocking

    def enqueue(
        self, name: str, token: str, ttl_ms: int, owner: Owner, wait_ms: int, pop: float = 0.0
    ) -> AcquireResult:
        args = self._enqueue_args(name, token, ttl_ms, owner, wait_ms)
        riders = self._take_riders() if self._riders else None
        if riders:
            (reply,) = self._after_releases(
                name, riders, lambda by_sha: [script_command("enqueue", by_sha, args)]
            )
            if isinstance(reply, Exception):
                self._fail(name, reply)
            return self._contention(name, self._acquire_result(reply))
        block = self._pop_for(name, wait_ms, pop)
        try:
            if block is not None:
                commands = self._enqueue_popping(name, token, args, block)
                result = self._popped(name, self._pipeline(self.client, commands))
                if result is not None:
                    return result
            return self._contention(
                name, self._acquire_result(self._eval(self.client, "enqueue", args))
            )
        except CLIENT_ERRORS as exc:
            self._fail(name, exc)

    def await_grant(self, name: str, token: str, timeout: float, above: int | None) -> int | None:
        block = self._block_for(timeout)
        key = self._grant_key(name, token)
        try:
            if block is None:
                time.sleep(self._nap(timeout))
                return self._granted(self._call(self.client, ("LPOP", key)), above)
            return self._granted(self._call(self.client, ("BLPOP", key, repr(block))), above)
        except CLIENT_ERRORS as exc:
            self._fail(name, exc)

    def dequeue(self, name: str, token: str) -> bool:
        try:
            return bool(self._eval(self.client, "dequeue", self._dequeue_args(name, token)))
        except CLIENT_ERRORS as exc:
            self._fail(name, exc)

    # -- asyncio

    async def aenqueue(
        self, name: str, token: str, ttl_ms: int, owner: Owner, wait_ms: int, pop: float = 0.0
    ) -> AcquireResult:
        client = self._async_client()
        args = self._enqueue_args(name, token, ttl_ms, owner, wait_ms)
        block = self._pop_for(name, wait_ms, pop)
        if block is not None:
            commands = self._enqueue_popping(name, token, args, block)
            replies = await self._acall(name, lambda: self._apipeline(client, commands))
            result = self._popped(name, replies)
            if result is not None:
                return result
        reply = await self._acall(name, lambda: self._aeval(client, "enqueue", args))
        return self._contention(name, self._acquire_result(reply))

    async def aawait_grant(
        self, name: str, token: str, timeout: float, above: int | None
    ) -> int | None:
        block = self._block_for(timeout)
        key = self._grant_key(name, token)
        client = self._async_client()
        if block is None:
            await asyncio.sleep(self._nap(timeout))
            popped = await self._acall(name, lambda: self._acall_one(client, ("LPOP", key)))
            return self._granted(popped, above)
        command = ("BLPOP", key, repr(block))
        return self._granted(
            await self._acall(name, lambda: self._acall_one(client, command)), above
        )

    async def adequeue(self, name: str, token: str) -> bool:
        client = self._async_client()
        args = self._dequeue_args(name, token)
        return bool(await self._acall(name, lambda: self._aeval(client, "dequeue", args)))
