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
import datetime as dt
import importlib
import itertools
import json
import math
import os
import platform
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(BENCH))

from servers import RedisServer  # noqa: E402  (tests/servers.py: the tests' own harness)

PEER_VENV = BENCH / ".peers"
#: PyPI distributions measured from the peers' venv; redis-py's Lock runs in ``.venv``.
PEERS = ("python-redis-lock", "pottery", "sherlock", "celery-singleton", "celery-once")
#: Which adapter (bench/workers.py) measures which peer distribution.
PEER_ADAPTERS = {
    "python-redis-lock": "python-redis-lock",
    "pottery": "pottery",
    "sherlock": "sherlock",
}
FLOOR = "our client (.venv)"
PEER_FLOOR = "peers' client (.peers)"
TTL = 30.0  # long enough that no renewal or expiry happens inside a latency sample


# -- settings per mode -------------------------------------------------------------------


@dataclass
class Plan:
    mode: str
    rounds: int  # uncontended rounds (each runs every subject once, rotated)
    cycles: int  # acquire+release cycles per subject per round
    procs: tuple[int, ...]
    holds: tuple[float, ...]
    contention_seconds: float
    contention_rounds: int
    target_rounds: int  # rounds for the cell the targets read (4 procs, 1 ms)
    leases: tuple[int, ...]
    renew_ttl: float
    renew_periods: float
    block_seconds: float = 0.5  # cap per subject per round, so slow backends stay cheap
    other_backends: bool = True  # redlock:// and etcd:// on servers of their own
    celery: bool = True
    libraries: tuple[str, ...] = ("task-locks", "redis-py", "python-redis-lock")


PLANS = {
    "full": Plan(
        "full", 15, 300, (2, 4, 8), (0.0, 0.001, 0.01), 1.5, 2, 4, (100, 1000, 10000), 3.0, 3
    ),
    "quick": Plan(
        "quick", 5, 150, (2, 4, 8), (0.001,), 1.5, 1, 2, (100, 1000), 1.5, 2, block_seconds=0.25
    ),
    "smoke": Plan(
        "smoke",
        2,
        40,
        (2,),
        (0.001,),
        0.4,
        1,
        1,
        (100,),
        1.5,
        1.5,
        block_seconds=0.2,
        other_backends=False,
        celery=False,
        libraries=("task-locks", "redis-py"),
    ),
}


# -- small statistics ----------------------------------------------------------------------


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (p99 of 4,000 samples is the 40th largest)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[index]


def summary_us(samples_ns: Sequence[float]) -> dict[str, float]:
    return {
        "median_us": quantile(samples_ns, 0.5) / 1000,
        "p99_us": quantile(samples_ns, 0.99) / 1000,
        "n": len(samples_ns),
    }


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- worker processes ------------------------------------------------------------------------


class WorkerError(RuntimeError):
    pass


class Worker:
    """One ``bench/workers.py`` process: a JSON request per line, a JSON reply per line."""

    def __init__(self, python: str, label: str, log_dir: Path) -> None:
        self.label = label
        self.log_path = log_dir / f"{label.replace(' ', '_').replace('/', '_')}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("PYTHONPATH", None)
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


# -- environment: machine facts, servers, the peers' venv --------------------------------------


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


def _pip_reason(stderr: str) -> str:
    lines = [
        line.strip()
        for line in stderr.splitlines()
        if line.strip() and not line.startswith(("WARNING", "[notice]"))
    ]
    return (lines[-1] if lines else "pip failed without a message")[:200]


def peer_versions(python: Path, dists: Iterable[str]) -> dict[str, str]:
    code = (
        "import json, sys, importlib.metadata as m\n"
        "out = {}\n"
        "for d in sys.argv[1:]:\n"
        "    try: out[d] = m.version(d)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))"
    )
    done = subprocess.run(
        [str(python), "-c", code, *dists], capture_output=True, text=True, check=False
    )
    return json.loads(done.stdout) if done.returncode == 0 else {}


def ensure_peers(enabled: bool) -> tuple[str | None, dict[str, str]]:
    """The peers' python and, per peer, its version or ``"not installed: <reason>"``."""
    if not enabled:
        return None, {p: "not installed: skipped (--no-peers)" for p in PEERS}
    python = PEER_VENV / "bin" / "python"
    if not python.exists():
        log(f"creating the peers' venv {PEER_VENV}")
        made = subprocess.run(
            [sys.executable, "-m", "venv", str(PEER_VENV)], capture_output=True, text=True
        )
        if made.returncode != 0:
            reason = f"not installed: venv creation failed: {_pip_reason(made.stderr)}"
            return None, dict.fromkeys(PEERS, reason)
    # The same redis-py, hiredis and Celery as ours, so only the lock libraries differ;
    # packaging is what kombu's Redis transport needs for the Celery peers.
    support = {
        "redis": f"redis[hiredis]=={_dist_version('redis')}",
        "celery": f"celery=={_dist_version('celery')}",
        "packaging": "packaging",
    }
    have = peer_versions(python, [*PEERS, *support, "hiredis"])
    status: dict[str, str] = {}
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    missing = [spec for dist, spec in support.items() if dist not in have]
    if missing:
        log(f"installing {' '.join(missing)} into {PEER_VENV}")
        done = subprocess.run([*pip, *missing], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            log(f"could not install {missing} for the peers: {_pip_reason(done.stderr)}")
    for peer in PEERS:
        if peer in have:
            continue
        log(f"installing {peer} into {PEER_VENV}")
        try:
            done = subprocess.run([*pip, peer], capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            status[peer] = "not installed: pip timed out after 300 s"
            continue
        if done.returncode != 0:
            status[peer] = f"not installed: {_pip_reason(done.stderr)}"
    have = peer_versions(python, [*PEERS, *support, "hiredis"])
    for peer in PEERS:
        status.setdefault(peer, have.get(peer) or "not installed: not found after pip install")
    for dist in ("redis", "hiredis", "celery"):
        status[f"{dist} (peers venv)"] = have.get(dist, "not installed")
    return str(python), status


def _dist_version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def installed(status: dict[str, str], peer: str) -> bool:
    return not status.get(peer, "not installed").startswith("not installed")


# -- the measurements ---------------------------------------------------------------------------


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
    server_us: float | None = None  # redis-server's CPU per cycle (INFO cpu)
    server_calls: float | None = None  # commands executed per cycle (inside scripts too)


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
                continue
            if item.error is not None:
                continue
            try:
                reply = item.worker.call(op="cycles", n=plan.cycles, max_seconds=plan.block_seconds)
            except WorkerError as exc:
                item.error = str(exc).splitlines()[-1][:300]
                continue
            cpu_ns, count = reply.pop("cpu")
            item.cpu_ns += cpu_ns
            item.cpu_cycles += count
            for key, values in reply.items():
                item.samples.setdefault(key, []).extend(values)
    return floors


def measure_server_cost(subjects: list[Subject], admin: Any, cycles: int) -> None:
    """Redis's CPU per cycle (INFO cpu) and commands per cycle (INFO commandstats, which
    also counts the commands a script runs), one subject alone on the server."""
    for subject in subjects:
        if subject.error is not None or subject.backend != "redis" or subject.worker is None:
            continue
        admin.config_resetstat()
        before = server_cpu(admin)
        try:
            subject.worker.call(op="cycles", n=cycles)
        except WorkerError as exc:
            subject.error = str(exc).splitlines()[-1][:300]
            continue
        spent = server_cpu(admin) - before
        stats = admin.info("commandstats")
        calls = sum(v["calls"] for k, v in stats.items() if k != "cmdstat_info")
        subject.server_us = spent * 1e6 / cycles
        subject.server_calls = calls / cycles


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
    for per_process, start, end, *measured in runs:
        if measured:  # what Redis ran, over every acquisition of the run
            for key, value in measured[0].items():
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
            }
            if server["acquisitions"]
            else {}
        ),
    }


def measure_contention(
    libraries: list[tuple[str, str, str]], url: str, plan: Plan, log_dir: Path, admin: Any
) -> dict[str, dict[str, Any]]:
    """``libraries``: (label, python, adapter). A pool of max(procs) workers per library."""
    size = max(plan.procs)
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
        cells = [(n, hold) for hold in plan.holds for n in plan.procs]
        runs: dict[tuple[str, int, float], list[Any]] = {}
        labels = list(pools)
        for round_no in range(max(plan.contention_rounds, plan.target_rounds)):
            for n, hold in cells:
                target_cell = n == 4 and hold == 0.001
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
        "calls": sum(v["calls"] for k, v in stats.items() if k != "cmdstat_info"),
        "blpop": stats.get("cmdstat_blpop", {}).get("calls", 0),
    }
    return per_process, start, end, server


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


# -- hooks into the other engineers' modules ------------------------------------------------------


def run_hook(module_name: str, **kwargs: Any) -> dict[str, Any]:
    """Call ``bench/<module_name>.py``'s ``run(**kwargs)`` if the module exists.

    TODO(bench owners): ``bench/celery_bench.py`` and ``bench/backends_bench.py`` are
    written by the Celery and backends engineers; this hook is adapted to their
    interface once they exist. Until then the results say "not measured".
    """
    path = BENCH / f"{module_name}.py"
    if not path.exists():
        return {"status": f"not measured: bench/{module_name}.py does not exist yet"}
    try:
        module = importlib.import_module(module_name)
        entry = getattr(module, "run", None)
        if entry is None:
            return {"status": f"not measured: bench/{module_name}.py has no run()"}
        result = entry(**kwargs)
        return {"status": "ok", **(result if isinstance(result, dict) else {"result": result})}
    except Exception as exc:
        log(f"{module_name} failed: {exc}")
        return {
            "status": f"failed: {type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }


# -- targets ----------------------------------------------------------------------------------


@dataclass
class Target:
    what: str
    value: float | None
    threshold: float
    higher_is_better: bool
    unit: str = "x"
    note: str = ""

    @property
    def verdict(self) -> str:
        if self.value is None or self.value != self.value:
            return "n/a"
        ok = self.value >= self.threshold if self.higher_is_better else self.value <= self.threshold
        return "PASS" if ok else "MISS"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or a != a or b != b:
        return None
    return a / b


def check_targets(results: dict[str, Any]) -> list[Target]:
    unc = {(r["label"], r["backend"]): r for r in results["uncontended"] if "median_us" in r}
    ours = unc.get(("task-locks", "redis"), {}).get("median_us")
    redis_py = unc.get(("redis-py Lock", "redis"), {}).get("median_us")
    ping = results["floor"].get(FLOOR, {}).get("ping", {}).get("median_us")
    cell = results["contention"]
    at = lambda lib: cell.get(f"{lib}|4|0.001", {})  # noqa: E731
    ours_c, rp_c, prl_c = at("task-locks"), at("redis-py Lock"), at("python-redis-lock")
    celery = results.get("celery", {})
    targets = [
        Target("uncontended cycle / redis-py Lock (median)", ratio(ours, redis_py), 1.1, False),
        Target(
            "uncontended cycle / two raw PING round trips (median)",
            ratio(ours, 2 * ping if ping else None),
            2.5,
            False,
        ),
        Target(
            "4 procs, 1 ms hold: rate / redis-py Lock (default sleep=0.1)",
            ratio(ours_c.get("rate"), rp_c.get("rate")),
            1.5,
            True,
        ),
        Target(
            "4 procs, 1 ms hold: rate / python-redis-lock",
            ratio(ours_c.get("rate"), prl_c.get("rate")),
            1.0,
            True,
            note="" if prl_c else "python-redis-lock not measured (not installed)",
        ),
        Target(
            "4 procs, 1 ms hold: fairness (slowest / fastest)",
            ours_c.get("fairness"),
            0.8,
            True,
            unit="",
        ),
        Target(
            "4 procs, 1 ms hold: lock utilisation", ours_c.get("utilisation"), 0.85, True, unit=""
        ),
    ]
    plain = _celery_rate(celery, "plain")
    mine = _celery_rate(celery, "singleton_task")
    missing = "" if celery.get("status") == "ok" else celery.get("status", "not measured")
    targets += [
        Target(
            "Celery: @singleton_task / plain task throughput",
            ratio(mine, plain),
            0.8,
            True,
            note=missing,
        ),
        Target(
            "Celery: @singleton_task / celery-singleton throughput",
            ratio(mine, _celery_rate(celery, "celery-singleton")),
            1.0,
            True,
            note=missing,
        ),
        Target(
            "Celery: @singleton_task / celery-once throughput",
            ratio(mine, _celery_rate(celery, "celery-once")),
            1.0,
            True,
            note=missing,
        ),
    ]
    return targets


def _celery_rate(celery: dict[str, Any], variant: str) -> float | None:
    """TODO: adapt to bench/celery_bench.py's result shape once it exists."""
    rates = celery.get("throughput") or {}
    value = rates.get(variant) if isinstance(rates, dict) else None
    return float(value) if isinstance(value, int | float) else None


# -- output -------------------------------------------------------------------------------------


def fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def write_markdown(results: dict[str, Any], path: Path) -> None:
    m = results["machine"]
    out: list[str] = []
    add = out.append
    add("# task-locks benchmarks\n")
    add(
        f"Generated by `make bench` (`bench/run.py --{results['mode']}`) on {m['date']}, "
        f"in {results['elapsed_s']:.0f} s.\n"
    )
    add(
        f"- Machine: {m['nproc']} CPUs ({m['cpu']}), Linux {m['kernel']}, Python {m['python']}, "
        f"{m['redis_server']} on loopback (no persistence), started by the runner."
    )
    la0, la1 = m["loadavg_start"], m["loadavg_end"]
    add(
        f"- Load average at start {la0[0]:.2f} / end {la1[0]:.2f} (1 min)."
        + (
            " **Noisy run**: other jobs shared the CPUs; treat small differences as noise."
            if max(la0[0], la1[0]) > 0.5 * (m["nproc"] or 1)
            else ""
        )
    )
    versions = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    add(f"- Versions: {versions}.")
    add(
        "- Every library runs in its own worker process; subjects take turns in rotated, "
        "alternating rounds so machine drift hits all of them alike.\n"
    )

    add("## Targets (ratios from this run)\n")
    add("| target | measured | threshold | verdict | note |")
    add("|---|---:|---:|:---:|---|")
    for t in results["targets"]:
        sign = ">=" if t["higher_is_better"] else "<="
        add(
            f"| {t['what']} | {fmt(t['value'], 2)}{t['unit'] if t['value'] is not None else ''} "
            f"| {sign} {t['threshold']}{t['unit']} | {t['verdict']} | {t['note']} |"
        )
    add("")

    add("## The floor: raw round trips from the same client\n")
    add("| client | command | median µs | p99 µs | samples |")
    add("|---|---|---:|---:|---:|")
    for who, floors in results["floor"].items():
        for cmd, s in floors.items():
            add(
                f"| {who} | {cmd.upper()} | {fmt(s['median_us'])} | {fmt(s['p99_us'])} | {s['n']} |"
            )
    add("")

    ping = results["floor"].get(FLOOR, {}).get("ping", {}).get("median_us")
    add("## Uncontended acquire + release\n")
    add(
        "One cycle = a blocking `acquire()` that succeeds at once, then `release()`. "
        "`x floor` = median / (2 x PING median): a lock cycle needs two round trips. "
        "Client CPU = the worker process's CPU per cycle (user + system, socket calls "
        "included); Redis CPU and Redis cmds (commands run, those inside scripts included) "
        "per cycle come from `INFO cpu` / `INFO commandstats` with that library alone on "
        "the server.\n"
    )
    add(
        "| library | backend | median µs | p99 µs | acquire µs | release µs | x floor | x redis-py Lock | client CPU µs | Redis CPU µs | Redis cmds | samples |"
    )
    add("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rp = next(
        (r for r in results["uncontended"] if r["label"] == "redis-py Lock" and "median_us" in r),
        None,
    )
    for r in results["uncontended"]:
        if "median_us" not in r:
            add(f"| {r['label']} | {r['backend']} | {r.get('error', 'n/a')} | | | | | | | | | |")
            continue
        add(
            f"| {r['label']} | {r['backend']} | {fmt(r['median_us'])} | {fmt(r['p99_us'])} "
            f"| {fmt(r['acquire_median_us'])} | {fmt(r['release_median_us'])} "
            f"| {fmt(ratio(r['median_us'], 2 * ping if ping and r['backend'] == 'redis' else None), 2)} "
            f"| {fmt(ratio(r['median_us'], rp['median_us'] if rp else None), 2)} "
            f"| {fmt(r['client_cpu_us'])} | {fmt(r['server_us'])} | {fmt(r['server_calls'])} | {r['n']} |"
        )
    add("")

    add("## Contention: N processes on one lock\n")
    add(
        "Each process loops: blocking acquire, hold (sleep), release, work outside (sleep "
        "2 x hold). Utilisation = time inside the critical section / wall time (1.0 is the "
        "limit); fairness = slowest process's acquisitions / fastest's; hand-off = "
        "release() called -> the next (already waiting) process's acquire returns; Redis "
        "cmds / acq = every command Redis ran (inside scripts too, failed attempts and "
        "wake-ups included) per acquisition. redis-py's Lock runs with its defaults "
        "(blocking, sleep=0.1) and timeout=30; python-redis-lock with expire=30.\n"
    )
    add(
        "| hold | procs | library | acq/s | utilisation | fairness (min) | hand-off median µs "
        "| hand-off p99 µs | hand-offs | Redis cmds / acq | BLPOP / acq |"
    )
    add("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    cells = [r for r in results["contention"].values() if "rate" in r]
    for r in sorted(cells, key=lambda r: (r["hold"], r["procs"], r["library"])):
        add(
            f"| {r['hold'] * 1000:g} ms | {r['procs']} | {r['library']} | {fmt(r['rate'], 0)} "
            f"| {fmt(r['utilisation'], 2)} | {fmt(r['fairness'], 2)} ({fmt(r['fairness_min'], 2)}) "
            f"| {fmt(r['handoff_median_us'])} | {fmt(r['handoff_p99_us'])} | {r['handoffs']} "
            f"| {fmt(r.get('server_calls_per_acq'))} | {fmt(r.get('blpop_per_acq'), 2)} |"
        )
    for r in results["contention"].values():
        if "error" in r:
            add(f"| | | {r['library']} | failed: {r['error']} | | | | | | | |")
    add("")

    add("## Renewal: live leases in one process, one watchdog thread\n")
    add(
        "Leases with TTL {ttl:g} s (renewed every ttl/3). A round = every lease renewed once. "
        "CPU = the watchdog thread's own CPU clock; round trips = `renew_many` calls (one "
        "pipelined round trip each); memory = traced Python memory per held lease (the "
        "`Lock` objects are excluded).\n".format(ttl=results["renewal_ttl"])
    )
    add(
        "| leases | rounds seen | watchdog CPU ms / round | µs / lease | round trips / round | median batch | Redis cmds / round | Redis CPU ms / round | bytes / lease | peak bytes / lease | lost |"
    )
    add("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results["renewal"]:
        if "error" in r:
            add(f"| {r['leases']} | failed: {r['error']} | | | | | | | | | |")
            continue
        add(
            f"| {r['leases']:,} | {fmt(r['rounds'], 1)} | {fmt(r['cpu_per_round_s'] * 1000, 2)} "
            f"| {fmt(r['cpu_per_round_s'] * 1e6 / r['leases'], 1)} | {fmt(r['calls_per_round'], 1)} "
            f"| {r['batch_size_median']:,} | {fmt(r['server_commands_per_round'], 0)} "
            f"| {fmt(r['server_cpu_per_round_s'] * 1000, 1)} | {fmt(r['memory_per_lease'], 0)} "
            f"| {fmt(r['peak_memory_per_lease'], 0)} | {r['lost']} |"
        )
    add("")

    add("## Celery (`bench/celery_bench.py`)\n")
    out.extend(celery_markdown(results.get("celery", {})))
    for key, title in (("backends", "Every backend of ours"), ("coordination", "Coordination")):
        section = results.get(key, {})
        if section.get("markdown"):
            add(f"## {title} (`bench/{key}_bench.py`)\n")
            add(section["markdown"] + "\n")
        elif section.get("status"):
            add(f"## {title} (`bench/{key}_bench.py`)\n")
            add(section["status"] + "\n")

    add("## Peers\n")
    add("| peer | status |")
    add("|---|---|")
    for peer, status in results["peers"].items():
        add(f"| {peer} | {status} |")
    add("")
    if results.get("notes"):
        add("## Notes\n")
        out.extend(f"- {note}" for note in results["notes"])
        add("")
    path.write_text("\n".join(out) + "\n")


def celery_markdown(celery: dict[str, Any]) -> list[str]:
    """The Celery section from ``celery_bench.run()``'s ``throughput`` (tasks/s per variant)."""
    if celery.get("status") != "ok":
        return [f"{celery.get('status', 'not measured')}\n"]
    rates = celery.get("throughput") or {}
    plain = rates.get("plain")
    lines = [
        f"{celery.get('n', '?')} tasks per round through one worker "
        f"(pool: {celery.get('pool', '?')}), {celery.get('rounds', '?')} rotated rounds, "
        "median rate; distinct lock keys, so no task is suppressed.\n",
        "| variant | tasks/s | x plain |",
        "|---|---:|---:|",
    ]
    for variant, rate in rates.items():
        lines.append(f"| {variant} | {fmt(float(rate), 0)} | {fmt(ratio(rate, plain), 2)} |")
    for variant in celery.get("not_measured") or []:
        lines.append(f"| {variant} | not measured: does not import in bench/.peers | |")
    if celery.get("markdown"):
        lines += ["", celery["markdown"]]
    lines.append("")
    lines.extend(burst_markdown(celery.get("burst")))
    return lines


def burst_markdown(burst: Any) -> list[str]:
    """Duplicate suppression (``celery_bench.measure_burst``): identical calls per library."""
    if not isinstance(burst, dict) or not burst.get("variants"):
        return []
    lines = [
        f"Duplicate suppression: {burst.get('calls', '?')} identical calls (same arguments) "
        f"published at once to one worker per library (pool {burst.get('pool', '?')}, each "
        f"run {burst.get('hold_seconds', '?')} s). Without suppression all of them run.\n",
        "| library | accepted at publish | ran | delivered, not run |",
        "|---|---:|---:|---:|",
    ]
    for label, sample in burst["variants"].items():
        lines.append(
            f"| {label} | {sample.get('accepted', 'n/a')} | {sample.get('ran', 'n/a')} "
            f"| {sample.get('skipped_at_run', 'n/a')} |"
        )
    for label in burst.get("not_measured") or []:
        lines.append(f"| {label} | not measured: does not import in bench/.peers | | |")
    lines.append("")
    return lines


def write_plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One Redis server (and memory://) only: the slower backends are in the table.
    rows = [
        r
        for r in results["uncontended"]
        if "median_us" in r and r["backend"] in ("redis", "memory")
    ]
    contention = [r for r in results["contention"].values() if "rate" in r]
    holds = sorted({r["hold"] for r in contention})
    fig, axes = plt.subplots(1, 1 + len(holds), figsize=(5 + 4 * len(holds), 4.8), squeeze=False)
    ax = axes[0][0]
    labels = [f"{r['label']}\n({r['backend']})" for r in rows]
    medians = [r["median_us"] for r in rows]
    colors = ["tab:green" if r["label"].startswith("task-locks") else "tab:gray" for r in rows]
    ax.barh(labels, medians, color=colors)
    right = 1.6 * max(medians, default=1)
    for y, r in enumerate(rows):  # p99 as text: on a shared machine it dwarfs the medians
        ax.text(r["median_us"] + right * 0.01, y, f"{r['median_us']:.0f} (p99 {r['p99_us']:,.0f})",
                va="center", fontsize=7)  # fmt: skip
    ax.set_xlim(0, right)
    ping = results["floor"].get(FLOOR, {}).get("ping", {}).get("median_us")
    if ping:
        ax.axvline(2 * ping, color="tab:red", linestyle="--", label=f"2 x PING ({2 * ping:.0f} µs)")
        ax.legend(loc="lower right", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("acquire + release, µs (median; p99 in brackets)")
    ax.set_title("Uncontended cycle, one Redis")
    ax.tick_params(axis="y", labelsize=8)
    for index, hold in enumerate(holds, start=1):
        ax = axes[0][index]
        cells = [r for r in contention if r["hold"] == hold]
        for library in sorted({r["library"] for r in cells}):
            series = sorted((r["procs"], r["rate"]) for r in cells if r["library"] == library)
            ax.plot([p for p, _ in series], [v for _, v in series], marker="o", label=library)
        if hold:
            ax.axhline(1 / hold, color="tab:red", linestyle=":", label="1 / hold (limit)")
        ax.set_xlabel("processes")
        ax.set_ylabel("acquisitions / s")
        ax.set_title(f"Contention, hold {hold * 1000:g} ms, outside {2 * hold * 1000:g} ms")
        ax.set_xticks(sorted({r["procs"] for r in cells}))
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle(f"task-locks vs peers ({results['mode']} run, {results['machine']['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="about a minute: fewer, shorter runs")
    mode.add_argument("--smoke", action="store_true", help="seconds: core parts only (tests)")
    parser.add_argument("--no-peers", action="store_true", help="do not install or run peers")
    parser.add_argument("--no-celery", action="store_true", help="skip bench/celery_bench.py")
    parser.add_argument("--out", type=Path, default=BENCH, help="where results.* go")
    args = parser.parse_args(argv)
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
                subjects.append(
                    Subject(
                        peer if peer != "pottery" else "pottery Redlock",
                        "redis",
                        peers_python,
                        adapter,
                        url,
                    )
                )
        if plan.other_backends:
            subjects += other_backends(main_python, extra_servers)
        start_subjects(subjects, log_dir)
        workers += [s.worker for s in subjects if s.worker]
        # The floor runs on the very client our Redis backend uses (redis-py's if ours
        # failed to start), and on the peers' client as a check that their stack is alike.
        floor_workers: dict[str, Worker] = {}
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
                floor_workers[key] = usable[0].worker
        log(f"uncontended: {plan.rounds} rounds x {plan.cycles} cycles x {len(subjects)} subjects")
        floors = measure_uncontended(subjects, plan, floor_workers)
        measure_server_cost(subjects, admin, plan.cycles)
        versions: dict[str, str] = {}
        uncontended = []
        for s in subjects:
            row: dict[str, Any] = {
                "label": s.label,
                "backend": s.backend,
                "diagnostic": s.diagnostic,
            }
            if s.error or not s.samples.get("cycle"):
                row["error"] = f"failed: {s.error}"
            else:
                row.update(summary_us(s.samples["cycle"]))
                row["acquire_median_us"] = quantile(s.samples["acq"], 0.5) / 1000
                row["release_median_us"] = quantile(s.samples["rel"], 0.5) / 1000
                row["client_cpu_us"] = s.cpu_ns / s.cpu_cycles / 1000 if s.cpu_cycles else None
                row["server_us"] = s.server_us
                row["server_calls"] = s.server_calls
            uncontended.append(row)
        for worker in workers:
            worker.close()
        workers.clear()

        contention_libs = [
            ("task-locks", main_python, "task-locks"),
            ("redis-py Lock", main_python, "redis-py"),
        ]
        if (
            "python-redis-lock" in plan.libraries
            and peers_python
            and installed(peers, "python-redis-lock")
        ):
            contention_libs.append(("python-redis-lock", peers_python, "python-redis-lock"))
        admin.flushall()
        log(
            f"contention: procs {plan.procs}, holds {plan.holds}, {plan.contention_seconds} s per run"
        )
        contention = measure_contention(contention_libs, url, plan, log_dir, admin)

        log(f"renewal: {plan.leases} leases")
        renewal = measure_renewal(url, plan, log_dir, admin.flushall)
        admin.flushall()

        celery: dict[str, Any] = {"status": "not measured: skipped"}
        if plan.celery and not args.no_celery:
            log("celery: bench/celery_bench.py")
            celery = run_hook(
                "celery_bench",
                redis_url=url,
                quick=plan.mode != "full",
                peers_python=peers_python,
                peers=peers,
                **({} if plan.mode == "full" else {"n": 300, "rounds": 2}),
            )
        backends: dict[str, Any] = {}
        coordination: dict[str, Any] = {}
        if plan.mode == "full":
            log("backends: bench/backends_bench.py")
            backends = run_hook("backends_bench", quick=False)
            coordination = run_hook("coordination_bench", quick=False)
        else:
            backends = {"status": f"skipped in --{plan.mode} (full run only)"}
            coordination = dict(backends)

        versions = {
            "task-locks": _dist_version("task-locks"),
            "redis-py": _dist_version("redis"),
            "hiredis": _dist_version("hiredis"),
            "celery": _dist_version("celery"),
            **{k: v for k, v in peers.items() if not v.startswith("not installed")},
        }
        machine["loadavg_end"] = os.getloadavg()
        results: dict[str, Any] = {
            "mode": plan.mode,
            "machine": machine,
            "versions": versions,
            "peers": peers,
            "floor": {
                who: {k: summary_us(v) for k, v in f.items() if v} for who, f in floors.items()
            },
            "uncontended": uncontended,
            "contention": contention,
            "renewal": renewal,
            "renewal_ttl": plan.renew_ttl,
            "celery": {k: v for k, v in celery.items() if k != "traceback"},
            "backends": backends,
            "coordination": coordination,
        }
        results["targets"] = [dict(vars(t), verdict=t.verdict) for t in check_targets(results)]
        results["notes"] = notes(results)
        results["elapsed_s"] = time.monotonic() - started
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        write_markdown(results, args.out / "results.md")
        write_plot(results, args.out / "results.png")
        for t in results["targets"]:
            log(
                f"{t['verdict']:4}  {t['what']}: {fmt(t['value'], 2)} (threshold {t['threshold']}) {t['note']}"
            )
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


def notes(results: dict[str, Any]) -> list[str]:
    """Plain statements of what the numbers mean, and the why of each MISS."""
    out = []
    m = results["machine"]
    load = max(m["loadavg_start"][0], m["loadavg_end"][0])
    if load > 0.5 * (m["nproc"] or 1):
        out.append(
            f"Load average reached {load:.1f} on {m['nproc']} CPUs: other jobs ran during "
            "this benchmark, so absolute figures (and p99s most of all) are noisy; ratios "
            "between libraries measured in the same rotated rounds hold up better."
        )
    verdict = {t["what"]: t for t in results["targets"]}
    unc = {(r["label"], r["backend"]): r for r in results["uncontended"] if "median_us" in r}
    ours, rp = unc.get(("task-locks", "redis")), unc.get(("redis-py Lock", "redis"))
    miss = lambda prefix: any(  # noqa: E731
        w.startswith(prefix) and t["verdict"] == "MISS" for w, t in verdict.items()
    )
    if ours and rp and miss("uncontended"):
        out.append(
            "Uncontended: our cycle is {o:.0f} µs against redis-py Lock's {r:.0f} µs "
            "(acquire {oa:.0f} vs {ra:.0f} µs, release {orl:.0f} vs {rrl:.0f} µs). Per cycle "
            "our client burns {oc} µs of CPU against {rc}, and Redis {os} µs against {rs} "
            "running {on} commands against {rn}: the acquire script also reads the server "
            "clock and the fence counter, writes the fence and the holder metadata (a hash) "
            "and sets two expiries; the release script also signals waiters (RPUSH, LTRIM, "
            "PEXPIRE); the client builds the owner JSON, a token, a Lease with a "
            "threading.Event and a watchdog entry. redis-py's acquire is one SET NX PX. On "
            "a 2-CPU machine shared by client, server and other jobs, CPU is latency.".format(
                o=ours["median_us"], r=rp["median_us"], oa=ours["acquire_median_us"],
                ra=rp["acquire_median_us"], orl=ours["release_median_us"],
                rrl=rp["release_median_us"], oc=fmt(ours.get("client_cpu_us"), 0),
                rc=fmt(rp.get("client_cpu_us"), 0), os=fmt(ours.get("server_us"), 0),
                rs=fmt(rp.get("server_us"), 0), on=fmt(ours.get("server_calls"), 0),
                rn=fmt(rp.get("server_calls"), 0),
            )
        )  # fmt: skip
    cell = results["contention"]
    ours_c, prl_c = cell.get("task-locks|4|0.001"), cell.get("python-redis-lock|4|0.001")
    ping = results["floor"].get(FLOOR, {}).get("ping", {}).get("median_us")
    if ours_c and miss("4 procs, 1 ms hold: lock utilisation"):
        handoff = ours_c["handoff_median_us"]
        out.append(
            f"Utilisation: each hand-off (release -> the woken waiter's acquire returns) "
            f"took {handoff:.0f} µs median"
            + (f" ({handoff / ping:.1f}x a PING)" if ping else "")
            + f", so with a 1 ms hold the lock cannot be busy more than about "
            f"{1000 / (1000 + handoff):.2f} of the time (sleep overshoot also counts as "
            "held). A hand-off is at least the release round trip, the BLPOP wake-up and "
            "the acquire round trip, plus waking a process when 4 workers and redis-server "
            f"share {m['nproc']} CPUs"
            + (
                f"; python-redis-lock, with the same BLPOP hand-off, reached "
                f"{prl_c['utilisation']:.2f} ({prl_c['handoff_median_us']:.0f} µs)."
                if prl_c
                else "."
            )
        )
    if ours_c and prl_c and miss("4 procs, 1 ms hold: rate / python-redis-lock"):
        out.append(
            "Against python-redis-lock: both hand over through BLPOP, so the rate follows "
            f"the cost of a hand-off: median {ours_c['handoff_median_us']:.0f} µs ours vs "
            f"{prl_c['handoff_median_us']:.0f} µs theirs in this run"
            + (
                f". Redis ran {ours_c['server_calls_per_acq']:.0f} commands per acquisition "
                f"for us against {prl_c['server_calls_per_acq']:.0f} for them: our failed "
                "attempt before the wait and our acquire after it are scripts (holder "
                "lookup; fence, metadata, expiries), theirs are SET NX, and on a 2-CPU "
                "machine Redis's time is on the hand-off's path"
                if "server_calls_per_acq" in ours_c and "server_calls_per_acq" in prl_c
                else ""
            )
            + "."
        )
    celery = results.get("celery", {})
    if miss("Celery:"):
        out.append(
            "Celery: every @singleton_task run takes and releases a lock (two Redis round "
            "trips, about one uncontended cycle above) on top of the broker's own work; "
            "with empty tasks on a solo-pool worker that is a large share of each task. "
            "The set-up and per-task worker CPU are in bench/celery_bench.py and its log."
        )
    if celery.get("not_measured"):
        out.append(
            "Celery peers not measured: " + ", ".join(celery["not_measured"]) + " (their "
            "library or kombu's Redis transport does not import in bench/.peers)."
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
