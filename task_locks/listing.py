"""What the lock service holds, as operators read it: grouped, described, rendered.

The one listing behind every front end: ``task-locks list``/``show`` and ``manage.py
locks`` (:mod:`task_locks.verbs`) print it, the Django admin's Lock holders page
shows it. It is kept apart from the verbs so a page that only reads holders does not
import the CLI's parser, signals and subprocess handling.

:func:`group_holders` sorts ``backend.holders()`` into plain locks as they are; elections
(locks ``election:<name>``) with their leader, term and since; semaphores (slot locks
``semaphore:<name>#<i>``) as "holders / limit" with each permit listed. Each election and
each permit is still one lock. The ``*_to_dict`` helpers are ``--json``'s shape, the
``render_*`` helpers ``list``'s tables, the ``describe_*`` helpers the sentences the
front ends share.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from . import semaphore
from .backends.base import Backend
from .election import LeaderInfo, leader_info
from .semaphore import SemaphoreInfo, parse_slot
from .types import Holder, Owner

#: The kinds of lock a listing tells apart (:func:`lock_role`), in the order it shows them.
KINDS: Final = ("lock", "election", "semaphore")

# -- formatting ----------------------------------------------------------------------


def format_duration(seconds: float | None) -> str:
    """``4.2s``, ``3m05s``, ``2h03m``, ``1d04h``; ``-`` when unknown."""
    if seconds is None or math.isnan(seconds):
        return "-"
    if seconds < 0:
        return "expired"
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def format_time(epoch: float | None) -> str:
    """``2025-06-01T12:00:03Z`` (UTC, one word, so table columns stay split by spaces)."""
    if epoch is None:
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def holder_to_dict(holder: Holder) -> dict[str, Any]:
    """A JSON-ready description of one holder (never its token)."""
    owner = json.loads(holder.owner.to_json())
    return {
        "name": holder.name,
        "kind": holder.kind,
        "fence": holder.fence,
        "owner": owner,
        "holder": holder.owner.describe(),
        "acquired_at": holder.acquired_at,
        "expires_at": holder.expires_at,
        "held_for": holder.held_for,
        "expires_in": holder.expires_in,
        "renewals": holder.renewals,
    }


def backend_namespace(backend: Backend) -> str | None:
    """The prefix ``backend`` puts before every lock name (its URL's ``prefix`` option,
    else the backend's default); ``None`` for a backend without namespaces (memory)."""
    prefix = getattr(backend, "prefix", None)
    if isinstance(prefix, bytes):
        return prefix.decode(errors="replace")
    return prefix if isinstance(prefix, str) else None


def describe_backend(backend: Backend) -> str:
    """``redis://127.0.0.1:6379/0 (namespace 'task_locks:')``: where the verbs look, and on
    Redis which hand-off its waiters get (``, hand-off: server (...)``) and why.

    Without the password. One lock name is one lock only within one server and namespace,
    so every listing says which it read.
    """
    problem = getattr(backend, "problem", None)
    if isinstance(problem, str):  # django_app.conf.MisconfiguredBackend
        return f"misconfigured ({problem})"
    namespace = backend_namespace(backend)
    where = "no namespace" if namespace is None else f"namespace {namespace!r}"
    handoff = getattr(backend, "handoff_mode", None)  # Redis: which hand-off, and why
    mode = f", hand-off: {handoff}" if isinstance(handoff, str) else ""
    return f"{backend.server} ({where}){mode}"


# -- elections and semaphores among the holders ----------------------------------------


@dataclass(frozen=True, slots=True)
class Listing:
    """``backend.holders()`` as operators read it: plain locks, elections, semaphores."""

    locks: list[Holder]
    #: Each led election with the lock that proves it (sorted by election name).
    elections: list[tuple[LeaderInfo, Holder]]
    #: Each semaphore with a permit taken, its permits sorted by slot.
    semaphores: list[SemaphoreInfo]

    @property
    def count(self) -> int:
        """Locks held: each election and each permit counts as the one lock it is."""
        permits = sum(info.count for info in self.semaphores)
        return len(self.locks) + len(self.elections) + permits

    def __bool__(self) -> bool:
        return self.count > 0


def visible(holders: Iterable[Holder]) -> list[Holder]:
    """``holders`` without the library's own records (``Owner.internal``: a Celery run's
    task-id guard): the locks users took, one per run."""
    return [holder for holder in holders if not holder.owner.internal]


def group_holders(holders: Iterable[Holder]) -> Listing:
    """Sort ``holders`` into plain locks, elections and semaphores (order kept for locks).

    The library's own records (``Owner.internal``: a Celery run's task-id guard) are left
    out: an operator sees the locks users took, one row per run."""
    locks: list[Holder] = []
    elections: list[tuple[LeaderInfo, Holder]] = []
    slots: list[Holder] = []
    for holder in visible(holders):
        info = leader_info(holder)
        if info is not None:
            elections.append((info, holder))
        elif parse_slot(holder.name) is not None:
            slots.append(holder)
        else:
            locks.append(holder)
    elections.sort(key=lambda pair: pair[0].election)
    semaphores = semaphore.describe(slots)
    for group in semaphores:
        group.holders.sort(key=slot_index)  # "#2" before "#10"
    return Listing(locks, elections, semaphores)


def lock_role(holder: Holder) -> str:
    """``"election"``, ``"semaphore"`` (one permit's slot) or ``"lock"``, by the lock's name.

    The same words as :attr:`Holder.kind <task_locks.types.Holder.kind>`.
    """
    if leader_info(holder) is not None:
        return "election"
    return "lock" if parse_slot(holder.name) is None else "semaphore"


def slot_index(holder: Holder) -> int:
    """The slot a permit's lock is (``semaphore:<name>#<slot>``); -1 if not a slot lock."""
    parsed = parse_slot(holder.name)
    return -1 if parsed is None else parsed[1]


def describe_role(holder: Holder) -> str:
    """What releasing this lock means when it is an election's or a semaphore's, else ``""``."""
    info = leader_info(holder)
    if info is not None:
        return f"the leadership of election {info.election!r} ({info.identity}, term {info.term})"
    parsed = parse_slot(holder.name)
    if parsed is not None:
        limit = f" (limit {holder.owner.limit})" if holder.owner.limit else ""
        return f"permit #{parsed[1]} of semaphore {parsed[0]!r}{limit}"
    return ""


def election_to_dict(info: LeaderInfo, holder: Holder) -> dict[str, Any]:
    """An election's JSON: its lock (``name`` is ``election:<name>``) and its leader."""
    return {
        **holder_to_dict(holder),
        "kind": "election",
        "election": info.election,
        "leader": info.identity,
        "term": info.term,
        "since": info.since,
    }


def permit_to_dict(holder: Holder) -> dict[str, Any]:
    """One permit's JSON: its slot lock (``name`` is ``semaphore:<name>#<slot>``)."""
    parsed = parse_slot(holder.name)
    return {
        **holder_to_dict(holder),
        "kind": "semaphore",
        "semaphore": parsed[0] if parsed else None,
        "slot": parsed[1] if parsed else None,
        "limit": holder.owner.limit,
    }


def semaphore_to_dict(info: SemaphoreInfo) -> dict[str, Any]:
    """A semaphore's JSON: "holders / limit" and each permit in ``holders``."""
    return {
        "name": f"{semaphore.PREFIX}{info.name}",
        "kind": "semaphore",
        "semaphore": info.name,
        "limit": info.limit,
        "held": info.count,
        "summary": info.summary,
        "holders": [permit_to_dict(h) for h in info.holders],
    }


def listing_to_json(listing: Listing) -> list[dict[str, Any]]:
    """``list --json``: plain locks, then elections, then semaphores."""
    return [
        *(holder_to_dict(h) for h in listing.locks),
        *(election_to_dict(info, h) for info, h in listing.elections),
        *(semaphore_to_dict(info) for info in listing.semaphores),
    ]


def lock_to_dict(holder: Holder) -> dict[str, Any]:
    """``show --json``: one lock, with its election or semaphore fields where it has them."""
    info = leader_info(holder)
    if info is not None:
        return election_to_dict(info, holder)
    if parse_slot(holder.name) is not None:
        return permit_to_dict(holder)
    return holder_to_dict(holder)


# -- tables ------------------------------------------------------------------------------


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()
        for row in [header, *rows]
    )


#: The columns of one holder in the locks' and the semaphores' tables (:func:`_held`).
_HELD_COLUMNS = ("HOLDER", "FENCE", "HELD FOR", "EXPIRES IN")


def _held(h: Holder) -> tuple[str, str, str, str]:
    """A holder's cells under :data:`_HELD_COLUMNS`: one place, so that a lock and a
    semaphore's permit read the same way."""
    return (
        h.owner.describe(),
        str(h.fence),
        format_duration(h.held_for),
        format_duration(h.expires_in),
    )


def render_table(holders: Sequence[Holder]) -> str:
    """The plain locks: one row per lock."""
    return _table(("NAME", *_HELD_COLUMNS), [(h.name, *_held(h)) for h in holders])


def render_elections(elections: Sequence[tuple[LeaderInfo, Holder]]) -> str:
    """One row per led election: leader, term (its fencing token), since, expiry, lock."""
    header = ("ELECTION", "LEADER", "TERM", "SINCE", "LEADING FOR", "EXPIRES IN", "LOCK")
    rows = [
        (
            info.election,
            info.identity,
            str(info.term),
            format_time(info.since),
            format_duration(holder.held_for),
            format_duration(holder.expires_in),
            holder.name,
        )
        for info, holder in elections
    ]
    return _table(header, rows)


def render_semaphores(semaphores: Sequence[SemaphoreInfo]) -> str:
    """One row per permit, the semaphore and its "holders / limit" on its first row."""
    header = ("SEMAPHORE", "HOLDERS / LIMIT", "PERMIT", *_HELD_COLUMNS)
    rows = [
        ("" if index else info.name, "" if index else info.summary, h.name, *_held(h))
        for info in semaphores
        for index, h in enumerate(info.holders)
    ]
    return _table(header, rows)


def render_listing(listing: Listing) -> str:
    """``list``'s text: the plain locks' table, then elections', then semaphores'."""
    tables = []
    if listing.locks:
        tables.append(render_table(listing.locks))
    if listing.elections:
        tables.append(render_elections(listing.elections))
    if listing.semaphores:
        tables.append(render_semaphores(listing.semaphores))
    return "\n\n".join(tables)


def describe_holder(holder: Holder) -> str:
    """``command 'manage.py report' on web-1 pid 42, holding it for 3.2s (fence 7)``."""
    held = f", holding it for {format_duration(holder.held_for)}" if holder.held_for else ""
    return f"{holder.owner.describe()}{held} (fence {holder.fence})"


def changed_hands_message(now: Holder) -> str:
    """The one line for a force release refused because someone else holds the lock now."""
    return f"the lock changed hands: now held by {describe_holder(now)}; nothing released"


def holder_job(owner: Owner) -> str:
    """The job a holder runs: ``task NAME [ID]`` for a Celery task, else its command."""
    if owner.task_name or owner.task_id:
        return f"task {owner.task_name or '?'} [{owner.task_id or '?'}]"
    return owner.command or ""


def filter_holders(
    holders: Iterable[Holder], *, job: str = "", host: str = "", kind: str = ""
) -> list[Holder]:
    """The holders whose job contains ``job`` (any case), on ``host``, of ``kind``.

    An empty filter matches all; ``kind`` is one of :data:`KINDS`.
    """
    return [
        h
        for h in holders
        if (not job or job.lower() in holder_job(h.owner).lower())
        and (not host or h.owner.host == host)
        and (not kind or lock_role(h) == kind)
    ]


__all__ = [
    "KINDS",
    "Listing",
    "backend_namespace",
    "changed_hands_message",
    "describe_backend",
    "describe_holder",
    "describe_role",
    "election_to_dict",
    "filter_holders",
    "format_duration",
    "format_time",
    "group_holders",
    "holder_job",
    "holder_to_dict",
    "listing_to_json",
    "lock_role",
    "lock_to_dict",
    "permit_to_dict",
    "render_elections",
    "render_listing",
    "render_semaphores",
    "render_table",
    "semaphore_to_dict",
    "slot_index",
    "visible",
]
