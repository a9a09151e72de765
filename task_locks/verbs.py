"""The operator verbs, written once for ``task-locks`` (CLI) and ``manage.py locks``.

``list [PREFIX] [--json]``, ``show NAME``, ``release NAME --force [--yes]`` and
``run NAME [--ttl S] [--wait S] -- CMD ARGS...``. Both front ends build their parser with
:func:`add_verbs` and call :func:`run_verb`; they differ only in where the backend comes
from and in what :class:`Audit` does (the Django app writes ``LockEvent`` rows).

``list`` prints :mod:`task_locks.listing` (also the admin's): plain locks as they are;
elections (locks ``election:<name>``) with their leader, term and since; semaphores (slot
locks ``semaphore:<name>#<i>``) as "holders / limit" with each permit listed. Each
election and each permit is still one lock: ``release election:<name> --force`` ends a
term, ``release semaphore:<name>#<i> --force`` frees one permit. ``--json`` prints one
array: a plain lock or an election is one object (its ``name`` is the lock's name), a
semaphore is one object with its permits in ``holders`` (each a lock object with its
``slot``). The listing itself is :mod:`task_locks.listing`'s; how ``run``
watches its program is :mod:`task_locks.supervise`'s.

Exit statuses follow ``sysexits.h``: 75 (``EX_TEMPFAIL``) when the lock is held by
someone else, 69 (``EX_UNAVAILABLE``) when the backend cannot be reached, 78
(``EX_CONFIG``) when it refuses the URL (password, TLS, not Redis), 1 when ``show``
finds no holder or a release is not confirmed, 3 (``EX_CHANGED_HANDS``) when ``release``
found the lock in other hands than the ones it showed (nothing is released: the backend
frees only the holder with the fence the operator saw, in one atomic step); ``run``
passes the program's own status through (128 + N when it died of signal N), except 79
(``EX_LEASE_LOST``) when it stopped the program because the lease was lost. docs/operations.md
has them in one table, docs/troubleshooting.md what to do about each.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shlex
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Protocol, TextIO

from . import events
from .backends.base import Backend, reported_by_caller
from .errors import BackendMisconfigured, BackendUnavailable, LockError, LockHeld
from .listing import (
    changed_hands_message,
    describe_backend,
    describe_holder,
    describe_role,
    format_duration,
    group_holders,
    holder_to_dict,
    listing_to_json,
    lock_to_dict,
    render_listing,
)
from .lock import Lease, Lock, validate_name
from .owner import owner_context
from .supervise import EX_LEASE_LOST, Interrupted, exit_status, forwarding, release, watch
from .types import Holder

EX_OK: Final = 0
EX_NOT_HELD: Final = 1
EX_USAGE: Final = 2
#: ``release``: the lock changed hands while the operator was asked; nothing was released.
EX_CHANGED_HANDS: Final = 3
EX_UNAVAILABLE: Final = 69
EX_TEMPFAIL: Final = 75
#: The backend answered but disagrees with its URL (password, TLS, not Redis): fix the URL.
EX_CONFIG: Final = 78


class Audit(Protocol):
    """Where the verbs report lock events (the Django app also writes ``LockEvent`` rows):
    a :class:`~task_locks.events.Forced` release, or a :class:`~task_locks.events.Conflict`
    (policy ``exit``: the front end exits 75; a force release refused)."""

    def __call__(self, event: events.LockEvent) -> None: ...


def emit_audit(event: events.LockEvent) -> None:
    """The CLI's audit: an event of the stream (:mod:`task_locks.events`), nothing stored."""
    events.emit(event)


def no_audit(event: events.LockEvent) -> None:
    """Report nothing (kept for callers that passed it; the verbs default to :func:`emit_audit`)."""


# -- conflicts -------------------------------------------------------------------------


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


def _number_of_seconds(text: str) -> float:
    """``text`` as a float, else the error both seconds types give for what is no number."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None


def seconds(text: str) -> float:
    """An argparse type: a number of seconds >= 0 (``inf``: forever)."""
    value = _number_of_seconds(text)
    if math.isnan(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds: {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0 (a TTL)."""
    value = _number_of_seconds(text)
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
    p.add_argument("--ttl", type=positive_seconds, default=None, help="seconds")
    p.add_argument(
        "--wait",
        type=seconds,
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
    # A typo after the verb is that verb's: its usage, not the top-level one, goes with it.
    known, extras = parser.parse_known_args(args, copy.copy(namespace))
    if extras:
        verb_parser = _verb_parsers(parser).get(getattr(known, "verb", None) or "")
        (verb_parser or parser).error(f"unrecognized arguments: {' '.join(extras)}")
    options = (parse or parser.parse_args)(args, namespace)
    if program:
        if getattr(options, "verb", None) != "run":
            parser.error("only `run` takes a program after --")
        options.command = [*options.command, *program]
    return options


def _verb_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The verbs' own parsers, by verb."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


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
    holder = backend.holder(validate_name(name))  # the names `run` refuses, refused here
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


def stdin_is_a_terminal() -> bool:
    return bool(sys.stdin) and sys.stdin.isatty()


def ask(question: str) -> bool:
    """Ask on the terminal; ``False`` when there is no terminal to ask on."""
    if not stdin_is_a_terminal():
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
            f"release frees {name!r} whoever holds it (the holder hears of it at once "
            "where the backend announces releases, else at its next renewal, and may "
            "keep writing until then: guard resources with fences); pass --force to do it\n"
        )
        return EX_USAGE
    holder = backend.holder(validate_name(name))
    if holder is None:
        err.write(f"lock {name!r} is not held\n")
        return EX_NOT_HELD
    role = describe_role(holder)
    what = f"{name!r} ({role})" if role else repr(name)
    if not yes and confirm is ask and not stdin_is_a_terminal():
        # (a piped "y" is no answer: the question was never shown)
        err.write(
            f"not released: standard input is not a terminal, so there is nobody to ask "
            f"whether to force-release {what}, held by {describe_holder(holder)}; pass "
            "--yes to release without the question\n"
        )
        return EX_NOT_HELD
    if not yes and not confirm(f"Force-release {what}, held by {describe_holder(holder)}?"):
        err.write("not released (not confirmed; pass --yes to skip the question)\n")
        return EX_NOT_HELD
    by = f" by {actor}" if actor else ""
    # Only the holder the operator was shown: the lock may have changed hands while the
    # question was on screen, and the backend checks the fence in the same atomic step.
    # The line below says it was released: the backend does not log it a second time.
    with reported_by_caller():
        released = backend.force_release(name, fence=holder.fence)
    if not released:
        return _not_released(backend, holder, err, audit, by)
    audit(
        events.Forced(
            name=name,
            backend=backend.server,
            fence=holder.fence,
            owner=holder.owner,
            detail=f"force-released{by}; was held by {describe_holder(holder)}",
        )
    )
    out.write(f"released {name!r} (was held by {describe_holder(holder)})\n")
    return EX_OK


def _not_released(backend: Backend, seen: Holder, err: TextIO, audit: Audit, by: str) -> int:
    """Say why a conditional force release freed nothing, and record a refusal."""
    now = backend.holder(seen.name)
    if now is None:
        err.write(f"lock {seen.name!r} was released before we got to it; nothing released\n")
        return EX_NOT_HELD
    err.write(f"task-locks: lock {seen.name!r}: {changed_hands_message(now)}\n")
    audit(
        events.Conflict(
            name=seen.name,
            backend=backend.server,
            fence=now.fence,
            owner=now.owner,
            detail=f"force release{by} refused: it was for {describe_holder(seen)}, "
            f"and the lock changed hands",
        )
    )
    return EX_CHANGED_HANDS


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
    backend stalls, the link is cut), ``run`` sends it SIGTERM :data:`~task_locks.supervise.STOP_MARGIN`
    seconds (a quarter of the TTL if shorter) before the lease's local deadline and
    SIGKILL at the deadline, so it has stopped before the server can let anyone else take
    the lock. A lease found lost outright (its token gone) is handled the same way, with
    SIGKILL at the deadline or after :data:`~task_locks.supervise.LOST_GRACE`, whichever is sooner. Each step is
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
        with forwarding(child):
            try:
                # The lock reports acquired/conflict/released/lost to the event stream.
                with (
                    owner_context(command=shlex.join(argv)),
                    events.context(policy="exit", detail=f"run {shlex.join(argv)}"),
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
            status = watch(child[0], lease, lost, err)
            if status is None:
                # It ended by itself; a lease found lost now (at the release, or by a
                # renewal as it ended) was lost while it ran: its work may overlap.
                stopped = True
                kept = release(lease, err)
                return exit_status(child[0].returncode) if kept else EX_LEASE_LOST
            stopped = True
            if not lease.lost.is_set():  # stopped before its deadline: not yet reported
                # One `lost` event, as any lease's (no later one): renewals were not
                # getting through, and the program was stopped before the deadline.
                lease._mark_lost(events.LostReason.UNREACHABLE, status)
            return EX_LEASE_LOST
    except Interrupted as stop:
        return 128 + stop.signum
    finally:
        # A program stopped for an expiring lease: the backend is not answering renewals,
        # and the lock ends by its TTL (a release would only wait for a timeout).
        if lease is not None and not stopped:
            release(lease, err)


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
    except LockError as exc:
        err.write(f"task-locks: {exc}\n")
        return _error_status(exc)
    raise ValueError(f"unknown verb {verb!r}")


def _error_status(exc: LockError) -> int:
    """The exit status of a verb that failed with ``exc``: 69 for an unreachable backend,
    78 for one refusing its URL, else 2 (usage). One place, so every verb maps an error
    alike."""
    if isinstance(exc, BackendUnavailable):
        return EX_UNAVAILABLE
    if isinstance(exc, BackendMisconfigured):
        return EX_CONFIG
    return EX_USAGE


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
    "accept_options_after_verb",
    "add_verbs",
    "ask",
    "cmd_list",
    "cmd_release",
    "cmd_run",
    "cmd_show",
    "conflict_holder",
    "conflict_message",
    "emit_audit",
    "no_audit",
    "parse_args",
    "positive_seconds",
    "run_verb",
    "seconds",
    "stdin_is_a_terminal",
]
