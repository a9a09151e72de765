"""Clients of the previous release and of this one on one lock name, during an upgrade.

The previous release kept a lock as a hash with a per-name fence counter
(``{name}:fence``) and release tombstone (``{name}:released``); this one keeps one string
and one fence counter for the database. The two never both hold a name: a new client
reads an old holder's hash as held (and an operator can force-release it), an old
client's script fails (WRONGTYPE, a LockError) on a name a new client holds or released
within the tombstone's minute. Fences keep growing across the switch, both ways, since
both kinds of client take max(counter + 1, server time): this holds while the server's
clock does not step back during the upgrade (CHANGELOG, "Upgrading").

The old client is the previous release's acquire and release scripts, as they were.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import redis
from servers import wait_until

from task_locks import Lock, LockHeld, get_backend
from task_locks.backends.redis_scripts import record_fields

# The previous release's ACQUIRE (KEYS: lock hash, fence counter; ARGV: token, ttl ms,
# owner JSON, counter ttl ms) and RELEASE (KEYS: lock hash, signal, tombstone; ARGV:
# token, fence, release id, tombstone ttl ms), verbatim but for the TTL bound.
OLD_ACQUIRE = """
local held = redis.call('hmget', KEYS[1], 'token', 'fence', 'owner', 'acquired')
if held[1] and held[1] ~= ARGV[1] then
  return {redis.call('pttl', KEYS[1]), held[3], held[2], held[4]}
end
local fence = held[2]
if held[1] then
  redis.call('hset', KEYS[1], 'owner', ARGV[3], 'ttl', ARGV[2])
else
  local now = redis.call('time')
  local next_fence = tonumber(now[1]) * 1000000 + tonumber(now[2])
  local last = tonumber(redis.call('get', KEYS[2]) or '0')
  if last >= next_fence then next_fence = last + 1 end
  fence = string.format('%.0f', next_fence)
  redis.call('set', KEYS[2], fence, 'px', ARGV[4])
  redis.call('hset', KEYS[1], 'token', ARGV[1], 'fence', fence, 'owner', ARGV[3],
    'ttl', ARGV[2], 'renewals', 0,
    'acquired', string.format('%.0f', tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)))
end
redis.call('pexpire', KEYS[1], ARGV[2])
return tonumber(fence)
"""
OLD_RELEASE = """
local held = redis.call('hmget', KEYS[1], 'token', 'ttl', 'fence')
if not held[1] or (ARGV[1] ~= '' and held[1] ~= ARGV[1])
  or (ARGV[2] ~= '' and held[3] ~= ARGV[2]) then
  local tombstone = redis.call('get', KEYS[3])
  if tombstone and string.match(tombstone, '^([^:]*):') == ARGV[3] then return 2 end
  return 0
end
redis.call('del', KEYS[1])
redis.call('set', KEYS[3], ARGV[3] .. ':' .. (held[3] or '') .. ':' .. held[1], 'px', ARGV[4])
if redis.call('exists', KEYS[2]) == 0 then
  redis.call('rpush', KEYS[2], '1')
  redis.call('pexpire', KEYS[2], held[2] or 60000)
end
return 1
"""


class OldClient:
    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)

    def acquire(self, name: str, token: str) -> object:
        key = f"task_locks:{{{name}}}"
        owner = json.dumps({"host": "old-host", "pid": 1})
        return self.client.eval(OLD_ACQUIRE, 2, key, key + ":fence", token, 30_000, owner, 60_000)

    def release(self, name: str, token: str) -> object:
        key = f"task_locks:{{{name}}}"
        keys = [key, key + ":signal", key + ":released"]
        return self.client.eval(OLD_RELEASE, 3, *keys, token, "", "old-release", 60_000)


def test_an_old_holder_is_held_for_new_clients_and_its_fence_is_exceeded(redis_url: str) -> None:
    old = OldClient(redis_url)
    old_fence = old.acquire("mixed", "old-token")
    assert isinstance(old_fence, int)
    backend = get_backend(redis_url)
    with pytest.raises(LockHeld) as held:
        Lock("mixed", ttl=5, backend=backend, renew=False).acquire(timeout=0)
    assert held.value.holder is not None and held.value.holder.owner.host == "old-host"
    seen = backend.holder("mixed")
    assert seen is not None and seen.fence == old_fence and seen.token == "old-token"
    assert [h.name for h in backend.holders()] == ["mixed"]
    assert backend.release("mixed", "new-token") is False  # only an old holder's own
    assert old.release("mixed", "old-token") == 1
    with Lock("mixed", ttl=5, backend=backend, renew=False).acquire(timeout=0) as lease:
        assert lease.fence > old_fence


def test_an_old_client_never_takes_a_name_a_new_client_holds(redis_url: str) -> None:
    old = OldClient(redis_url)
    backend = get_backend(redis_url)
    lease = Lock("mixed-new", ttl=5, backend=backend, renew=False).acquire(timeout=0)
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        old.acquire("mixed-new", "old-token")
    lease.release()
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):  # the release's tombstone
        old.acquire("mixed-new", "old-token")
    redis.Redis.from_url(redis_url).delete("task_locks:{mixed-new}")  # as its expiry would
    assert old.acquire("mixed-new", "old-token") > lease.fence


def test_an_operator_on_the_new_release_frees_an_old_holder_it_saw(redis_url: str) -> None:
    old = OldClient(redis_url)
    fence = old.acquire("mixed-forced", "old-token")
    backend = get_backend(redis_url)
    assert backend.force_release("mixed-forced", fence=int(fence) + 1) is False  # not it
    assert backend.force_release("mixed-forced", fence=fence) is True
    assert backend.holder("mixed-forced") is None
    with Lock("mixed-forced", ttl=5, backend=backend, renew=False).acquire(timeout=0) as lease:
        assert lease.fence > fence


def test_the_default_hand_off_changed_under_a_running_fleet(redis_url: str) -> None:
    """Clients of the previous default (the client hand-off, ``?handoff=client`` now) and
    of this one (the server hand-off) on one name, with the keys both already use: each
    kind's waiter gets the lock after the other kind's release, with a higher fence."""
    raw = redis.Redis.from_url(redis_url)
    old = Lock("switch", ttl=2, backend=redis_url + "?handoff=client", renew=False)
    new = Lock("switch", ttl=2, backend=redis_url, renew=False)

    def waiting(lock: Lock) -> bool:
        if lock is new:  # queued in the server
            return int(raw.zcard("task_locks:{switch}:queue")) == 1
        fields = record_fields(raw.get("task_locks:{switch}"))  # counted in the record
        return fields is not None and fields["waiters"] != "0"

    for holder, waiter in ((old, new), (new, old)):
        lease = holder.acquire(timeout=0)
        got: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda w=waiter, out=got: out.update(lease=w.acquire(timeout=10))
        )
        thread.start()
        wait_until(lambda w=waiter: waiting(w), 5, "the waiter to wait")
        lease.release()
        thread.join(15)
        assert not thread.is_alive()
        assert got["lease"].fence > lease.fence
        got["lease"].release()
    raw.close()
