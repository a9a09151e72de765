"""Highly available Celery beat: run ``celery beat`` on several hosts, exactly one sends.

::

    celery -A proj beat -S task_locks.celery.beat:LeaderScheduler

Every beat process is a candidate of one :class:`~task_locks.Election`. Only the leader
sends; the others wait in :meth:`LeaderScheduler.tick`, woken when the leader resigns
(a clean shutdown hands over at once) or when its lease runs out (a dead leader is
replaced within one TTL). The wrapped scheduler, Celery's ``PersistentScheduler`` by
default, keeps doing the scheduling.

**No tick is sent twice**, even across a change of leader. Before each send the leader

1. checks its lease (no round trip): a leader that may have lost the election sends
   nothing;
2. *claims the tick*: takes, once, the lock ``beat-tick:<election>:<entry>@<ms>`` and
   lets it expire on its own after the tick's period (plus one TTL). A second sender of
   the same tick (a deposed leader that woke from a pause, a new leader whose local
   schedule state is stale) finds the claim taken and sends nothing;
3. stamps the message headers ``task_locks_election``, ``task_locks_term`` (the
   leader's term, a fencing token), ``task_locks_tick`` (the tick's id) and
   ``task_locks_claim`` (the token of its claim), so a worker can refuse a message that
   may be a second send of its tick (:func:`beat_tick` reads them back). Singleton
   tasks do: before running a beat-sent message they read the election's leader (one
   round trip, only for beat messages); when the message's term is older than the
   leader's (:func:`stale_tick_term`) they read the tick's claim too, and run the
   message if the claim is still the one it was sent under: then no other send of that
   tick can exist, and a clean hand-over (a deploy restart, ``resign()``) loses nothing.
   Otherwise (the claim expired, or is another sender's) the message is refused, with
   a WARNING log naming the tick, and ends ready as a skip does: ``SUCCESS`` with a
   :class:`~task_locks.celery.StaleTick` result, or ``FAILURE`` with
   :class:`~task_locks.celery.DuplicateTask` (``skip_as="failure"``). Other tasks can
   do the same with :func:`beat_tick`, :func:`election_holder` and :func:`claim_holds`.

A tick's id is ``<entry name>@<epoch ms of the entry's next run after this one>``: every
candidate computes the same id for the same tick without sharing any state. For that,
interval schedules (``schedule=10``, ``timedelta``) run on a grid aligned to the Unix
epoch (at :00, :10, :20... for 10 s) rather than relative to when beat started; crontab
and solar schedules are on a grid already.

What a leader change costs: the ticks due between the leader's death and the takeover
(at most one TTL of them) are not sent; the new leader then sends each overdue entry
once, as Celery always does after a pause.

Settings, read from the Celery config (``app.conf``; with Django's ``CELERY`` namespace,
``CELERY_TASK_LOCKS_BEAT_TTL`` and so on) or else from the environment
(``TASK_LOCKS_BEAT_TTL``...):

- ``task_locks_beat_election``: the election's name (default ``celery-beat:<app.main>``)
- ``task_locks_beat_ttl``: seconds a dead leader keeps the election (default 10)
- ``task_locks_beat_backend``: lock backend URL (default: the task-locks default backend)
- ``task_locks_beat_scheduler``: the scheduler class to wrap, e.g.
  ``django_celery_beat.schedulers:DatabaseScheduler`` (alias ``django``); default
  ``celery.beat:PersistentScheduler``. :func:`leader_scheduler` wraps a class directly.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from celery.beat import PersistentScheduler, Scheduler
from celery.schedules import schedstate
from celery.schedules import schedule as interval_schedule
from celery.utils.imports import symbol_by_name

from .. import events
from ..backends.base import Backend
from ..config import resolve_backend
from ..election import Election, Leadership
from ..election import lock_name as election_lock_name
from ..errors import BackendUnavailable, InvalidArgument, LockError, LockHeld
from ..lock import Lock
from ..types import Holder

log = logging.getLogger("task_locks.celery.beat")

ELECTION_HEADER: Final = "task_locks_election"
TERM_HEADER: Final = "task_locks_term"
TICK_HEADER: Final = "task_locks_tick"
CLAIM_HEADER: Final = "task_locks_claim"
#: Prefix of the per-tick claim locks.
CLAIM_PREFIX: Final = "beat-tick:"
DEFAULT_TTL: Final = 10.0
#: Longest a follower blocks in one tick() before giving the beat loop a turn.
FOLLOWER_WAIT: Final = 1.0
SCHEDULER_ALIASES: Final = {
    "default": "celery.beat:PersistentScheduler",
    "persistent": "celery.beat:PersistentScheduler",
    "django": "django_celery_beat.schedulers:DatabaseScheduler",
}


def _setting(app: Any, key: str, default: Any = None) -> Any:
    value = app.conf.get(key) if app is not None else None
    if value is None:
        value = os.environ.get(key.upper())
    return default if value in (None, "") else value


def _epoch_ms(moment: datetime) -> int:
    return round(moment.timestamp() * 1000)


def _period_ms(entry_schedule: Any) -> int | None:
    """The period of a plain interval schedule, in ms (``None`` for anything else)."""
    if not isinstance(entry_schedule, interval_schedule) or entry_schedule.relative:
        return None
    period = round(entry_schedule.run_every.total_seconds() * 1000)
    return period if period >= 1 else None


@dataclass(frozen=True, slots=True)
class BeatTick:
    """What a beat-sent message says about where it came from."""

    election: str
    term: int
    tick: str
    #: Token of the tick's claim lock (``None``: sent by a version that did not say).
    claim: str | None = None


def beat_tick(request: Any) -> BeatTick | None:
    """The beat tick a task message carries (``task.request`` or its headers), if any.

    Compare its ``term`` with the election's current one (:func:`election_holder`,
    :func:`stale_tick_term`) to refuse a tick a deposed leader sent.
    """
    sources: list[Any] = [request]
    headers = request.get("headers") if isinstance(request, Mapping) else None
    headers = headers or getattr(request, "headers", None)
    if isinstance(headers, Mapping):
        sources.insert(0, headers)

    def find(key: str) -> Any:
        for source in sources:
            value = source.get(key) if isinstance(source, Mapping) else getattr(source, key, None)
            if value is not None:
                return value
        return None

    election, term, tick = find(ELECTION_HEADER), find(TERM_HEADER), find(TICK_HEADER)
    if election is None or term is None or tick is None:
        return None
    claim = find(CLAIM_HEADER)
    try:
        return BeatTick(str(election), int(term), str(tick), None if claim is None else str(claim))
    except (TypeError, ValueError):
        return None  # not a term we stamped


def beat_backend(app: Any) -> Backend:
    """The backend the beat election of ``app`` lives on (``task_locks_beat_backend``)."""
    return resolve_backend(_setting(app, "task_locks_beat_backend"))


def election_holder(app: Any, election: str) -> Holder | None:
    """The current leader's lock of ``election`` (its ``fence`` is the term): one round trip."""
    return beat_backend(app).holder(election_lock_name(election))


async def aelection_holder(app: Any, election: str) -> Holder | None:
    return await beat_backend(app).aholder(election_lock_name(election))


def claim_name(election: str, tick: str) -> str:
    """The lock that makes the send of ``tick`` unique (taken once, expires on its own)."""
    return f"{CLAIM_PREFIX}{election}:{tick}"


def _claim_matches(tick: BeatTick, claim: Holder | None) -> bool:
    return tick.claim is not None and claim is not None and claim.token == tick.claim


def claim_holds(app: Any, tick: BeatTick) -> bool:
    """``True`` if the claim ``tick`` was sent under still holds: no other send of it exists.

    A tick under an old term whose claim holds was sent by a leader that has since handed
    over (cleanly, or not): it is the only send of that tick, and may run.
    """
    if tick.claim is None:
        return False
    return _claim_matches(tick, beat_backend(app).holder(claim_name(tick.election, tick.tick)))


async def aclaim_holds(app: Any, tick: BeatTick) -> bool:
    if tick.claim is None:
        return False
    claim = await beat_backend(app).aholder(claim_name(tick.election, tick.tick))
    return _claim_matches(tick, claim)


def stale_tick_term(tick: BeatTick, leader: Holder | None) -> int | None:
    """The current term if ``tick`` was sent under an older one, else ``None``.

    No leader right now (it died, none elected yet) refuses nothing: the message may
    well come from the last leader, and the per-tick claim already kept it unique.
    """
    if leader is None or leader.fence <= tick.term:
        return None
    return leader.fence


class LeaderMixin:
    """Makes a Celery beat scheduler send only while it leads; see the module doc."""

    app: Any
    _heap: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        app = kwargs.get("app", args[0] if args else None)
        raw_ttl = _setting(app, "task_locks_beat_ttl", DEFAULT_TTL)
        try:
            ttl = float(raw_ttl)
        except (TypeError, ValueError):
            raise InvalidArgument(
                f"task_locks_beat_ttl must be a number of seconds, got {raw_ttl!r}"
            ) from None
        name = _setting(
            app,
            "task_locks_beat_election",
            f"celery-beat:{getattr(app, 'main', None) or 'default'}",
        )
        self.election = Election(
            name,
            ttl=ttl,
            backend=_setting(app, "task_locks_beat_backend"),
            identity=f"beat@{socket.gethostname()}:{os.getpid()}",
        )
        self.leadership: Leadership | None = None
        super().__init__(*args, **kwargs)

    # -- leading ---------------------------------------------------------------------

    @property
    def follower_wait(self) -> float:
        return min(self.election.ttl, FOLLOWER_WAIT)

    def _lead(self) -> bool:
        """Lead, or campaign for up to ``follower_wait`` s (woken by resignation or TTL)."""
        leadership = self.leadership
        if leadership is not None:
            if leadership.held:
                return True
            log.warning(
                "beat: lost the lead of %r (term %s); sending nothing until re-elected",
                self.election.name,
                leadership.term,
            )
            self.leadership = None
        try:
            leadership = self.election.campaign(timeout=self.follower_wait)
        except LockHeld:
            return False
        self.leadership = leadership
        self._heap = None  # rebuild from the schedule as it is now
        log.info(
            "beat: %s leads %r, term %s",
            self.election.identity,
            self.election.name,
            leadership.term,
        )
        return True

    def tick(self, *args: Any, **kwargs: Any) -> Any:
        try:
            leading = self._lead()
        except BackendUnavailable as exc:
            log.warning("beat: cannot reach the lock backend, not sending: %s", exc)
            return self.follower_wait
        if not leading:
            return 0  # the campaign itself waited; try again at once
        return super().tick(*args, **kwargs)  # type: ignore[misc]

    def close(self) -> None:
        """Flush the wrapped scheduler, then resign so another beat takes over at once."""
        try:
            super().close()  # type: ignore[misc]
        finally:
            try:
                self.election.resign()
            except LockError as exc:
                log.warning("beat: could not resign %r: %s", self.election.name, exc)
            self.leadership = None

    # -- the tick grid ---------------------------------------------------------------

    def is_due(self, entry: Any) -> Any:
        """The wrapped answer, with interval schedules moved onto the epoch grid."""
        state = super().is_due(entry)  # type: ignore[misc]
        period = _period_ms(entry.schedule)
        if period is None:
            return state
        timed = entry.schedule.is_due(entry.last_run_at)
        if not state.is_due and timed.is_due:
            return state  # refused for a reason other than time (disabled, not started...)
        now = _epoch_ms(entry.default_now())
        last = _epoch_ms(entry.schedule.maybe_make_aware(entry.last_run_at))
        due = (last // period + 1) * period
        if now < due:  # + beat's 10 ms early wake-up (Scheduler.adjust), to wake on time
            return schedstate(False, (due - now) / 1000 + 0.010)
        return schedstate(True, ((now // period + 1) * period - now) / 1000)

    def tick_id(self, entry: Any, now: datetime) -> tuple[str, float]:
        """This tick's id, and how long its claim must last (seconds)."""
        period = _period_ms(entry.schedule)
        now_ms = _epoch_ms(now)
        if period is not None:
            next_ms = (now_ms // period + 1) * period
        else:
            try:
                next_ms = 1000 * round((now + entry.schedule.remaining_estimate(now)).timestamp())
            except (NotImplementedError, AttributeError, TypeError, ValueError):
                next_ms = (now_ms // 1000 + 1) * 1000  # unknown schedule: one tick a second
        return f"{entry.name}@{next_ms}", max(next_ms - now_ms, 0) / 1000 + self.election.ttl

    # -- sending ----------------------------------------------------------------------

    def _claim(self, tick: str, ttl: float) -> str | None:
        """The token of this tick's claim, or ``None`` if another sender has it."""
        claim = Lock(
            claim_name(self.election.name, tick),
            ttl=max(ttl, 1.0),
            backend=self.election.backend,
            renew=False,
        )
        with events.context(policy=""):  # a tick already sent is routine, not a conflict
            lease = claim.try_acquire()
        if lease is None:
            return None
        lease.hand_over(f"tick {tick}, kept to its TTL")  # held by the sent message now
        return lease.token

    def apply_async(
        self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        leadership = self.leadership
        if leadership is None or not leadership.held:
            log.warning("beat: not leading %r; %s not sent", self.election.name, entry.name)
            return None
        tick, claim_ttl = self.tick_id(entry, entry.default_now())
        try:
            claimed = self._claim(tick, claim_ttl)
        except LockError as exc:
            log.error("beat: could not claim tick %s, not sent: %s", tick, exc)
            claimed = None
        if advance:
            entry = self.reserve(entry)  # type: ignore[attr-defined]
        if not claimed:
            log.info("beat: tick %s was already sent; not sending it again", tick)
            return None
        sent = object.__new__(type(entry))  # not copy.copy: ModelEntry's __reduce__ breaks
        sent.__dict__.update(vars(entry))
        sent.options = dict(entry.options or {})
        sent.options["headers"] = {
            **(sent.options.get("headers") or {}),
            ELECTION_HEADER: self.election.name,
            TERM_HEADER: leadership.term,
            TICK_HEADER: tick,
            CLAIM_HEADER: claimed,
        }
        return super().apply_async(sent, producer, False, **kwargs)  # type: ignore[misc]

    @property
    def info(self) -> str:
        wrapped = super().info  # type: ignore[misc]
        mine = f"    . leader election -> {self.election.name} (ttl {self.election.ttl:g}s)"
        return f"{wrapped}\n{mine}" if wrapped else mine


_wrapped: dict[type[Any], type[Any]] = {}


def leader_scheduler(base: type[Any] | str) -> type[Any]:
    """A leader-only version of the scheduler class ``base`` (a class or "module:Class")."""
    if isinstance(base, str):
        base = symbol_by_name(base, aliases=SCHEDULER_ALIASES)
    if not (isinstance(base, type) and issubclass(base, Scheduler)):
        raise LockError(f"{base!r} is not a Celery beat scheduler class")
    if issubclass(base, LeaderMixin):
        return base
    if base not in _wrapped:
        _wrapped[base] = type(
            f"Leader{base.__name__}", (LeaderMixin, base), {"__module__": __name__}
        )
    return _wrapped[base]


class LeaderScheduler(LeaderMixin, PersistentScheduler):  # type: ignore[misc]
    """``celery beat -S task_locks.celery.beat:LeaderScheduler``.

    Wraps ``PersistentScheduler``, or the class named by ``task_locks_beat_scheduler``.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is LeaderScheduler:
            app = kwargs.get("app", args[0] if args else None)
            named = _setting(app, "task_locks_beat_scheduler")
            if named is not None:
                base = symbol_by_name(named, aliases=SCHEDULER_ALIASES)
                if base is not PersistentScheduler:
                    # Not a LeaderScheduler, so Python will not run __init__ twice.
                    return leader_scheduler(base)(*args, **kwargs)
        return super().__new__(cls)


def __getattr__(name: str) -> Any:
    if name == "LeaderDatabaseScheduler":  # imported only by those who use it
        return leader_scheduler(SCHEDULER_ALIASES["django"])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CLAIM_HEADER",
    "CLAIM_PREFIX",
    "ELECTION_HEADER",
    "TERM_HEADER",
    "TICK_HEADER",
    "BeatTick",
    "LeaderMixin",
    "LeaderScheduler",
    "aclaim_holds",
    "aelection_holder",
    "beat_backend",
    "beat_tick",
    "claim_holds",
    "claim_name",
    "election_holder",
    "leader_scheduler",
    "stale_tick_term",
]
