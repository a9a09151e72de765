"""Redis: ``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://``, ``redis+cluster://``.

One lock is three keys sharing a cluster hash slot (the name is the hash tag):

- ``<prefix>{name}``        hash: token, fence, owner JSON, acquired (server ms), renewals, ttl
- ``<prefix>{name}:fence``  the last fence handed out for this name
- ``<prefix>{name}:signal`` a list a release pushes to; waiters BLPOP it

Acquire, renew and release are one script call (one round trip) each. Waiters block on
the signal list, so a release hands the lock to the longest waiter in about one round
trip, without polling; they also wake when the holder's TTL runs out.

URL options (query string, removed before the URL reaches redis-py): ``prefix``
(default ``task_locks:``), ``socket_timeout`` (seconds, default 5), ``connect_timeout``
(default 2), ``wait_replicas`` and ``wait_timeout`` (ms) to demand that a replica has the
lock before an acquire counts, ``fence_ttl`` (seconds a fence counter outlives its last
use, default 7 days).

Sentinel: ``redis+sentinel://[:password@]host:port[,host:port]/service[/db]``.
Cluster: ``redis+cluster://host:port[,host:port]``.
"""

from __future__ import annotations

import asyncio
import re
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel
from redis.backoff import NoBackoff
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    NoScriptError,
    ReadOnlyError,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError

from ..errors import BackendUnavailable, InvalidArgument, LockError
from ..types import AcquireResult, Holder, Owner, RenewItem
from .base import Backend

T = TypeVar("T")

# KEYS[1] lock hash, KEYS[2] fence counter
# ARGV[1] token, ARGV[2] ttl ms, ARGV[3] owner JSON, ARGV[4] fence counter ttl ms
# Returns the fence (integer) when the lock is now ours (or already was, for this token:
# a retried acquire is idempotent); else {holder pttl ms, owner JSON, fence, acquired ms}.
# fence = max(last fence + 1, server time in microseconds): increasing even when the
# counter was lost in a restart without persistence.
ACQUIRE = """
local held = redis.call('hmget', KEYS[1], 'token', 'fence', 'owner', 'acquired')
if held[1] then
  if held[1] == ARGV[1] then return tonumber(held[2]) end
  return {redis.call('pttl', KEYS[1]), held[3], held[2], held[4]}
end
local now = redis.call('time')
local fence = tonumber(now[1]) * 1000000 + tonumber(now[2])
local last = tonumber(redis.call('get', KEYS[2]) or '0')
if last >= fence then fence = last + 1 end
local text = string.format('%.0f', fence)
redis.call('set', KEYS[2], text, 'px', ARGV[4])
redis.call('hset', KEYS[1], 'token', ARGV[1], 'fence', text, 'owner', ARGV[3],
  'acquired', string.format('%.0f', tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)),
  'renewals', 0, 'ttl', ARGV[2])
redis.call('pexpire', KEYS[1], ARGV[2])
return fence
"""

# KEYS[1] lock hash; ARGV[1] token, ARGV[2] ttl ms
# Returns 1 if the TTL was extended, 0 if the token is not ours (the lease is lost).
RENEW = """
if redis.call('hget', KEYS[1], 'token') == ARGV[1] then
  redis.call('pexpire', KEYS[1], ARGV[2])
  redis.call('hincrby', KEYS[1], 'renewals', 1)
  return 1
end
return 0
"""

# KEYS[1] lock hash, KEYS[2] signal list; ARGV[1] token, or '' to release whoever holds it
# Returns 1 if the lock was deleted (and one waiter signalled), 0 if not held / not ours.
RELEASE = """
local held = redis.call('hmget', KEYS[1], 'token', 'ttl')
if not held[1] or (ARGV[1] ~= '' and held[1] ~= ARGV[1]) then return 0 end
redis.call('del', KEYS[1])
redis.call('rpush', KEYS[2], '1')
redis.call('ltrim', KEYS[2], -1, -1)
redis.call('pexpire', KEYS[2], held[2] or 60000)
return 1
"""

_UNAVAILABLE = (
    RedisConnectionError,
    RedisTimeoutError,
    BusyLoadingError,
    ReadOnlyError,
    ClusterDownError,
    MasterNotFoundError,
    TryAgainError,
    OSError,
)
_OUR_OPTIONS = {
    "prefix",
    "socket_timeout",
    "connect_timeout",
    "wait_replicas",
    "wait_timeout",
    "fence_ttl",
}
_GLOB = re.compile(r"([*?\[\]\\])")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Scripts:
    """SHA1s of our scripts, computed once; NOSCRIPT is answered by loading them."""

    def __init__(self) -> None:
        import hashlib

        self.source = {"acquire": ACQUIRE, "renew": RENEW, "release": RELEASE}
        self.sha = {k: hashlib.sha1(v.encode()).hexdigest() for k, v in self.source.items()}


SCRIPTS = _Scripts()


class RedisBackend(Backend):
    schemes = ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster")
    capabilities = frozenset({"fencing", "multiprocess", "wakeup", "holders"})

    def __init__(self, url: str) -> None:
        super().__init__(url)
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        options = {k: query.pop(k) for k in list(query) if k in _OUR_OPTIONS}
        self.prefix = options.get("prefix", "task_locks:")
        self.socket_timeout = self._number(options, "socket_timeout", 5.0)
        self.connect_timeout = self._number(options, "connect_timeout", 2.0)
        self.wait_replicas = int(self._number(options, "wait_replicas", 0))
        self.wait_timeout_ms = int(self._number(options, "wait_timeout", 100))
        self.fence_ttl_ms = int(self._number(options, "fence_ttl", 7 * 86400) * 1000)
        self.scheme = parts.scheme.lower()
        self._client_url = urlunsplit(parts._replace(query=urlencode(query)))
        self._parts = parts
        self.cluster = self.scheme == "redis+cluster"
        self.client = self._make_client(redis, redis.sentinel, redis.cluster)
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = (
            weakref.WeakKeyDictionary()
        )

    # -- construction -----------------------------------------------------------------

    def _number(self, options: dict[str, str], key: str, default: float) -> float:
        if key not in options:
            return default
        try:
            value = float(options[key])
        except ValueError:
            raise InvalidArgument(
                f"{self.server}: option {key}={options[key]!r} is not a number"
            ) from None
        if value < 0:
            raise InvalidArgument(f"{self.server}: option {key} must be >= 0, got {value}")
        return value

    def _hosts(self) -> list[tuple[str, int]]:
        netloc = self._parts.netloc.rsplit("@", 1)[-1]
        hosts = []
        for item in filter(None, netloc.split(",")):
            host, _, port = item.rpartition(":")
            try:
                hosts.append((host or item, int(port) if host else 26379))
            except ValueError:
                raise InvalidArgument(f"malformed host:port {item!r} in {self.server}") from None
        if not hosts:
            raise InvalidArgument(f"no host:port in {self.server}")
        return hosts

    def _make_client(self, plain: Any, sentinel: Any, cluster: Any) -> Any:
        common: dict[str, Any] = {
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": self.connect_timeout,
        }
        # One quick retry on a dropped connection (a restarted server, a stale pooled
        # socket); never on a timeout, so a paused server fails within socket_timeout.
        retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
        if self.scheme == "redis+sentinel":
            path = [p for p in self._parts.path.split("/") if p]
            if not path:
                raise InvalidArgument(f"{self.server}: sentinel URL needs /service_name")
            kwargs = dict(common, password=self._parts.password, retry=retry)
            if len(path) > 1:
                kwargs["db"] = int(path[1])
            return sentinel.Sentinel(self._hosts(), **common).master_for(path[0], **kwargs)
        if self.cluster:
            first = self._hosts()[0]
            nodes = [cluster.ClusterNode(h, p) for h, p in self._hosts()]
            return cluster.RedisCluster(
                host=first[0],
                port=first[1],
                startup_nodes=nodes,
                password=self._parts.password,
                **common,
            )
        try:
            return plain.Redis.from_url(self._client_url, retry=retry, **common)
        except ValueError as exc:
            raise InvalidArgument(f"malformed Redis URL {self.server}: {exc}") from exc

    def _async_client(self) -> Any:
        loop = asyncio.get_running_loop()
        client = self._async.get(loop)
        if client is None:
            client = self._make_client(redis.asyncio, redis.asyncio.sentinel, redis.asyncio.cluster)
            self._async[loop] = client
        return client

    # -- keys ---------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return f"{self.prefix}{{{name}}}"

    def _name(self, key: Any) -> str:
        return _text(key)[len(self.prefix) + 1 : -1]

    # -- errors -------------------------------------------------------------------------

    def _fail(self, name: str | None, exc: Exception) -> NoReturn:
        what = f"lock {name!r}" if name else "listing locks"
        if isinstance(exc, _UNAVAILABLE):
            raise BackendUnavailable(
                f"{what}: Redis at {self.server} is unavailable: {exc}",
                name=name,
                server=self.server,
            ) from exc
        raise LockError(f"{what}: Redis at {self.server} refused: {exc}", name=name) from exc

    # -- request shaping shared by sync and async paths ----------------------------------

    def _acquire_args(self, name: str, token: str, ttl_ms: int, owner: Owner) -> list[Any]:
        key = self._key(name)
        return [2, key, key + ":fence", token, ttl_ms, owner.to_json(), self.fence_ttl_ms]

    def _acquire_result(self, reply: Any) -> AcquireResult:
        if isinstance(reply, int):
            return AcquireResult(int(reply))
        pttl, owner, fence, acquired = reply
        return AcquireResult(
            None,
            retry_after=max(0, int(pttl)) / 1000 if int(pttl) >= 0 else None,
            holder=Owner.from_json(owner),
            holder_fence=int(fence) if fence else None,
            holder_acquired_at=int(acquired) / 1000 if acquired else None,
        )

    def _check_replicas(self, name: str, acked: Any) -> None:
        if int(acked) < self.wait_replicas:
            raise BackendUnavailable(
                f"lock {name!r}: only {acked} of {self.wait_replicas} replicas acknowledged the "
                f"acquire within {self.wait_timeout_ms} ms at {self.server}",
                name=name,
                server=self.server,
            )

    def _block_for(self, timeout: float) -> float:
        # BLPOP 0 would block forever, and a block longer than the socket timeout would
        # read as a timeout: keep it in between.
        return max(0.001, min(timeout, self.socket_timeout * 0.8 or timeout))

    def _holder(self, key: Any, fields: dict[Any, Any], pttl: int) -> Holder | None:
        if not fields or pttl == -2:
            return None
        data = {_text(k): _text(v) for k, v in fields.items()}
        acquired = data.get("acquired")
        return Holder(
            name=self._name(key),
            fence=int(data.get("fence", 0)),
            owner=Owner.from_json(data.get("owner")),
            acquired_at=int(acquired) / 1000 if acquired else None,
            expires_at=time.time() + pttl / 1000 if pttl >= 0 else None,
            renewals=int(data.get("renewals", 0)),
            token=data.get("token", ""),
        )

    def _match(self, prefix: str) -> str:
        return _GLOB.sub(r"\\\1", f"{self.prefix}{{{prefix}") + "*"

    # -- sync I/O -----------------------------------------------------------------------

    def _eval(self, client: Any, script: str, args: list[Any]) -> Any:
        try:
            return client.evalsha(SCRIPTS.sha[script], *args)
        except NoScriptError:
            return client.eval(SCRIPTS.source[script], *args)

    def acquire(self, name: str, token: str, ttl_ms: int, owner: Owner) -> AcquireResult:
        args = self._acquire_args(name, token, ttl_ms, owner)
        try:
            result = self._acquire_result(self._eval(self.client, "acquire", args))
            if result.acquired and self.wait_replicas:
                acked = self.client.execute_command(
                    "WAIT", self.wait_replicas, self.wait_timeout_ms
                )
                self._check_replicas(name, acked)
            return result
        except RedisError as exc:
            self._fail(name, exc)

    def renew(self, name: str, token: str, ttl_ms: int) -> bool:
        try:
            return bool(self._eval(self.client, "renew", [1, self._key(name), token, ttl_ms]))
        except RedisError as exc:
            self._fail(name, exc)

    def renew_many(self, items: Sequence[RenewItem]) -> list[bool]:
        if not items:
            return []
        try:
            for attempt in range(2):
                pipe = self.client.pipeline(transaction=False)
                for item in items:
                    pipe.evalsha(
                        SCRIPTS.sha["renew"], 1, self._key(item.name), item.token, item.ttl_ms
                    )
                replies = pipe.execute(raise_on_error=False)
                if attempt == 0 and any(isinstance(r, NoScriptError) for r in replies):
                    self.client.script_load(RENEW)
                    continue
                break
        except RedisError as exc:
            self._fail(items[0].name, exc)
        for item, reply in zip(items, replies, strict=True):
            if isinstance(reply, Exception):
                self._fail(item.name, reply)
        return [bool(r) for r in replies]

    def release(self, name: str, token: str) -> bool:
        key = self._key(name)
        try:
            return bool(self._eval(self.client, "release", [2, key, key + ":signal", token]))
        except RedisError as exc:
            self._fail(name, exc)

    def force_release(self, name: str) -> bool:
        return self.release(name, "")

    def wait(self, name: str, timeout: float) -> None:
        try:
            self.client.blpop([self._key(name) + ":signal"], self._block_for(timeout))
        except RedisError as exc:
            self._fail(name, exc)

    def holders(self, prefix: str = "") -> list[Holder]:
        try:
            keys = list(self.client.scan_iter(match=self._match(prefix), count=1000, _type="HASH"))
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(key)
                pipe.pttl(key)
            replies = pipe.execute() if keys else []
        except RedisError as exc:
            self._fail(prefix or None, exc)
        found = (self._holder(k, replies[2 * i], replies[2 * i + 1]) for i, k in enumerate(keys))
        return sorted((h for h in found if h is not None), key=lambda h: h.name)

    def holder(self, name: str) -> Holder | None:
        key = self._key(name)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.hgetall(key)
            pipe.pttl(key)
            fields, pttl = pipe.execute()
        except RedisError as exc:
            self._fail(name, exc)
        return self._holder(key, fields, pttl)

    def close(self) -> None:
        self.client.close()

    # -- async I/O: the same requests, awaited --------------------------------------------

    async def _aeval(self, client: Any, script: str, args: list[Any]) -> Any:
        try:
            return await client.evalsha(SCRIPTS.sha[script], *args)
        except NoScriptError:
            return await client.eval(SCRIPTS.source[script], *args)

    async def _acall(self, name: str | None, call: Callable[[], Any]) -> Any:
        try:
            return await call()
        except RedisError as exc:
            self._fail(name, exc)

    async def aacquire(self, name: str, token: str, ttl_ms: int, owner: Owner) -> AcquireResult:
        client = self._async_client()
        args = self._acquire_args(name, token, ttl_ms, owner)
        result = self._acquire_result(
            await self._acall(name, lambda: self._aeval(client, "acquire", args))
        )
        if result.acquired and self.wait_replicas:
            acked = await self._acall(
                name,
                lambda: client.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms),
            )
            self._check_replicas(name, acked)
        return result

    async def arenew(self, name: str, token: str, ttl_ms: int) -> bool:
        client = self._async_client()
        args = [1, self._key(name), token, ttl_ms]
        return bool(await self._acall(name, lambda: self._aeval(client, "renew", args)))

    async def arenew_many(self, items: Sequence[RenewItem]) -> list[bool]:
        if not items:
            return []
        client = self._async_client()

        async def run() -> list[Any]:
            for attempt in range(2):
                pipe = client.pipeline(transaction=False)
                for item in items:
                    pipe.evalsha(
                        SCRIPTS.sha["renew"], 1, self._key(item.name), item.token, item.ttl_ms
                    )
                replies: list[Any] = await pipe.execute(raise_on_error=False)
                if attempt == 0 and any(isinstance(r, NoScriptError) for r in replies):
                    await client.script_load(RENEW)
                    continue
                break
            return replies

        replies = await self._acall(items[0].name, run)
        for item, reply in zip(items, replies, strict=True):
            if isinstance(reply, Exception):
                self._fail(item.name, reply)
        return [bool(r) for r in replies]

    async def arelease(self, name: str, token: str) -> bool:
        client = self._async_client()
        key = self._key(name)
        args = [2, key, key + ":signal", token]
        return bool(await self._acall(name, lambda: self._aeval(client, "release", args)))

    async def aforce_release(self, name: str) -> bool:
        return await self.arelease(name, "")

    async def await_release(self, name: str, timeout: float) -> None:
        client = self._async_client()
        block = self._block_for(timeout)
        await self._acall(name, lambda: client.blpop([self._key(name) + ":signal"], block))
