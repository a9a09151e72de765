"""A cron job that must never run twice at once: ``manage.py nightly_report``.

A second run while one is going exits with status 75 and names the holder; with
``--lock-wait 60`` it waits for the first to finish instead. The lock is renewed while
``handle()`` runs, and released on return, on an exception, on SIGTERM and on Ctrl-C.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from django_app.commands import LockedCommand
from shop.models import JobRun


class Command(LockedCommand):
    help = "Build the nightly report (never two at once, cluster-wide)."
    lock_name = "nightly-report"
    lock_ttl = 30

    def add_arguments(self, parser):
        super().add_arguments(parser)
        parser.add_argument("--seconds", type=float, default=2.0, help="how long the work takes")
        parser.add_argument(
            "--until",
            type=Path,
            metavar="PATH",
            help="(demo) work until PATH exists, at most --seconds: makes a clash certain",
        )

    def handle(self, *args, **options):
        run = JobRun.objects.create(
            job="nightly_report", key="nightly-report", started=time.time(), pid=os.getpid()
        )
        deadline = time.monotonic() + options["seconds"]
        while time.monotonic() < deadline:  # the work itself
            if options["until"] is not None and options["until"].exists():
                break
            time.sleep(0.05)
        run.ended = time.time()
        run.save(update_fields=["ended"])
        fence = self.lease.fence if self.lease else None  # None under --no-lock
        self.stdout.write(f"nightly report done (fence {fence})")
