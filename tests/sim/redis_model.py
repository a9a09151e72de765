"""A simulated Redis keyspace that runs the production Lua scripts as they are.

Only the commands task-locks sends (its scripts' ``redis.call`` / ``redis.pcall`` and the
backend's own commands) are implemented, each with Redis's semantics for what the
scripts depend on:

- expiry: a key past its PX/PEXPIRE deadline is gone for every command (Redis's lazy
  expiry; its active expiry only frees memory sooner, and SCAN/KEYS skip expired keys
  too), ``PTTL`` is -2 / -1 / ms left, a non-positive PEXPIRE deletes the key;
- time: ``TIME`` reads the server's clock (``now_us``, virtual in the simulator, which
  may be stepped), and inside a script expiry is judged at the script's start time, as
  Redis 7 does;
- scripts: EVAL caches the script (EVALSHA of an unknown SHA answers NOSCRIPT; a
  restart forgets the cache), run by an embedded Lua 5.1 (``lupa``, Redis's Lua
  version), atomically (nothing else runs while one does); ``redis.call`` raises a
  command error out of the script, ``redis.pcall`` returns it as ``{err=...}``;
  replies convert as Redis converts them (nil bulk -> ``false``, Lua numbers truncate
  to integers, a table stops at its first nil, ``{ok=}`` / ``{err=}`` tables are status
  and error replies).

Replies are plain Python: ``int``, ``str`` (bulk), ``None`` (nil), ``list``,
:class:`Status`, :class:`ReplyError` (returned, not raised, so a pipeline can carry it).
Blocking pops are the server's business (``tests/sim/world.py``): the model only says
which lists got pushed (:attr:`RedisModel.pushed`).
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
from collections.abc import Callable
from typing import Any

import lupa.lua51 as lua51

LLONG_MAX = 2**63 - 1


class Status(str):
    """A status reply (``+OK``)."""


class ReplyError(Exception):
    """An error reply (``-ERR ...``); a value in replies, raised by nobody here."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReplyError) and other.message == self.message

    def __hash__(self) -> int:
        return hash(self.message)

    def __repr__(self) -> str:
        return f"ReplyError({self.message!r})"


class Zset(dict):  # type: ignore[type-arg]
    """A sorted set: member -> score (ordered on demand: our zsets are small)."""


WRONGTYPE = "WRONGTYPE Operation against a key holding the wrong kind of value"
NOT_INT = "ERR value is not an integer or out of range"


class CommandError(Exception):
    """Raised inside a command; becomes a :class:`ReplyError`."""


def _int(value: str) -> int:
    try:
        if value.strip() != value or not value:
            raise ValueError
        return int(value)
    except ValueError:
        raise CommandError(NOT_INT) from None


def _span(length: int, first: str, last: str) -> slice:
    """LRANGE/ZRANGE's inclusive, negative-from-the-end indexes as a slice."""
    start, stop = _int(first), _int(last)
    start = max(0, start + length if start < 0 else start)
    stop = stop + length if stop < 0 else stop
    return slice(start, stop + 1)


def _score(value: float) -> str:
    if value == int(value) and abs(value) < 1e17:
        return str(int(value))
    return repr(value)


def _arg(value: Any) -> str:
    """A Lua (or Python) command argument as Redis receives it: a string."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, bool):
        raise CommandError("ERR Lua redis lib command arguments must be strings or integers")
    if isinstance(value, float):
        if value == int(value) and abs(value) < 1e17:
            return str(int(value))
        return f"{value:.17g}"
    return str(value)


_PRELUDE = """
local dispatch = ...
local redis = {}
function redis.call(...)
  local ok, reply = dispatch(...)
  if ok then return reply end
  error({err = reply}, 0)
end
function redis.pcall(...)
  local ok, reply = dispatch(...)
  if ok then return reply end
  return {err = reply}
end
function redis.error_reply(message) return {err = message} end
function redis.status_reply(message) return {ok = message} end
_G.redis = redis
return function(script, count, ...)
  -- KEYS and ARGV made here from the arguments (cheaper than two tables from Python)
  local args, keys, argv = {...}, {}, {}
  for i = 1, count do keys[i] = args[i] end
  for i = count + 1, select('#', ...) do argv[i - count] = args[i] end
  KEYS, ARGV = keys, argv
  return pcall(script)
end
"""


class _Lua:
    """One Lua runtime for every model (a runtime and its compiled scripts cost more than
    a short simulated run): scripts call back into the model running them (``active``).
    Globals a script leaves behind are reset for each call (KEYS, ARGV); our scripts
    write no others (Redis refuses that too)."""

    active: RedisModel | None = None

    def __init__(self) -> None:
        self.runtime = lua51.LuaRuntime(encoding="utf-8", unpack_returned_tuples=True)
        self.run = self.runtime.execute(_PRELUDE, self._dispatch)
        self.compile = self.runtime.eval(
            "function(source) local f, e = loadstring(source, '@user_script') return f, e end"
        )
        self.compiled: dict[str, Any] = {}

    @staticmethod
    def _dispatch(*args: Any) -> tuple[bool, Any]:
        model = _Lua.active
        assert model is not None
        return model._dispatch(*args)


_shared: list[_Lua] = []


def _lua() -> _Lua:
    if not _shared:
        _shared.append(_Lua())
    return _shared[0]


_shas: dict[str, str] = {}


def _sha(source: str) -> str:
    sha = _shas.get(source)
    if sha is None:
        sha = _shas[source] = hashlib.sha1(source.encode()).hexdigest()
    return sha


@functools.cache
def _command_methods(cls: type) -> tuple[str, ...]:
    """The ``cmd_*`` methods of a model class (``dir`` is slow, and a run makes a model)."""
    return tuple(name for name in dir(cls) if name.startswith("cmd_"))


class RedisModel:
    """One Redis server's keyspace and script cache (see the module docstring)."""

    def __init__(self, now_us: Callable[[], int]) -> None:
        self.now_us = now_us
        self.data: dict[str, Any] = {}
        self.expires: dict[str, int] = {}
        #: Lists pushed to since the server last served its blocked clients.
        self.pushed: set[str] = set()
        self._frozen_ms: int | None = None
        lua = _lua()
        self._run, self._compile, self._table = lua.run, lua.compile, lua.runtime.table_from
        self._compiled = lua.compiled
        self._lua_type = lua51.lua_type
        #: The script cache (SHA -> compiled function): what EVALSHA finds.
        self.scripts: dict[str, Any] = {}
        self._commands: dict[str, Callable[[list[str]], Any]] = {
            name[4:]: getattr(self, name) for name in _command_methods(type(self))
        }
        #: A script's command as it spells it -> its handler (looked up once per spelling).
        self._script_commands: dict[str, Callable[[list[str]], Any]] = {}

    # -- the server's life -----------------------------------------------------------

    def restart(self) -> None:
        """A restart without persistence: no keys, no cached scripts."""
        self.data.clear()
        self.expires.clear()
        self.scripts.clear()
        self.pushed.clear()

    def now_ms(self) -> int:
        if self._frozen_ms is not None:
            return self._frozen_ms
        return self.now_us() // 1000

    # -- the keyspace ------------------------------------------------------------------

    def _alive(self, key: str) -> bool:
        when = self.expires.get(key)
        if when is not None and self.now_ms() > when:
            del self.expires[key]
            self.data.pop(key, None)
            return False
        return key in self.data

    def get_value(self, key: str, kind: type | None = None) -> Any:
        if not self._alive(key):
            return None
        value = self.data[key]
        if kind is not None and type(value) is not kind:
            raise CommandError(WRONGTYPE)
        return value

    def _delete(self, key: str) -> bool:
        self.expires.pop(key, None)
        return self.data.pop(key, None) is not None

    def live_keys(self) -> list[str]:
        return [key for key in list(self.data) if self._alive(key)]

    def pttl(self, key: str) -> int:
        if not self._alive(key):
            return -2
        when = self.expires.get(key)
        return -1 if when is None else max(0, when - self.now_ms())

    def snapshot(self) -> dict[str, tuple[str, Any, int]]:
        """Every live key: (type, value as plain data, PTTL ms) (for checks and diffs)."""
        out = {}
        for key in self.live_keys():
            value = self.data[key]
            kind = type(value)
            if kind is str:
                shown: Any = ("string", value)
            elif kind is dict:
                shown = ("hash", dict(value))
            elif kind is list:
                shown = ("list", list(value))
            else:
                shown = ("zset", sorted(((s, m) for m, s in value.items())))
            out[key] = (shown[0], shown[1], self.pttl(key))
        return out

    # -- executing commands ------------------------------------------------------------

    def execute(self, args: list[Any] | tuple[Any, ...]) -> Any:
        """Run one command (the client's argument list); its reply (errors returned)."""
        words = [a if type(a) is str else _arg(a) for a in args]
        handler = self._commands.get(words[0].lower())
        if handler is None:
            return ReplyError(f"ERR unknown command '{words[0]}'")
        try:
            return handler(words[1:])
        except CommandError as exc:
            return ReplyError(str(exc))

    def _dispatch(self, *args: Any) -> tuple[bool, Any]:
        """``redis.call`` from a script: ``(True, reply as Lua)`` or ``(False, message)``."""
        try:
            words = [a if type(a) is str else _arg(a) for a in args]
        except CommandError as exc:
            return False, str(exc)
        if not words:
            return False, "ERR Please specify at least one argument for this redis lib call"
        handler = self._script_commands.get(words[0])
        if handler is None:
            name = words[0].lower()
            handler = self._commands.get(name)
            if handler is None or name in _NOT_IN_SCRIPTS:
                return False, "ERR unknown command or not allowed from scripts"
            self._script_commands[words[0]] = handler
        try:
            reply = handler(words[1:])
        except CommandError as exc:
            return False, str(exc)
        kind = type(reply)
        if kind is int or kind is str:
            return True, reply
        if isinstance(reply, ReplyError):
            return False, reply.message
        return True, self._to_lua(reply)

    def _to_lua(self, reply: Any) -> Any:
        if reply is None:
            return False
        if isinstance(reply, Status):
            return self._table({"ok": str(reply)})
        if isinstance(reply, list):
            return self._table([self._to_lua(item) for item in reply])
        return reply

    def _from_lua(self, value: Any) -> Any:
        if value is None:
            return None
        kind = type(value)
        if kind is bool:
            return 1 if value else None
        if kind is int:
            return value
        if kind is float:
            return int(value)
        if kind is str:
            return value
        if kind is bytes:
            return value.decode()
        if self._lua_type(value) != "table":
            return None
        err = value["err"]
        if err is not None:
            return ReplyError(str(err))
        ok = value["ok"]
        if ok is not None:
            return Status(ok)
        out = []
        index = 1
        while True:
            item = value[index]
            if item is None:
                return out
            out.append(self._from_lua(item))
            index += 1

    def _script(self, source: str) -> tuple[str, Any]:
        sha = _sha(source)
        function = self.scripts.get(sha)
        if function is None:
            function = self._compiled.get(sha)
            if function is None:
                function, error = self._compile(source)
                if function is None:
                    raise CommandError(f"ERR Error compiling script (new function): {error}")
                self._compiled[sha] = function
            self.scripts[sha] = function
        return sha, function

    def _call_script(self, function: Any, args: list[str]) -> Any:
        count = _int(args[0])
        if count < 0 or count > len(args) - 1:
            raise CommandError("ERR Number of keys can't be greater than number of args")
        self._frozen_ms = self.now_us() // 1000  # expiry judged at the script's start
        _Lua.active = self
        try:
            ok, reply = self._run(function, count, *args[1:])
        finally:
            self._frozen_ms = None
        if ok:
            return self._from_lua(reply)
        if self._lua_type(reply) == "table" and reply["err"] is not None:
            return ReplyError(str(reply["err"]))
        return ReplyError(f"ERR user_script: {reply}")

    def cmd_eval(self, args: list[str]) -> Any:
        _, function = self._script(args[0])
        return self._call_script(function, args[1:])

    def cmd_evalsha(self, args: list[str]) -> Any:
        function = self.scripts.get(args[0].lower())
        if function is None:
            return ReplyError("NOSCRIPT No matching script. Please use EVAL.")
        return self._call_script(function, args[1:])

    def cmd_script(self, args: list[str]) -> Any:
        sub = args[0].lower()
        if sub == "load":
            return self._script(args[1])[0]
        if sub == "exists":
            return [int(sha.lower() in self.scripts) for sha in args[1:]]
        if sub == "flush":
            self.scripts.clear()
            return Status("OK")
        raise CommandError(f"ERR unknown subcommand '{args[0]}'")

    # -- generic -----------------------------------------------------------------------

    def cmd_ping(self, args: list[str]) -> Any:
        return Status("PONG")

    def cmd_time(self, args: list[str]) -> Any:
        now = self.now_us()
        return [str(now // 1_000_000), str(now % 1_000_000)]

    def cmd_del(self, args: list[str]) -> int:
        return sum(1 for key in args if self._alive(key) and self._delete(key))

    def cmd_exists(self, args: list[str]) -> int:
        return sum(1 for key in args if self._alive(key))

    def cmd_type(self, args: list[str]) -> Any:
        value = self.get_value(args[0])
        names = {str: "string", dict: "hash", list: "list", Zset: "zset"}
        return Status("none" if value is None else names[type(value)])

    def cmd_pttl(self, args: list[str]) -> int:
        return self.pttl(args[0])

    def cmd_ttl(self, args: list[str]) -> int:
        left = self.pttl(args[0])
        return left if left < 0 else (left + 500) // 1000

    def cmd_pexpire(self, args: list[str]) -> int:
        key, ms = args[0], _int(args[1])
        if len(args) > 2:
            raise CommandError(f"ERR Unsupported option {args[2]}")
        now = self.now_ms()
        if ms > 0 and ms > LLONG_MAX - now:
            raise CommandError("ERR invalid expire time in 'pexpire' command")
        if not self._alive(key):
            return 0
        if now + ms <= now:
            self._delete(key)
            return 1
        self.expires[key] = now + ms
        return 1

    def cmd_persist(self, args: list[str]) -> int:
        return int(self._alive(args[0]) and self.expires.pop(args[0], None) is not None)

    def cmd_keys(self, args: list[str]) -> list[str]:
        return sorted(k for k in self.live_keys() if fnmatch.fnmatchcase(k, args[0]))

    def cmd_dbsize(self, args: list[str]) -> int:
        return len(self.live_keys())

    def cmd_flushall(self, args: list[str]) -> Any:
        self.data.clear()
        self.expires.clear()
        return Status("OK")

    cmd_flushdb = cmd_flushall

    def cmd_scan(self, args: list[str]) -> list[Any]:
        """One pass: cursor 0 back, every match (our keyspaces are small)."""
        match, kind = "*", None
        for i in range(1, len(args) - 1, 2):
            option = args[i].lower()
            if option == "match":
                match = args[i + 1]
            elif option == "type":
                kind = args[i + 1].lower()
        keys = [k for k in self.live_keys() if fnmatch.fnmatchcase(k, match)]
        if kind is not None:
            keys = [k for k in keys if self.cmd_type([k]) == kind]
        return ["0", sorted(keys)]

    # -- strings -----------------------------------------------------------------------

    def cmd_get(self, args: list[str]) -> Any:
        return self.get_value(args[0], str)

    def cmd_set(self, args: list[str]) -> Any:
        key, value = args[0], args[1]
        when, nx, xx, keepttl, get = None, False, False, False, False
        i = 2
        while i < len(args):
            option = args[i].lower()
            if option in ("px", "ex"):
                if i + 1 >= len(args):
                    raise CommandError("ERR syntax error")
                amount = _int(args[i + 1])
                ms = amount * 1000 if option == "ex" else amount
                now = self.now_ms()
                if ms <= 0 or ms > LLONG_MAX - now:
                    raise CommandError("ERR invalid expire time in 'set' command")
                when = now + ms
                i += 2
                continue
            if option == "nx":
                nx = True
            elif option == "xx":
                xx = True
            elif option == "keepttl":
                keepttl = True
            elif option == "get":  # Redis 6.2: answer the old value
                get = True
            else:
                raise CommandError("ERR syntax error")
            i += 1
        exists = self._alive(key)
        old = self.get_value(key, str) if get else None  # WRONGTYPE if not a string
        if (nx and exists) or (xx and not exists):
            return old if get else None
        self.data[key] = value
        if when is not None:
            self.expires[key] = when
        elif not keepttl:
            self.expires.pop(key, None)
        return old if get else Status("OK")

    # -- hashes ------------------------------------------------------------------------

    def _hash(self, key: str, create: bool = False) -> dict[str, str] | None:
        value = self.get_value(key, dict)
        if value is None and create:
            value = self.data[key] = {}
        return value  # type: ignore[no-any-return]

    def cmd_hset(self, args: list[str]) -> int:
        if len(args) < 3 or len(args) % 2 == 0:
            raise CommandError("ERR wrong number of arguments for 'hset' command")
        fields = self._hash(args[0], create=True)
        assert fields is not None
        added = 0
        for i in range(1, len(args), 2):
            added += args[i] not in fields
            fields[args[i]] = args[i + 1]
        return added

    def cmd_hget(self, args: list[str]) -> Any:
        fields = self._hash(args[0])
        return None if fields is None else fields.get(args[1])

    def cmd_hmget(self, args: list[str]) -> list[Any]:
        fields = self._hash(args[0]) or {}
        return [fields.get(name) for name in args[1:]]

    def cmd_hgetall(self, args: list[str]) -> list[str]:
        fields = self._hash(args[0]) or {}
        return [item for pair in fields.items() for item in pair]

    def cmd_hdel(self, args: list[str]) -> int:
        fields = self._hash(args[0])
        if fields is None:
            return 0
        removed = sum(1 for name in args[1:] if fields.pop(name, None) is not None)
        if not fields:
            self._delete(args[0])
        return removed

    def cmd_hincrby(self, args: list[str]) -> int:
        fields = self._hash(args[0], create=True)
        assert fields is not None
        current = fields.get(args[1], "0")
        try:
            number = int(current)
        except ValueError:
            raise CommandError("ERR hash value is not an integer") from None
        number += _int(args[2])
        fields[args[1]] = str(number)
        return number

    # -- lists -------------------------------------------------------------------------

    def cmd_rpush(self, args: list[str]) -> int:
        items = self.get_value(args[0], list)
        if items is None:
            items = self.data[args[0]] = []
        items.extend(args[1:])
        self.pushed.add(args[0])
        return len(items)

    def cmd_lpush(self, args: list[str]) -> int:
        items = self.get_value(args[0], list)
        if items is None:
            items = self.data[args[0]] = []
        for value in args[1:]:
            items.insert(0, value)
        self.pushed.add(args[0])
        return len(items)

    def cmd_lpop(self, args: list[str]) -> Any:
        return self.pop_first(args[0])

    def pop_first(self, key: str) -> str | None:
        items = self.get_value(key, list)
        if not items:
            return None
        value = items.pop(0)
        if not items:
            self._delete(key)
        return value  # type: ignore[no-any-return]

    def cmd_llen(self, args: list[str]) -> int:
        return len(self.get_value(args[0], list) or ())

    def cmd_lrange(self, args: list[str]) -> list[str]:
        items = self.get_value(args[0], list) or []
        return list(items[_span(len(items), args[1], args[2])])

    # -- sorted sets -------------------------------------------------------------------

    def _zset(self, key: str, create: bool = False) -> Zset | None:
        value = self.get_value(key, Zset)
        if value is None and create:
            value = self.data[key] = Zset()
        return value  # type: ignore[no-any-return]

    def cmd_zadd(self, args: list[str]) -> int:
        key, i = args[0], 1
        nx = xx = False
        while i < len(args) and args[i].lower() in ("nx", "xx"):
            nx, xx = nx or args[i].lower() == "nx", xx or args[i].lower() == "xx"
            i += 1
        pairs = args[i:]
        if not pairs or len(pairs) % 2:
            raise CommandError("ERR syntax error")
        try:
            scores = [float(pairs[j]) for j in range(0, len(pairs), 2)]
        except ValueError:
            raise CommandError("ERR value is not a valid float") from None
        zset = self._zset(key, create=True)
        assert zset is not None
        added = 0
        for score, member in zip(scores, pairs[1::2], strict=True):
            present = member in zset
            if (nx and present) or (xx and not present):
                continue
            added += not present
            zset[member] = score
        if not zset:
            self._delete(key)
        return added

    def cmd_zrem(self, args: list[str]) -> int:
        zset = self._zset(args[0])
        if zset is None:
            return 0
        removed = sum(1 for member in args[1:] if zset.pop(member, None) is not None)
        if not zset:
            self._delete(args[0])
        return removed

    def cmd_zpopmin(self, args: list[str]) -> list[str]:
        zset = self._zset(args[0])
        count = _int(args[1]) if len(args) > 1 else 1
        out: list[str] = []
        while zset and count > 0:
            member = min(zset, key=lambda m: (zset[m], m))
            out += [member, _score(zset.pop(member))]
            count -= 1
        if zset is not None and not zset:
            self._delete(args[0])
        return out

    def cmd_zcard(self, args: list[str]) -> int:
        return len(self._zset(args[0]) or ())

    def cmd_zrange(self, args: list[str]) -> list[str]:
        zset = self._zset(args[0]) or Zset()
        ordered = sorted(zset, key=lambda m: (zset[m], m))
        chosen = ordered[_span(len(ordered), args[1], args[2])]
        if len(args) > 3 and args[3].lower() == "withscores":
            return [x for m in chosen for x in (m, _score(zset[m]))]
        return chosen


#: Commands a script may not call (blocking, or about scripts themselves).
_NOT_IN_SCRIPTS = frozenset({"eval", "evalsha", "script", "blpop", "flushall", "flushdb"})
