"""Fenced writes to data kept in Redis: the resource itself refuses stale holders.

A lock cannot stop a holder that paused past its TTL (a GC pause, a stopped VM, a slow
network) from waking up and writing: by then someone else holds the lock and has
written. Only the resource can tell, by remembering the newest fencing token that
touched it and refusing older ones. This module is that guard for data kept in Redis.

Each resource is one hash, ``<prefix><resource>``, holding the value, the high-water
mark (``fence``) and a ``version`` counter (the number of accepted writes, a
server-assigned order). Every write is one Lua script: compare the presented fence with
the mark, refuse if it is older, else store the value and raise the mark, atomically.
The same fence may write many times (a holder writes as often as it likes under its
own lease); a lower one is refused with :class:`~task_locks.StaleFence`.

Read-modify-write needs the read fenced too: ``read(resource, fence=lease.fence)``
raises the mark before returning the value, so an older holder that read earlier can no
longer write over what the newer holder is about to write (its write is refused), and
the newer holder never builds on a value the older one changes afterwards.

Fences are compared as exact integers (decimal strings in the script), so any
non-negative fence works: Redis microsecond fences, etcd revisions, database counters.

::

    store = FencedStore("redis://127.0.0.1:6379/0")
    with Lock("invoice:7", ttl=30) as lease:
        current = store.read("invoice:7", fence=lease)       # claims the resource
        store.write("invoice:7", render(current.value), lease)  # StaleFence if superseded
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn, Protocol, TypeVar

import redis
import redis.asyncio
from redis.exceptions import NoScriptError

from .backends.redis_errors import CLIENT_ERRORS, translate
from .errors import InvalidArgument, StaleFence

T = TypeVar("T")

#: Keys are ``<prefix><resource>``; the default keeps them apart from the locks' own keys.
DEFAULT_PREFIX = "task_locks:fenced:"

# KEYS[1] the resource hash. ARGV[1] fence (decimal string), ARGV[2] op: 'set' (store
# ARGV[3]), 'del' (drop the value, keep the mark) or 'claim' (raise the mark, read).
# Refused: {0, current mark}. Accepted: {1, version, value or false, previous mark or false}.
FENCED = """
local function older(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local current = redis.call('hget', KEYS[1], 'fence')
if current and older(ARGV[1], current) then return {0, current} end
local op = ARGV[2]
if op == 'claim' then
  if current ~= ARGV[1] then redis.call('hset', KEYS[1], 'fence', ARGV[1]) end
  local held = redis.call('hmget', KEYS[1], 'version', 'value')
  return {1, held[1] or '0', held[2], current}
end
if op == 'set' then
  redis.call('hset', KEYS[1], 'fence', ARGV[1], 'value', ARGV[3])
else
  redis.call('hset', KEYS[1], 'fence', ARGV[1])
  redis.call('hdel', KEYS[1], 'value')
end
local version = redis.call('hincrby', KEYS[1], 'version', 1)
return {1, tostring(version), false, current}
"""
FENCED_SHA = hashlib.sha1(FENCED.encode()).hexdigest()


class _HasFence(Protocol):
    @property
    def fence(self) -> int: ...

    @property
    def name(self) -> str: ...


Fence = int | _HasFence


@dataclass(frozen=True, slots=True)
class FencedValue:
    """What a resource holds: its value, its high-water mark and its write count."""

    #: The stored value (bytes unless the client decodes), ``None`` if never written or deleted.
    value: Any
    #: The newest fence that wrote or claimed the resource, ``None`` if none ever did.
    fence: int | None
    #: Accepted writes so far: the order in which the server accepted them (an ETag).
    version: int


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


#: ``_FencedBase._op`` without a value (``del``, ``claim``).
_NO_VALUE: Any = object()


class _Op(NamedTuple):
    resource: str
    fence: int
    lock_name: str | None
    args: list[Any]


class _FencedBase:
    """Argument checks, request shaping and reply parsing shared by sync and async."""

    def __init__(self, client: Any, prefix: str) -> None:
        if not isinstance(prefix, str):
            raise InvalidArgument(f"prefix must be a string, got {prefix!r}")
        self.client = client
        self.prefix = prefix

    def key(self, resource: str) -> str:
        """The Redis key holding ``resource`` (a hash: value, fence, version)."""
        return f"{self.prefix}{resource}"

    @staticmethod
    def _resource(resource: object) -> str:
        if not isinstance(resource, str) or not resource.strip():
            raise InvalidArgument(f"a resource must be a non-empty string, got {resource!r}")
        return resource

    @staticmethod
    def _fence(fence: object, resource: str) -> tuple[int, str | None]:
        """The fence as an int, and the lock name when a lease was passed."""
        lock_name = None
        if not isinstance(fence, int) and hasattr(fence, "fence"):
            lock_name = getattr(fence, "name", None)
            fence = fence.fence
        if isinstance(fence, bool) or not isinstance(fence, int) or fence < 0:
            raise InvalidArgument(
                f"resource {resource!r}: a fence must be a non-negative int or a lease, "
                f"got {fence!r}",
                name=resource,
            )
        return fence, lock_name

    @staticmethod
    def _value(value: object, resource: str) -> Any:
        if isinstance(value, bool) or not isinstance(value, bytes | str | int | float):
            raise InvalidArgument(
                f"resource {resource!r}: a value must be bytes, str, int or float, "
                f"got {type(value).__name__}",
                name=resource,
            )
        return value

    def _request(self, resource: str, fence: int, op: str, value: Any = "") -> list[Any]:
        return [1, self.key(resource), str(fence), op, value]

    def _op(self, resource: object, fence: object, op: str, value: object = _NO_VALUE) -> _Op:
        """One fenced call (``set``, ``del``, ``claim``) checked and shaped before its I/O:
        one place for what every write, delete and claiming read does, sync or async."""
        resource = self._resource(resource)
        number, lock_name = self._fence(fence, resource)
        payload = "" if value is _NO_VALUE else self._value(value, resource)
        return _Op(resource, number, lock_name, self._request(resource, number, op, payload))

    def _check(self, op: _Op, reply: Any) -> list[Any]:
        """``op``'s reply, or :class:`~task_locks.StaleFence` if a newer fence refused it."""
        return self._accepted(reply, op.resource, op.fence, op.lock_name)

    @staticmethod
    def _accepted(reply: Any, resource: str, fence: int, lock_name: str | None) -> list[Any]:
        if int(reply[0]):
            return list(reply)
        current = int(_text(reply[1]))
        raise StaleFence(
            f"resource {resource!r} refused a write with fence {fence}: fence {current} "
            "already wrote to it (the lock was lost and taken by a newer holder)",
            name=lock_name or resource,
            resource=resource,
            fence=fence,
            current=current,
        )

    @staticmethod
    def _snapshot(fields: list[Any]) -> FencedValue:
        value, fence, version = fields
        return FencedValue(
            value=value,
            fence=None if fence is None else int(_text(fence)),
            version=int(_text(version)) if version is not None else 0,
        )

    def _server(self) -> str:
        try:
            kwargs = self.client.connection_pool.connection_kwargs
            return f"redis://{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
        except AttributeError:
            return repr(self.client)

    def _fail(self, resource: str, exc: Exception) -> NoReturn:
        what = f"resource {resource!r}"
        raise translate(exc, what=what, name=resource, server=self._server()) from exc


class FencedStore(_FencedBase):
    """Values in Redis that only the newest fencing token may change.

    ``client_or_url`` is a ``redis.Redis`` (or cluster / sentinel master) client, or a
    ``redis://`` URL. ``prefix`` is put in front of every resource name to make its key.
    """

    def __init__(self, client_or_url: Any, *, prefix: str = DEFAULT_PREFIX) -> None:
        if isinstance(client_or_url, str):
            try:
                client_or_url = redis.Redis.from_url(client_or_url)
            except ValueError as exc:
                raise InvalidArgument(f"malformed Redis URL {client_or_url!r}: {exc}") from exc
        super().__init__(client_or_url, prefix)

    def _script(self, resource: str, args: list[Any]) -> Any:
        try:
            try:
                return self.client.evalsha(FENCED_SHA, *args)
            except NoScriptError:
                return self.client.eval(FENCED, *args)
        except CLIENT_ERRORS as exc:
            self._fail(resource, exc)

    def write(self, resource: str, value: bytes | str | int | float, fence: Fence) -> int:
        """Store ``value`` unless a newer fence already wrote or claimed ``resource``.

        ``fence`` is ``lease.fence`` (or the lease itself). Returns the resource's new
        version. Raises :class:`~task_locks.StaleFence` (``.resource``, ``.fence``,
        ``.current``) when refused; nothing is changed then.
        """
        op = self._op(resource, fence, "set", value)
        return int(_text(self._check(op, self._script(op.resource, op.args))[1]))

    def delete(self, resource: str, fence: Fence) -> int:
        """Drop the value (the mark stays, so older holders stay refused); new version."""
        op = self._op(resource, fence, "del")
        return int(_text(self._check(op, self._script(op.resource, op.args))[1]))

    def read(self, resource: str, *, fence: Fence | None = None) -> FencedValue:
        """The current value, fence and version.

        With ``fence``, the read also claims the resource: the mark rises to ``fence``
        (or :class:`~task_locks.StaleFence` if a newer one got there first), so no
        older holder can write between this read and your write.
        """
        if fence is None:
            resource = self._resource(resource)
            try:
                fields = self.client.hmget(self.key(resource), ["value", "fence", "version"])
            except CLIENT_ERRORS as exc:
                self._fail(resource, exc)
            return self._snapshot(fields)
        op = self._op(resource, fence, "claim")
        reply = self._check(op, self._script(op.resource, op.args))
        return self._snapshot([reply[2], str(op.fence), reply[1]])


class AsyncFencedStore(_FencedBase):
    """The asyncio twin of :class:`FencedStore` (a ``redis.asyncio`` client or a URL)."""

    def __init__(self, client_or_url: Any, *, prefix: str = DEFAULT_PREFIX) -> None:
        if isinstance(client_or_url, str):
            try:
                client_or_url = redis.asyncio.Redis.from_url(client_or_url)
            except ValueError as exc:
                raise InvalidArgument(f"malformed Redis URL {client_or_url!r}: {exc}") from exc
        super().__init__(client_or_url, prefix)

    async def _call(self, resource: str, call: Callable[[], Awaitable[T]]) -> T:
        try:
            return await call()
        except CLIENT_ERRORS as exc:
            self._fail(resource, exc)

    async def _script(self, resource: str, args: list[Any]) -> Any:
        async def run() -> Any:
            try:
                return await self.client.evalsha(FENCED_SHA, *args)
            except NoScriptError:
                return await self.client.eval(FENCED, *args)

        return await self._call(resource, run)

    async def write(self, resource: str, value: bytes | str | int | float, fence: Fence) -> int:
        """See :meth:`FencedStore.write`."""
        op = self._op(resource, fence, "set", value)
        return int(_text(self._check(op, await self._script(op.resource, op.args))[1]))

    async def delete(self, resource: str, fence: Fence) -> int:
        """See :meth:`FencedStore.delete`."""
        op = self._op(resource, fence, "del")
        return int(_text(self._check(op, await self._script(op.resource, op.args))[1]))

    async def read(self, resource: str, *, fence: Fence | None = None) -> FencedValue:
        """See :meth:`FencedStore.read`."""
        if fence is None:
            resource = self._resource(resource)
            key = self.key(resource)
            fields = await self._call(
                resource, lambda: self.client.hmget(key, ["value", "fence", "version"])
            )
            return self._snapshot(fields)
        op = self._op(resource, fence, "claim")
        reply = self._check(op, await self._script(op.resource, op.args))
        return self._snapshot([reply[2], str(op.fence), reply[1]])


def fenced_set(
    client_or_url: Any,
    resource: str,
    value: bytes | str | int | float,
    fence: Fence,
    *,
    prefix: str = DEFAULT_PREFIX,
) -> int:
    """One fenced write without keeping a store around: ``FencedStore(...).write(...)``."""
    store = FencedStore(client_or_url, prefix=prefix)
    try:
        return store.write(resource, value, fence)
    finally:
        if isinstance(client_or_url, str):
            store.client.close()


__all__ = [
    "DEFAULT_PREFIX",
    "AsyncFencedStore",
    "FencedStore",
    "FencedValue",
    "fenced_set",
]
