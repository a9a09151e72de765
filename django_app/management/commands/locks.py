"""``manage.py locks``: list, show, release, run (the same verbs as ``task-locks``) and prune.

::

    manage.py locks list [PREFIX] [--json]
    manage.py locks show NAME
    manage.py locks release NAME --force [--yes]     # writes a "forced" LockEvent
    manage.py locks run NAME [--ttl S] [--wait S] -- CMD ARGS...
    manage.py locks prune [--days N]                  # delete events older than the retention

The backend is ``TASK_LOCKS["BACKEND"]`` (default: ``$TASK_LOCKS_URL`` when set, the URL
the ``task-locks`` CLI uses; a setting that would lock in another namespace than that
variable is refused: :mod:`django_app.conf`). ``--help``, ``list`` and ``show`` name the
backend and namespace. Exit statuses: see :mod:`task_locks.verbs` (3 when ``release``
found the lock in other hands than it showed: nothing released).
"""

from __future__ import annotations

import getpass
import os
import socket
from dataclasses import replace
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from task_locks import events, verbs
from task_locks.listing import describe_backend

from ... import audit, conf


def _audit(event: events.LockEvent) -> None:
    actor = f"{getpass.getuser()}@{socket.gethostname()} (manage.py locks, pid {os.getpid()})"
    # An event of the stream; an operator's force-release is recorded before we report
    # it done.
    audit.record(replace(event, actor=actor), sync=event.kind == events.EventKind.FORCED)


class Command(BaseCommand):
    help = "See and steer distributed locks: list, show, release, run; prune lock events."
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        subparsers = verbs.add_verbs(parser, where=describe_backend(conf.backend()))
        prune = subparsers.add_parser("prune", help="delete lock events older than the retention")
        prune.add_argument(
            "--days",
            type=float,
            default=None,
            help="keep this many days (default: TASK_LOCKS['EVENT_RETENTION_DAYS'])",
        )
        # Django's own options (--settings, --verbosity...) were added before this.
        verbs.accept_options_after_verb(parser, subparsers)

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parse = parser.parse_args

        def parse_args(args: Any = None, namespace: Any = None) -> Any:
            # Everything after ``--`` is ``run``'s program, as for ``task-locks``.
            return verbs.parse_args(parser, args or [], namespace, parse=parse)

        parser.parse_args = parse_args  # type: ignore[assignment,method-assign]
        return parser

    def handle(self, *args: Any, **options: Any) -> None:
        verb = options["verb"]
        if verb == "prune":
            self._prune(options.get("days"))
            return
        try:
            status = verbs.run_verb(
                options,
                conf.backend(),
                out=self.stdout,
                err=self.stderr,
                audit=_audit,
                default_ttl=conf.default_ttl(),
                actor=f"{getpass.getuser()} via manage.py locks",
            )
        finally:
            audit.flush(timeout=5.0)
        if status:
            self.stdout.flush()
            self.stderr.flush()
            # A status, not an error: `locks run` passes its program's status through.
            raise SystemExit(status)

    def _prune(self, days: float | None) -> None:
        if days is None:
            days = conf.lock_settings().event_retention_days
        if days < 0:
            raise CommandError(f"--days must be >= 0, got {days}")
        deleted = audit.prune(days)
        self.stdout.write(f"deleted {deleted} lock event(s) older than {days:g} day(s)")
