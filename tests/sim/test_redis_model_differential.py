"""The simulator's Redis model against a real redis-server: same operations, same answers.

Hypothesis draws sequences of the production scripts' calls, with the argument lists the
backend itself shapes (``_acquire_args``, also with a Celery run's check for ACQUIRE_RUN, ``_enqueue_args``, ``_renew_commands``,
``_release_args``, ``_dequeue_args``; the fenced store's and Redlock's scripts too),
resends of a release (what redis-py does after a lost reply), out-of-range TTLs, plain
reads (TTL, PTTL, EXISTS, GET, HGETALL, TYPE, LRANGE, ZRANGE) and sleeps past TTLs. Each
step runs on the model and on the real server; the replies must be the same, and after
each step so must the whole keyspace (keys, types, values, TTLs).

Time. redis-server cannot run under libfaketime, so the model's clock is driven by the
real server's: before each step the model's clock is set to the server's ``TIME``. The
server then runs the step a fraction of a millisecond later than the model, so values made
from the clock are compared with a tolerance: fences and queue scores (microseconds) within
200 ms, ``acquired`` stamps (ms) within 200 ms, TTLs within 60 ms. To keep expiry itself
exact, no step runs within 30 ms of any key's expiry: the test waits the boundary out
first (both sides then agree on which keys are alive). Fence arguments a later step needs
(a force release "of the holder seen") are each side's own value, never copied across.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, example, given, reject, settings
from hypothesis import strategies as st

import task_locks.backends.redlock  # noqa: F401  (registers its bump_fence script)
from task_locks.backends.redis import RedisBackend
from task_locks.backends.redis_scripts import SCRIPTS
from task_locks.fencing import FENCED
from task_locks.types import Owner, RenewItem, RunCheck

from .redis_model import RedisModel, ReplyError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

NAMES = ["a", "b%}"]
TOKENS = ["t0", "t1", "t2"]
OWNERS = [Owner(host="h", pid=1, thread="t"), Owner(host="hö", pid=2, task_id="x|y")]
PLAIN = RedisBackend("redis://127.0.0.1:1/0?prefix=sim:&handoff=client")
HANDOFF = RedisBackend("redis://127.0.0.1:1/0?prefix=sim:&handoff=server")
FENCED_SOURCE = FENCED
GUARD_MS = 30
TTL_TOLERANCE = 60
TIME_US_TOLERANCE = 200_000
TIME_MS_TOLERANCE = 200

#: Task ids a run check looks for: a look-alike prefix of another, and one whose JSON form
#: escapes a quote, a backslash and a non-ASCII letter (matched as text by the script).
RUN_IDS = ["x|y", "x|y2", 'q"\\\u00e9']
RUN_OWNERS = [Owner(host="h", pid=3, task_id=task_id) for task_id in RUN_IDS]
#: The names a run check also looks at (a semaphore's other slot, a task id's own name).
RUN_OTHERS = ["b%}", "a#task:x|y"]
ttls = st.sampled_from([60, 150, 400, 1200])
names = st.sampled_from(NAMES)
tokens = st.sampled_from(TOKENS)

operations = st.one_of(
    st.tuples(st.just("acquire"), names, tokens, ttls, st.sampled_from([0, 1])),
    st.tuples(
        st.just("acquire_run"),
        st.sampled_from([*NAMES, RUN_OTHERS[1]]),
        tokens,
        ttls,
        st.sampled_from(range(len(RUN_OWNERS))),
        st.sampled_from(range(len(RUN_IDS))),
        st.sampled_from([(), (0,), (1,), (0, 1)]),
        st.sampled_from([None, *TOKENS]),
        st.sampled_from([None, *TOKENS]),
    ),
    st.tuples(
        st.just("enqueue"),
        names,
        tokens,
        ttls,
        st.sampled_from([0, 100, 300]),
        st.sampled_from([0, 50, 5000]),
    ),
    st.tuples(st.just("renew"), st.lists(st.tuples(names, tokens, ttls), min_size=1, max_size=3)),
    st.tuples(st.just("release"), names, tokens, st.booleans()),
    st.tuples(st.just("resend")),
    st.tuples(st.just("force"), names, st.sampled_from(["any", "seen", "wrong"]), st.booleans()),
    st.tuples(st.just("dequeue"), names, tokens),
    st.tuples(st.just("pop_grant"), names, tokens),
    st.tuples(
        st.just("fenced"), st.sampled_from([-1, 0, 1]), st.sampled_from(["set", "del", "claim"])
    ),
    st.tuples(st.just("bump"), names, tokens),
    st.tuples(st.just("bad_ttl"), names, tokens, st.sampled_from([0, -5, 10**12, "x"])),
    st.tuples(
        st.just("read"),
        st.sampled_from(["TTL", "PTTL", "EXISTS", "GET", "HGETALL", "TYPE", "LRANGE", "ZRANGE"]),
        names,
        st.sampled_from(["", ":fence", ":signal", ":released", ":queue", ":grant:t1", ":wait:t1"]),
    ),
    st.tuples(
        st.just("scan"), st.sampled_from(["sim:{*", "sim:{a}*"]), st.sampled_from(["", "hash"])
    ),
    st.tuples(st.just("sleep"), st.sampled_from([10, 70, 200, 450])),
)


class Side:
    """One of the two servers, with the fences it has shown (each side keeps its own)."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.seen: dict[str, int] = {}

    def note(self, name: str, reply: Any) -> None:
        if isinstance(reply, int) and reply > 1:
            self.seen[name] = reply
        elif isinstance(reply, list) and len(reply) in (4, 5) and reply[2]:
            self.seen[name] = int(reply[2])


def _script(which: str, args: list[Any]) -> list[Any]:
    return ["EVAL", SCRIPTS.source[which], *args]


def _commands(op: tuple[Any, ...], side: Side, last: list[Any]) -> list[list[Any]]:
    """The command(s) for ``op`` on ``side`` (fence arguments from the side's own view)."""
    kind = op[0]
    owner = OWNERS[len(str(op)) % 2]
    if kind == "acquire":
        _, name, token, ttl, which = op
        return [_script("acquire", PLAIN._acquire_args(name, token, ttl, OWNERS[which]))]
    if kind == "acquire_run":
        _, name, token, ttl, which, task, others, take_over, mark = op
        also = tuple(RUN_OTHERS[i] for i in others if RUN_OTHERS[i] != name)
        run = RunCheck(RUN_IDS[task], (name, *also), take_over=take_over, mark=mark)
        return [
            _script("acquire_run", PLAIN._acquire_args(name, token, ttl, RUN_OWNERS[which], run))
        ]
    if kind == "enqueue":
        _, name, token, ttl, wait, pop_ms = op  # pop_ms: the caller's BLPOP goes with it
        args = HANDOFF._enqueue_args(name, token, ttl, owner, wait)
        return [_script("enqueue", [*args, pop_ms] if pop_ms else args)]
    if kind == "renew":
        items = [RenewItem(n, t, ttl) for n, t, ttl in op[1]]
        chunks = PLAIN._renew_chunks(items)
        return [list(c) for c in PLAIN._renew_commands(chunks)(False)]
    if kind == "bad_ttl":
        _, name, token, ttl = op
        args = PLAIN._acquire_args(name, token, 1000, owner)
        args[4] = ttl
        return [_script("acquire", args)]
    if kind == "pop_grant":
        return [["LPOP", HANDOFF._grant_key(op[1], op[2])]]
    if kind == "read":
        _, command, name, suffix = op
        key = PLAIN._key(name) + suffix
        if command in ("LRANGE", "ZRANGE"):
            return [[command, key, 0, -1]]
        return [[command, key]]
    if kind == "scan":  # as holders() sends it; one pass covers a keyspace this small
        return [["SCAN", 0, "MATCH", op[1], "COUNT", 1000, *(["TYPE", op[2]] if op[2] else [])]]
    if kind == "fenced":
        fence = side.seen.get("a", 1) + op[1]
        return [["EVAL", FENCED_SOURCE, 1, "sim:fenced:r", str(fence), op[2], "v"]]
    if kind == "bump":
        _, name, token = op
        key = PLAIN._key(name)
        fence = side.seen.get(name, 5) + 1
        return [_script("bump_fence", [2, key, key + ":fence", token, fence, 60000])]
    raise AssertionError(op)


def _release_like(op: tuple[Any, ...], sides: tuple[Side, Side]) -> tuple[list[Any], ...]:
    """Release, force release and dequeue: one release id for both sides (a resend repeats
    it); the force release's fence is each side's own view."""
    kind = op[0]
    if kind == "release":
        _, name, token, handoff = op
        backend = HANDOFF if handoff else PLAIN
        args = backend._release_args(name, token)
        return tuple([_script(backend._release_script, list(args))] for _ in sides)
    if kind == "dequeue":
        args = HANDOFF._dequeue_args(op[1], op[2])
        return tuple([_script("dequeue", list(args))] for _ in sides)
    _, name, mode, handoff = op
    backend = HANDOFF if handoff else PLAIN
    args = backend._release_args(name, "", None)
    out = []
    for side in sides:
        mine = list(args)
        fence = None if mode == "any" else side.seen.get(name, 7) + (mode == "wrong")
        mine[mine.index("") + 1] = "" if fence is None else str(fence)
        out.append([_script(backend._release_script, mine)])
    return tuple(out)


_DIGITS = re.compile(r"(\d{11,})")


def same(a: Any, b: Any, ttl: bool = False) -> bool:
    """Equal, but for clock-made values within their tolerance (see the module docstring)."""
    if isinstance(a, ReplyError) or isinstance(b, ReplyError):
        if not (isinstance(a, ReplyError) and isinstance(b, ReplyError)):
            return False
        # Redis appends where in the script an error came from; the text before is ours.
        return a.message.split(" script:")[0] in b.message or b.message in a.message
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float | int) and isinstance(b, float | int):
        if ttl:
            return abs(a - b) <= TTL_TOLERANCE
        if min(a, b) >= 10**14:
            return abs(a - b) <= TIME_US_TOLERANCE
        if min(a, b) >= 10**11:
            return abs(a - b) <= TIME_MS_TOLERANCE
        return a == b
    if isinstance(a, str) and isinstance(b, str):
        pa, pb = _DIGITS.split(a), _DIGITS.split(b)
        if len(pa) != len(pb):
            return False
        return all(
            x == y if i % 2 == 0 else same(int(x), int(y))
            for i, (x, y) in enumerate(zip(pa, pb, strict=True))
        )
    return a == b


def _reply_same(op: tuple[Any, ...], model: Any, real: Any) -> bool:
    if (
        op[0] in ("acquire", "acquire_run", "enqueue", "bad_ttl")
        and isinstance(model, list)
        and isinstance(real, list)
        and len(model) in (4, 5)
    ):
        return same(model[0], real[0], ttl=True) and same(model[1:], real[1:])
    if op[0] == "scan":
        return str(model[0]) == str(real[0]) == "0" and sorted(model[1]) == sorted(real[1])
    if op[0] == "read" and op[1] in ("PTTL", "TTL"):
        return same(model, real, ttl=op[1] == "PTTL") or (op[1] == "TTL" and abs(model - real) <= 1)
    return same(model, real)


def _plain(reply: Any) -> Any:
    """A redis-py reply (``decode_responses``) as the model writes it."""
    if isinstance(reply, redis.ResponseError):
        return ReplyError(str(reply))
    if isinstance(reply, bool):
        return int(reply)
    if isinstance(reply, list):
        return [_plain(x) for x in reply]
    if isinstance(reply, dict):
        return [x for pair in reply.items() for x in pair]
    return reply


def real_keyspace(client: redis.Redis) -> dict[str, tuple[str, Any, int]]:
    out = {}
    for key in client.keys("*"):
        kind = client.type(key)
        if kind == "string":
            value: Any = client.get(key)
        elif kind == "hash":
            value = client.hgetall(key)
        elif kind == "list":
            value = client.lrange(key, 0, -1)
        elif kind == "zset":
            value = [(s, m) for m, s in client.zrange(key, 0, -1, withscores=True)]
        else:
            continue  # expired between KEYS and TYPE: caught by the next comparison
        out[key] = (kind, value, client.pttl(key))
    return out


def keyspaces_same(model: dict[str, Any], real: dict[str, Any]) -> bool:
    if model.keys() != real.keys():
        return False
    for key, (kind, value, pttl) in model.items():
        rkind, rvalue, rpttl = real[key]
        if kind != rkind or not same(value, rvalue):
            return False
        if (pttl < 0 or rpttl < 0) and pttl != rpttl:
            return False
        if not same(pttl, rpttl, ttl=True):
            return False
    return True


@pytest.fixture(scope="module")
def real(redis_server: Any) -> redis.Redis:
    return redis.Redis(port=redis_server.port, db=3, decode_responses=True)


def _server_us(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.filter_too_much,
    ],
)
@given(st.lists(operations, min_size=1, max_size=25))
# A run check refused by another name (its index in the reply), by a look-alike id
# (not a copy), through its take-over and mark tokens, and resent after a lost reply.
@example(
    ops=[
        ("acquire_run", "b%}", "t0", 1200, 2, 2, (), None, None),
        ("acquire_run", "a", "t1", 1200, 2, 2, (0, 1), None, None),
        ("acquire_run", "a", "t1", 1200, 1, 1, (0,), None, None),
        ("acquire_run", "a", "t2", 1200, 0, 0, (0,), "t1", "t0"),
        ("acquire_run", "a", "t2", 1200, 0, 0, (0,), "t1", "t0"),
        ("acquire_run", "a#task:x|y", "t0", 1200, 0, 0, (1,), None, None),
    ]
)
def test_model_answers_as_redis_does(real: redis.Redis, ops: list[tuple[Any, ...]]) -> None:
    real.flushdb()
    clock = [_server_us(real)]
    model = RedisModel(lambda: clock[0])
    sides = (Side(model.execute), Side(lambda args: _plain(_run_real(real, args))))
    last: tuple[list[Any], ...] | None = None
    history: list[str] = []
    for op in ops:
        if op[0] == "sleep":
            time.sleep(op[1] / 1000)
            continue
        _wait_out_boundaries(real, model, clock)
        if op[0] in ("release", "force", "dequeue"):
            commands = last = _release_like(op, sides)
        elif op[0] == "resend":
            if last is None:
                continue
            commands = last
        else:
            commands = tuple(_commands(op, side, []) for side in sides)
        replies = []
        for side, batch in zip(sides, commands, strict=True):
            replies.append([side.run(command) for command in batch])
        history.append(f"{op} -> model {replies[0]!r} / real {replies[1]!r}")
        began, clock[0] = clock[0], _server_us(real)
        for mine, theirs in zip(*replies, strict=True):
            if not _reply_same(op, mine, theirs):
                _reject_if_ambiguous(model, began, clock[0])
                raise AssertionError("\n".join(history))
        for side, batch_replies in zip(sides, replies, strict=True):
            if op[0] in ("acquire", "acquire_run", "enqueue"):
                side.note(op[1], batch_replies[0])
        model_keys, real_keys = model.snapshot(), real_keyspace(real)
        if not keyspaces_same(model_keys, real_keys):
            _reject_if_ambiguous(model, began, _server_us(real))
            raise AssertionError("\n".join(history) + f"\nmodel: {model_keys}\nreal: {real_keys}")


def _reject_if_ambiguous(model: RedisModel, began_us: int, ended_us: int) -> None:
    """A loaded machine can stretch one step past the guard: if some key's expiry fell
    within the step (the server ran it at an unknown moment inside it), the comparison
    says nothing, and Hypothesis draws another example instead."""
    low, high = began_us // 1000 - TTL_TOLERANCE, ended_us // 1000 + TTL_TOLERANCE
    if ended_us - began_us > TTL_TOLERANCE * 500 or any(
        low <= when <= high for when in model.expires.values()
    ):
        reject()


def _run_real(client: redis.Redis, args: list[Any]) -> Any:
    try:
        return client.execute_command(*args)
    except redis.ResponseError as exc:
        return exc


def _wait_out_boundaries(real: redis.Redis, model: RedisModel, clock: list[int]) -> None:
    """Set the model's clock to the server's, first waiting out any expiry within GUARD_MS."""
    while True:
        clock[0] = _server_us(real)
        now = clock[0] // 1000
        near = [when for when in model.expires.values() if abs(when - now) < GUARD_MS]
        if not near:
            return
        time.sleep((max(near) - now + GUARD_MS) / 1000)
