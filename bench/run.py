"""``make bench``: task-locks against its peers, measured side by side in one run.

It starts its own ``redis-server``, installs the peers into ``bench/.peers`` (a separate
venv, so their pins never touch the project's), and runs every library in its own worker
process (``bench/workers.py``), in alternating rounds so that drift on the machine
(other jobs, thermal, the server's allocator) lands on every library alike.

Measured: the floor (raw PING / SET from the same client), uncontended acquire+release,
contention (2/4/8 processes, hold 0/1/10 ms, work outside 2x hold), renewal of
100/1,000/10,000 live leases, and Celery throughput (``bench/celery_bench.py``). The
targets of issues 2 and 8 are checked as ratios from this same run.

Writes ``bench/results.md``, ``bench/results.png`` and ``bench/results.json``.

    .venv/bin/python bench/run.py            # full run (< 10 min)
    .venv/bin/python bench/run.py --quick    # about a minute: smaller counts, fewer cells
    .venv/bin/python bench/run.py --smoke --no-peers --out /tmp/x   # the test's few seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(BENCH))

from common import FLOOR, PEER_ADAPTERS, PEER_FLOOR, PLANS, Plan, fmt, log, quantile, summary_us  # noqa: E402
from measure import (  # noqa: E402
    Subject,
    Worker,
    machine_facts,
    measure_contention,
    measure_renewal,
    measure_server_cost,
    measure_uncontended,
    other_backends,
    run_hook,
    start_subjects,
)
from peers import _dist_version, ensure_peers, installed  # noqa: E402
from report import notes, write_markdown, write_plot  # noqa: E402
from servers import RedisServer  # noqa: E402  (tests/servers.py: the tests' own harness)
from targets import check_targets  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="about a minute: fewer, shorter runs")
    mode.add_argument("--smoke", action="store_true", help="seconds: core parts only (tests)")
    parser.add_argument("--no-peers", action="store_true", help="do not install or run peers")
    parser.add_argument("--no-celery", action="store_true", help="skip bench/celery_bench.py")
    parser.add_argument("--out", type=Path, default=BENCH, help="where results.* go")
    return parser.parse_args(argv)


def subjects_for(
    url: str, peers_python: str | None, peers: dict[str, str], plan: Plan, extra: list[Any]
) -> list[Subject]:
    """Every library and backend measured uncontended, each in its own worker process."""
    main_python = sys.executable
    subjects = [
        Subject("task-locks", "redis", main_python, "task-locks", url),
        Subject("task-locks", "memory", main_python, "task-locks", "memory://"),
        Subject(
            "task-locks (renew=False)",
            "redis",
            main_python,
            "task-locks-norenew",
            url,
            diagnostic=True,
        ),
        Subject("redis-py Lock", "redis", main_python, "redis-py", url),
    ]
    for peer, adapter in PEER_ADAPTERS.items():
        if peers_python and installed(peers, peer):
            label = peer if peer != "pottery" else "pottery Redlock"
            subjects.append(Subject(label, "redis", peers_python, adapter, url))
    if plan.other_backends:
        subjects += other_backends(main_python, extra)
    return subjects


def floor_workers(subjects: list[Subject]) -> dict[str, Worker]:
    """The floor runs on the very client our Redis backend uses (redis-py's if ours failed
    to start), and on the peers' client as a check that their stack is alike."""
    floors: dict[str, Worker] = {}
    for key, adapters in (
        (FLOOR, ("task-locks", "redis-py")),
        (PEER_FLOOR, ("python-redis-lock",)),
    ):
        usable = [
            s
            for a in adapters
            for s in subjects
            if s.adapter == a and s.backend == "redis" and not s.error
        ]
        if usable and usable[0].worker:
            floors[key] = usable[0].worker
    return floors


def uncontended_rows(subjects: list[Subject]) -> list[dict[str, Any]]:
    rows = []
    for s in subjects:
        row: dict[str, Any] = {"label": s.label, "backend": s.backend, "diagnostic": s.diagnostic}
        if s.error or not s.samples.get("cycle"):
            row["error"] = f"failed: {s.error}"
        else:
            row.update(summary_us(s.samples["cycle"]))
            row["acquire_median_us"] = quantile(s.samples["acq"], 0.5) / 1000
            row["release_median_us"] = quantile(s.samples["rel"], 0.5) / 1000
            row["client_cpu_us"] = s.cpu_ns / s.cpu_cycles / 1000 if s.cpu_cycles else None
            row["server_us"] = s.server_us
            row["server_calls"] = s.server_calls
        rows.append(row)
    return rows


def contention_libraries(
    plan: Plan, peers_python: str | None, peers: dict[str, str]
) -> list[tuple[str, str, str]]:
    libs = [
        ("task-locks", sys.executable, "task-locks"),
        ("redis-py Lock", sys.executable, "redis-py"),
    ]
    if (
        "python-redis-lock" in plan.libraries
        and peers_python
        and installed(peers, "python-redis-lock")
    ):
        libs.append(("python-redis-lock", peers_python, "python-redis-lock"))
    return libs


def hooks(
    plan: Plan, args: argparse.Namespace, url: str, peers_python: str | None, peers: dict[str, str]
) -> dict[str, Any]:
    """The measurements in modules of their own: Celery, other backends, coordination."""
    out: dict[str, Any] = {"celery": {"status": "not measured: skipped"}}
    if plan.celery and not args.no_celery:
        log("celery: bench/celery_bench.py")
        out["celery"] = run_hook(
            "celery_bench",
            redis_url=url,
            quick=plan.mode != "full",
            peers_python=peers_python,
            peers=peers,
            **({} if plan.mode == "full" else {"n": 300, "rounds": 2}),
        )
    if plan.mode == "full":
        log("backends: bench/backends_bench.py")
        out["backends"] = run_hook("backends_bench", quick=False)
        out["coordination"] = run_hook("coordination_bench", quick=False)
    else:
        out["backends"] = {"status": f"skipped in --{plan.mode} (full run only)"}
        out["coordination"] = dict(out["backends"])
    return out


def versions_of(peers: dict[str, str]) -> dict[str, str]:
    return {
        "task-locks": _dist_version("task-locks"),
        "redis-py": _dist_version("redis"),
        "hiredis": _dist_version("hiredis"),
        "celery": _dist_version("celery"),
        **{k: v for k, v in peers.items() if not v.startswith("not installed")},
    }


def write_results(results: dict[str, Any], out: Path) -> None:
    """Targets and notes, then results.json, results.md and results.png."""
    results["targets"] = [dict(vars(t), verdict=t.verdict) for t in check_targets(results)]
    results["notes"] = notes(results)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    write_markdown(results, out / "results.md")
    write_plot(results, out / "results.png")
    for t in results["targets"]:
        log(
            f"{t['verdict']:4}  {t['what']}: {fmt(t['value'], 2)} (threshold {t['threshold']}) {t['note']}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = PLANS["smoke" if args.smoke else "quick" if args.quick else "full"]
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    # Worker logs (their stderr) live in a temp dir, kept only when the run fails.
    log_dir = Path(tempfile.mkdtemp(prefix="task-locks-bench-"))

    machine = machine_facts()
    peers_python, peers = ensure_peers(not args.no_peers)
    server = RedisServer().start()
    workers: list[Worker] = []
    extra_servers: list[Any] = []
    try:
        url = server.url()
        import redis

        admin = redis.Redis.from_url(url)
        log(
            f"{plan.mode} run; redis-server on port {server.port}; peers: "
            + ", ".join(f"{k} {v}" for k, v in peers.items())
        )
        subjects = subjects_for(url, peers_python, peers, plan, extra_servers)
        start_subjects(subjects, log_dir)
        workers += [s.worker for s in subjects if s.worker]
        log(f"uncontended: {plan.rounds} rounds x {plan.cycles} cycles x {len(subjects)} subjects")
        floors = measure_uncontended(subjects, plan, floor_workers(subjects))
        measure_server_cost(subjects, admin, plan.cycles)
        uncontended = uncontended_rows(subjects)
        for worker in workers:
            worker.close()
        workers.clear()

        admin.flushall()
        log(
            f"contention: procs {plan.procs}, holds {plan.holds}, {plan.contention_seconds} s per run"
        )
        contention = measure_contention(
            contention_libraries(plan, peers_python, peers), url, plan, log_dir, admin
        )
        log(f"renewal: {plan.leases} leases")
        renewal = measure_renewal(url, plan, log_dir, admin.flushall)
        admin.flushall()
        hooked = hooks(plan, args, url, peers_python, peers)

        machine["loadavg_end"] = os.getloadavg()
        results: dict[str, Any] = {
            "mode": plan.mode,
            "machine": machine,
            "versions": versions_of(peers),
            "peers": peers,
            "floor": {
                who: {k: summary_us(v) for k, v in f.items() if v} for who, f in floors.items()
            },
            "uncontended": uncontended,
            "contention": contention,
            "renewal": renewal,
            "renewal_ttl": plan.renew_ttl,
            "celery": {k: v for k, v in hooked["celery"].items() if k != "traceback"},
            "backends": hooked["backends"],
            "coordination": hooked["coordination"],
            "elapsed_s": time.monotonic() - started,
        }
        write_results(results, args.out)
        log(f"wrote {args.out / 'results.md'} and results.png in {results['elapsed_s']:.0f} s")
        shutil.rmtree(log_dir, ignore_errors=True)
        return 0
    except BaseException:
        log(f"failed; worker logs are in {log_dir}")
        raise
    finally:
        for worker in workers:
            worker.close()
        for extra in extra_servers:
            extra.cleanup()
        server.cleanup()


if __name__ == "__main__":
    sys.exit(main())
