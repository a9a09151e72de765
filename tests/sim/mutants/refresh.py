"""Write ``tests/sim/mutants/*.diff`` anew from the edits below (run it when production
code moved and a mutant no longer applies: ``python tests/sim/mutants/refresh.py``).

Each mutant is a list of (file hint, old text, new text): the old text is looked for in
the hinted file first, then in every module of ``task_locks`` (code moves between
modules; the snippet is what brings the bug back).
"""

from __future__ import annotations

import difflib
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[3]
OUT = pathlib.Path(__file__).resolve().parent


#: Mutants whose code moved on (reported at the end; the others are still written).
STALE: list[str] = []


class Pending(Exception):
    """The code a mutant reverts is not on this branch yet."""


def _find(hint: str, old: str, texts: dict[str, tuple[str, str]]) -> str:
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "task_locks").rglob("*.py"))
    candidates = [hint, *modules]
    for path in candidates:
        if not (ROOT / path).exists():
            continue
        current = texts[path][1] if path in texts else (ROOT / path).read_text()
        if old in current:
            return path
    raise Pending(f"no module holds {old[:60]!r}")


def mutant(
    name: str,
    why: str,
    edits: list[tuple[str, str, str]],
    pending: bool = False,
    otherwise: list[tuple[str, str, str]] | None = None,
) -> None:
    """Write ``NAME.diff``. ``pending``: the fix it reverts may not have landed yet (then
    no diff is written); otherwise a snippet not found means the mutant needs updating.
    ``otherwise``: the same bug in the code's other shape (before or after a refactor
    in flight), used when ``edits`` do not apply."""
    if otherwise is not None:
        try:
            for hint, old, _ in edits:
                _find(hint, old, {})
        except Pending:
            edits = otherwise
    texts: dict[str, tuple[str, str]] = {}
    for hint, old, new in edits:
        try:
            path = _find(hint, old, texts)
        except Pending as exc:
            if not pending:
                STALE.append(f"{name}: {exc}: update this mutant")
                print(STALE[-1])
                return
            print(f"{name}: not written, its fix is not here yet ({exc})")
            (OUT / f"{name}.diff").unlink(missing_ok=True)
            return
        original, current = texts.get(path, ((ROOT / path).read_text(),) * 2)
        texts[path] = (original, current.replace(old, new, 1))
    chunks = [
        "".join(
            difflib.unified_diff(
                original.splitlines(True), changed.splitlines(True), f"a/{path}", f"b/{path}", n=2
            )
        )
        for path, (original, changed) in sorted(texts.items())
    ]
    header = "".join(f"# {line}\n".replace("# \n", "#\n") for line in why.strip().splitlines())
    (OUT / f"{name}.diff").write_text(header + "".join(chunks))


mutant(
    "force_release_frees_a_new_holder",
    """
An operator's force release frees whoever holds the lock now, not the
holder the operator saw (the fence condition is gone from the release).
""",
    [
        (
            "task_locks/backends/redis_scripts.py",
            """  return fence == '' or held.fence == fence""",
            """  return true""",
        )
    ],
)

mutant(
    "lease_lost_only_when_a_call_returns",
    """
A lease counts as lost only when a renewal call returns; behind a lost
request or reply it says held past its local deadline (no deadline in `held`/`lost`,
no deadline watch).
""",
    [
        (
            "task_locks/lock.py",
            """        return self._set or time.monotonic() >= self._deadline""",
            """        return self._set""",
        ),
        (
            "task_locks/lock.py",
            """            and time.monotonic() < self._expires_mono
""",
            """""",
        ),
        (
            "task_locks/lock.py",
            """    def _watch(self) -> None:
        self._watched = True
        deadline_watch().add(self)
""",
            """    def _watch(self) -> None:
        self._watched = False
""",
        ),
    ],
    otherwise=[  # the lease on an injected runtime (task_locks.leasing)
        (
            "task_locks/lock.py",
            "return self._set or self._now() >= self._deadline",
            "return self._set",
        ),
        (
            "task_locks/lock.py",
            "            and self._clock.monotonic() < self._book.deadline\n",
            "",
        ),
        (
            "task_locks/lock.py",
            """    def _watch(self) -> None:
        self._watched = True
        self._runtime.watch(self)
""",
            """    def _watch(self) -> None:
        self._watched = False
""",
        ),
    ],
)

mutant(
    "retried_release_reports_not_owned",
    """
A release that redis-py resent after its first reply was lost
answers "not ours" although the first attempt freed the lock (the release id left in
the record is not looked at).
""",
    [
        (
            "task_locks/backends/redis_scripts.py",
            """    if last == release_id or before == release_id then return 2 end""",
            """""",
        )
    ],
)

mutant(
    "stale_handoff_grant_after_force_release",
    """
Hand-off hardening (CHANGELOG): after an operator force-released a lock granted to a
waiter that had not popped its grant yet, the waiter pops the stale grant as the lock
while another process holds it (the force release keeps the grant, and the pop takes
any fence).
""",
    [
        (
            "task_locks/backends/redis_scripts.py",
            """  if token == '' then redis.call('del', key .. ':grant:' .. held.token) end
end""",
            """end""",
        ),
        (
            "task_locks/backends/redis_scripts.py",
            """      if token == '' then redis.call('del', key .. ':grant:' .. held.token) end
""",
            """""",
        ),
        (
            "task_locks/backends/redis.py",
            """        if reply is None or above is None:
            return None
        fence = int(reply)
        return fence if fence > above else None""",
            """        if reply is None:
            return None
        return int(reply)""",
        ),
    ],
)

mutant(
    "lease_counts_from_the_reply",
    """
The classic mistake (distributed-lock card): a lease counted from when the acquire's
reply arrived, not from when its request left; a slow reply makes the local deadline
later than the server's expiry.
""",
    [
        (
            "task_locks/lock.py",
            """            return self.token, fence, sent_at""",
            """            return self.token, fence, now""",
        )
    ],
    otherwise=[  # the one plan before it was split by protocol
        (
            "task_locks/lock.py",
            """                    return token, result.fence, sent_at""",
            """                    return token, result.fence, now""",
        )
    ],
)

mutant(
    "renewal_counts_from_the_reply",
    """
The watchdog counting a renewal from its reply's arrival instead of its send: a slow
reply moves the local deadline past the server's expiry.
""",
    [
        (
            "task_locks/watchdog.py",
            """            if lease._renewed(sent_at):""",
            """            if lease._renewed(now):""",
        )
    ],
    otherwise=[  # the lease on an injected runtime (task_locks.leasing)
        (
            "task_locks/leasing.py",
            """            if outcome is True:
                if lease._renewed(call):""",
            """            if outcome is True:
                call.sent_at = now
                if lease._renewed(call):""",
        )
    ],
)

mutant(
    "fence_from_the_counter_only",
    """
Fences across a restart without persistence (DESIGN: fence = max(counter + 1, server
TIME)): from the counter alone, the first fence after a restart repeats an old one.
""",
    [
        (
            "task_locks/backends/redis_scripts.py",
            """  local fence = us
  last = tonumber(last or '0') or 0
  if last >= fence then fence = last + 1 end""",
            """  last = tonumber(last or '0') or 0
  local fence = last + 1""",
        )
    ],
)

mutant(
    "handoff_grant_counts_from_the_pop",
    """
Server hand-off: a grant lands any time after the try that queued the waiter was sent,
and the lease must count from that send; counted from the pop that brought it, the local
deadline is later than the server's expiry.
""",
    [
        (
            "task_locks/lock.py",
            """            fence = yield from _leaving_if_failed(a, grant, give_back=True)
""",
            """            fence = yield from _leaving_if_failed(a, grant, give_back=True)
            sent_at = a.clock.monotonic()
""",
        )
    ],
    otherwise=[  # the one plan before it was split by protocol
        (
            "task_locks/lock.py",
            """                result, granted = AcquireResult(granted), None""",
            """                result, granted = AcquireResult(granted), None
                sent_at = time.monotonic()""",
        )
    ],
)

mutant(
    "pipelined_pop_takes_its_unblocking_zero_as_a_grant",
    """
Server hand-off: a waiter's first try goes with its pop of the grant; a try that must not
wait (the lock taken, the caller unqueued, the holder's record ending before the pop)
pushes 0 to unblock that pop. Taken as a grant without the check that a grant's fence is
above the holder's, the 0 makes the waiter a second holder.
protocol: redis-handoff
""",
    [
        (
            "task_locks/backends/redis.py",
            """        granted = self._granted(popped, result.holder_fence)
        if granted is not None:
            return AcquireResult(granted)""",
            """        granted = int(popped[1]) if popped else None
        if granted is not None:
            return AcquireResult(granted)""",
        )
    ],
)

mutant(
    "release_without_token_check",
    """
The classic mistake: a release that deletes the lock whoever holds it (no token check),
so a holder whose lease ran out frees the next holder's lock.
""",
    [
        (
            "task_locks/backends/redis_scripts.py",
            """  if token ~= '' and held.token ~= token then return false end
""",
            """""",
        )
    ],
)

mutant(
    "release_wakes_no_waiter",
    """
Waiters are woken by the release (README: "Redis ... wake a waiter at the release"):
without the signal a waiter sleeps until the holder's TTL would have ended, and gives up
on a lock that has been free most of its wait (the liveness check, on fair schedules).
""",
    [
        (
            "task_locks/backends/redis_scripts.py",
            """  if waiters > 0 then
    redis.call('rpush', signal_key, '1')
    redis.call('pexpire', signal_key, signal_ttl)
    if not queue_key""",
            """  if waiters > 0 then
    if not queue_key""",
        )
    ],
)


mutant(
    "renew_longer_ttl_overtaken_by_a_renewal_in_flight",
    """
renew(ttl=LONGER) raced by a watchdog renewal of the old TTL already in flight: a granted
call drops every other open call, so the old-TTL reply processed after the extension sets
the deadline from the wrong TTL (the server saw the old one last: two holders).
""",
    [
        (
            "task_locks/leasing.py",
            """            self._open = [
                c
                for c in self._open
                if c is call or c.resolved_seq is None or c.resolved_seq > call.sent_seq
            ]""",
            """            self._open = [call]""",
        )
    ],
)

mutant(
    "failed_shorter_renew_keeps_the_old_schedule",
    """
A failed renew(ttl=SHORTER) moves the deadline earlier but the next renewal stays where
the old TTL put it (the schedule follows granted calls only): the lease is declared lost
with no renewal tried.
""",
    [
        (
            "task_locks/leasing.py",
            """            due = min(c.sent_at + c.ttl / 3 for c in self._open)""",
            """            due = min(c.sent_at + c.ttl / 3 for c in self._open if c.granted)""",
        )
    ],
    otherwise=[  # an unanswered call counts from the latest send; failed calls' TTL floor
        (  # and the one-call shortcut off: the one call may be an unanswered renewal's
            "task_locks/leasing.py",
            """            calls, ttl = self._open, self._failed_ttl
            if len(calls) == 1:""",
            """            calls, ttl = self._open, math.inf
            if not calls:""",
        ),
        (
            "task_locks/leasing.py",
            """                for c in calls
            )""",
            """                for c in calls
                if c.granted
            )""",
        ),
    ],
)

mutant(
    "slow_on_lost_runs_on_the_lane",
    """
The on_lost callback runs right where the loss is found, the renewal lane's thread or the
deadline watch included: a slow one stops the renewals of the process's other leases.
""",
    [
        (
            "task_locks/lock.py",
            """self._runtime.run_callback(self, self._call_on_lost)""",
            """self._call_on_lost()""",
        )
    ],
)

mutant(
    "handoff_release_grants_to_itself",
    """
Server hand-off: a release hands the lock on to the first live queue entry even when it
is the releasing holder's own (left from a try before it took the lock free): nobody pops
that grant, the release reports "released" and the lock stays held until its TTL. Both
halves of the fix go: a lock taken free leaves the taker's queue entry in place, and the
release's pop does not skip the releasing token (either half alone keeps the bug away).
protocol: redis-mixed
""",
    [
        (
            "task_locks/backends/redis_scripts.py",
            """    if (head or (held and held.waiters ~= '0')) and redis.call('del', entry_key) == 1 then
      redis.call('zrem', queue_key, token)
      redis.call('del', grant_key)
    end
""",
            "",
        ),
        (
            "task_locks/backends/redis_scripts.py",
            """    local head, entry = pop_live(key, queue_key, held.token)""",
            """    local head, entry = pop_live(key, queue_key)""",
        ),
    ],
)

mutant(
    "renewal_lane_waits_for_its_call",
    """
A renewal lane waits for each renewal call before it sends the next: one whose reply was
lost holds the lane for the validity left to its lease, and a lease of the same lane due
sooner (a shorter TTL, one acquired since) runs out behind it.
""",
    [
        (
            "task_locks/watchdog.py",
            """MAX_CALLS_IN_FLIGHT = 8""",
            """MAX_CALLS_IN_FLIGHT = 1""",
        )
    ],
)

mutant(
    "unanswered_renewal_counts_from_its_send",
    """
A renewal not answered since the latest send (renew() whose reply was lost, open until
its socket timeout; one granted while a later one is on its way) schedules the next one
from its own send: that time soon passes, and the lane renews back to back.
""",
    [
        (
            "task_locks/leasing.py",
            """(c.sent_at if _answered_after(c, latest) else latest.sent_at) + min(c.ttl, ttl) / 3""",
            """c.sent_at + min(c.ttl, ttl) / 3""",
        )
    ],
)

mutant(
    "timed_out_renewal_cuts_an_extension_short",
    """
A renewal that timed out with its request still on its way does not bound the later
calls' validity: its request lands after renew(ttl=LONGER) and cuts the server's expiry
back to the old TTL, while the extension's reply set the local deadline from the new one
(the long run's seed 44632: a deadline 1.8 s past the server's expiry).
""",
    [
        (
            "task_locks/leasing.py",
            """            self._failed_valid = min(self._failed_valid, call.valid)\n""",
            "",
        )
    ],
)

mutant(
    "redlock_force_release_of_a_minority_remnant",
    """
Redlock: a force release that frees only a copy left on a minority of the masters (the
holder's own release broke its majority first, or a partial release left it) reports that
it freed the holder, as if a majority had held it.
protocol: redlock
""",
    [
        (
            "task_locks/backends/redlock.py",
            """        return yes > 0 and yes + unanswered >= self.quorum""",
            """        return yes > 0""",
        )
    ],
)

mutant(
    "redlock_lease_counts_without_the_drift",
    """
Redlock: the local lease counts a whole TTL from its request (the acquire and renewal
validity keep Redlock's drift allowance, the lease does not), so with a slow client clock
or a fast master clock it says held after the masters let the key expire.
protocol: redlock
""",
    [
        (
            "task_locks/backends/redlock.py",
            """        return ttl * self.drift_factor + _DRIFT_FLOOR""",
            """        return 0.0""",
        ),
        (
            "task_locks/backends/redlock.py",
            """        validity = ttl - elapsed - self.clock_margin(ttl)""",
            """        validity = ttl - elapsed - (ttl * self.drift_factor + _DRIFT_FLOOR)""",
        ),
        (
            "task_locks/backends/redlock.py",
            """            outcomes.append(outcome(answers, index, ttl - elapsed - self.clock_margin(ttl)))""",
            """            outcomes.append(
                outcome(answers, index, ttl - elapsed - (ttl * self.drift_factor + _DRIFT_FLOOR))
            )""",
        ),
    ],
)

mutant(
    "redlock_waiter_blocks_where_the_name_hashes",
    """
Redlock: a waiter blocks on the release signal of the master its name hashes to, even
when the holder missed that master: the release signals only where it held the lock,
and the waiter sleeps until its retry while the lock is free (found by the simulator).
protocol: redlock
""",
    [
        (
            "task_locks/backends/redlock.py",
            """        holding = self._holding.get(name, frozenset())""",
            """        holding: frozenset[int] = frozenset()""",
        )
    ],
)

mutant(
    "redlock_restarted_master_votes_at_once",
    """
Redlock: a master that restarted without persistence (a new run_id) votes at once: it
forgot the locks it held, and a lock held on a bare majority that included it is granted
to a second client.
protocol: redlock
""",
    [
        (
            "task_locks/backends/redlock.py",
            """            delay = self.redlock.restart_quarantine()""",
            """            delay = 0.0""",
        )
    ],
)

mutant(
    "redlock_late_undo_takes_the_next_grant",
    """
Redlock: a master whose undo of a failed try went unanswered still votes for that token:
the undo, still on its way, lands after the next try's grant there and deletes it, and
the lease stands on fewer masters than a majority (found by the simulator).
protocol: redlock
""",
    [
        (
            "task_locks/backends/redlock.py",
            """        unsettled |= {i for i, a in enumerate(cleanup) if not isinstance(a, bool)}
""",
            "",
        )
    ],
)

mutant(
    "sql_force_release_frees_a_new_holder",
    """
django:// force release of a new holder (fixed early): force_release(name, fence)
deleted whatever row held the name, so an operator's release of the holder it saw
freed the next holder instead when the lock had changed hands meanwhile, and said
it had freed the one it saw.
protocol: sql
""",
    [
        (
            "django_app/backend.py",
            """        return self._delete(name, None, fence)""",
            """        return self._delete(name, None)""",
        )
    ],
)

mutant(
    "sql_retried_release_reports_not_owned",
    """
django:// release retried after a connection error, as an acquire is: the DELETE whose
reply was lost (or whose connection was reset after it ran) had removed the row, so
the retry finds nothing and the release answers "not ours" for a delete that did
happen. The backend never retries a release (its docstring says why); Redis had this
bug and fixed it (retried_release_reports_not_owned).
protocol: sql
""",
    [
        (
            "django_app/backend.py",
            """    def release(self, name: str, token: str) -> bool:
        return self._delete(name, token)
""",
            """    def release(self, name: str, token: str) -> bool:
        try:
            return self._delete(name, token)
        except BackendUnavailable:
            return self._delete(name, token)
""",
        )
    ],
)

mutant(
    "celery_limit_redelivery_takes_a_second_permit",
    """
Celery, limit > 1: the run check looks only at the slot being tried, not at every slot,
so a second delivery of a message still running (a visibility timeout, a broker's
duplicate) finds a free permit and runs the same task id twice at once. (Before one lock
per run: no run guard named by the key and the task id, the same bug.)
protocol: celery
""",
    [
        (
            "task_locks/semaphore.py",
            """        original holds another.\"\"\"
        return self.slot_names""",
            """        original holds another.\"\"\"
        return ()""",
        )
    ],
)

mutant(
    "celery_both_copy_takes_over_the_running_lock",
    """
Celery, lock_on="both": the run takes its publish-time lock over under that lock's own
token, so a second delivery of the running message, which carries the same token, takes
the run's lock over in turn (same token, same fence) and runs beside it. (Before one lock
per run: no run guard, the same bug.)
protocol: celery-both
""",
    [
        (
            "task_locks/_friends.py",
            """    lock._token = None
    lock._run = RunCheck(""",
            """    lock._token = token
    lock._run = RunCheck(""",
        )
    ],
)

mutant(
    "etcd_retried_acquire_revokes_its_own_write",
    """
etcd's retried acquire: a failed create revoked the fresh lease before looking whose key
it found, so a transaction retried after its lost reply, finding its own write on that
lease, deleted our key and still answered 'acquired'.
protocol: etcd
""",
    [
        (
            "task_locks/backends/etcd.py",
            """            revision = int(kv.get("create_revision", 0))
            if data.get("token") not in mine or _a_copy(data, ours, run):
                self._revoke_later(name, lease)  # never attached: the key is not ours""",
            """            revision = int(kv.get("create_revision", 0))
            self._revoke_later(name, lease)
            if data.get("token") not in mine or _a_copy(data, ours, run):""",
        )
    ],
)

mutant(
    "celery_both_hand_over_releases_then_acquires",
    """
Celery, lock_on="both": the run frees its publish-time lock, then acquires the key afresh
(the hand-over before it was one server-side step): a publish in between is accepted
beside a message that is about to run.
""",
    [
        (
            "task_locks/celery/task.py",
            """        if handed and self.lock_on == "enqueue":
            yield from self._drop_queued_lock(name, handed)
        tick = _beat_tick(request)""",
            """        if handed and self.lock_on in ("enqueue", "both"):
            yield from self._drop_queued_lock(name, handed)
        tick = _beat_tick(request)""",
        ),
        (
            "task_locks/celery/task.py",
            """        return handed if self.lock_on == "both" else None""",
            """        return None""",
        ),
    ],
)

mutant(
    "celery_redelivered_copy_refused_at_once",
    """
Celery: a redelivered message that meets its own task id on the key is refused at once
as "already running", even when the worker that ran it was killed whole: the copy is
acknowledged and the message lost.
""",
    [
        (
            "task_locks/celery/task.py",
            """            if watch and held.holder is not None and (redelivered(request) or request.retries):""",
            """            if False and watch and held.holder is not None and (redelivered(request) or request.retries):""",
        )
    ],
)

mutant(
    "celery_lost_lease_outcome_decided_at_release",
    """
Celery: whether a run lost its lock is decided when its release answers, not when its
body returns: a lock force-released after the last renewal ends the run FAILURE when its
result is stored (the release is sent at once and finds it gone) and SUCCESS when not
(the release is deferred).
""",
    [
        (
            "task_locks/celery/interrupt.py",
            """        if not self._lost_at_end:
            return result""",
            """        if not (self._lost_at_end or self.lost_known):
            return result""",
        )
    ],
)

mutant(
    "celery_both_refused_run_keeps_its_publish_lock",
    """
Celery, lock_on="both": a run refused by another holder (a PeerCheckedTask run skipped
because an old library's key is held) keeps the lock its publish took, for the whole
enqueue_ttl: every later publish of the key is dropped as a duplicate of the skipped
message.
""",
    [
        (
            "task_locks/celery/task.py",
            """        if handed and self.lock_on == "both":
            try:
                yield _DropQueued(self.resolved_lock_backend(), name, handed)""",
            """        if False:
            try:
                yield _DropQueued(self.resolved_lock_backend(), name, handed)""",
        )
    ],
)

mutant(
    "redlock_late_renewal_cuts_a_longer_one_short",
    """
Redlock: a renewal a master did not answer in time (a majority granted it) still counts
that master for a later renewal with a longer TTL; the late one lands there after it and
cuts that master's copy back, while the lease counts it (seed 3234).
protocol: redlock
""",
    [
        (
            "task_locks/backends/redlock.py",
            """        if late:
            for item in items:
                self._note_straggler(item.name, item.token, late, item.ttl_ms)""",
            """        if False:
            for item in items:
                self._note_straggler(item.name, item.token, late, item.ttl_ms)""",
        )
    ],
)

mutant(
    "record_made_anew_counts_no_waiters",
    """
Server hand-off: an acquire that makes a lock's record anew (its holder's expired) counts
no waiters while some are still queued. A later taker then trusts a tombstone counting
none and leaves its own place in line, which a release grants the lock to after it, with
nobody to pop the grant (the uncontended cycle skips that DEL only on this count).
protocol: redis-handoff
""",
    [
        (
            "task_locks/backends/redis_scripts.py",
            """  if held then return held.waiters end
  return tostring(redis.call('zcard', key .. ':queue'))""",
            """  if held then return held.waiters end
  return '0'""",
        ),
        (
            "task_locks/backends/redis_scripts.py",
            """    if head then waiters = tostring(redis.call('zcard', queue_key)) end
""",
            "",
        ),
    ],
)

mutant(
    "client_release_uncounts_a_queued_waiter",
    """
A name with waiters of both hand-offs: a release that wakes a client hand-off waiter
counts one waiter down while server hand-off waiters are still queued, so the count falls
below the queue (see record_made_anew_counts_no_waiters for what that costs).
protocol: redis-mixed
""",
    [
        (
            "task_locks/backends/redis_scripts.py",
            """    if not queue_key or redis.call('exists', queue_key) == 0 then waiters = waiters - 1 end""",
            """    waiters = waiters - 1""",
        )
    ],
)

if STALE:
    raise SystemExit(1)
