"""``make bench``: task-locks against its peers, measured side by side in one run.

It starts its own ``redis-server``, installs the peers into ``bench/.peers`` (a separate
venv, so their pins never touch the project's), and runs every library in its own worker
process (``bench/workers.py``), in alternating rounds so that drift on the machine
(other jobs, thermal, the server's allocator) lands on every library alike.

Measured: the floor (raw PING / SET from the same client), uncontended acquire+release,
contention (2/4/8 processes, hold 0/1/10 ms, and 4 processes at hold 0.2 ms; work
outside 2x hold; the opt-in server hand-off too), renewal of
100/1,000/10,000 live leases, how soon a holder learns of a force release (release
notice vs renewal, ``bench/notice_bench.py``), Celery throughput (``bench/celery_bench.py``) and where
a singleton run's time goes (``bench/celery_profile.py``, its quick form, in every mode).
The speed targets (bench/targets.py) are checked as ratios from this same run.

Writes ``bench/results.md``, ``bench/results.png`` and ``bench/results.json``.

This file only orchestrates; each step lives in a module of its own: installing the
peers (``peers.py``), measuring (``measure.py``), checking the targets (``targets.py``)
and writing the reports (``report.py``).

    .venv/bin/python bench/run.py            # full run (about 25 min)
    .venv/bin/python bench/run.py --quick    # about a minute: smaller counts, fewer cells
    .venv/bin/python bench/run.py --smoke --no-peers --out /tmp/x   # the test's few seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import PLANS, log
from measure import (
    contention_libraries,
    machine_facts,
    measure_all,
    measure_footprint,
    run_hook,
)
from peers import ensure_peers, versions_of
from report import celery_footprint_markdown, footprint_markdown, write_results
from servers import RedisServer  # tests/servers.py, the tests' own harness
from targets import target_rows

BENCH = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="about a minute: fewer, shorter runs")
    mode.add_argument("--smoke", action="store_true", help="seconds: core parts only (tests)")
    parser.add_argument("--no-peers", action="store_true", help="do not install or run peers")
    parser.add_argument(
        "--no-celery", action="store_true", help="skip bench/celery_bench.py and celery_profile.py"
    )
    parser.add_argument("--out", type=Path, default=BENCH, help="where results.* go")
    parser.add_argument(
        "--footprint-cycles", type=int, help="unique-name cycles of the footprint cell"
    )
    parser.add_argument(
        "--only-notices",
        action="store_true",
        help="run only the release-notice cell (bench/notice_bench.py) and print it",
    )
    parser.add_argument(
        "--only-locks",
        action="store_true",
        help="only the Redis lock cells: uncontended (with the floor and Redis's cost), "
        "contention and their targets; no renewal, footprint, Celery or other backends "
        "(for a shared machine)",
    )
    parser.add_argument(
        "--cells",
        help="contention cells to run, as PROCSxHOLD_SECONDS, comma-separated "
        "(e.g. 4x0,4x0.0002,4x0.001); default: the plan's",
    )
    parser.add_argument(
        "--only-footprint",
        action="store_true",
        help="run only the footprint cell (and print it): what each lock leaves in Redis",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = PLANS["smoke" if args.smoke else "quick" if args.quick else "full"]
    if args.footprint_cycles:
        plan = dataclasses.replace(plan, footprint_cycles=args.footprint_cycles)
    if args.cells:
        cells = tuple(
            (int(n), float(hold)) for n, hold in (cell.split("x") for cell in args.cells.split(","))
        )
        plan = dataclasses.replace(plan, procs=(), holds=(), extra_cells=cells)
    if args.only_locks:
        plan = dataclasses.replace(plan, other_backends=False, celery=False)
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    # Worker logs (their stderr) live in a temp dir, kept only when the run fails.
    log_dir = Path(tempfile.mkdtemp(prefix="task-locks-bench-"))

    if args.only_notices:  # starts its own servers
        print(run_hook("notice_bench", quick=args.quick).get("markdown", "failed"))
        return 0
    machine = machine_facts()
    peers_python, peers = ensure_peers(not args.no_peers)
    server = RedisServer().start()
    try:
        url = server.url()
        log(
            f"{plan.mode} run; redis-server on port {server.port}; peers: "
            + ", ".join(f"{k} {v}" for k, v in peers.items())
        )
        if args.only_footprint:
            found = measure_footprint(
                contention_libraries(plan, peers_python, peers), url, plan, log_dir
            )
            print("\n".join(footprint_markdown(found, dataclasses.asdict(plan))))
            if not args.no_celery:
                cells = run_hook(
                    "celery_footprint", url=url, n=plan.footprint_cycles, peers_python=peers_python
                )
                print("\n".join(celery_footprint_markdown(cells)))
            return 0
        measured = measure_all(
            plan,
            url,
            peers_python,
            peers,
            log_dir,
            celery=not args.no_celery,
            locks_only=args.only_locks,
        )
        machine["loadavg_end"] = os.getloadavg()
        results: dict[str, Any] = {
            "mode": plan.mode,
            "machine": machine,
            "versions": versions_of(peers),
            "peers": peers,
            "plan": dataclasses.asdict(plan),
            **measured,
            "elapsed_s": time.monotonic() - started,
        }
        results["targets"] = target_rows(results)
        write_results(results, args.out)
        log(f"wrote {args.out / 'results.md'} and results.png in {results['elapsed_s']:.0f} s")
        shutil.rmtree(log_dir, ignore_errors=True)
        return 0
    except BaseException:
        log(f"failed; worker logs are in {log_dir}")
        raise
    finally:
        server.cleanup()


if __name__ == "__main__":
    sys.exit(main())
