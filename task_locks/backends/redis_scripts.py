"""The Redis backend's Lua scripts, by name (:data:`SCRIPTS`), and how a call is shaped.

The text of every script lives here and nowhere else: :mod:`.redis` and :mod:`.redlock`
send them, and a model of Redis can import and run exactly these.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

from .base import MAX_TTL

# The longest TTL a script writes, in ms (base.MAX_TTL): checked before any write, so
# that no failure of PEXPIRE can leave a lock (or a fence counter) without expiry.
MAX_TTL_MS = int(MAX_TTL * 1000)

# KEYS[1] lock hash, KEYS[2] fence counter
# ARGV[1] token, ARGV[2] ttl ms, ARGV[3] owner JSON, ARGV[4] fence counter ttl ms
# Returns the fence (integer) when the lock is now ours: taken now, or already held by
# this token (a retried acquire), whose TTL then restarts at ARGV[2] and owner becomes
# ARGV[3], keeping its fence: the caller counts its lease from this request's send time.
# Else {holder pttl ms, owner JSON, fence, acquired ms}.
# Raises (having written nothing) when a ttl is not in 1..MAX_TTL_MS.
# fence = max(last fence + 1, server time in microseconds): increasing even when the
# counter was lost in a restart without persistence.
# Every write carries its expiry: SET ... PX for the counter (one command), and HSET then
# PEXPIRE with the TTL checked first; should PEXPIRE still fail, the hash is deleted.
ACQUIRE = """
local ttl, counter_ttl = tonumber(ARGV[2]), tonumber(ARGV[4])
if not ttl or ttl < 1 or ttl > MAX_TTL_MS or not counter_ttl or counter_ttl < 1
  or counter_ttl > MAX_TTL_MS then
  return redis.error_reply('task_locks: ttl out of range 1..MAX_TTL_MS ms')
end
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
local expired = redis.pcall('pexpire', KEYS[1], ARGV[2])
if type(expired) == 'table' and expired.err then
  redis.call('del', KEYS[1])
  return expired
end
return tonumber(fence)
""".replace("MAX_TTL_MS", str(MAX_TTL_MS))

# KEYS[i] lock hashes; ARGV[2i-1] the token and ARGV[2i] the ttl ms for KEYS[i]
# Returns a list with, for each key, 1 if its TTL was extended, 0 if the token is not ours
# (that lease is lost). Raises (having written nothing) when a ttl is not in
# 1..MAX_TTL_MS. The watchdog's batches: one command for many leases is far cheaper than
# one each; a single renew is a batch of one.
RENEW_MANY = """
for i = 1, #KEYS do
  local ttl = tonumber(ARGV[2 * i])
  if not ttl or ttl < 1 or ttl > MAX_TTL_MS then
    return redis.error_reply('task_locks: ttl out of range 1..MAX_TTL_MS ms')
  end
end
local renewed = {}
for i, key in ipairs(KEYS) do
  if redis.call('hget', key, 'token') == ARGV[2 * i - 1] then
    redis.call('pexpire', key, ARGV[2 * i])
    redis.call('hincrby', key, 'renewals', 1)
    renewed[i] = 1
  else
    renewed[i] = 0
  end
end
return renewed
""".replace("MAX_TTL_MS", str(MAX_TTL_MS))

# KEYS[1] lock hash, KEYS[2] signal list, KEYS[3] release tombstone
# ARGV[1] token, or '' to release whoever holds it (operator override)
# ARGV[2] fence, or '': then the lock is deleted only if its holder has this fence, so an
#   operator's force release cannot free a holder that came after the one they saw
# ARGV[3] this call's release id (random, one per call: a resend repeats it)
# ARGV[4] tombstone ttl ms
# Returns 1 if the lock was deleted (and one waiter signalled); 2 if this very call
# already deleted it: redis-py resent it after the first attempt's reply was lost, and
# the tombstone names its release id; 0 if not held / not ours / held under another
# fence (a new call, even for the same token or fence, never matches a tombstone).
# The delete writes the tombstone 'id:fence:token' (SET ... PX: never without expiry).
RELEASE = """
local held = redis.call('hmget', KEYS[1], 'token', 'ttl', 'fence')
if not held[1] or (ARGV[1] ~= '' and held[1] ~= ARGV[1])
  or (ARGV[2] ~= '' and held[3] ~= ARGV[2]) then
  local tombstone = redis.call('get', KEYS[3])
  if tombstone and string.match(tombstone, '^([^:]*):') == ARGV[3] then return 2 end
  return 0
end
redis.call('del', KEYS[1])
redis.call('set', KEYS[3], ARGV[3] .. ':' .. (held[3] or '') .. ':' .. held[1], 'px', ARGV[4])
if ARGV[1] == '' then
  -- An operator's release: the holder may be a hand-off waiter that has not popped its
  -- grant yet (see RELEASE_HANDOFF), whatever mode the operator's URL names.
  redis.call('del', KEYS[1] .. ':grant:' .. held[1])
end
if redis.call('exists', KEYS[2]) == 0 then
  redis.call('rpush', KEYS[2], '1')
  redis.call('pexpire', KEYS[2], held[2] or 60000)
end
return 1
"""


# -- server-side hand-off (URL option ``handoff=server``) --------------------------------
#
# Per lock, beside the three keys above (all under the same hash tag):
# - ``<lock>:queue``          zset of waiting tokens, scored by arrival (server us): FIFO
# - ``<lock>:wait:<token>``   a waiter's entry: "ttl_ms|owner JSON", expiring (PX) unless
#                             refreshed; a waiter without one is dead and is skipped
# - ``<lock>:grant:<token>``  a waiter's own list: the release pushes the new fence there
# The entry and grant keys are built in the scripts from KEYS[1]: same hash tag, same
# slot, so a cluster serves them with the lock.
#
# Shared functions, prepended to each hand-off script.
#
# Fences: ``take`` makes max(last + 1, server time in us), ``last`` being the fence of the
# holder the lock is handed from when there is one (the counter is written only by a take,
# together with the hash, so a held lock's fence is the last one handed out: no GET of
# the counter), else the counter's value.
_HANDOFF_LIB = """
local function take(key, counter, token, ttl, owner, counter_ttl, last)
  local now = redis.call('time')
  local next_fence = tonumber(now[1]) * 1000000 + tonumber(now[2])
  last = tonumber(last or redis.call('get', counter) or '0')
  if last >= next_fence then next_fence = last + 1 end
  local fence = string.format('%.0f', next_fence)
  redis.call('set', counter, fence, 'px', counter_ttl)
  redis.call('hset', key, 'token', token, 'fence', fence, 'owner', owner, 'ttl', ttl,
    'acquired', string.format('%.0f', tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)),
    'renewals', 0)
  redis.call('pexpire', key, ttl)
  return fence
end
-- Pops the queue up to its first waiter whose entry is alive, and returns it (out of the
-- queue now: the caller must grant it the lock) with its entry; dead ones are dropped
-- on the way (ZPOPMIN: one command per waiter looked at).
local function pop_live(key, queue)
  while true do
    local head = redis.call('zpopmin', queue)[1]
    if not head then return false, false end
    local entry = redis.call('get', key .. ':wait:' .. head)
    if entry then return head, entry end
  end
end
-- The lock goes to waiter ``head``, just popped (every field of the hash is written
-- anew): new fence, its TTL and owner, and the fence pushed to its grant list, which
-- lives as long as the grant's TTL. Its entry is left to expire. ``last``: the fence it
-- is handed from (nil: read the counter).
local function grant_to(key, counter, head, entry, counter_ttl, last)
  local sep = string.find(entry, '|', 1, true)
  local ttl = string.sub(entry, 1, sep - 1)
  local fence = take(key, counter, head, ttl, string.sub(entry, sep + 1), counter_ttl, last)
  local grant = key .. ':grant:' .. head
  redis.call('rpush', grant, fence)
  redis.call('pexpire', grant, ttl)
end
-- A lock its holder (fence ``last``) gives up: to the first live waiter, else deleted,
-- waking the BLPOP waiters as RELEASE does.
local function hand_on(key, counter, queue, signal, ttl, counter_ttl, last)
  local head, entry = pop_live(key, queue)
  if head then
    grant_to(key, counter, head, entry, counter_ttl, last)
    return
  end
  redis.call('del', key)
  if redis.call('exists', signal) == 0 then
    redis.call('rpush', signal, '1')
    redis.call('pexpire', signal, ttl or 60000)
  end
end
"""

# KEYS[1] lock hash, KEYS[2] fence counter, KEYS[3] queue
# ARGV[1] token, ARGV[2] ttl ms, ARGV[3] owner JSON, ARGV[4] fence counter ttl ms,
# ARGV[5] wait entry ms (0: try once, do not queue)
# Returns the fence (integer) when the lock is now ours: already held by this token (a
# grant that raced in, or a retried call: TTL restarts at ARGV[2], owner becomes ARGV[3],
# as in ACQUIRE), or free with no live waiter ahead of us. A free lock with live waiters
# ahead goes to the first of them (as a release would). Else, the lock being held, the
# caller is queued (or its entry refreshed, keeping its place) and gets
# {holder pttl ms, owner JSON, fence, acquired ms} as from ACQUIRE.
# Raises (having written nothing) when a ttl is not in 1..MAX_TTL_MS.
ENQUEUE = (
    _HANDOFF_LIB
    + """
local ttl, counter_ttl, wait = tonumber(ARGV[2]), tonumber(ARGV[4]), tonumber(ARGV[5])
if not ttl or ttl < 1 or ttl > MAX_TTL_MS or not counter_ttl or counter_ttl < 1
  or counter_ttl > MAX_TTL_MS or not wait or wait < 0 or wait > MAX_TTL_MS then
  return redis.error_reply('task_locks: ttl out of range 1..MAX_TTL_MS ms')
end
local entry = KEYS[1] .. ':wait:' .. ARGV[1]
local held = redis.call('hmget', KEYS[1], 'token', 'fence', 'owner', 'acquired')
if held[1] == ARGV[1] then
  redis.call('hset', KEYS[1], 'owner', ARGV[3], 'ttl', ARGV[2])
  redis.call('pexpire', KEYS[1], ARGV[2])
  redis.call('zrem', KEYS[3], ARGV[1])
  redis.call('del', entry, KEYS[1] .. ':grant:' .. ARGV[1])
  return tonumber(held[2])
end
if not held[1] then
  local head, waiting = pop_live(KEYS[1], KEYS[3])
  if not head or head == ARGV[1] then
    return tonumber(take(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4]))
  end
  grant_to(KEYS[1], KEYS[2], head, waiting, ARGV[4])
  held = redis.call('hmget', KEYS[1], 'token', 'fence', 'owner', 'acquired')
end
-- Not ours. A grant still in our list is stale (a force release drops the grant with
-- the lock, but one may outlive its lock's expiry by a moment): it is left to its pop,
-- which drops it, its fence being at most the holder's reported below (fences only
-- grow); a grant made after this call has a larger one (await_grant's ``above``).
if wait > 0 then
  redis.call('set', entry, ARGV[2] .. '|' .. ARGV[3], 'px', wait)
  local now = redis.call('time')
  -- NX: a refresh keeps its place in line. The queue outlives the entry just written,
  -- and a short waiter never shortens it for the others (-1: no expiry yet); extended
  -- to twice the entry's time, so the waiters' next tries seldom need to extend it.
  redis.call('zadd', KEYS[3], 'NX', tonumber(now[1]) * 1000000 + tonumber(now[2]), ARGV[1])
  if redis.call('pttl', KEYS[3]) < wait then
    redis.call('pexpire', KEYS[3], math.min(2 * wait, MAX_TTL_MS))
  end
end
return {redis.call('pttl', KEYS[1]), held[3], held[2], held[4]}
""".replace("MAX_TTL_MS", str(MAX_TTL_MS))
)

# KEYS[1] lock hash, KEYS[2] fence counter, KEYS[3] queue, KEYS[4] signal list,
# KEYS[5] release tombstone
# ARGV[1] token, or '' to release whoever holds it (operator override)
# ARGV[2] fence, or '' (as in RELEASE), ARGV[3] this call's release id, ARGV[4] tombstone
# ttl ms, ARGV[5] fence counter ttl ms
# Returns 1 if the lock was released (and handed to the first live waiter, who now holds
# it, or else deleted and a BLPOP waiter signalled); 2 if this very call already released
# it (a resend: the tombstone names its release id, as in RELEASE); 0 if not held / not
# ours / another fence. The release writes the tombstone as RELEASE does.
RELEASE_HANDOFF = (
    _HANDOFF_LIB
    + """
local held = redis.call('hmget', KEYS[1], 'token', 'ttl', 'fence')
if not held[1] or (ARGV[1] ~= '' and held[1] ~= ARGV[1])
  or (ARGV[2] ~= '' and held[3] ~= ARGV[2]) then
  local tombstone = redis.call('get', KEYS[5])
  if tombstone and string.match(tombstone, '^([^:]*):') == ARGV[3] then return 2 end
  return 0
end
redis.call('set', KEYS[5], ARGV[3] .. ':' .. (held[3] or '') .. ':' .. held[1], 'px', ARGV[4])
if ARGV[1] == '' then
  -- An operator's release may free a grant its waiter has not popped yet (paused between
  -- the try that queued it and its pop): the grant goes too, or the waiter would pop it
  -- later as the lock while someone else holds it. A holder's own release has no grant
  -- left (popped, or dropped by the ENQUEUE that found the lock its own).
  redis.call('del', KEYS[1] .. ':grant:' .. held[1])
end
hand_on(KEYS[1], KEYS[2], KEYS[3], KEYS[4], held[2], ARGV[5], held[3])
return 1
"""
)

# KEYS[1] lock hash, KEYS[2] fence counter, KEYS[3] queue, KEYS[4] signal list,
# KEYS[5] release tombstone
# ARGV[1] token, ARGV[2] fence counter ttl ms, ARGV[3] this call's release id, ARGV[4]
# tombstone ttl ms
# A waiter that gives up: leaves the queue, drops its entry and grant list, and gives
# back (token-checked) a grant that raced in, which goes on to the next live waiter; the
# give-back writes the tombstone as RELEASE does.
# Returns 1 if a grant was given back, 2 if this very call already gave it back (a
# resend), 0 if the token held nothing.
DEQUEUE = (
    _HANDOFF_LIB
    + """
redis.call('zrem', KEYS[3], ARGV[1])
redis.call('del', KEYS[1] .. ':wait:' .. ARGV[1], KEYS[1] .. ':grant:' .. ARGV[1])
local held = redis.call('hmget', KEYS[1], 'token', 'ttl', 'fence')
if held[1] ~= ARGV[1] then
  local tombstone = redis.call('get', KEYS[5])
  if tombstone and string.match(tombstone, '^([^:]*):') == ARGV[3] then return 2 end
  return 0
end
redis.call('set', KEYS[5], ARGV[3] .. ':' .. (held[3] or '') .. ':' .. held[1], 'px', ARGV[4])
hand_on(KEYS[1], KEYS[2], KEYS[3], KEYS[4], held[2], ARGV[2], held[3])
return 1
"""
)


class _Scripts:
    """Our scripts by name, with SHA1s computed once; NOSCRIPT is answered by loading them."""

    def __init__(self) -> None:
        self.source: dict[str, str] = {}
        self.sha: dict[str, str] = {}
        self.register("acquire", ACQUIRE)
        self.register("renew_many", RENEW_MANY)
        self.register("release", RELEASE)
        self.register("enqueue", ENQUEUE)
        self.register("release_handoff", RELEASE_HANDOFF)
        self.register("dequeue", DEQUEUE)

    def register(self, name: str, source: str) -> None:
        """Add a script (backends built on this one bring their own)."""
        self.source[name] = source
        self.sha[name] = hashlib.sha1(source.encode()).hexdigest()


SCRIPTS = _Scripts()

#: Script calls shaped once: ``commands(by_sha)`` gives EVALSHA commands, or EVAL ones
#: (with the source) to resend after NOSCRIPT.
Commands = Callable[[bool], list[tuple[Any, ...]]]


def script_command(which: str, by_sha: bool, args: Sequence[Any]) -> tuple[Any, ...]:
    """One script call as a raw command, for a pipeline.

    ``execute_command``, not ``pipe.evalsha()``: redis-py refuses the latter in cluster
    mode, although every key of one script call shares a slot here.
    """
    if by_sha:
        return ("EVALSHA", SCRIPTS.sha[which], *args)
    return ("EVAL", SCRIPTS.source[which], *args)
