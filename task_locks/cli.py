"""``task-locks``: the operator verbs without Django.

::

    task-locks --url redis://127.0.0.1:6379/0 list [PREFIX] [--json]
    task-locks show NAME
    task-locks release NAME --force [--yes]
    task-locks run NAME [--ttl S] [--wait S] -- CMD ARGS...

The backend is ``--url``, else ``TASK_LOCKS_URL``; its ``prefix`` option is the
namespace (a Django app with ``django_app`` uses the same variable, and refuses to lock in
another namespace while it is set). ``--help``, ``list`` and ``show`` name the backend and
namespace they use. For ``django://ALIAS`` also set ``DJANGO_SETTINGS_MODULE``. The verbs
are the same code as ``manage.py locks`` (:mod:`task_locks.verbs`); without Django no audit
rows are written.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import watchdog
from .backends import get_backend
from .backends.base import redact_url
from .config import default_ttl
from .errors import InvalidArgument, LockError
from .listing import describe_backend
from .verbs import EX_USAGE, accept_options_after_verb, add_verbs, parse_args, run_verb

#: At most this long (seconds), an exiting CLI lets a renewal call in flight end.
EXIT_QUIET = 2.0


def chosen_url(args: Sequence[str]) -> str | None:
    """The backend URL ``args`` would use (``--url``, else ``$TASK_LOCKS_URL``)."""
    args = list(args)
    if "--" in args:
        args = args[: args.index("--")]
    scan = argparse.ArgumentParser(add_help=False)
    scan.add_argument("--url", default=None)
    known, _ = scan.parse_known_args(args)
    return known.url or os.environ.get("TASK_LOCKS_URL") or None


def describe_url(url: str | None) -> str:
    """The backend line for ``--help`` (never raises: help must always print)."""
    if not url:
        return "none configured (pass --url or set TASK_LOCKS_URL)"
    try:
        return describe_backend(get_backend(url))
    except (LockError, ValueError) as exc:
        return f"{redact_url(url)} (not usable: {exc})"


def build_parser(where: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="task-locks",
        description="See and steer task-locks locks: list, show, release, run. "
        "The backend URL's prefix option is the namespace: the same URL (TASK_LOCKS_URL) "
        "everywhere means one lock per name.",
    )
    parser.add_argument(
        "--url",
        default=None,
        help="backend URL (default: $TASK_LOCKS_URL), e.g. redis://127.0.0.1:6379/0"
        "?prefix=myproject:",
    )
    accept_options_after_verb(parser, add_verbs(parser, where=where))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    ours = args[: args.index("--")] if "--" in args else args
    wants_help = any(arg in ("-h", "--help") for arg in ours)
    # Only --help prints the parser's text; the verbs name the backend themselves.
    parser = build_parser(describe_url(chosen_url(args)) if wants_help else "")
    options = parse_args(parser, args)
    url = options.url or os.environ.get("TASK_LOCKS_URL")
    if not url:
        parser.error("no backend: pass --url or set TASK_LOCKS_URL")
    try:
        backend = get_backend(url)
    except InvalidArgument as exc:
        sys.stderr.write(f"task-locks: {exc}\n")
        return EX_USAGE
    try:
        return run_verb(
            vars(options),
            backend,
            out=sys.stdout,
            err=sys.stderr,
            default_ttl=default_ttl(),
            actor=f"task-locks CLI (pid {os.getpid()})",
        )
    finally:
        sys.stdout.flush()
        # A renewal still in flight (a stalled link: `run` stopped its program for it)
        # ends first, or the exit can deadlock in the client library's cleanup.
        watchdog.thread_renewer().quiet(EXIT_QUIET)
        backend.close()


if __name__ == "__main__":
    sys.exit(main())
