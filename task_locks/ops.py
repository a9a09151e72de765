"""The operator verbs, written once for ``task-locks`` (CLI) and ``manage.py locks``.

``list [PREFIX] [--json]``, ``show NAME``, ``release NAME --force [--yes]`` and
``run NAME [--ttl S] [--wait S] -- CMD ARGS...``. Both front ends build their parser with
:func:`add_verbs` and call :func:`run_verb`; they differ only in where the backend comes
from and in what :class:`Audit` does (the Django app writes ``LockEvent`` rows).

Exit statuses follow ``sysexits.h``: 75 (``EX_TEMPFAIL``) when the lock is held by
someone else, 69 (``EX_UNAVAILABLE``) when the backend cannot be reached, 1 when ``show``
finds no holder or a release is not confirmed; ``run`` passes the program's own status
through (128 + N when it died of signal N).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any, Final, Protocol, TextIO

from .backends.base import Backend
from .errors import BackendUnavailable, LockError, LockHeld, LockLost
from .lock import Lease, Lock
from .owner import owner_context
from .types import Holder, Owner

EX_OK: Final = 0
EX_NOT_HELD: Final = 1
EX_USAGE: Final = 2
EX_UNAVAILABLE: Final = 69
EX_TEMPFAIL: Final = 75
#: Signals ``run`` forwards to its program.
FORWARDED_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
#: How long ``run`` lets its program stop after the lock was lost before killing it.
LOST_GRACE: Final = 10.0


class Audit(Protocol):
    """Where notable events go (the Django app writes ``LockEvent`` rows)."""

    def __call__(
        self,
        kind: str,
        name: str,
        *,
        fence: int | None = None,
        owner: Owner | None = None,
        detail: str = "",
    ) -> None: ...


def no_audit(
    kind: str, name: str, *, fence: int | None = None, owner: Owner | None = None, detail: str = ""
) -> None:
    """The CLI's audit: nothing is stored (the caller's own logs are the record)."""


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


def render_table(holders: Sequence[Holder]) -> str:
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
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()
        for row in [header, *rows]
    )


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
    value = _seconds(text)
    if value <= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0: {text!r}")
    return value


def add_verbs(parser: argparse.ArgumentParser) -> Any:
    """Add the ``list``/``show``/``release``/``run`` subcommands; returns the subparsers."""
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    p = verbs.add_parser("list", help="list the live locks (a table, or --json)")
    p.add_argument("prefix", nargs="?", default="", metavar="PREFIX")
    p.add_argument("--json", action="store_true", dest="as_json", help="one JSON array")

    p = verbs.add_parser("show", help="show who holds one lock")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--json", action="store_true", dest="as_json")

    p = verbs.add_parser("release", help="operator override: free a lock whoever holds it")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--force", action="store_true", help="required: says you mean it")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")

    p = verbs.add_parser(
        "run",
        help="run a program under the lock, like flock(1) for the whole cluster",
        description="Take the lock, run CMD while renewing it, release it when CMD ends, "
        f"and exit with CMD's status ({EX_TEMPFAIL} if the lock is held elsewhere).",
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


def parse_args(parser: argparse.ArgumentParser, args: Sequence[str]) -> argparse.Namespace:
    """Parse ``args``, giving everything after the first ``--`` to ``run``'s program.

    argparse mishandles ``--`` under subcommands, so the program is split off first.
    """
    args = list(args)
    program: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, program = args[:cut], args[cut + 1 :]
    options = parser.parse_args(args)
    if program:
        if getattr(options, "verb", None) != "run":
            parser.error("only `run` takes a program after --")
        options.command = [*options.command, *program]
    return options


# -- the verbs -----------------------------------------------------------------------


def cmd_list(backend: Backend, prefix: str, as_json: bool, out: TextIO) -> int:
    holders = backend.holders(prefix)
    if as_json:
        out.write(json.dumps([holder_to_dict(h) for h in holders], indent=2) + "\n")
    elif not holders:
        where = f" matching {prefix!r}" if prefix else ""
        out.write(f"no locks held{where}\n")
    else:
        out.write(render_table(holders) + "\n")
    return EX_OK


def cmd_show(backend: Backend, name: str, as_json: bool, out: TextIO, err: TextIO) -> int:
    holder = backend.holder(name)
    if holder is None:
        err.write(f"lock {name!r} is not held\n")
        return EX_NOT_HELD
    if as_json:
        out.write(json.dumps(holder_to_dict(holder), indent=2) + "\n")
        return EX_OK
    data = holder_to_dict(holder)
    lines = [
        f"name:        {holder.name}",
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
    audit: Audit = no_audit,
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
    if not yes and not confirm(f"Force-release {name!r}, held by {describe_holder(holder)}?"):
        err.write("not released (not confirmed; pass --yes to skip the question)\n")
        return EX_NOT_HELD
    released = backend.force_release(name)
    if not released:
        err.write(f"lock {name!r} was released before we got to it\n")
        return EX_NOT_HELD
    detail = f"force-released by {actor}" if actor else "force-released"
    audit("forced", name, fence=holder.fence, owner=holder.owner, detail=detail)
    out.write(f"released {name!r} (was held by {describe_holder(holder)})\n")
    return EX_OK


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
    audit: Audit = no_audit,
) -> int:
    """Hold ``name`` while ``argv`` runs; return its status (75 if the lock is held)."""
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
    try:
        with _forwarding(child):
            try:
                with owner_context(command=shlex.join(argv)):
                    lease = lock.acquire()
            except LockHeld as exc:
                holder = conflict_holder(backend, exc)
                err.write(conflict_message(name, holder) + "\n")
                audit(
                    "conflict",
                    name,
                    fence=holder.fence if holder else None,
                    owner=holder.owner if holder else None,
                    detail=f"run {shlex.join(argv)}",
                )
                return EX_TEMPFAIL
            audit("acquired", name, fence=lease.fence, detail=f"run {shlex.join(argv)}")
            try:
                child.append(subprocess.Popen(argv))
            except OSError as exc:
                err.write(f"run: cannot start {argv[0]!r}: {exc}\n")
                return 127
            return _supervise(child[0], lease, lost, err, audit)
    except _Interrupted as stop:
        return 128 + stop.signum
    finally:
        if lease is not None:
            _release(lease, err, audit)


def _supervise(
    proc: subprocess.Popen[bytes],
    lease: Lease,
    lost: threading.Event,
    err: TextIO,
    audit: Audit,
) -> int:
    while True:
        try:
            return _status(proc.wait(timeout=0.2))
        except subprocess.TimeoutExpired:
            pass
        if lost.is_set():
            err.write(
                f"task-locks: lost lock {lease.name!r} ({lease.lost_reason}); "
                f"stopping {proc.args!r}\n"
            )
            audit("lost", lease.name, fence=lease.fence, detail=lease.lost_reason or "")
            proc.terminate()
            try:
                proc.wait(timeout=LOST_GRACE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return EX_TEMPFAIL


def _release(lease: Lease, err: TextIO, audit: Audit) -> None:
    if lease.lost.is_set():
        return
    try:
        lease.release()
    except LockLost as exc:
        err.write(f"task-locks: {exc}\n")
        audit("lost", lease.name, fence=lease.fence, detail=str(exc))
    except BackendUnavailable as exc:
        err.write(f"task-locks: could not release {lease.name!r} (it expires by its TTL): {exc}\n")
    else:
        audit("released", lease.name, fence=lease.fence)


def run_verb(
    options: Mapping[str, Any],
    backend: Backend,
    *,
    out: TextIO,
    err: TextIO,
    audit: Audit = no_audit,
    confirm: Callable[[str], bool] = ask,
    default_ttl: float | None = None,
    actor: str = "",
) -> int:
    """Dispatch one parsed verb; backend errors become a message and status 69."""
    verb = options["verb"]
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
    except LockError as exc:
        err.write(f"task-locks: {exc}\n")
        return EX_USAGE
    raise ValueError(f"unknown verb {verb!r}")


__all__ = [
    "EX_NOT_HELD",
    "EX_OK",
    "EX_TEMPFAIL",
    "EX_UNAVAILABLE",
    "EX_USAGE",
    "Audit",
    "add_verbs",
    "ask",
    "cmd_list",
    "cmd_release",
    "cmd_run",
    "cmd_show",
    "conflict_holder",
    "conflict_message",
    "describe_holder",
    "format_duration",
    "holder_to_dict",
    "no_audit",
    "parse_args",
    "render_table",
    "run_verb",
]
