"""A LockedCommand for the tests: holds ``sleepy:{group}`` while it sleeps."""

import time
from pathlib import Path

from django_app.commands import LockedCommand


class Command(LockedCommand):
    help = "Sleep while holding a lock."
    lock_name = "sleepy:{group}"
    lock_ttl = 5

    def add_arguments(self, parser):
        parser.add_argument("--group", default="a")
        parser.add_argument("--seconds", type=float, default=0.0)
        parser.add_argument("--marker", default=None, help="file to create once running")
        parser.add_argument("--until", default=None, help="stop early once this file exists")
        parser.add_argument("--beats", default=None, help="append time.time() while working")

    def handle(self, *args, **options):
        lease = getattr(self, "lease", None)  # no lease under --no-lock
        fence = lease.fence if lease else None
        if options["marker"]:
            Path(options["marker"]).write_text(str(fence))
        deadline = time.monotonic() + options["seconds"]
        beats = open(options["beats"], "a") if options["beats"] else None
        while time.monotonic() < deadline:
            if options["until"] and Path(options["until"]).exists():
                break
            if beats:
                beats.write(f"{time.time()}\n")
                beats.flush()
            time.sleep(0.05)
        self.stdout.write(f"done {options['group']} fence={fence}")
