"""``task-locks``: the operator verbs without Django.

::

    task-locks --url redis://127.0.0.1:6379/0 list [PREFIX] [--json]
    task-locks show NAME
    task-locks release NAME --force [--yes]
    task-locks run NAME [--ttl S] [--wait S] -- CMD ARGS...

The backend is ``--url``, else ``TASK_LOCKS_URL``. For ``django://ALIAS`` also set
``DJANGO_SETTINGS_MODULE``. The verbs are the same code as ``manage.py locks``
(:mod:`task_locks.ops`); without Django no audit rows are written.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .backends import get_backend
from .config import default_ttl
from .errors import InvalidArgument
from .ops import EX_USAGE, add_verbs, parse_args, run_verb


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="task-locks",
        description="See and steer task-locks locks: list, show, release, run.",
    )
    parser.add_argument(
        "--url",
        default=None,
        help="backend URL (default: $TASK_LOCKS_URL), e.g. redis://127.0.0.1:6379/0",
    )
    add_verbs(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    options = parse_args(parser, sys.argv[1:] if argv is None else argv)
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
        backend.close()


if __name__ == "__main__":
    sys.exit(main())
