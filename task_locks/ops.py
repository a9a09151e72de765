"""The operator verbs, written once for ``task-locks`` (CLI) and ``manage.py locks``.

``list [PREFIX] [--json]``, ``show NAME``, ``release NAME --force [--yes]`` and
``run NAME [--ttl S] [--wait S] -- CMD ARGS...``. Both front ends build their parser with
:func:`add_verbs` and call :func:`run_verb`; they differ only in where the backend comes
from and in what :class:`Audit` does (the Django app writes ``LockEvent`` rows).

``list`` groups what the backend holds (:func:`group_holders`, also used by the admin):
plain locks as they are; elections (locks ``election:<name>``) with their leader, term
and since; semaphores (slot locks ``semaphore:<name>#<i>``) as "holders / limit" with
each permit listed. Each election and each permit is still one lock: ``release
election:<name> --force`` ends a term, ``release semaphore:<name>#<i> --force`` frees one
permit. ``--json`` prints one array: a plain lock or an election is one object (its
``name`` is the lock's name), a semaphore is one object with its permits in ``holders``
(each a lock object with its ``slot``).

Exit statuses follow ``sysexits.h``: 75 (``EX_TEMPFAIL``) when the lock is held by
someone else, 69 (``EX_UNAVAILABLE``) when the backend cannot be reached, 78
(``EX_CONFIG``) when it refuses the URL (password, TLS, not Redis), 1 when ``show``
finds no holder or a release is not confirmed, 3 (``EX_CHANGED_HANDS``) when ``release``
found the lock in other hands than the ones it showed (nothing is released: the backend
frees only the holder with the fence the operator saw, in one atomic step); ``run``
passes the program's own status through (128 + N when it died of signal N), except 79
(``EX_LEASE_LOST``) when it stopped the program because the lease was lost. The README
has them in one table.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any, Final, Protocol, TextIO

from . import events, semaphore
from .backends.base import Backend
from .election import LeaderInfo, leader_info
from .errors import BackendMisconfigured, BackendUnavailable, LockError, LockHeld, LockLost
from .lock import Lease, Lock
from .owner import owner_context
from .semaphore import SemaphoreInfo, parse_slot
from .types import Holder, Owner

EX_OK: Final = 0
EX_NOT_HELD: Final = 1
EX_USAGE: Final = 2
#: ``release``: the lock changed hands while the operator was asked; nothing was released.
EX_CHANGED_HANDS: Final = 3
EX_UNAVAILABLE: Final = 69
EX_TEMPFAIL: Final = 75
#: The backend answered but disagrees with its URL (password, TLS, not Redis): fix the URL.
EX_CONFIG: Final = 78
#: ``run`` stopped its program because the lease was lost (its work may overlap another
#: holder's): not 75, which means "held elsewhere, nothing ran". Past ``sysexits.h``'s
#: range, below the shell's 126/127 and the 128 + N of a signal.
EX_LEASE_LOST: Final = 79
#: Signals ``run`` forwards to its program.
FORWARDED_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
#: How long ``run`` lets its program stop after the lock was lost before killing it
#: (never past the lease's local deadline).
LOST_GRACE: Final = 10.0
#: ``run`` sends SIGTERM this long (at most; a quarter of the TTL for short TTLs) before
#: the lease's local deadline when no renewal has extended it, and SIGKILL at the deadline.
STOP_MARGIN: Final = 1.0


class Audit(Protocol):
    """Where the verbs report lock events (the Django app also writes ``LockEvent`` rows).

    ``policy`` is a conflict's (``exit``: the front end exits 75).
    """

    def __call__(
        self,
        kind: str,
        name: str,
        *,
        fence: int | None = None,
        owner: Owner | None = None,
        detail: str = "",
        policy: str = "",
    ) -> None: ...


def emit_audit(
    kind: str,
    name: str,
    *,
    fence: int | None = None,
    owner: Owner | None = None,
    detail: str = "",
    policy: str = "",
) -> None:
    """The CLI's audit: an event of the stream (:mod:`task_locks.events`), nothing stored."""
    events.emit(kind, name, fence=fence, owner=owner, detail=detail, policy=policy)


def no_audit(
    kind: str,
    name: str,
    *,
    fence: int | None = None,
    owner: Owner | None = None,
    detail: str = "",
    policy: str = "",
) -> None:
    """Report nothing (kept for callers that passed it; the verbs default to :func:`emit_audit`)."""


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
    """``redis://127.0.0.1:6379/0 (namespace 'task_locks:')``: where the verbs look.

    Without the password. One lock name is one lock only within one server and namespace,
    so every listing says which it read.
    """
    problem = getattr(backend, "problem", None)
    if isinstance(problem, str):  # django_app.conf.MisconfiguredBackend
        return f"misconfigured ({problem})"
    namespace = backend_namespace(backend)
    where = "no namespace" if namespace is None else f"namespace {namespace!r}"
    return f"{backend.server} ({where})"


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


def group_holders(holders: Iterable[Holder]) -> Listing:
    """Sort ``holders`` into plain locks, elections and semaphores (order kept for locks)."""
    locks: list[Holder] = []
    elections: list[tuple[LeaderInfo, Holder]] = []
    slots: list[Holder] = []
    for holder in holders:
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


def render_table(holders: Sequence[Holder]) -> str:
    """The plain locks: one row per lock."""
    header = ("NAME", "HOLDER", "FENCE", "HELD FOR", "EXPIRES IN")
    rows = [
        (
            h.name,
            h.owner.describe(),
            str(h.fence),
            format_duration(h.held_for),
            format_duration(h.expires_in),
        )
        for h in holders
    ]
    return _table(header, rows)


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
    header = ("SEMAPHORE", "HOLDERS / LIMIT", "PERMIT", "HOLDER", "FENCE", "HELD FOR", "EXPIRES IN")
    rows = [
        (
            "" if index else info.name,
            "" if index else info.summary,
            h.name,
            h.owner.describe(),
            str(h.fence),
            format_duration(h.held_for),
            format_duration(h.expires_in),
        )
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


def conflict_message(name: str, holder: Holder | None) -> str:
    """The one stderr line for "someone else holds it": lock, holder, how long."""
    who = describe_holder(holder) if holder is not None else "another holder"
    return f"task-locks: lock {name!r} is held by {who}; exiting with status {EX_TEMPFAIL}"


def conflict_holder(backend: Backend, error: LockHeld) -> Holder | None:
    """The holder named by ``error``, else looked up (best effort)."""
    if error.holder is not None:
        return error.holder
    try:
        return backend.holder(error.name or "")
    except LockError:
        return None


# -- the parser, shared --------------------------------------------------------------


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if math.isnan(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds: {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or math.isinf(value):  # NaN too
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0: {text!r}")
    return value


def add_verbs(parser: argparse.ArgumentParser, *, where: str = "") -> Any:
    """Add the ``list``/``show``/``release``/``run`` subcommands; returns the subparsers.

    ``where`` (:func:`describe_backend`'s line) ends every ``--help``, so the operator
    sees which server and namespace the verbs act on before running them.
    """
    epilog = f"backend: {where}" if where else None
    if epilog:
        parser.epilog = epilog
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    p = verbs.add_parser("list", help="list the live locks (a table, or --json)", epilog=epilog)
    p.add_argument("prefix", nargs="?", default="", metavar="PREFIX")
    p.add_argument("--json", action="store_true", dest="as_json", help="one JSON array")

    p = verbs.add_parser("show", help="show who holds one lock", epilog=epilog)
    p.add_argument("name", metavar="NAME")
    p.add_argument("--json", action="store_true", dest="as_json")

    p = verbs.add_parser(
        "release",
        help="operator override: free the lock from the holder it shows you",
        description="Show the holder, ask (unless --yes), then free the lock only if that "
        "same holder (its fence) still holds it. Exit status 0 when released, "
        f"{EX_NOT_HELD} when not held or not confirmed, {EX_CHANGED_HANDS} when the lock "
        "changed hands meanwhile (nothing released: look again), "
        f"{EX_UNAVAILABLE} when the backend cannot be reached.",
        epilog=epilog,
    )
    p.add_argument("name", metavar="NAME")
    p.add_argument("--force", action="store_true", help="required: says you mean it")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")

    p = verbs.add_parser(
        "run",
        help="run a program under the lock, like flock(1) for the whole cluster",
        description="Take the lock, run CMD while renewing it, release it when CMD ends, "
        f"and exit with CMD's status ({EX_TEMPFAIL} if the lock is held elsewhere, "
        f"{EX_LEASE_LOST} if the lease was lost and CMD was stopped).",
        epilog=epilog,
    )
    p.add_argument("name", metavar="NAME")
    p.add_argument("--ttl", type=_positive_seconds, default=None, help="seconds")
    p.add_argument(
        "--wait",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="wait this long for the lock (default 0: try once; inf: forever)",
    )
    # parse_args() hands it everything after "--", including the program's options.
    p.add_argument("command", nargs="*", default=[], metavar="-- CMD ARGS")
    return verbs


def accept_options_after_verb(parser: argparse.ArgumentParser, verbs: Any) -> None:
    """Let the front end's own options come after the verb too, as people type them:
    ``manage.py locks list --settings X --verbosity 0``, ``task-locks list --url URL``.

    Each verb's parser gets a copy of ``parser``'s options with no default of its own
    (``SUPPRESS``), so one given before the verb is not reset by the verb's parser.
    """
    for sub in verbs.choices.values():
        taken = set(sub._option_string_actions)
        for action in parser._actions:
            if not action.option_strings or taken & set(action.option_strings):
                continue
            if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
                continue
            shared = copy.copy(action)
            shared.default = argparse.SUPPRESS
            sub._add_action(shared)


def parse_args(
    parser: argparse.ArgumentParser,
    args: Sequence[str],
    namespace: argparse.Namespace | None = None,
    *,
    parse: Callable[..., argparse.Namespace] | None = None,
) -> argparse.Namespace:
    """Parse ``args``, giving everything after the first ``--`` to ``run``'s program.

    argparse mishandles ``--`` under subcommands, so the program is split off first.
    ``parse`` is the parser's own ``parse_args`` when a front end (``manage.py locks``)
    replaces that method with one calling this function.
    """
    args = list(args)
    program: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, program = args[:cut], args[cut + 1 :]
    options = (parse or parser.parse_args)(args, namespace)
    if program:
        if getattr(options, "verb", None) != "run":
            parser.error("only `run` takes a program after --")
        options.command = [*options.command, *program]
    return options


# -- the verbs -----------------------------------------------------------------------


def cmd_list(backend: Backend, prefix: str, as_json: bool, out: TextIO) -> int:
    listing = group_holders(backend.holders(prefix))
    if as_json:
        out.write(json.dumps(listing_to_json(listing), indent=2) + "\n")
    elif not listing:
        where = f" matching {prefix!r}" if prefix else ""
        out.write(f"no locks held{where}\n")
    else:
        out.write(render_listing(listing) + "\n")
    return EX_OK


def cmd_show(backend: Backend, name: str, as_json: bool, out: TextIO, err: TextIO) -> int:
    holder = backend.holder(name)
    if holder is None:
        err.write(f"lock {name!r} is not held\n")
        return EX_NOT_HELD
    if as_json:
        out.write(json.dumps(lock_to_dict(holder), indent=2) + "\n")
        return EX_OK
    data = holder_to_dict(holder)
    role = describe_role(holder)
    lines = [
        f"name:        {holder.name}",
        *([f"is:          {role}"] if role else []),
        f"holder:      {holder.owner.describe()}",
        f"fence:       {holder.fence}",
        f"held for:    {format_duration(holder.held_for)}",
        f"expires in:  {format_duration(holder.expires_in)}",
        f"renewals:    {holder.renewals}",
    ]
    lines += [f"  {key}: {value}" for key, value in sorted(data["owner"].items())]
    out.write("\n".join(lines) + "\n")
    return EX_OK


def ask(question: str) -> bool:
    """Ask on the terminal; ``False`` when there is no terminal to ask on."""
    if not sys.stdin or not sys.stdin.isatty():
        return False
    try:
        return input(f"{question} [y/N] ").strip().lower() in {"y", "yes"}
    except EOFError:
        return False


def cmd_release(
    backend: Backend,
    name: str,
    *,
    force: bool,
    yes: bool,
    out: TextIO,
    err: TextIO,
    audit: Audit = emit_audit,
    confirm: Callable[[str], bool] = ask,
    actor: str = "",
) -> int:
    if not force:
        err.write(
            f"release frees {name!r} whoever holds it (the holder is not told and may "
            "keep writing: guard resources with fences); pass --force to do it\n"
        )
        return EX_USAGE
    holder = backend.holder(name)
    if holder is None:
        err.write(f"lock {name!r} is not held\n")
        return EX_NOT_HELD
    role = describe_role(holder)
    what = f"{name!r} ({role})" if role else repr(name)
    if not yes and not confirm(f"Force-release {what}, held by {describe_holder(holder)}?"):
        err.write("not released (not confirmed; pass --yes to skip the question)\n")
        return EX_NOT_HELD
    by = f" by {actor}" if actor else ""
    # Only the holder the operator was shown: the lock may have changed hands while the
    # question was on screen, and the backend checks the fence in the same atomic step.
    if not backend.force_release(name, fence=holder.fence):
        return _not_released(backend, holder, err, audit, by)
    audit(
        "forced",
        name,
        fence=holder.fence,
        owner=holder.owner,
        detail=f"force-released{by}; was held by {describe_holder(holder)}",
    )
    out.write(f"released {name!r} (was held by {describe_holder(holder)})\n")
    return EX_OK


def changed_hands_message(now: Holder) -> str:
    """The one line for a force release refused because someone else holds the lock now."""
    return f"the lock changed hands: now held by {describe_holder(now)}; nothing released"


def _not_released(backend: Backend, seen: Holder, err: TextIO, audit: Audit, by: str) -> int:
    """Say why a conditional force release freed nothing, and record a refusal."""
    now = backend.holder(seen.name)
    if now is None:
        err.write(f"lock {seen.name!r} was released before we got to it; nothing released\n")
        return EX_NOT_HELD
    err.write(f"task-locks: lock {seen.name!r}: {changed_hands_message(now)}\n")
    audit(
        "conflict",
        seen.name,
        fence=now.fence,
        owner=now.owner,
        detail=f"force release{by} refused: it was for {describe_holder(seen)}, "
        f"and the lock changed hands",
    )
    return EX_CHANGED_HANDS


class _Interrupted(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _forwarding(child: list[subprocess.Popen[bytes]]) -> Iterator[None]:
    """Forward signals to the program once it runs; before that, stop waiting."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        if child and child[0].poll() is None:
            child[0].send_signal(signum)
        elif not child:
            raise _Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def cmd_run(
    backend: Backend,
    name: str,
    argv: Sequence[str],
    *,
    ttl: float | None,
    wait: float,
    err: TextIO,
    audit: Audit = emit_audit,
) -> int:
    """Hold ``name`` while ``argv`` runs; return its status (75 if the lock is held).

    The program never outlives the lease: when renewals stop getting through (the
    backend stalls, the link is cut), ``run`` sends it SIGTERM :data:`STOP_MARGIN`
    seconds (a quarter of the TTL if shorter) before the lease's local deadline and
    SIGKILL at the deadline, so it has stopped before the server can let anyone else take
    the lock. A lease found lost outright (its token gone) is handled the same way, with
    SIGKILL at the deadline or after :data:`LOST_GRACE`, whichever is sooner. Each step is
    said on stderr, and ``run`` then exits 79 (``EX_LEASE_LOST``) whatever the program's
    own status: its work may be incomplete (75 means only "held elsewhere").
    """
    argv = list(argv)
    if not argv:
        err.write("run: no command given (usage: run NAME [--ttl S] [--wait S] -- CMD ...)\n")
        return EX_USAGE
    lost = threading.Event()
    lock = Lock(
        name,
        ttl,
        backend=backend,
        timeout=None if math.isinf(wait) else wait,
        on_lost=lambda _lease: lost.set(),
    )
    child: list[subprocess.Popen[bytes]] = []
    lease: Lease | None = None
    stopped = False
    try:
        with _forwarding(child):
            try:
                # The lock reports acquired/conflict/released/lost to the event stream.
                with owner_context(command=shlex.join(argv)), events.context(
                    policy="exit", detail=f"run {shlex.join(argv)}"
                ):
                    lease = lock.acquire()
            except LockHeld as exc:
                holder = conflict_holder(backend, exc)
                err.write(conflict_message(name, holder) + "\n")
                return EX_TEMPFAIL
            try:
                child.append(subprocess.Popen(argv))
            except OSError as exc:
                err.write(f"run: cannot start {argv[0]!r}: {exc}\n")
                return 127
            status = _supervise(child[0], lease, lost, err)
            if status is None:
                return _status(child[0].returncode)
            stopped = True
            if not lease.lost.is_set():  # stopped before its deadline: not yet reported
                audit("lost", lease.name, fence=lease.fence, detail=status)
            return EX_LEASE_LOST
    except _Interrupted as stop:
        return 128 + stop.signum
    finally:
        # A program stopped for an expiring lease: the backend is not answering renewals,
        # and the lock ends by its TTL (a release would only wait for a timeout).
        if lease is not None and not stopped:
            _release(lease, err, audit)


def _stop_margin(lease: Lease) -> float:
    return min(STOP_MARGIN, lease.ttl / 4)


def _supervise(
    proc: subprocess.Popen[bytes],
    lease: Lease,
    lost: threading.Event,
    err: TextIO,
) -> str | None:
    """Wait for ``proc``; ``None`` if it ended on its own, else why ``run`` stopped it."""
    margin = _stop_margin(lease)
    while True:
        left = lease.remaining
        try:
            proc.wait(timeout=min(0.05, max(0.001, left - margin)))
            return None
        except subprocess.TimeoutExpired:
            pass
        left = lease.remaining
        if lost.is_set() or lease.lost.is_set() or left <= margin:
            return _stop(proc, lease, left, err)


def _stop(proc: subprocess.Popen[bytes], lease: Lease, left: float, err: TextIO) -> str:
    """SIGTERM now, SIGKILL at the lease's local deadline (or after LOST_GRACE)."""
    if lease.lost.is_set():
        why = f"lost lock {lease.name!r} ({lease.lost_reason})"
        left = min(left, LOST_GRACE)
    else:
        why = (
            f"lost lock {lease.name!r}: not renewed, it expires in {left:.2f}s "
            f"(fence {lease.fence})"
        )
    err.write(
        f"task-locks: {why}; stopping {proc.args!r}: SIGTERM now, SIGKILL in {left:.2f}s "
        f"at the lease's deadline; exit status {EX_LEASE_LOST}\n"
    )
    err.flush()
    proc.terminate()
    try:
        proc.wait(timeout=max(0.0, left))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        err.write(f"task-locks: {proc.args!r} did not stop by the deadline: sent SIGKILL\n")
    else:
        err.write(f"task-locks: {proc.args!r} stopped (status {proc.returncode})\n")
    return why


def _release(lease: Lease, err: TextIO, audit: Audit) -> None:
    if lease.lost.is_set():
        return
    try:
        lease.release()
    except LockLost as exc:
        err.write(f"task-locks: {exc}\n")
    except BackendUnavailable as exc:
        err.write(f"task-locks: could not release {lease.name!r} (it expires by its TTL): {exc}\n")


def run_verb(
    options: Mapping[str, Any],
    backend: Backend,
    *,
    out: TextIO,
    err: TextIO,
    audit: Audit = emit_audit,
    confirm: Callable[[str], bool] = ask,
    default_ttl: float | None = None,
    actor: str = "",
) -> int:
    """Dispatch one parsed verb; backend errors become a message and status 69."""
    verb = options["verb"]
    if verb in ("list", "show"):  # on stderr: stdout stays the table or the JSON
        err.write(f"backend: {describe_backend(backend)}\n")
    try:
        if verb == "list":
            return cmd_list(backend, options.get("prefix") or "", options["as_json"], out)
        if verb == "show":
            return cmd_show(backend, options["name"], options["as_json"], out, err)
        if verb == "release":
            return cmd_release(
                backend,
                options["name"],
                force=options["force"],
                yes=options["yes"],
                out=out,
                err=err,
                audit=audit,
                confirm=confirm,
                actor=actor,
            )
        if verb == "run":
            return cmd_run(
                backend,
                options["name"],
                options["command"],
                ttl=options.get("ttl") or default_ttl,
                wait=options.get("wait") or 0.0,
                err=err,
                audit=audit,
            )
    except BackendUnavailable as exc:
        err.write(f"task-locks: {exc}\n")
        return EX_UNAVAILABLE
    except BackendMisconfigured as exc:
        err.write(f"task-locks: {exc}\n")
        return EX_CONFIG
    except LockError as exc:
        err.write(f"task-locks: {exc}\n")
        return EX_USAGE
    raise ValueError(f"unknown verb {verb!r}")


__all__ = [
    "EX_CHANGED_HANDS",
    "EX_CONFIG",
    "EX_LEASE_LOST",
    "EX_NOT_HELD",
    "EX_OK",
    "EX_TEMPFAIL",
    "EX_UNAVAILABLE",
    "EX_USAGE",
    "Audit",
    "Listing",
    "accept_options_after_verb",
    "add_verbs",
    "ask",
    "backend_namespace",
    "changed_hands_message",
    "cmd_list",
    "cmd_release",
    "cmd_run",
    "cmd_show",
    "conflict_holder",
    "conflict_message",
    "describe_backend",
    "describe_holder",
    "describe_role",
    "election_to_dict",
    "emit_audit",
    "format_duration",
    "format_time",
    "group_holders",
    "holder_to_dict",
    "listing_to_json",
    "lock_role",
    "lock_to_dict",
    "no_audit",
    "parse_args",
    "permit_to_dict",
    "render_elections",
    "render_listing",
    "render_semaphores",
    "render_table",
    "run_verb",
    "semaphore_to_dict",
    "slot_index",
]
