"""`make demo`: the example's main job, end to end, on whatever backend is configured.

With nothing configured it runs embedded: SQLite for Django and for the locks
(``django://default``), a folder as the Celery broker (kombu's filesystem transport) and
SQLite for task results. It starts two real Celery worker processes (three pool
processes each), fires bursts of duplicate calls at singleton tasks (one per conflict
policy, one with a fenced write), runs a locked management command twice at once, shows
who holds what while it runs, and ends with a verdict table built from what the jobs
recorded. ``TASK_LOCKS_URL='redis://127.0.0.1:6379/0?prefix=task-locks-demo:'`` runs the
same with the locks on Redis (under the key prefix ``task-locks-demo:``, the URL's
``prefix``; nothing else there is touched).
Exit status 0 only when every check holds.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
VAR = Path(os.environ.get("DEMO_VAR_DIR") or HERE / "var").resolve()
#: Seconds the calls may take once fired (the whole demo must stay under a minute).
DEADLINE = 40.0
WORKERS = ("w1", "w2")
CONCURRENCY = 3
#: The first nightly_report works until this file exists (the demo creates it once the
#: second run has met the lock), so the two runs are sure to overlap.
REPORT_DONE = str(VAR / "nightly-report.done")


def claim_var_dir() -> IO[str]:
    """One demo at a time per VAR folder: a second `make demo` waits for the first."""
    claim = open(f"{VAR}.lock", "a+")  # kept open (and locked) until the process exits
    try:
        fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"another demo is using {VAR}; waiting for it (or set DEMO_VAR_DIR)", flush=True)
        fcntl.flock(claim, fcntl.LOCK_EX)
    return claim


# A fresh state each run: the databases and the broker folder live in VAR.
VAR.parent.mkdir(parents=True, exist_ok=True)
_claim = claim_var_dir()
shutil.rmtree(VAR, ignore_errors=True)
VAR.mkdir(parents=True)
os.environ["DEMO_VAR_DIR"] = str(VAR)
os.environ["DJANGO_SETTINGS_MODULE"] = "demo_site.settings"  # also for the workers

import django  # noqa: E402

django.setup()

from celery import states  # noqa: E402
from celery.result import AsyncResult  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402
from shop import tasks  # noqa: E402
from shop.models import Invoice, JobRun  # noqa: E402

from django_app import conf  # noqa: E402
from task_locks.celery import SKIPPED, Skipped  # noqa: E402

FINISHED = {states.SUCCESS, states.FAILURE, states.REVOKED}


def say(text: str = "") -> None:
    print(text, flush=True)


@dataclass
class Key:
    """One lock key under test and the calls fired at it."""

    name: str
    policy: str
    results: list[AsyncResult] = field(default_factory=list)
    states: Counter[str] = field(default_factory=Counter)


def start_worker(name: str) -> subprocess.Popen[bytes]:
    log = open(VAR / f"worker-{name}.log", "wb")  # the child writes to it
    command = [
        sys.executable, "-m", "celery", "-A", "demo_site", "worker",
        "--pool", "prefork", "--concurrency", str(CONCURRENCY),
        "--hostname", f"{name}@%h", "--loglevel", "INFO",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]  # fmt: skip
    return subprocess.Popen(command, cwd=HERE, stdout=log, stderr=subprocess.STDOUT)


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM, then wait: a worker finishes its current task (warm shutdown) and a
    command releases its lock, before they exit."""
    for worker in processes:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
    for worker in processes:
        try:
            worker.wait(timeout=15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def nightly_report(log: IO[bytes]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "manage.py", "nightly_report", "--seconds", "20", "--until", REPORT_DONE],
        cwd=HERE,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def max_overlap(runs: list[JobRun]) -> dict[str, int]:
    """For each key, the most runs that were inside their critical section at once."""
    events: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for run in runs:
        events[run.key] += [(run.started, 1), (run.ended or time.time(), -1)]
    peaks = {}
    for key, points in events.items():
        inside = peak = 0
        for _, step in sorted(points):  # at a tie the end (-1) sorts before the start
            inside += step
            peak = max(peak, inside)
        peaks[key] = peak
    return peaks


def workers_ready() -> int:
    """How many workers have logged that they are ready (progress display only)."""
    return sum(" ready." in log.read_text(errors="replace") for log in VAR.glob("worker-*.log"))


def progress(elapsed: float, done: int, total: int) -> None:
    ready = workers_ready()
    booting = f" | workers ready {ready}/{len(WORKERS)}" if ready < len(WORKERS) else ""
    try:
        holders = conf.backend().holders()
    except Exception as exc:  # progress is a view; the verdict decides
        held = f"(holders unavailable: {exc})"
    else:
        shown = [f"{h.name} (pid {h.owner.pid}, fence {h.fence})" for h in holders[:4]]
        more = [f"+{len(holders) - 4} more"] if len(holders) > 4 else []
        held = ", ".join(shown + more) or "-"
    bar = "#" * round(20 * done / total)
    say(f"  {elapsed:5.1f}s [{bar:20}] {done:2d}/{total} done{booting} | holding: {held}")


def clear_leftovers() -> None:
    """A shared backend (Redis) may still hold locks of an earlier demo that was killed.

    Only locks whose holder process is gone are released; a live holder is another run.
    """
    backend = conf.backend()
    for holder in backend.holders():
        owner = holder.owner
        if owner.host == socket.gethostname() and owner.pid and not pid_alive(owner.pid):
            backend.force_release(holder.name)
            say(f"  released {holder.name!r}, left by an earlier run ({owner.describe()})")
        else:
            say(f"  note: {holder.name!r} is held by {owner.describe()}: another demo running?")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fire(invoice_pk: int) -> list[Key]:
    keys = [Key(f"sync:{account}", "skip") for account in (1, 2, 3)]
    for _ in range(8):
        for account, key in zip((1, 2, 3), keys, strict=True):
            key.results.append(tasks.sync_account.delay(account, seconds=1.5))
    rates = Key("rates", "raise")
    rates.results = [tasks.refresh_exchange_rates.delay(1.0) for _ in range(3)]
    index = Key("search-index", "wait")
    index.results = [tasks.rebuild_search_index.delay(0.3) for _ in range(6)]
    mail = Key(f"mail:{invoice_pk}", "retry")
    mail.results = [tasks.send_invoice_mail.delay(invoice_pk, 0.2) for _ in range(4)]
    charge = Key(f"invoice:{invoice_pk}", "wait+fence")
    charge.results = [tasks.charge_invoice.delay(invoice_pk, 100) for _ in range(5)]
    return [*keys, rates, index, mail, charge]


def main() -> int:
    t0 = time.monotonic()
    backend_url = settings.TASK_LOCKS["BACKEND"]
    say(f"task-locks demo: locks on {backend_url}, broker {settings.CELERY_BROKER_URL}")
    say(f"                 files in {VAR}")
    # The workers boot (a few seconds) while this process prepares the database.
    workers = [start_worker(name) for name in WORKERS]
    say(f"starting {len(workers)} Celery workers x {CONCURRENCY} processes ({VAR}/worker-*.log)")
    commands: list[subprocess.Popen[bytes]] = []
    try:
        call_command("migrate", verbosity=0)
        _ = AsyncResult("warm-up").state  # creates the result tables before the workers race to
        clear_leftovers()
        command_log = open(VAR / "nightly_report.log", "wb")
        commands.append(nightly_report(command_log))  # boots while we go on
        get_user_model().objects.create_superuser("admin", "admin@example.com", "admin")
        invoice = Invoice.objects.create(number="INV-1")
        keys = fire(invoice.pk)
        results = {id(r): (key, r) for key in keys for r in key.results}
        say(
            f"fired {len(results)} calls: 3 accounts x 8 duplicate sync_account (skip), "
            "3 refresh_exchange_rates (raise),\n      6 rebuild_search_index (wait), "
            "4 send_invoice_mail (retry), 5 charge_invoice (wait, fenced write)"
        )
        say("started `manage.py nightly_report`; a second one starts once the first holds")

        pending = dict(results)
        last = -1.0
        while True:
            for ident, (key, result) in list(pending.items()):
                state = result.state
                if state in FINISHED:
                    if state == states.SUCCESS and isinstance(result.result, Skipped):
                        state = SKIPPED  # a skipped run's result (a ready SUCCESS)
                    key.states[state] += 1
                    del pending[ident]
            # The second run starts once the first holds the lock, so the clash is certain;
            # once the second is over, the first may end.
            if len(commands) == 1 and conf.backend().holder("nightly-report") is not None:
                commands.append(nightly_report(command_log))
            if len(commands) == 2 and commands[1].poll() is not None:
                Path(REPORT_DONE).touch()
            elapsed = time.monotonic() - t0
            finished = (
                not pending and len(commands) == 2 and all(c.poll() is not None for c in commands)
            )
            if finished or elapsed - last >= 1.0:
                progress(elapsed, len(results) - len(pending), len(results))
                last = elapsed
            if finished:
                break
            if elapsed > DEADLINE or any(w.poll() is not None for w in workers):
                say(f"demo: {len(pending)} calls unfinished (or a worker died); see {VAR}/*.log")
                return 1
            time.sleep(0.2)
    finally:
        stopping = time.monotonic()
        stop(commands + workers)
        say(
            f"stopped the workers in {time.monotonic() - stopping:.1f}s "
            f"(exit codes {[w.returncode for w in workers]})"
        )

    return verdict(keys, commands, invoice, t0)


def verdict(
    keys: list[Key], commands: list[subprocess.Popen[bytes]], invoice: Invoice, t0: float
) -> int:
    runs = list(JobRun.objects.all())
    peaks = max_overlap(runs)
    by_key: dict[str, list[JobRun]] = defaultdict(list)
    for run in runs:
        by_key[run.key].append(run)
    codes = sorted(c.returncode for c in commands)

    rows: list[tuple[Any, ...]] = []
    problems: list[str] = []
    for key in keys:
        ran = by_key[key.name]
        calls = len(key.results)
        skipped = key.states[SKIPPED]
        failed = key.states[states.FAILURE]
        retries = sum(r.retries for r in ran)
        if len(ran) != key.states[states.SUCCESS]:
            problems.append(
                f"{key.name}: {len(ran)} runs recorded, {key.states[states.SUCCESS]} successes"
            )
        if key.policy == "raise":
            if len(ran) + failed != calls:
                problems.append(f"{key.name}: {calls} calls, {len(ran)} ran, {failed} raised")
        elif failed or (key.policy != "skip" and len(ran) != calls):
            problems.append(f"{key.name}: {failed} failed, {len(ran)}/{calls} ran")
        if key.policy == "skip" and len(ran) + skipped != calls:
            problems.append(f"{key.name}: {calls} calls, {len(ran)} ran, {skipped} skipped")
        held_off = {"skip": f"{skipped} skipped", "raise": f"{failed} LockHeld",
                    "retry": f"{retries} retries"}.get(key.policy, "waited")  # fmt: skip
        rows.append((key.name, key.policy, calls, len(ran), held_off, peaks.get(key.name, 0),
                     sum(r.lease_lost for r in ran)))  # fmt: skip
    report = by_key["nightly-report"]
    rows.append(("nightly-report", "command", len(commands), len(report),
                 f"{codes.count(75)} exit 75", peaks.get("nightly-report", 0),
                 sum(r.lease_lost for r in report)))  # fmt: skip
    if codes != [0, 75]:
        problems.append(f"nightly_report exit codes {codes}, want [0, 75]")

    invoice.refresh_from_db()
    charges = len(by_key[f"invoice:{invoice.pk}"])
    if invoice.amount_cents != 100 * charges or charges != 5:
        problems.append(f"invoice total {invoice.amount_cents}, want {100 * charges} (5 charges)")

    header = ("key", "policy", "calls", "ran", "held off", "max concurrent", "lost leases")
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    line = "  ".join(f"{{:{'<' if i in (0, 1, 4) else '>'}{w}}}" for i, w in enumerate(widths))
    say()
    say(line.format(*header))
    say(line.format(*("-" * w for w in widths)))
    for row in rows:
        say(line.format(*map(str, row)))
    say()
    total_calls = sum(row[2] for row in rows)
    total_ran = sum(row[3] for row in rows)
    max_concurrent = max(row[5] for row in rows)
    lost = sum(row[6] for row in rows)
    say(f"calls {total_calls}, ran {total_ran}, max concurrency per key {max_concurrent}, "
        f"lost leases {lost}")  # fmt: skip
    say(f"invoice INV-1: {invoice.amount_cents} cents from {charges} fenced charges of 100 "
        f"(last fence {invoice.charged_by_fence})")  # fmt: skip
    conflict = [
        ln for ln in (VAR / "nightly_report.log").read_text().splitlines() if "is held by" in ln
    ]
    if conflict:
        say(f"the second nightly_report said: {conflict[-1]}")
    if max_concurrent != 1:
        problems.append(f"max concurrency per key is {max_concurrent}, want 1")
    if lost:
        problems.append(f"{lost} leases were lost")
    for problem in problems:
        say(f"PROBLEM: {problem}")
    ok = not problems
    say(f"verdict: {'PASS' if ok else 'FAIL'} in {time.monotonic() - t0:.1f}s")
    say()
    python, manage = os.path.relpath(sys.executable), os.path.relpath(HERE / "manage.py")
    env = "" if VAR == HERE / "var" else f"DEMO_VAR_DIR={VAR} "
    if os.environ.get("TASK_LOCKS_URL"):  # the CLI and the site read it alike
        env += f"TASK_LOCKS_URL={shlex.quote(settings.TASK_LOCKS_URL)} "
    say("look next:")
    say(f"  {env}{python} {manage} runserver")
    say("  then http://127.0.0.1:8000/admin/ (login admin / admin): Task locks > Lock holders,")
    say("  Lock events (the conflict the second nightly_report met), Shop > Job runs")
    say(f"  {env}{python} {manage} locks list      # who holds what, from a shell")
    say("  README.md: the quick starts; make docs: the documentation site (build/site/index.html)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
