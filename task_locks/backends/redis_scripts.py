"""The Redis backend's Lua scripts, by name (:data:`SCRIPTS`), and how a call is shaped.

The text of every script lives here and nowhere else: :mod:`.redis` and :mod:`.redlock`
send them, and a model of Redis can import and run exactly these. Each script is its
body with the shared functions it needs prepended (:func:`_lua`), so a rule such as the
fence's is written once; ``$``-placeholders (:class:`string.Template`) are filled in.

Keys (``<prefix>`` from the URL; ``{name}`` is the lock name as a cluster hash tag):

- ``<prefix>{name}`` the lock's **record**, one string. Held:
  ``h<token>|<fence>|<renewals>|<acquired ms>|<waiters>|<release id>|<owner JSON>``;
  released: ``r<waiters>|<release id>``, a tombstone that lives ``tombstone_ms``
  (60 s by default), so that a release redis-py resends after losing the first reply
  finds its own id and answers "released". ``<waiters>`` counts the tries refused since
  the last wake-up: a release wakes one waiter while it is above 0 (and counts it down),
  and never writes a signal when nobody waits. It is never below the number of live
  server hand-off waiters queued (a grant counts one down, a release only once the queue
  is drained or gone, a record made anew counts the queue), so a record that counts none
  tells its taker that no place in line of its own needs dropping. The release id of a held record is that
  of the release that freed the lock for this holder (its tombstone's) or handed it on
  (server hand-off), so a resend arriving after the next acquire still finds it.
- ``<prefix>fence`` the **fence counter**, one for the database, shared by every lock;
  on a cluster one per hash slot, ``<prefix>fence:{<tag>}`` with a tag of that slot
  (:func:`counter_key`, :func:`slot_tag`), so a script's keys share the lock's slot (a
  plain ``redis://`` URL that turns out to reach a cluster node switches to these at its
  first CROSSSLOT refusal). Their number does not grow with names or runs; each expires
  ``fence_ttl`` after the last acquire it served.
- ``<prefix>{name}:signal`` a list a release pushes to when someone waits; waiters
  BLPOP it. It lives ``signal_ms`` (the socket timeout: no BLPOP blocks longer).
- ``<prefix>released:<db>``, a pub/sub **channel**, not a key: an operator's release
  publishes ``<fence>|<record key>`` to it, so the holder's process (its one listener,
  :mod:`task_locks.notices`) marks that lease lost at once. Nothing is stored.
- server hand-off waiters (the default): ``<prefix>{name}:queue`` (zset of tokens by arrival),
  ``:wait:<token>`` (the waiter's entry, ``ttl|owner``, expiring unless refreshed) and
  ``:grant:<token>`` (the list its grant is pushed to; or ``0``, no grant, when the
  waiter's BLPOP went with a try after which it must not wait that long). They exist
  while someone waits.

A lock record an earlier version wrote (a hash, during a rolling upgrade) is read by
every script and never written, except by an operator's force release, which deletes it.
"""

from __future__ import annotations

import binascii
import functools
import hashlib
from collections.abc import Callable, Sequence
from string import Template
from typing import Any

from .base import MAX_TTL

#: The longest TTL a script writes, in ms (base.MAX_TTL): checked before any write.
MAX_TTL_MS = int(MAX_TTL * 1000)
#: Redis Cluster's hash slots.
SLOTS = 16384

# -- shared functions, prepended to the scripts that use them ---------------------------

_CHECKS = """
local function ttls_ok(...)
  for i = 1, select('#', ...) do
    local ttl = select(i, ...)
    if not ttl or ttl < 1 or ttl > $max_ttl_ms then return false end
  end
  return true
end
local TTL_ERROR = 'task_locks: ttl out of range 1..$max_ttl_ms ms'
"""

# A record as a table: token (nil once released), fence, renewals, acquired, waiters,
# rid (release id), owner; legacy = a hash an earlier version wrote (read, never written).
_RECORD = """
local function read_record(key)
  local raw = redis.pcall('get', key)
  if type(raw) == 'table' and raw.err then
    local old = redis.call('hmget', key, 'token', 'fence', 'owner', 'acquired', 'renewals')
    if not old[1] then return false end
    return {token = old[1], fence = old[2] or '', owner = old[3] or '',
      acquired = old[4] or '', renewals = old[5] or '0', waiters = '1', rid = '',
      legacy = true}
  end
  if not raw then return false end
  if string.sub(raw, 1, 1) == 'r' then
    local waiters, rid = string.match(raw, '^r([^|]*)|(.*)$$')
    return {waiters = waiters or '0', rid = rid or ''}
  end
  local token, fence, renewals, acquired, waiters, rid, owner =
    string.match(raw, '^h([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|(.*)$$')
  if not token then return false end
  return {token = token, fence = fence, renewals = renewals, acquired = acquired,
    waiters = waiters, rid = rid, owner = owner}
end
-- The newest release id a record names: a new holder keeps only that one (a release
-- keeps two, see with_release), so a live lock's record stays as small as it was.
local function last_release(rid)
  return string.match(rid or '', '^([^,]*)') or ''
end
-- The waiters a record taken over from ``held`` counts: a record made anew (none was
-- there, its holder's expired) counts whoever is still in the server hand-off's queue.
local function waiters_of(key, held)
  if held then return held.waiters end
  return tostring(redis.call('zcard', key .. ':queue'))
end
local function write_record(key, held, ttl)
  redis.call('set', key, 'h' .. held.token .. '|' .. held.fence .. '|' .. held.renewals
    .. '|' .. held.acquired .. '|' .. held.waiters .. '|' .. held.rid .. '|' .. held.owner,
    'px', ttl)
end
-- A try that finds the lock held: answers {pttl ms, owner, fence, acquired ms}; when the
-- caller is to wait (``counted``), it is counted in the record, so a release wakes it.
-- ``pttl``: the record's, if the caller has read it already.
local function refuse(key, held, counted, pttl)
  pttl = pttl or redis.call('pttl', key)
  if counted and not held.legacy and pttl > 0 then
    held.waiters = tostring((tonumber(held.waiters) or 0) + 1)
    write_record(key, held, pttl)
  end
  return {pttl, held.owner, held.fence, held.acquired}
end
"""

# Fences: max(counter + 1, server time in microseconds, floor + 1). The time keeps them
# increasing across a restart that lost the counter, the counter across the clock
# stepping back; ``floor`` is the fence a lock is handed on from. Every fence handed out
# raises the counter, shared by every lock of the database (slot). SET ... GET (Redis
# 6.2) reads and writes the counter in one command; older servers refuse the option,
# and the counter is read, then written.
_FENCE = """
local function next_fence(counter_key, counter_ttl, floor)
  local now = redis.call('time')
  local us = tonumber(now[1]) * 1000000 + tonumber(now[2])
  local stamp = string.format('%.0f', us)
  local last = redis.pcall('set', counter_key, stamp, 'px', counter_ttl, 'get')
  local written = true
  if type(last) == 'table' and last.err then
    last, written = redis.call('get', counter_key), false
  end
  local fence = us
  last = tonumber(last or '0') or 0
  if last >= fence then fence = last + 1 end
  if floor and floor >= fence then fence = floor + 1 end
  if fence ~= us or not written then
    stamp = string.format('%.0f', fence)
    redis.call('set', counter_key, stamp, 'px', counter_ttl)
  end
  return stamp, string.format('%.0f', tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000))
end
"""

# Releases. ``token`` '' is an operator's release of whoever holds it, and then ``fence``
# ('' or the fence seen) names the holder. A release that finds nothing of its own
# answers 2 when this very call already released (a resend: the record, tombstone or the
# next holder's, names its release id among its last two), else 0. ``bury`` leaves the
# tombstone, wakes one waiter if someone waits and, for an operator, drops a grant its
# holder has not popped yet (a hand-off waiter paused before its pop would take it later
# as the lock). A signal wakes a client hand-off waiter; while ``queue_key`` (the server
# hand-off's queue, false once drained) exists, its waiters stay counted.
_RELEASE = """
local function names_holder(held, token, fence)
  if not held or not held.token then return false end
  if token ~= '' and held.token ~= token then return false end
  return fence == '' or held.fence == fence
end
local function not_released(held, release_id)
  if held and held.rid ~= '' then
    local last, before = string.match(held.rid, '^([^,]*),?(.*)$$')
    if last == release_id or before == release_id then return 2 end
  end
  return 0
end
-- The release ids a record keeps: this release's and the one before it, so a resend of
-- either (its reply lost) still answers 2 after one more holder came and went.
local function with_release(release_id, rid)
  local last = last_release(rid)
  if last ~= '' and last ~= release_id then return release_id .. ',' .. last end
  return release_id
end
-- An operator's release tells the holder's process at once (``<fence>|<key>`` on the
-- release-notice channel, '' for none): PUBLISH stores nothing, and pcall keeps a release
-- going where an ACL forbids the channel (the holder then learns at its next renewal).
local function announce(channel, key, held, token)
  if token == '' and channel ~= '' then
    redis.pcall('publish', channel, held.fence .. '|' .. key)
  end
end
local function bury(key, signal_key, held, token, release_id, tombstone_ttl, signal_ttl,
    queue_key)
  local waiters = tonumber(held.waiters) or 0
  if waiters > 0 then
    redis.call('rpush', signal_key, '1')
    redis.call('pexpire', signal_key, signal_ttl)
    if not queue_key or redis.call('exists', queue_key) == 0 then waiters = waiters - 1 end
  end
  redis.call('set', key, 'r' .. waiters .. '|' .. with_release(release_id, held.rid),
    'px', tombstone_ttl)
  if token == '' then redis.call('del', key .. ':grant:' .. held.token) end
end
"""

# The server hand-off's queue. ``pop_live`` pops up to the first waiter whose entry is
# alive and returns it (out of the queue now: the caller grants it the lock) with its
# entry; dead ones are dropped on the way, and so is ``skip`` (the releasing holder: a
# grant to itself would be popped by nobody, the lock held until its TTL). ``grant``
# gives the lock to that waiter: a new fence, its TTL and owner, and the fence pushed to
# its grant list, which lives as long as the grant. ``hand_on``: a lock its holder gives up goes to the first live
# waiter, when someone waits, else is released as by RELEASE.
_HANDOFF = """
local function pop_live(key, queue_key, skip)
  while true do
    local head = redis.call('zpopmin', queue_key)[1]
    if not head then return false, false end
    local entry = redis.call('get', key .. ':wait:' .. head)
    if entry and head ~= skip then return head, entry end
  end
end
local function grant(key, counter_key, counter_ttl, head, entry, floor, waiters, rid)
  local sep = string.find(entry, '|', 1, true)
  local ttl = string.sub(entry, 1, sep - 1)
  local fence, now_ms = next_fence(counter_key, counter_ttl, floor)
  write_record(key, {token = head, fence = fence, renewals = '0', acquired = now_ms,
    waiters = waiters, rid = rid, owner = string.sub(entry, sep + 1)}, ttl)
  local grant_key = key .. ':grant:' .. head
  redis.call('rpush', grant_key, fence)
  redis.call('pexpire', grant_key, ttl)
end
"""
_HAND_ON = """
local function hand_on(key, counter_key, queue_key, signal_key, held, token, release_id,
    tombstone_ttl, counter_ttl, signal_ttl)
  local waiters = tonumber(held.waiters) or 0
  if waiters > 0 then
    local head, entry = pop_live(key, queue_key, held.token)
    if head then
      if token == '' then redis.call('del', key .. ':grant:' .. held.token) end
      -- An earlier version's record (an operator's force release) counts nobody: count
      -- the queue.
      local left = held.legacy and redis.call('zcard', queue_key) or waiters - 1
      grant(key, counter_key, counter_ttl, head, entry, tonumber(held.fence),
        tostring(left), with_release(release_id, held.rid))
      return
    end
  end
  -- The queue is drained here, or the record counts no waiter: nobody stays uncounted.
  bury(key, signal_key, held, token, release_id, tombstone_ttl, signal_ttl, false)
end
"""


def _lua(*parts: str) -> str:
    """A script: the shared functions it needs, then its body, placeholders filled."""
    return Template("".join(parts)).substitute(max_ttl_ms=MAX_TTL_MS)


# KEYS[1] - the lock's record
# KEYS[2] - the fence counter
# ARGV[1] - token
# ARGV[2] - ttl (ms)
# ARGV[3] - owner JSON
# ARGV[4] - the fence counter's ttl (ms)
# Returns the fence (integer) when the lock is now ours: taken now, or already held by
# this token (a retried acquire), whose TTL then restarts and owner is replaced, keeping
# its fence. Else {holder pttl ms, owner JSON, fence, acquired ms}, and the caller is
# counted as a waiter. Refuses (having written nothing) a ttl not in 1..MAX_TTL_MS.
ACQUIRE = _lua(
    _CHECKS,
    _RECORD,
    _FENCE,
    """
local key = KEYS[1]
local counter_key = KEYS[2]
local token = ARGV[1]
local ttl = tonumber(ARGV[2])
local owner = ARGV[3]
local counter_ttl = tonumber(ARGV[4])
if not ttls_ok(ttl, counter_ttl) then return redis.error_reply(TTL_ERROR) end
local held = read_record(key)
if held and held.token and held.token ~= token then return refuse(key, held, true) end
if held and held.token then
  held.owner = owner
  write_record(key, held, ttl)
  return tonumber(held.fence)
end
local fence, now_ms = next_fence(counter_key, counter_ttl)
write_record(key, {token = token, fence = fence, renewals = '0', acquired = now_ms,
  waiters = waiters_of(key, held), rid = held and last_release(held.rid) or '',
  owner = owner}, ttl)
return tonumber(fence)
""",
)

# KEYS[1] - the lock's record
# KEYS[2] - the fence counter
# KEYS[3..] - the records of the other names a Celery run's check looks at (the other
#   slots of a semaphore)
# ARGV[1] - token
# ARGV[2] - ttl (ms)
# ARGV[3] - owner JSON
# ARGV[4] - the fence counter's ttl (ms)
# ARGV[5] - the run's task id as its owner JSON has it: '"task_id": ' and the id as a
#   JSON string (Owner.to_json's form, old clients' too; found as plain text, no decode)
# ARGV[6] - the token of the publish-time lock the run takes over, or ''
# ARGV[7] - the token of the run's own mark among KEYS[3..], or ''
# As ACQUIRE, for a run of a task (types.RunCheck): refused, answering that holder, when
# the lock or one of KEYS[3..] is held, under another token than ARGV[1], [6] and [7], by
# an owner whose task_id is ARGV[5] (a second delivery of the message); the reply then
# has a fifth element, the index in KEYS of the key that holder holds. A lock held by
# ARGV[6] becomes ARGV[1]'s, keeping its fence.
ACQUIRE_RUN = _lua(
    _CHECKS,
    _RECORD,
    _FENCE,
    """
local key = KEYS[1]
local counter_key = KEYS[2]
local token = ARGV[1]
local ttl = tonumber(ARGV[2])
local owner = ARGV[3]
local counter_ttl = tonumber(ARGV[4])
local task_id = ARGV[5]
local take_over = ARGV[6]
local mark = ARGV[7]
if not ttls_ok(ttl, counter_ttl) then return redis.error_reply(TTL_ERROR) end
local function copy(held)
  if not held or not held.token or held.token == token or held.token == take_over
      or held.token == mark then
    return false
  end
  return string.find(held.owner, task_id, 1, true) ~= nil
end
for i = 3, #KEYS do
  local other = read_record(KEYS[i])
  if copy(other) then
    local reply = refuse(KEYS[i], other, true)
    reply[5] = i
    return reply
  end
end
local held = read_record(key)
if copy(held) then return refuse(key, held, true) end
if held and held.token and take_over ~= '' and held.token == take_over then
  held.token = token
end
if held and held.token and held.token ~= token then return refuse(key, held, true) end
if held and held.token then
  held.owner = owner
  write_record(key, held, ttl)
  return tonumber(held.fence)
end
local fence, now_ms = next_fence(counter_key, counter_ttl)
write_record(key, {token = token, fence = fence, renewals = '0', acquired = now_ms,
  waiters = waiters_of(key, held), rid = held and last_release(held.rid) or '',
  owner = owner}, ttl)
return tonumber(fence)
""",
)

# KEYS[i] - a lock's record
# ARGV[2i-1] - the token that should hold KEYS[i]
# ARGV[2i] - its new ttl (ms)
# Returns, for each key, 1 if its TTL was restarted, 0 if the token is not the holder's
# (that lease is lost). Refuses (having written nothing) a ttl not in 1..MAX_TTL_MS. The
# watchdog's batches: one call for many leases costs far less than one each.
RENEW_MANY = _lua(
    _CHECKS,
    _RECORD,
    """
for i = 1, #KEYS do
  if not ttls_ok(tonumber(ARGV[2 * i])) then return redis.error_reply(TTL_ERROR) end
end
local renewed = {}
for i, key in ipairs(KEYS) do
  local token, ttl = ARGV[2 * i - 1], ARGV[2 * i]
  local held = read_record(key)
  renewed[i] = 0
  if held and held.token == token and not held.legacy then
    held.renewals = tostring((tonumber(held.renewals) or 0) + 1)
    write_record(key, held, ttl)
    renewed[i] = 1
  end
end
return renewed
""",
)

# KEYS[1] - the lock's record
# KEYS[2] - the signal list
# KEYS[3] - the server hand-off's wait queue (a name may have waiters of both kinds)
# ARGV[1] - token, or '' to release whoever holds it (operator override)
# ARGV[2] - fence, or '': with a fence, only a holder with this fence is released, so an
#           operator's force release cannot free a holder that came after the one they saw
# ARGV[3] - this call's release id (one per call: a resend repeats it)
# ARGV[4] - the tombstone's ttl (ms)
# ARGV[5] - the signal's ttl (ms)
# ARGV[6] - the release-notice channel (an operator's release publishes to it), or ''
# Returns 1 if the lock was released; 2 if this very call already released it (redis-py
# resent it after losing the reply); 0 if not held / not ours / held under another fence.
RELEASE = _lua(
    _RECORD,
    _RELEASE,
    """
local key = KEYS[1]
local signal_key = KEYS[2]
local queue_key = KEYS[3] or false
local token = ARGV[1]
local fence = ARGV[2]
local release_id = ARGV[3]
local tombstone_ttl = ARGV[4]
local signal_ttl = ARGV[5]
local channel = ARGV[6] or ''
local held = read_record(key)
if not names_holder(held, token, fence) then return not_released(held, release_id) end
bury(key, signal_key, held, token, release_id, tombstone_ttl, signal_ttl, queue_key)
announce(channel, key, held, token)
return 1
""",
)

# -- server-side hand-off (the default; ``handoff=client`` opts out) ----------------------

# KEYS[1] - the lock's record
# KEYS[2] - the fence counter
# KEYS[3] - the wait queue
# ARGV[1] - token
# ARGV[2] - ttl (ms)
# ARGV[3] - owner JSON
# ARGV[4] - the fence counter's ttl (ms)
# ARGV[5] - how long the wait entry lives (ms; 0: try once, do not queue)
# ARGV[6] - how long (ms) the caller's BLPOP of its grant list, sent in the same request
#           after this, blocks (optional; 0 or none: no such pop). A try that leaves the
#           caller unqueued, or finds the holder's record ending before that pop would,
#           pushes '0' there, so that the pop does not block (no grant's fence is 0: its
#           pop drops it as stale); the caller then waits no longer than the holder's TTL
# Returns the fence (integer) when the lock is now ours: already held by this token (a
# grant that raced in, or a retried call: TTL and owner anew, as in ACQUIRE), or free with
# no live waiter ahead of us; the caller's own queue entry and any stale grant go with it
# (else its release would hand the lock to itself). A lock found free with live waiters
# ahead goes to the first of them (as a release would). Else the caller is queued (or its entry refreshed,
# keeping its place) and gets {holder pttl ms, owner JSON, fence, acquired ms}. A grant
# still in the caller's list then is stale (fences only grow: at most the holder's
# reported here), and its pop drops it. Refuses a ttl not in 1..MAX_TTL_MS.
ENQUEUE = _lua(
    _CHECKS,
    _RECORD,
    _FENCE,
    _HANDOFF,
    """
local key = KEYS[1]
local counter_key = KEYS[2]
local queue_key = KEYS[3]
local token = ARGV[1]
local ttl = tonumber(ARGV[2])
local owner = ARGV[3]
local counter_ttl = tonumber(ARGV[4])
local wait = tonumber(ARGV[5])
local pop_ms = tonumber(ARGV[6] or '0') or 0
if not ttls_ok(ttl, counter_ttl) or not wait or wait < 0 or wait > $max_ttl_ms then
  return redis.error_reply(TTL_ERROR)
end
local entry_key = key .. ':wait:' .. token
local grant_key = key .. ':grant:' .. token
-- The caller's pop, when it follows, must not block behind a try that left it unqueued.
local function unblock()
  if pop_ms > 0 then
    redis.call('rpush', grant_key, '0')
    redis.call('pexpire', grant_key, ttl)
  end
end
local held = read_record(key)
if held and held.token == token then
  held.owner = owner
  write_record(key, held, ttl)
  redis.call('zrem', queue_key, token)
  redis.call('del', entry_key, grant_key)
  unblock()
  return tonumber(held.fence)
end
if not held or not held.token then
  -- Free. Without a record (its holder expired) waiters may still be queued: the first
  -- live one comes first. A tombstone's release already found the queue empty.
  local head, entry = false, false
  if not held then head, entry = pop_live(key, queue_key) end
  if not head or head == token then
    -- Our own place in line goes with the lock, if we may have a live one: a tombstone
    -- counting no waiter means none is queued (a member whose entry expired is dropped
    -- by any pop), and a queue found empty holds none of ours. So an uncontended try
    -- pays nothing for this; one after a wait pays a DEL.
    if (head or (held and held.waiters ~= '0')) and redis.call('del', entry_key) == 1 then
      redis.call('zrem', queue_key, token)
      redis.call('del', grant_key)
    end
    unblock()
    local fence, now_ms = next_fence(counter_key, counter_ttl)
    -- A record made anew (its holder's expired) counts whoever is still queued.
    local waiters = (held and held.waiters) or '0'
    if head then waiters = tostring(redis.call('zcard', queue_key)) end
    write_record(key, {token = token, fence = fence, renewals = '0', acquired = now_ms,
      waiters = waiters, rid = held and last_release(held.rid) or '',
      owner = owner}, ttl)
    return tonumber(fence)
  end
  grant(key, counter_key, counter_ttl, head, entry, nil,
    tostring(redis.call('zcard', queue_key)), '')
  held = read_record(key)
end
local queued = false
local pttl = redis.call('pttl', key)
-- A record in its last millisecond (PTTL 0) cannot count one more waiter (it cannot be
-- written again with a TTL of 0), and an uncounted waiter would be left in line: the try
-- is not queued, and its caller tries again within a millisecond, the record gone.
if wait > 0 and pttl > 0 then
  redis.call('set', entry_key, ARGV[2] .. '|' .. owner, 'px', wait)
  local now = redis.call('time')
  -- NX: a refresh keeps its place in line. The queue outlives the entry just written,
  -- and a short waiter never shortens it for the others; extended to twice the entry's
  -- time, so the waiters' next tries seldom need to extend it.
  queued = redis.call('zadd', queue_key, 'NX', tonumber(now[1]) * 1000000 + tonumber(now[2]),
    token) == 1
  if redis.call('pttl', queue_key) < wait then
    redis.call('pexpire', queue_key, math.min(2 * wait, $max_ttl_ms))
  end
  -- A holder whose record ends before the pop would (it may have died: no release
  -- comes) is waited for by the caller's next try, up to its TTL only.
  if pttl < pop_ms then unblock() end
else
  unblock()
end
return refuse(key, held, queued, pttl)
""",
)

# KEYS[1] - the lock's record
# KEYS[2] - the fence counter
# KEYS[3] - the wait queue
# KEYS[4] - the signal list
# ARGV[1] - token, or '' to release whoever holds it (operator override)
# ARGV[2] - fence, or '' (as in RELEASE)
# ARGV[3] - this call's release id
# ARGV[4] - the tombstone's ttl (ms)
# ARGV[5] - the fence counter's ttl (ms)
# ARGV[6] - the signal's ttl (ms)
# ARGV[7] - the release-notice channel, or '' (as in RELEASE)
# Returns 1 if the lock was released (handed to the first live waiter, who now holds it,
# or else released as by RELEASE); 2 for a resend of a call that did; 0 if not held /
# not ours / another fence.
RELEASE_HANDOFF = _lua(
    _RECORD,
    _FENCE,
    _RELEASE,
    _HANDOFF,
    _HAND_ON,
    """
local key = KEYS[1]
local counter_key = KEYS[2]
local queue_key = KEYS[3]
local signal_key = KEYS[4]
local token = ARGV[1]
local fence = ARGV[2]
local release_id = ARGV[3]
local tombstone_ttl = ARGV[4]
local counter_ttl = ARGV[5]
local signal_ttl = ARGV[6]
local channel = ARGV[7] or ''
local held = read_record(key)
if not names_holder(held, token, fence) then return not_released(held, release_id) end
hand_on(key, counter_key, queue_key, signal_key, held, token, release_id, tombstone_ttl,
  counter_ttl, signal_ttl)
announce(channel, key, held, token)
return 1
""",
)

# KEYS[1] - the lock's record
# KEYS[2] - the fence counter
# KEYS[3] - the wait queue
# KEYS[4] - the signal list
# ARGV[1] - token
# ARGV[2] - the fence counter's ttl (ms)
# ARGV[3] - this call's release id
# ARGV[4] - the tombstone's ttl (ms)
# ARGV[5] - the signal's ttl (ms)
# A waiter that gives up: leaves the queue, drops its entry and grant list, and gives
# back a grant that raced in, which goes on to the next live waiter as a release would.
# Returns 1 if a grant was given back, 2 for a resend of a call that did, 0 otherwise.
DEQUEUE = _lua(
    _RECORD,
    _FENCE,
    _RELEASE,
    _HANDOFF,
    _HAND_ON,
    """
local key = KEYS[1]
local counter_key = KEYS[2]
local queue_key = KEYS[3]
local signal_key = KEYS[4]
local token = ARGV[1]
local counter_ttl = ARGV[2]
local release_id = ARGV[3]
local tombstone_ttl = ARGV[4]
local signal_ttl = ARGV[5]
redis.call('zrem', queue_key, token)
redis.call('del', key .. ':wait:' .. token, key .. ':grant:' .. token)
local held = read_record(key)
if not names_holder(held, token, '') then return not_released(held, release_id) end
hand_on(key, counter_key, queue_key, signal_key, held, token, release_id, tombstone_ttl,
  counter_ttl, signal_ttl)
return 1
""",
)

# KEYS[1] - the lock's record
# KEYS[2] - the fence counter
# ARGV[1] - token
# ARGV[2] - the fence a majority of Redlock's masters agreed on
# ARGV[3] - the fence counter's ttl (ms)
# Raises the counter to that fence (counters only grow) and records it in the lock, if
# this token holds it, so every master reports the same fence. Returns 1.
BUMP_FENCE = _lua(
    _RECORD,
    """
local key = KEYS[1]
local counter_key = KEYS[2]
local token = ARGV[1]
local fence = ARGV[2]
local counter_ttl = ARGV[3]
local last = tonumber(redis.call('get', counter_key) or '0') or 0
if last < tonumber(fence) then redis.call('set', counter_key, fence, 'px', counter_ttl) end
local held = read_record(key)
if held and held.token == token and not held.legacy then
  local pttl = redis.call('pttl', key)
  if pttl > 0 then
    held.fence = fence
    write_record(key, held, pttl)
  end
end
return 1
""",
)


class _Scripts:
    """Our scripts by name, with SHA1s computed once; NOSCRIPT is answered by loading them."""

    def __init__(self) -> None:
        self.source: dict[str, str] = {}
        self.sha: dict[str, str] = {}
        self.register("acquire", ACQUIRE)
        self.register("acquire_run", ACQUIRE_RUN)
        self.register("renew_many", RENEW_MANY)
        self.register("release", RELEASE)
        self.register("enqueue", ENQUEUE)
        self.register("release_handoff", RELEASE_HANDOFF)
        self.register("dequeue", DEQUEUE)
        self.register("bump_fence", BUMP_FENCE)

    def register(self, name: str, source: str) -> None:
        """Add a script by name."""
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


#: A held record's fields, in order (``h<token>|<fence>|...``).
RECORD_FIELDS = ("token", "fence", "renewals", "acquired", "waiters", "rid", "owner")


def record_fields(record: Any) -> dict[str, str] | None:
    """A lock record's fields as stored (bytes or text, as GET answers), or ``None``:
    released, or absent. A dict is the hash an earlier version wrote (HGETALL's)."""
    if isinstance(record, dict):
        fields = {_text(k): _text(v) for k, v in record.items()}
        return fields if fields.get("token") else None
    if not isinstance(record, bytes | str):
        return None
    text = _text(record)
    if not text.startswith("h"):
        return None
    parts = text[1:].split("|", len(RECORD_FIELDS) - 1)
    if len(parts) < len(RECORD_FIELDS):
        return None
    return dict(zip(RECORD_FIELDS, parts, strict=True))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def hash_tag(name: str) -> str:
    """``name`` as a Redis Cluster hash tag: the tag ends at the first ``}``, so a ``}``
    in a name (or an empty tag) would scatter one lock's keys over several slots.

    ``%`` and ``}`` are percent-encoded; names without them keep their plain keys.
    """
    if "%" not in name and "}" not in name:
        return name
    return name.replace("%", "%25").replace("}", "%7D")


def untag(tag: str) -> str:
    """The lock name a hash tag stands for (:func:`hash_tag` undone)."""
    if "%" not in tag:
        return tag
    return tag.replace("%7D", "}").replace("%25", "%")


def counter_key(prefix: str, name: str | None = None) -> str:
    """The fence counter serving lock ``name`` on a cluster: its hash slot's; without a
    name, the database's one counter (a server that is no cluster node)."""
    if name is None:
        return f"{prefix}fence"
    return f"{prefix}fence:{{{slot_tag(key_slot(hash_tag(name)))}}}"


def key_slot(tag: str) -> int:
    """The cluster hash slot of a key whose hash tag is ``tag`` (CRC16-XMODEM)."""
    return binascii.crc_hqx(tag.encode(), 0) % SLOTS


#: Slot tags are four characters from ``@`` (0x40) to ``_`` (0x5F): the low five bits of
#: each are free (20 bits, rank 14: every slot reachable), the rest fixed, never a brace.
_TAG_BASE = b"@@@@"


def _tag_basis() -> list[tuple[int, int] | None]:
    """CRC16 has no initial value or final xor here, so it is linear over GF(2): flipping
    a set of the tag's free bits flips the CRC by the xor of what each flip alone does.
    A basis of those effects on the slot's 14 bits (by highest bit) solves for any slot."""
    base = binascii.crc_hqx(_TAG_BASE, 0)
    basis: list[tuple[int, int] | None] = [None] * 14
    for bit in range(5 * len(_TAG_BASE)):
        flipped = bytearray(_TAG_BASE)
        flipped[bit // 5] ^= 1 << (bit % 5)
        value, combo = (binascii.crc_hqx(bytes(flipped), 0) ^ base) % SLOTS, 1 << bit
        for high in range(13, -1, -1):
            if not value >> high & 1:
                continue
            known = basis[high]
            if known is None:
                basis[high] = (value, combo)
                break
            value, combo = value ^ known[0], combo ^ known[1]
    return basis


_BASIS = _tag_basis()
_BASE_SLOT = binascii.crc_hqx(_TAG_BASE, 0) % SLOTS


@functools.lru_cache(maxsize=SLOTS)
def slot_tag(slot: int) -> str:
    """A four-character hash tag of ``slot``: the fence counter of a slot is named
    with it. Solved, not searched: microseconds, and no table to build."""
    want, combo = (slot ^ _BASE_SLOT) % SLOTS, 0
    for high in range(13, -1, -1):
        if want >> high & 1:
            value, bits = _BASIS[high]  # type: ignore[misc]  # full rank: checked in tests
            want, combo = want ^ value, combo ^ bits
    return bytes(c | (combo >> (5 * i) & 31) for i, c in enumerate(_TAG_BASE)).decode()
