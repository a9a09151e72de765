"""Measuring: worker processes, subjects, and each measurement (uncontended, contention,
renewal, the optional hooks).
"""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import importlib
import itertools
import json
import os
import platform
import select
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    FLOOR,
    PEER_ADAPTERS,
    PEER_FLOOR,
    TARGET_CELLS,
    TTL,
    Plan,
    log,
    quantile,
    summary_us,
)
from peers import installed
from servers import RedisServer  # tests/servers.py, the tests' own harness

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


class WorkerError(RuntimeError):
    pass


class Worker:
    """One ``bench/workers.py`` process: a JSON request per line, a JSON reply per line."""

    def __init__(self, python: str, label: str, log_dir: Path) -> None:
        self.label = label
        self.log_path = log_dir / f"{label.replace(' ', '_').replace('/', '_')}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("PYTHONPATH", None)
        if python == sys.executable:
            # This checkout's task_locks, not whichever the venv has installed (an
            # editable install of another worktree would be measured instead).
            env["PYTHONPATH"] = str(ROOT)
        with open(self.log_path, "ab") as err:
            self.proc = subprocess.Popen(
                [python, str(BENCH / "workers.py")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
                cwd=str(ROOT),
            )

    def send(self, **request: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            tail = self.log_path.read_text(errors="replace")[-1500:]
            why = "timed out" if not ready else f"exited ({self.proc.poll()})"
            raise WorkerError(f"worker {self.label} {why}; its log ends:\n{tail}")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise WorkerError(f"worker {self.label}: {reply['error']}")
        return reply

    def call(self, timeout: float = 120.0, **request: Any) -> dict[str, Any]:
        self.send(**request)
        return self.receive(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="quit")
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait(timeout=5)


def machine_facts() -> dict[str, Any]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    redis_server = subprocess.run(
        [RedisServer.binary, "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "date": dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "redis_server": redis_server.split(" sha=")[0],
        "loadavg_start": os.getloadavg(),
    }


@dataclass
class Subject:
    label: str  # what the tables call it
    backend: str  # which server / backend kind
    python: str
    adapter: str
    url: str
    diagnostic: bool = False  # shown, but not a peer and not in targets
    worker: Worker | None = None
    samples: dict[str, list[int]] = field(default_factory=dict)
    error: str | None = None
    cpu_ns: int = 0
    cpu_cycles: int = 0
    #: Background thread wake-ups (deadline watch + renewal lanes) over ``woken_cycles``.
    wakeups: int = 0
    woken_cycles: int = 0
    server_us: float | None = None  # redis-server's CPU per cycle (INFO cpu)
    server_calls: float | None = None  # commands executed per cycle (inside scripts too)
    #: Each round's median cycle (ns): the median of these is the typical round, which a
    #: burst of load from other jobs during a minority of rounds does not move.
    round_medians: list[float] = field(default_factory=list)


def start_subjects(subjects: list[Subject], log_dir: Path) -> None:
    for index, subject in enumerate(subjects):
        if subject.error is None:
            subject.worker = Worker(
                subject.python, f"uncontended-{index}-{subject.adapter}", log_dir
            )
    for index, subject in enumerate(subjects):
        if subject.worker is None:
            continue
        try:
            subject.worker.call(
                op="setup",
                adapter=subject.adapter,
                url=subject.url,
                name=f"bench:uncontended:{index}",
                ttl=TTL,
            )
            subject.worker.call(op="cycles", n=30)  # warm: connect, load scripts, threads
        except WorkerError as exc:
            subject.error = str(exc).splitlines()[-1][:300]
            log(f"{subject.label} ({subject.backend}) failed to start: {subject.error}")


def measure_uncontended(
    subjects: list[Subject], plan: Plan, floor_workers: dict[str, Worker]
) -> dict[str, dict[str, list[int]]]:
    """Rotate through the subjects each round; the floor is one more subject in the rotation."""
    floors: dict[str, dict[str, list[int]]] = {
        key: {"ping": [], "set": []} for key in floor_workers
    }
    steps: list[tuple[str, Any]] = [("subject", s) for s in subjects if s.error is None]
    steps += [("floor", key) for key in floor_workers]
    for round_no in range(plan.rounds):
        shift = round_no % len(steps)
        order = steps[shift:] + steps[:shift]
        if round_no % 2:
            order.reverse()
        for kind, item in order:
            if kind == "floor":
                try:
                    reply = floor_workers[item].call(op="floor", n=plan.cycles)
                except WorkerError as exc:
                    log(f"floor on {item} failed: {exc}")
                    continue
                for key in ("ping", "set"):
                    floors[item][key] += reply.get(key, [])
                if reply.get("ping"):
                    floors[item].setdefault("ping_rounds", []).append(quantile(reply["ping"], 0.5))
                continue
            if item.error is not None:
                continue
            try:
                reply = item.worker.call(op="cycles", n=plan.cycles, max_seconds=plan.block_seconds)
            except WorkerError as exc:
                item.error = str(exc).splitlines()[-1][:300]
                continue
            cpu_ns, count = reply.pop("cpu")
            woken, woken_cycles = reply.pop("wakeups", (0, 0))
            item.wakeups += woken
            item.woken_cycles += woken_cycles
            if reply.get("cycle"):
                item.round_medians.append(quantile(reply["cycle"], 0.5))
            item.cpu_ns += cpu_ns
            item.cpu_cycles += count
            for key, values in reply.items():
                item.samples.setdefault(key, []).extend(values)
    return floors


#: Blocks per subject in :func:`measure_server_cost` (the median kept).
SERVER_COST_ROUNDS = 5


def measure_server_cost(
    subjects: list[Subject], admin: Any, cycles: int, rounds: int = SERVER_COST_ROUNDS
) -> None:
    """Redis's CPU per cycle (INFO cpu) and commands per cycle (INFO commandstats, which
    also counts the commands a script runs), one subject alone on the server.

    ``rounds`` blocks of ``cycles`` per subject, the subjects taking turns, the median
    block kept: one block of 300 cycles is some 70 ms of Redis CPU, and a single block
    once read 83 µs a cycle for ours against 28 for the floor, where 5,000 cycles of each
    in a process of its own read 75-80 against 70-80."""
    measured = [
        s for s in subjects
        if s.error is None and s.backend == "redis" and s.worker is not None
    ]  # fmt: skip
    spent: dict[int, list[float]] = {id(s): [] for s in measured}
    calls: dict[int, list[float]] = {id(s): [] for s in measured}
    for round_no in range(rounds):
        shift = round_no % max(1, len(measured))
        for subject in measured[shift:] + measured[:shift]:
            if subject.error is not None:
                continue
            try:
                # Steady state: a process idle for 5 s (its turn in the rotation waited
                # that long) lets its release-notice listener go, and the first lease
                # after opens it again (HELLO, SUBSCRIBE): once per listener, not per cycle.
                subject.worker.call(op="cycles", n=5)
                admin.config_resetstat()
                before = server_cpu(admin)
                subject.worker.call(op="cycles", n=cycles)
            except WorkerError as exc:
                subject.error = str(exc).splitlines()[-1][:300]
                continue
            spent[id(subject)].append((server_cpu(admin) - before) * 1e6 / cycles)
            calls[id(subject)].append(lock_calls(admin.info("commandstats")) / cycles)
    for subject in measured:
        if spent[id(subject)]:
            subject.server_us = statistics.median(spent[id(subject)])
            subject.server_calls = statistics.median(calls[id(subject)])


#: The runner's own commands around a measurement, left out of the counts (Redis 7 names
#: a subcommand ``cmdstat_config|resetstat``: matched by the part before ``|``).
ADMIN_COMMANDS = ("cmdstat_info", "cmdstat_config")


def lock_calls(stats: dict[str, Any]) -> int:
    """Commands ``INFO commandstats`` counted, the runner's own left out."""
    return sum(v["calls"] for k, v in stats.items() if k.split("|")[0] not in ADMIN_COMMANDS)


def server_cpu(admin: Any) -> float:
    cpu = admin.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def contention_stats(runs: list[tuple[Any, ...]]) -> dict[str, Any]:
    """Pool several runs of one cell. Each run: per-process records, start, end.

    - rate: acquisitions that began in the window / window seconds;
    - utilisation: critical-section time (acquire returned -> release() called), clipped
      to the window, over the window;
    - fairness: slowest process's count / fastest's, per run, then averaged;
    - hand-off: the next holder's acquire returning minus the previous holder calling
      release(), counted only when the next holder was already waiting (another process
      that asked before the release began).
    """
    total = held = wall = 0.0
    fairness: list[float] = []
    handoffs: list[float] = []
    server = {"cpu": 0.0, "calls": 0, "blpop": 0, "acquisitions": 0}
    by_command: collections.Counter[str] = collections.Counter()
    for per_process, start, end, *measured in runs:
        if measured:  # what Redis ran, over every acquisition of the run
            for key, value in measured[0].items():
                if key == "by_command":
                    by_command.update(value)
                else:
                    server[key] += value
            server["acquisitions"] += sum(len(records) for records in per_process)
        wall += end - start
        counts = []
        events = []
        for proc, records in enumerate(per_process):
            kept = [r for r in records if start <= r[1] < end]
            counts.append(len(kept))
            for asked, got, releasing in kept:
                held += max(0.0, min(releasing, end) - got)
                events.append((got, releasing, asked, proc))
        total += sum(counts)
        fairness.append(min(counts) / max(counts) if max(counts) else 0.0)
        events.sort()
        for prev, nxt in itertools.pairwise(events):
            if nxt[3] != prev[3] and nxt[2] < prev[1]:
                handoffs.append((nxt[0] - prev[1]) * 1e9)
    return {
        "rate": total / wall if wall else 0.0,
        "utilisation": held / wall if wall else 0.0,
        "fairness": statistics.fmean(fairness) if fairness else 0.0,
        "fairness_min": min(fairness) if fairness else 0.0,
        "handoff_median_us": quantile(handoffs, 0.5) / 1000,
        "handoff_p99_us": quantile(handoffs, 0.99) / 1000,
        "handoffs": len(handoffs),
        "acquisitions": int(total),
        **(
            {
                "server_calls_per_acq": server["calls"] / server["acquisitions"],
                "blpop_per_acq": server["blpop"] / server["acquisitions"],
                "server_cpu_per_acq_us": server["cpu"] * 1e6 / server["acquisitions"],
                # Which commands: the target's note says where the count comes from.
                "server_calls_by_command": {
                    name: calls / server["acquisitions"] for name, calls in by_command.most_common()
                },
            }
            if server["acquisitions"]
            else {}
        ),
    }


def measure_contention(
    libraries: list[tuple[str, str, str]], url: str, plan: Plan, log_dir: Path, admin: Any
) -> dict[str, dict[str, Any]]:
    """``libraries``: (label, python, adapter). A pool of max(procs) workers per library."""
    size = max(n for n, _ in plan.cells())
    pools: dict[str, list[Worker]] = {}
    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    try:
        for label, python, adapter in libraries:
            pools[label] = [Worker(python, f"contend-{adapter}-{i}", log_dir) for i in range(size)]
            try:
                for worker in pools[label]:
                    worker.call(
                        op="setup",
                        adapter=adapter,
                        url=url,
                        name=f"bench:contend:{adapter}",
                        ttl=TTL,
                    )
                _contend_once(pools[label][:2], 0.0005, 0.001, 0.3)  # warm up
            except WorkerError as exc:
                failed[label] = str(exc).splitlines()[-1][:300]
                log(f"contention: {label} failed to start: {failed[label]}")
                for worker in pools.pop(label):
                    worker.close()
        cells = plan.cells()
        runs: dict[tuple[str, int, float], list[Any]] = {}
        labels = list(pools)
        for round_no in range(max(plan.contention_rounds, plan.target_rounds)):
            for n, hold in cells:
                target_cell = (n, hold) in TARGET_CELLS
                if round_no >= (plan.target_rounds if target_cell else plan.contention_rounds):
                    continue
                shift = round_no % len(labels)
                for label in labels[shift:] + labels[:shift]:
                    if label in failed:
                        continue
                    try:
                        run = _contend_once(
                            pools[label][:n], hold, 2 * hold, plan.contention_seconds, admin
                        )
                    except WorkerError as exc:
                        failed[label] = str(exc).splitlines()[-1][:300]
                        log(f"contention: {label} failed: {failed[label]}")
                        continue
                    runs.setdefault((label, n, hold), []).append(run)
            log(f"contention round {round_no + 1} done")
        for (label, n, hold), cell_runs in runs.items():
            results[f"{label}|{n}|{hold}"] = {
                "library": label,
                "procs": n,
                "hold": hold,
                "out": 2 * hold,
                **contention_stats(cell_runs),
            }
        for label, reason in failed.items():
            results[f"{label}|failed"] = {"library": label, "error": reason}
    finally:
        for pool in pools.values():
            for worker in pool:
                worker.close()
    return results


def _contend_once(
    workers: list[Worker], hold: float, out: float, seconds: float, admin: Any = None
) -> Any:
    """One run; with ``admin``, also what Redis executed (this library alone on it)."""
    if admin is not None:
        admin.config_resetstat()
        cpu = server_cpu(admin)
    start = time.monotonic() + 0.2 + 0.03 * len(workers)
    end = start + seconds
    for worker in workers:
        worker.send(op="contend", start=start, end=end, hold=hold, out=out)
    per_process = [w.receive(timeout=seconds + 60)["records"] for w in workers]
    if admin is None:
        return per_process, start, end
    stats = admin.info("commandstats")
    server = {
        "cpu": server_cpu(admin) - cpu,
        "calls": lock_calls(stats),
        "blpop": stats.get("cmdstat_blpop", {}).get("calls", 0),
        "by_command": {
            k.removeprefix("cmdstat_"): int(v["calls"])
            for k, v in stats.items()
            if k.split("|")[0] not in ADMIN_COMMANDS
        },
    }
    return per_process, start, end, server


def measure_wakeup(url: str, log_dir: Path, n: int) -> dict[str, Any]:
    """The floor of any hand-off that wakes a blocked process: a bare LPUSH from one
    process to another blocked in BLPOP for 1 ms (the hold of the target cell), unpinned
    as in the contention runs, with the pusher's PING beside it (the hand-off
    target is a multiple of a PING)."""
    popper = Worker(sys.executable, "wakeup-pop", log_dir)
    pusher = Worker(sys.executable, "wakeup-push", log_dir)
    try:
        popper.send(op="wake_pop", url=url, key="bench:wakeup", n=n)
        pushed = pusher.call(op="wake_push", url=url, key="bench:wakeup", n=n, gap=0.001)
        popped = popper.receive(timeout=60 + n * 0.01)
    except WorkerError as exc:
        return {"error": str(exc).splitlines()[-1][:300]}
    finally:
        popper.close()
        pusher.close()
    wake, ping = popped.get("wakeup", []), pushed.get("ping", [])
    if not wake or not ping:
        return {"error": "no wake-up measured"}
    return {"wakeup": summary_us(wake), "ping": summary_us(ping)}


def measure_ring(
    url: str, log_dir: Path, admin: Any, members: int, seconds: float
) -> dict[str, Any]:
    """The most hand-offs a second any design can make here where each wakes a blocked
    process: ``members`` processes passing one token round by LPUSH and BLPOP, no lock
    code, unpinned as in the contention runs (:func:`workers.ring`)."""
    admin.delete(*[f"bench:ring:{i}" for i in range(members)])
    ring = [Worker(sys.executable, f"ring-{i}", log_dir) for i in range(members)]
    try:
        for worker in ring:
            worker.send(op="ready", url=url)
        for worker in ring:
            worker.receive(timeout=60)
        start_at = time.monotonic() + 0.2
        for index, worker in enumerate(ring):
            worker.send(
                op="ring", url=url, members=members, index=index, start_at=start_at,
                seconds=seconds,
            )  # fmt: skip
        passes = sum(worker.receive(timeout=seconds + 60)["passes"] for worker in ring)
    except WorkerError as exc:
        return {"error": str(exc).splitlines()[-1][:300]}
    finally:
        for worker in ring:
            worker.close()
        admin.delete(*[f"bench:ring:{i}" for i in range(members)])
    if not passes:
        return {"error": "the token never went round"}
    return {"members": members, "rate": passes / seconds, "handoff_us": seconds / passes * 1e6}


def measure_renewal(
    url: str, plan: Plan, log_dir: Path, flush: Callable[[], None]
) -> list[dict[str, Any]]:
    rows = []
    for leases in plan.leases:
        flush()
        worker = Worker(sys.executable, f"renewal-{leases}", log_dir)
        try:
            reply = worker.call(
                timeout=600,
                op="renewal",
                url=url,
                leases=leases,
                ttl=plan.renew_ttl,
                periods=plan.renew_periods,
            )
        except WorkerError as exc:
            rows.append({"leases": leases, "error": str(exc).splitlines()[-1][:300]})
            continue
        finally:
            worker.close()
        sizes, seconds = reply.pop("batch_sizes"), reply.pop("batch_seconds")
        reply["batch_size_median"] = quantile(sizes, 0.5) if sizes else 0
        reply["batch_seconds_median"] = quantile(seconds, 0.5) if seconds else 0
        rows.append(reply)
        log(f"renewal of {leases} leases: {reply['cpu_per_round_s'] * 1000:.1f} ms CPU per round")
    return rows


def run_hook(module_name: str, entry_name: str = "run", **kwargs: Any) -> dict[str, Any]:
    """Call ``bench/<module_name>.py``'s ``run(**kwargs)`` (or ``entry_name``) if the
    module exists.

    TODO(bench owners): ``bench/celery_bench.py`` and ``bench/backends_bench.py`` are
    written by the Celery and backends engineers; this hook is adapted to their
    interface once they exist. Until then the results say "not measured".
    """
    path = BENCH / f"{module_name}.py"
    if not path.exists():
        return {"status": f"not measured: bench/{module_name}.py does not exist yet"}
    try:
        module = importlib.import_module(module_name)
        entry = getattr(module, entry_name, None)
        if entry is None:
            return {"status": f"not measured: bench/{module_name}.py has no {entry_name}()"}
        result = entry(**kwargs)
        return {"status": "ok", **(result if isinstance(result, dict) else {"result": result})}
    except Exception as exc:
        log(f"{module_name} failed: {exc}")
        return {
            "status": f"failed: {type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }


def other_backends(python: str, started: list[Any]) -> list[Subject]:
    """Our other backends on servers of their own: redlock (3 masters), etcd (1 member).

    ``django://`` needs a configured Django project; it is left to
    ``bench/backends_bench.py`` (see :func:`run_hook`).
    """
    import servers

    subjects = []
    for backend, factory in (
        ("redlock (3 masters)", lambda: servers.RedisMasters(3)),
        ("etcd (1 member)", lambda: servers.EtcdServer()),
    ):
        subject = Subject("task-locks", backend, python, "task-locks", "")
        try:
            server = factory()
            started.append(server)
            server.start()
            subject.url = server.url()
        except Exception as exc:  # a missing binary or harness class: say so, carry on
            subject.error = f"not available: {type(exc).__name__}: {exc}"[:300]
        subjects.append(subject)
    return subjects


# -- the whole measuring sequence, in the order bench/run.py runs it -------------------


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
        # Not a library: what a cycle with our guarantees costs with no lock code.
        Subject(
            "floor: fenced cycle, no lock code",
            "redis",
            main_python,
            "fenced-floor",
            url,
            diagnostic=True,
        ),
        # asyncio, ours beside redis-py's own (no target: the note under the table)
        Subject(
            "task-locks AsyncLock", "redis", main_python, "task-locks-async", url, diagnostic=True
        ),
        Subject("redis.asyncio Lock", "redis", main_python, "redis-py-async", url, diagnostic=True),
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
            row["round_median_us"] = statistics.median(s.round_medians) / 1000
            row["rounds"] = len(s.round_medians)
            row["acquire_median_us"] = quantile(s.samples["acq"], 0.5) / 1000
            row["release_median_us"] = quantile(s.samples["rel"], 0.5) / 1000
            row["client_cpu_us"] = s.cpu_ns / s.cpu_cycles / 1000 if s.cpu_cycles else None
            row["wakeups_per_cycle"] = s.wakeups / s.woken_cycles if s.woken_cycles else None
            row["server_us"] = s.server_us
            row["server_calls"] = s.server_calls
        rows.append(row)
    return rows


def contention_libraries(
    plan: Plan, peers_python: str | None, peers: dict[str, str]
) -> list[tuple[str, str, str]]:
    libs = [("task-locks", sys.executable, "task-locks")]
    if "task-locks-client" in plan.libraries:
        # The opt-out client hand-off (Redis URL option handoff=client).
        libs.append(("task-locks-client", sys.executable, "task-locks-client"))
    libs.append(("redis-py Lock", sys.executable, "redis-py"))
    if (
        "python-redis-lock" in plan.libraries
        and peers_python
        and installed(peers, "python-redis-lock")
    ):
        libs.append(("python-redis-lock", peers_python, "python-redis-lock"))
    return libs


def measure_footprint(
    libraries: list[tuple[str, str, str]], url: str, plan: Plan, log_dir: Path
) -> dict[str, dict[str, Any]]:
    """Per library, alone on a database of its own (12): the bytes and keys of a live
    lock, and what ``plan.footprint_cycles`` unique-name cycles leave behind."""
    db_url = url.rsplit("/", 1)[0] + "/12"
    results: dict[str, dict[str, Any]] = {}
    for label, python, adapter in libraries:
        worker = Worker(python, f"footprint-{adapter}", log_dir)
        try:
            worker.call(op="setup", adapter=adapter, url=db_url, name="bench:fp", ttl=TTL)
            results[label] = worker.call(
                timeout=60 + plan.footprint_cycles * 0.01,
                op="footprint",
                url=db_url,
                n=plan.footprint_cycles,
                live=plan.footprint_live,
            )
        except WorkerError as exc:
            results[label] = {"error": str(exc).splitlines()[-1][:300]}
        finally:
            worker.close()
        log(f"footprint: {label} {results[label]}")
    ours = next((python for label, python, _ in libraries if label == "task-locks"), None)
    if ours is not None and "error" not in results["task-locks"]:
        worker = Worker(ours, "footprint-floor", log_dir)
        try:
            floor = worker.call(op="record_floor", url=db_url, live=plan.footprint_live, ttl=TTL)
            results["task-locks"]["record_floor"] = floor
        except WorkerError as exc:
            results["task-locks"]["record_floor"] = {"error": str(exc).splitlines()[-1][:300]}
        finally:
            worker.close()
        log(f"footprint: the record floor {results['task-locks']['record_floor']}")
    return results


def hooks(
    plan: Plan, celery: bool, url: str, peers_python: str | None, peers: dict[str, str]
) -> dict[str, Any]:
    """The measurements in modules of their own: Celery, other backends, coordination.

    The singleton run profile (``bench/celery_profile.py``, its quick form: seconds, in
    this process) runs in every mode, ``--smoke`` too, unless ``--no-celery``.
    """
    out: dict[str, Any] = {
        "celery": {"status": "not measured: skipped"},
        "celery_profile": {"status": "not measured: skipped (--no-celery)"},
        "celery_footprint": {"status": "not measured: skipped (--no-celery)"},
    }
    if plan.celery and celery:
        log("celery: bench/celery_bench.py")
        out["celery"] = run_hook(
            "celery_bench",
            redis_url=url,
            quick=plan.mode != "full",
            peers_python=peers_python,
            peers=peers,
            **({} if plan.mode == "full" else {"n": 300, "rounds": 2}),
        )
    if celery:
        log("celery profile: bench/celery_profile.py (quick)")
        out["celery_profile"] = run_hook("celery_profile", redis_url=url, quick=True)
    if celery and plan.mode != "smoke":  # a process per mode: seconds even for a few runs
        log(f"celery footprint: {plan.footprint_cycles:,} runs per mode (celery_footprint.py)")
        out["celery_footprint"] = run_hook(
            "celery_footprint", url=url, n=plan.footprint_cycles, peers_python=peers_python
        )
    if plan.mode == "full":
        log("backends: bench/backends_bench.py")
        out["backends"] = run_hook(
            "backends_bench", quick=False, peers_python=peers_python, peers=peers
        )
        out["coordination"] = run_hook("coordination_bench", quick=False)
    else:
        skipped = {"status": f"skipped in --{plan.mode} (full run only)"}
        out["coordination"] = dict(skipped)
        if plan.mode == "quick":
            # The three backend targets only: Redlock vs pottery, etcd and PostgreSQL floors.
            log("backends: the Redlock, etcd and PostgreSQL targets (bench/backends_bench.py)")
            out["backends"] = run_hook(
                "backends_bench", "run_targets", quick=True, peers_python=peers_python, peers=peers
            )
        else:
            # The django:// (PostgreSQL) target alone: one short child process.
            log("backends: django (PostgreSQL) cycle vs its floor (bench/backends_bench.py)")
            out["backends"] = run_hook("backends_bench", "run_pg_floor", quick=True)
    if plan.mode != "smoke":
        log("notices: force release to lease.lost (bench/notice_bench.py)")
        out["notice"] = run_hook("notice_bench", quick=plan.mode != "full")
    return out


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` on ``cpus`` (threads it starts later inherit it)."""
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(tid), cpus)
    except (FileNotFoundError, PermissionError):
        pass  # gone, or not ours to pin: measured unpinned


def _server_pids(extra_servers: list[Any]) -> list[int]:
    """The processes of the other backends' servers (Redlock's masters, etcd)."""
    pids = []
    for server in extra_servers:
        for one in [server, *getattr(server, "servers", [])]:
            proc = getattr(one, "proc", None)
            if proc is not None and proc.poll() is None:
                pids.append(proc.pid)
    return pids


@contextlib.contextmanager
def apart(servers: list[int], clients: list[int]) -> Iterator[None]:
    """Servers on the first CPU, clients on the others, for the uncontended rounds.

    Unpinned, the scheduler puts a client on the server's CPU for some rounds and on the
    other CPU for others: two modes about 2x apart on a 2-CPU machine, so a library's
    median said more about where its process landed than about the library (a process
    with more threads landed apart more often). Apart is the remote server's case: every
    round trip crosses CPUs. Undone afterwards (contention runs unpinned).
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        yield
        return
    for pid in servers:
        _pin(pid, {cpus[0]})
    for pid in clients:
        _pin(pid, set(cpus[1:]))
    try:
        yield
    finally:
        for pid in servers + clients:
            _pin(pid, set(cpus))


def measure_all(
    plan: Plan,
    url: str,
    peers_python: str | None,
    peers: dict[str, str],
    log_dir: Path,
    *,
    celery: bool = True,
    locks_only: bool = False,
) -> dict[str, Any]:
    """Every measurement of one run against the Redis server at ``url``, in order:
    uncontended (with the floor and the server's cost), contention, renewal, the hooks.
    ``locks_only``: the first two only (``--only-locks``), the rest reported as skipped.

    Returns the results' measurement sections; worker processes and the extra servers of
    other backends are stopped before it returns, whatever happens.
    """
    import redis

    admin = redis.Redis.from_url(url)
    workers: list[Worker] = []
    extra_servers: list[Any] = []
    try:
        subjects = subjects_for(url, peers_python, peers, plan, extra_servers)
        start_subjects(subjects, log_dir)
        workers += [s.worker for s in subjects if s.worker]
        log(f"uncontended: {plan.rounds} rounds x {plan.cycles} cycles x {len(subjects)} subjects")
        servers = [int(admin.info("server")["process_id"]), *_server_pids(extra_servers)]
        clients = [w.proc.pid for w in workers]
        with apart(servers, clients):
            floors = measure_uncontended(subjects, plan, floor_workers(subjects))
            measure_server_cost(subjects, admin, plan.cycles)
        uncontended = uncontended_rows(subjects)
        for worker in workers:
            worker.close()
        workers.clear()

        admin.flushall()
        log(
            f"contention: (procs, hold) {plan.cells()}, outside 2 x hold, "
            f"{plan.contention_seconds} s per run"
        )
        contention = measure_contention(
            contention_libraries(plan, peers_python, peers), url, plan, log_dir, admin
        )
        wakeup = measure_wakeup(url, log_dir, 300 if plan.mode == "smoke" else 1000)
        wakeup["ring"] = measure_ring(
            url, log_dir, admin, 4, 1.0 if plan.mode == "smoke" else plan.contention_seconds
        )
        skipped = {"status": "not measured: --only-locks"}
        renewal: list[dict[str, Any]] = []
        footprint: dict[str, dict[str, Any]] = {}
        hooked = {
            k: dict(skipped) for k in ("celery", "celery_profile", "celery_footprint", "backends")
        }
        hooked["coordination"] = dict(skipped)
        if not locks_only:
            log(f"renewal: {plan.leases} leases")
            renewal = measure_renewal(url, plan, log_dir, admin.flushall)
            admin.flushall()
            log(f"footprint: {plan.footprint_cycles:,} unique-name cycles per library")
            footprint = measure_footprint(
                contention_libraries(plan, peers_python, peers), url, plan, log_dir
            )
            hooked = hooks(plan, celery, url, peers_python, peers)
    finally:
        for worker in workers:
            worker.close()
        for extra in extra_servers:
            extra.cleanup()
    return {
        "floor": {
            who: {k: summary_us(v) for k, v in f.items() if v and k != "ping_rounds"}
            for who, f in floors.items()
        },
        # The typical round's PING median (see Subject.round_medians).
        "floor_round_ping_us": {
            who: statistics.median(f["ping_rounds"]) / 1000
            for who, f in floors.items()
            if f.get("ping_rounds")
        },
        "uncontended": uncontended,
        "contention": contention,
        "wakeup": wakeup,
        "renewal": renewal,
        "renewal_ttl": plan.renew_ttl,
        "footprint": footprint,
        "celery": {k: v for k, v in hooked["celery"].items() if k != "traceback"},
        "celery_profile": {k: v for k, v in hooked["celery_profile"].items() if k != "traceback"},
        "celery_footprint": {
            k: v for k, v in hooked["celery_footprint"].items() if k != "traceback"
        },
        "backends": hooked["backends"],
        "coordination": hooked["coordination"],
    }
