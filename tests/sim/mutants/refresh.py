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
            """  if held and held.rid == release_id then return 2 end""",
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
    waiters = waiters - 1
  end""",
            """  if waiters > 0 then
    waiters = waiters - 1
  end""",
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
        (
            "task_locks/leasing.py",
            """            ttl = self._failed_ttl
            due = min(""",
            """            ttl = math.inf
            due = min(""",
        ),
        (
            "task_locks/leasing.py",
            """                for c in self._open
            )""",
            """                for c in self._open
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
""",
    [
        (
            "task_locks/backends/redis_scripts.py",
            """    if (held or head) and redis.call('del', entry_key) == 1 then
      redis.call('zrem', queue_key, token)
      redis.call('del', key .. ':grant:' .. token)
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

if STALE:
    raise SystemExit(1)
