"""`make demo`: the example's main job, end to end, on whatever backend is configured.

With nothing configured it runs embedded: SQLite for Django and for the locks
(``django://default``), kombu's filesystem transport as the Celery broker. It starts two
real Celery worker processes, fires bursts of duplicate calls at singleton tasks, runs a
locked management command twice at once, shows who holds what while it runs, and ends
with a verdict table. Set ``TASK_LOCKS_URL=redis://127.0.0.1:6379/0`` to run the same on
Redis. Exit status 0 only when every check holds.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
VAR = Path(os.environ.get("DEMO_VAR_DIR", HERE / "var"))
DEADLINE = 50.0  # seconds for the whole burst to finish

# A fresh state each run (the broker folder, the databases).
shutil.rmtree(VAR, ignore_errors=True)
VAR.mkdir(parents=True)
os.environ["DEMO_VAR_DIR"] = str(VAR)
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_site.settings")
sys.path.insert(0, str(HERE))

import django  # noqa: E402

django.setup()

from celery.result import AsyncResult  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402
from shop import tasks  # noqa: E402
from shop.models import Invoice, JobRun  # noqa: E402

from task_locks.config import resolve_backend  # noqa: E402


def say(text: str = "") -> None:
    print(text, flush=True)


def start_worker(name: str) -> subprocess.Popen[bytes]:
    log = open(VAR / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [
            sys.executable, "-m", "celery", "-A", "demo_site", "worker", "-P", "prefork",
            "-c", "3", "-n", f"{name}@%h", "-l", "WARNING",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ],
        cwd=HERE, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy(),
    )


def run_command_twice() -> list[subprocess.Popen[bytes]]:
    cmd = [sys.executable, "manage.py", "nightly_report", "--seconds", "3"]
    first = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # The second starts once the first holds the lock, so the clash is certain.
    backend = resolve_backend()
    deadline = time.monotonic() + 20
    while backend.holder("nightly-report") is None and time.monotonic() < deadline:
        time.sleep(0.05)
    second = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return [first, second]


def max_overlap(runs: list[JobRun]) -> dict[str, int]:
    """For each key, the most runs that were ever inside at the same moment."""
    events: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for run in runs:
        events[run.key] += [(run.started, 1), (run.ended or time.time(), -1)]
    result = {}
    for key, points in events.items():
        inside = peak = 0
        for _, step in sorted(points, key=lambda p: (p[0], p[1])):
            inside += step
            peak = max(peak, inside)
        result[key] = peak
    return result


def show_holders(elapsed: float, done: int, total: int) -> None:
    holders = resolve_backend().holders()
    held = ", ".join(f"{h.name} <- {h.owner.describe()}" for h in holders) or "none"
    say(f"  {elapsed:5.1f}s  {done:3d}/{total} calls finished   holding: {held}")


def main() -> int:
    t0 = time.monotonic()
    say(f"task-locks demo: lock backend {settings.TASK_LOCKS['BACKEND']}, "
        f"broker {settings.CELERY_BROKER_URL}")
    call_command("migrate", verbosity=0)
    User = get_user_model()
    User.objects.create_superuser("admin", "admin@example.com", "admin")
    invoice = Invoice.objects.create(number="INV-1")

    workers = [start_worker("w1"), start_worker("w2")]
    try:
        say("fired: 3 accounts x 8 duplicate sync_account (skip), 6 rebuild_search_index (wait),")
        say("       4 send_invoice_mail (retry), 5 charge_invoice (wait, fenced write),")
        say("       and `manage.py nightly_report` twice at once")
        calls: list[tuple[str, AsyncResult]] = []
        for _ in range(8):
            for account in (1, 2, 3):
                calls.append(("skip", tasks.sync_account.delay(account, seconds=1.5)))
        calls += [("wait", tasks.rebuild_search_index.delay(0.3)) for _ in range(6)]
        calls += [("retry", tasks.send_invoice_mail.delay(invoice.pk, 0.2)) for _ in range(4)]
        calls += [("wait", tasks.charge_invoice.delay(invoice.pk, 100)) for _ in range(5)]
        commands = run_command_twice()

        last = 0.0
        while True:
            done = sum(1 for _, r in calls if r.ready())
            elapsed = time.monotonic() - t0
            if elapsed - last >= 1.0:
                show_holders(elapsed, done, len(calls))
                last = elapsed
            if done == len(calls) and all(c.poll() is not None for c in commands):
                break
            if elapsed > DEADLINE:
                say("demo: calls still unfinished at the deadline; see example_project/var/*.log")
                return 1
            time.sleep(0.2)
    finally:
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        for worker in workers:
            try:
                worker.wait(timeout=15)
            except subprocess.TimeoutExpired:
                worker.kill()

    states: dict[str, int] = defaultdict(int)
    for _, result in calls:
        states[result.state] += 1
    runs = list(JobRun.objects.all())
    peaks = max_overlap(runs)
    lost = sum(1 for r in runs if r.lease_lost)
    exit_codes = sorted(c.returncode for c in commands)
    conflict_line = commands[exit_codes.index(75)].stderr.read().decode().strip() if 75 in exit_codes else ""
    invoice.refresh_from_db()

    checks = [
        ("calls fired", len(calls), None),
        ("ran (SUCCESS)", states.get("SUCCESS", 0), None),
        ("skipped (SKIPPED state)", states.get("SKIPPED", 0), None),
        ("failed", states.get("FAILURE", 0), 0),
        ("job runs recorded", len(runs), None),
        ("max concurrency per key", max(peaks.values(), default=0), 1),
        ("lost leases", lost, 0),
        ("invoice total (5 x 100)", invoice.amount_cents, 500),
        ("nightly_report exit codes", exit_codes, [0, 75]),
    ]
    say()
    say(f"{'check':32} {'value':>12}  verdict")
    ok = True
    for label, value, expected in checks:
        verdict = "" if expected is None else ("ok" if value == expected else f"WRONG (want {expected})")
        ok = ok and verdict in ("", "ok")
        say(f"{label:32} {value!s:>12}  {verdict}")
    say()
    if conflict_line:
        say(f"the second nightly_report said: {conflict_line.splitlines()[-1]}")
    say(f"verdict: {'PASS' if ok else 'FAIL'} in {time.monotonic() - t0:.1f}s")
    say("next: `python example_project/manage.py runserver`, then http://127.0.0.1:8000/admin/ "
        "(login admin / admin) -> Task locks -> Lock holders; `python example_project/manage.py "
        "locks list`; README.md")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
