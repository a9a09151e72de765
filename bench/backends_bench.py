"""Every backend side by side, and pottery's Redlock beside ours on the same masters.

Per backend: the median (and p90) of one uncontended acquire+release cycle, and the
contended hand-off rate (4 threads taking the same lock in turn, nothing done inside,
so each hand-off costs one release plus one wake-up plus one acquire). pottery runs
from its own venv ``bench/.peers`` (created here if missing), against the very same
three Redis masters as ``redlock://``.

    .venv/bin/python bench/backends_bench.py           # about a minute
    .venv/bin/python bench/backends_bench.py --quick   # a few seconds per backend

``bench/run.py`` calls :func:`run` and folds the result into ``bench/results.md``.
Servers are started here (tests/servers.py) on free loopback ports; a backend whose
server or module is missing is reported as "not measured" with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from common import pg_floor_us
from peers import ensure_peers, installed

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
# This checkout's task_locks, not whatever the virtualenv's editable install points at.
sys.path.insert(0, str(ROOT))

TTL = 30.0
CONTENDERS = 4
ROUNDS = 3

# Runs in bench/.peers: the same two measurements, with pottery's Redlock.
POTTERY_WORKER = r"""
import json, statistics, sys, threading, time, uuid
import redis
from pottery import Redlock

ports, cycles, seconds, contenders, ttl = json.loads(sys.argv[1])
masters = {redis.Redis(port=p) for p in ports}

def lock(name):
    return Redlock(key=name, masters=masters, auto_release_time=ttl)

one = lock("pottery-unc-" + uuid.uuid4().hex)
for _ in range(min(50, cycles)):
    one.acquire(); one.release()
samples = []
for _ in range(cycles):
    t = time.perf_counter(); one.acquire(); one.release(); samples.append(time.perf_counter() - t)

name = "pottery-con-" + uuid.uuid4().hex
done = [0] * contenders
stop = time.monotonic() + seconds
def contend(i):
    mine = lock(name)
    while time.monotonic() < stop:
        if mine.acquire(blocking=True, timeout=5):
            done[i] += 1
            mine.release()
threads = [threading.Thread(target=contend, args=(i,)) for i in range(contenders)]
started = time.perf_counter()
for t in threads: t.start()
for t in threads: t.join()
elapsed = time.perf_counter() - started
print(json.dumps({"samples": samples, "handoffs": sum(done), "seconds": elapsed}))
"""


def log(message: str) -> None:
    print(f"[backends_bench] {message}", file=sys.stderr, flush=True)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- our backends -------------------------------------------------------------------------


Raw = tuple[list[float], int, float, list[str]]  # samples, hand-offs, seconds, errors


def measure_ours(url: str, cycles: int, seconds: float) -> Raw:
    """Uncontended cycle latency and contended hand-off rate for one backend URL."""
    from task_locks import Lock

    lock = Lock(f"bench-unc-{uuid.uuid4().hex}", ttl=TTL, backend=url, renew=False)
    for _ in range(min(50, cycles)):  # warm up connections and scripts
        lock.acquire(timeout=5).release()
    samples = []
    for _ in range(cycles):
        started = time.perf_counter()
        lock.acquire(timeout=5).release()
        samples.append(time.perf_counter() - started)

    name = f"bench-con-{uuid.uuid4().hex}"
    done = [0] * CONTENDERS
    errors: list[str] = []
    stop = time.monotonic() + seconds

    def contend(index: int) -> None:
        mine = Lock(name, ttl=TTL, backend=url, renew=False, timeout=10)
        try:
            while time.monotonic() < stop:
                mine.acquire().release()
                done[index] += 1
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(CONTENDERS)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    return samples, sum(done), elapsed, errors


def summarise(rounds: list[Raw]) -> dict[str, Any]:
    """Rounds of one subject merged: all samples, total hand-offs over total time."""
    samples = [x for r in rounds for x in r[0]]
    handoffs = sum(r[1] for r in rounds)
    elapsed = sum(r[2] for r in rounds)
    errors = [e for r in rounds for e in r[3]]
    result: dict[str, Any] = {
        "median_us": statistics.median(samples) * 1e6,
        # The typical round (median of the rounds' medians): a burst of load from other
        # jobs in one round does not decide it (the targets read this).
        "round_median_us": statistics.median(statistics.median(r[0]) for r in rounds if r[0]) * 1e6,
        "rounds": len(rounds),
        "p90_us": quantile(samples, 0.9) * 1e6,
        "cycles": len(samples),
        "handoffs_per_s": handoffs / elapsed if elapsed else 0.0,
        "handoffs": handoffs,
    }
    if errors:
        result["errors"] = errors[:3]
    return result


# -- pottery, from its own venv ---------------------------------------------------------------


def pottery_python() -> tuple[str | None, str]:
    """The peers' interpreter with pottery importable (``bench/peers.py`` installs it into
    ``bench/.peers`` as it installs every peer), and pottery's version or why not."""
    python, status = ensure_peers(True)
    if python is None or not installed(status, "pottery"):
        return None, f"pottery {status.get('pottery', 'not installed')}"
    return python, status["pottery"]


def measure_pottery(python: str, ports: list[int], cycles: int, seconds: float) -> Raw:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(POTTERY_WORKER)
    try:
        args = json.dumps([ports, cycles, seconds, CONTENDERS, TTL])
        done = subprocess.run(
            [python, script.name, args], capture_output=True, text=True, timeout=300, check=False
        )
    finally:
        os.unlink(script.name)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr else "failed")
    reply = json.loads(done.stdout)
    return reply["samples"], reply["handoffs"], reply["seconds"], []


# -- deployments ------------------------------------------------------------------------------


@contextmanager
def started(server: Any) -> Iterator[Any]:
    try:
        yield server.start()
    finally:
        server.cleanup()


def deployments(
    stack: ExitStack, only_targets: bool = False
) -> Iterator[tuple[str, Callable[[], str], Any]]:
    """(label, URL factory, the servers) for every backend (``only_targets``: those the
    targets read), started lazily."""
    import shutil

    import common  # noqa: F401  (puts tests/ on sys.path for servers)
    import servers

    if not only_targets:
        yield "memory", lambda: f"memory://{uuid.uuid4().hex}", None
        redis_server = stack.enter_context(started(servers.RedisServer()))
        yield "redis (1 server)", redis_server.url, redis_server
    masters = stack.enter_context(started(servers.RedisMasters(3)))
    yield "redlock (3 masters)", masters.url, masters
    if shutil.which("etcd"):
        node = stack.enter_context(started(servers.EtcdServer()))
        yield "etcd (1 member)", node.url, node
        if not only_targets:
            cluster = stack.enter_context(started(servers.EtcdCluster(3)))
            yield "etcd (3 members)", cluster.url, cluster
    else:
        yield "etcd", lambda: "", "no etcd binary (scripts/install-servers.sh installs it)"


DJANGO_ALIASES = {"django (SQLite)": "default", "django (PostgreSQL)": "pg"}


def django_worker(alias: str, cycles: int, seconds: float) -> None:
    """In a child process: set Django up on the test settings, migrate, measure, print.

    ``seconds`` 0: only the PostgreSQL cycle beside its floor (:func:`pg_floor`).
    """
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", database=alias, verbosity=0, interactive=False)
    raw: list[Any] = (
        list(measure_ours(f"django://{alias}", cycles, seconds)) if seconds else [[], 0, 0.0, []]
    )
    if alias == "pg":
        raw.append(pg_floor(alias, cycles))
    print(json.dumps(raw))


def alternating(
    subjects: dict[str, Callable[[], object]], cycles: int, block: int
) -> dict[str, list[float]]:
    """Each subject's call timed ``block`` times in turn, about ``cycles`` times in all:
    alternating blocks, so load from other jobs lands on every subject alike."""
    samples: dict[str, list[float]] = {key: [] for key in subjects}
    for _ in range(max(1, cycles // block)):
        for key, call in subjects.items():
            for _ in range(block):
                started = time.perf_counter()
                call()
                samples[key].append(time.perf_counter() - started)
    return samples


def pg_floor(alias: str, cycles: int) -> dict[str, Any]:
    """The uncontended cycle beside two raw ``SELECT 1`` round trips (the django:// target)
    and one durable one-row write, on a connection opened with the backend's own
    settings, in alternating blocks so that load lands on all alike; and the statements
    one cycle sends (counted on the backend's pooled connections)."""
    from task_locks import Lock

    lock = Lock(
        f"bench-floor-{uuid.uuid4().hex}", ttl=TTL, backend=f"django://{alias}", renew=False
    )
    backend: Any = lock.backend
    for _ in range(20):
        lock.acquire(timeout=5).release()
    sent: list[str] = []
    replay: list[tuple[Any, Any]] = []  # what one cycle sent, to send again raw

    def counting(base: Any) -> Any:
        """``base`` (the driver's cursor class) recording every statement it runs."""

        def execute(cursor: Any, query: Any, params: Any = None, **options: Any) -> Any:
            sql = str(query)
            sent.append("; ".join(" ".join(part.split())[:48] for part in sql.split("; ")))
            replay.append((query, params))
            return base.execute(cursor, query, params, **options)

        return type("Counting", (base,), {"execute": execute})

    # Counted in the driver (psycopg's cursor_factory, which Django's cursors come from
    # too), so statements the backend sends on raw driver cursors are counted as well.
    # The backend keeps a driver cursor with each connection: dropped before, so that the
    # counted cycle makes counting ones, and after, so that the timed cycles count nothing.
    wrappers = [w for w in backend.idle_connections() if w.connection is not None]
    idle = [w.connection for w in wrappers]
    factories = [raw.cursor_factory for raw in idle]
    for wrapper, raw, factory in zip(wrappers, idle, factories, strict=True):
        wrapper.task_locks_cursor = None
        raw.cursor_factory = counting(factory)
    lock.acquire(timeout=5).release()
    for wrapper, raw, factory in zip(wrappers, idle, factories, strict=True):
        wrapper.task_locks_cursor = None
        raw.cursor_factory = factory

    wrapper = backend.new_connection()  # the pool's settings: same options, own connection
    wrapper.ensure_connection()
    conn = wrapper.connection
    conn.execute("CREATE TABLE IF NOT EXISTS bench_floor (id int PRIMARY KEY, n bigint)")
    conn.execute("INSERT INTO bench_floor VALUES (1, 0) ON CONFLICT DO NOTHING")
    conn.execute("CREATE TABLE IF NOT EXISTS bench_floor_lock (id int PRIMARY KEY)")
    conn.execute("DELETE FROM bench_floor_lock")

    def select1_twice() -> None:
        with conn.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
            cursor.execute("SELECT 1")
            cursor.fetchone()

    def cycle() -> None:
        lock.acquire(timeout=5).release()

    def durable_write() -> None:
        conn.execute("UPDATE bench_floor SET n = n + 1 WHERE id = 1")

    def floor() -> None:
        """The floor as one call, the same shape as a cycle: measured apart, its parts
        ran up to 4x faster when they followed a durable write than in a block of their
        own (a CPU woken by the flush answers the next round trip sooner), so their sum
        swung with the block order; one call keeps those states as a cycle meets them."""
        select1_twice()
        durable_write()

    def bare_cycle() -> None:
        """The statements of one cycle (the same token: taken again, released again),
        sent raw on the floor's connection: the SQL's own cost, no lock code."""
        for query, params in replay:
            conn.execute(query, params, prepare=True).fetchall()

    def bare_lock() -> None:
        """The least any row lock's cycle sends: the row inserted (a durable commit: the
        acquire must survive a crash) and deleted (committed without waiting for its
        WAL flush, as our release is), no expiry, fence or wake-up: a release is a
        write, dearer than a ``SELECT 1`` even when nothing waits for its flush."""
        conn.execute("INSERT INTO bench_floor_lock VALUES (1)")
        conn.execute(
            "WITH d AS (DELETE FROM bench_floor_lock WHERE id = 1 RETURNING id) "
            "SELECT set_config('synchronous_commit', 'off', true) FROM d"
        ).fetchall()

    subjects = {
        "cycle": cycle,
        "select1x2": select1_twice,
        "bare_lock": bare_lock,
        "durable_write": durable_write,
        "floor": floor,
        "bare_cycle": bare_cycle,
    }
    samples = alternating(subjects, cycles, block=25)
    wrapper.close()
    return {"samples": samples, "statements": sent}


def etcd_floor(url: str, cycles: int) -> dict[str, Any]:
    """The etcd target's floor: the uncontended cycle beside two bare gateway requests (a
    range of a missing key) sent through the backend's own HTTP client (etcd3gw over one
    ``requests`` session: the same transport), in alternating blocks; beside them the
    least any lease-based lock cycle sends (grant a lease, put the key with it if absent,
    delete it if still ours), bare; and the requests one of our cycles sends."""
    import base64

    from task_locks import Lock

    lock = Lock(f"bench-floor-{uuid.uuid4().hex}", ttl=TTL, backend=url, renew=False)
    for _ in range(20):
        lock.acquire(timeout=5).release()
    client = lock.backend.transport()
    sent: list[str] = []
    caller = threading.get_ident()

    def count(response: Any, *args: Any, **kwargs: Any) -> None:
        # The caller's path only: the lease revoke goes out after the release returns,
        # from the backend's revoker thread.
        if threading.get_ident() == caller:
            sent.append(response.request.path_url.rsplit("/v3/", 1)[-1])

    client.session.hooks["response"].append(count)
    lock.acquire(timeout=5).release()
    client.session.hooks["response"].remove(count)

    def post(path: str, body: dict[str, Any]) -> Any:
        return client.post(client.get_url(path), json=body)

    missing = base64.b64encode(f"bench-floor-missing-{uuid.uuid4().hex}".encode()).decode()
    key = base64.b64encode(f"bench-floor-bare-{uuid.uuid4().hex}".encode()).decode()

    def range_twice() -> None:
        post("/kv/range", {"key": missing})
        post("/kv/range", {"key": missing})

    def bare_protocol() -> None:
        lease = post("/lease/grant", {"TTL": int(TTL)})["ID"]
        absent = [{"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}]
        put = [{"request_put": {"key": key, "value": "eA==", "lease": lease}}]
        post("/kv/txn", {"compare": absent, "success": put, "failure": []})
        ours = [{"key": key, "result": "EQUAL", "target": "LEASE", "lease": lease}]
        delete = [{"request_delete_range": {"key": key}}]
        post("/kv/txn", {"compare": ours, "success": delete, "failure": []})

    def cycle() -> None:
        lock.acquire(timeout=5).release()

    subjects = {"cycle": cycle, "range2": range_twice, "bare3": bare_protocol}
    return {"samples": alternating(subjects, cycles, block=10), "statements": sent}


def summarise_floor(floors: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`pg_floor` results of every round merged: medians in µs, their ratio."""
    merged: dict[str, list[float]] = {}
    for floor in floors:
        for key, values in floor["samples"].items():
            merged.setdefault(key, []).extend(values)
    medians = {f"{key}_us": statistics.median(v) * 1e6 for key, v in merged.items() if v}
    base = "select1x2_us" if "select1x2_us" in medians else "range2_us"
    return {
        **medians,
        "ratio": medians["cycle_us"] / medians[base],
        "statements": floors[-1]["statements"],
    }


def measure_django(
    alias: str, cycles: int, seconds: float, floors: list[dict[str, Any]] | None = None
) -> Raw:
    """django:// in a child process with its own database (SQLite file / PostgreSQL db);
    on PostgreSQL, :func:`pg_floor`'s result is appended to ``floors``."""
    line = django_child(alias, __file__, "--django-worker", alias, str(cycles), str(seconds))
    samples, handoffs, elapsed, errors, *floor = json.loads(line)
    if floors is not None:
        floors.extend(floor)
    return samples, handoffs, elapsed, errors


def django_child(alias: str, script: str, *args: str) -> str:
    """``script ARGS`` in a child process on the tests' Django settings, with a database of
    its own (an SQLite file; on PostgreSQL a database created, and dropped after): the
    last line it printed. Its last stderr line is the error if it fails."""
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="tests.django.settings")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    database = f"bench_task_locks_{os.getpid()}"
    with tempfile.TemporaryDirectory() as scratch:
        env["TASK_LOCKS_TEST_SQLITE"] = os.path.join(scratch, "bench.sqlite3")
        env["TASK_LOCKS_TEST_PG"] = database
        if alias == "pg":
            postgres_admin(f"CREATE DATABASE {database}")
        try:
            done = subprocess.run(
                [sys.executable, script, *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
                cwd=ROOT,
            )
        finally:
            if alias == "pg":
                postgres_admin(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
    if done.returncode != 0:
        raise RuntimeError((done.stderr.strip().splitlines() or ["failed"])[-1])
    return done.stdout.strip().splitlines()[-1]


def postgres_admin(sql: str) -> None:
    """Run ``sql`` on the local PostgreSQL's maintenance database (CREATE/DROP DATABASE)."""
    import psycopg

    with psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=postgres") as conn:
        conn.autocommit = True
        conn.execute(sql)  # type: ignore[arg-type]


def django_reason(alias: str) -> str | None:
    """Why django:// on ``alias`` cannot be measured here, or ``None``."""
    try:
        import django_app.backend  # noqa: F401
    except Exception as exc:
        return f"not measured: django_app.backend does not import ({exc})"
    if alias == "pg":
        import socket

        try:
            socket.create_connection(("127.0.0.1", 5432), timeout=0.5).close()
        except OSError:
            return "not measured: no PostgreSQL on 127.0.0.1:5432"
    return None


def run(
    quick: bool = False,
    peers_python: str | None = None,
    peers: dict[str, str] | None = None,
    only_targets: bool = False,
) -> dict[str, Any]:
    """Measure every backend; returns ``{"rows": [...], "markdown": "..."}``.

    Each subject is measured in ROUNDS short rounds, the order rotated each round; on
    ``redlock://`` ours and pottery take turns, so load on the machine falls on both
    alike. ``peers_python``/``peers``: the runner's peers venv (``bench/peers.py``), else
    installed here. ``only_targets``: just the three target cells (Redlock vs pottery,
    the etcd and PostgreSQL floors), for the runner's ``--quick``.
    """
    cycles, seconds = (200, 1.5) if quick else (1000, 4.0)
    per_round = (max(50, cycles // ROUNDS), seconds / ROUNDS)
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        for label, make_url, server in deployments(stack, only_targets):
            if isinstance(server, str):
                rows.append({"backend": label, "library": "task-locks", "status": server})
                continue
            url = make_url()
            log(f"{label}: {url}")
            subjects: dict[str, Callable[[], Raw]] = {
                "task-locks": partial(measure_ours, url, *per_round)
            }
            if label.startswith("redlock"):
                if peers is None:  # run alone: install the peers here
                    python, version = pottery_python()
                elif peers_python and installed(peers, "pottery"):
                    python, version = peers_python, peers["pottery"]
                else:
                    python, version = None, f"pottery {peers.get('pottery', 'not installed')}"
                if python is None:
                    rows.append({"backend": label, "library": "pottery Redlock", "status": version})
                else:
                    ports = [s.port for s in server.servers]
                    subjects[f"pottery {version} Redlock"] = partial(
                        measure_pottery, python, ports, *per_round
                    )
            measured: dict[str, list[Raw]] = {library: [] for library in subjects}
            failed: dict[str, str] = {}
            order = list(subjects)
            for turn in range(ROUNDS):
                for library in order[turn % len(order) :] + order[: turn % len(order)]:
                    if library in failed:
                        continue
                    try:
                        measured[library].append(subjects[library]())
                    except Exception as exc:
                        failed[library] = f"failed: {type(exc).__name__}: {exc}"
            for library in subjects:
                row: dict[str, Any] = {"backend": label, "library": library}
                if library in failed:
                    row["status"] = failed[library]
                else:
                    row.update(summarise(measured[library]))
                if library == "task-locks" and label.startswith("etcd") and "status" not in row:
                    try:
                        row["floor"] = summarise_floor([etcd_floor(url, cycles)])
                    except Exception as exc:
                        row["floor_status"] = f"failed: {type(exc).__name__}: {exc}"
                rows.append(row)
        for label, alias in DJANGO_ALIASES.items():
            if only_targets and alias != "pg":
                continue
            reason = django_reason(alias)
            if reason:
                rows.append({"backend": label, "library": "task-locks", "status": reason})
                continue
            log(f"{label}: django://{alias} (child process)")
            try:
                floors: list[dict[str, Any]] = []
                raw = [measure_django(alias, *per_round, floors) for _ in range(ROUNDS)]
                row = {"backend": label, "library": "task-locks", **summarise(raw)}
                if floors:
                    row["floor"] = summarise_floor(floors)
                rows.append(row)
            except Exception as exc:
                rows.append({"backend": label, "library": "task-locks", "status": f"failed: {exc}"})
    from task_locks import close_all

    close_all()
    result: dict[str, Any] = {
        "rows": rows,
        "contenders": CONTENDERS,
        "cycles": per_round[0] * ROUNDS,
        "seconds": seconds,
        "rounds": ROUNDS,
        "loadavg": os.getloadavg(),
    }
    result["markdown"] = markdown(result)
    return result


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Uncontended acquire+release ({result['cycles']} cycles) and contended hand-offs "
        f"({result['contenders']} threads, {result['seconds']} s, empty critical section), "
        f"in {result['rounds']} alternating rounds.",
        "",
        "| backend | library | median cycle | p90 cycle | hand-offs/s |",
        "|---|---|---:|---:|---:|",
    ]
    for row in result["rows"]:
        if "median_us" in row:
            lines.append(
                f"| {row['backend']} | {row['library']} | {row['median_us']:.0f} µs "
                f"| {row['p90_us']:.0f} µs | {row['handoffs_per_s']:.0f} |"
            )
        else:
            lines.append(f"| {row['backend']} | {row['library']} | {row.get('status', '?')} | | |")
    for row in result["rows"]:
        if "floor" in row:
            lines += ["", *floor_markdown(row["backend"], row["floor"])]
        elif "floor_status" in row:
            lines += ["", f"{row['backend']}: floor {row['floor_status']}"]
    ours = next(
        (
            r
            for r in result["rows"]
            if r["backend"].startswith("redlock") and r["library"] == "task-locks"
        ),
        {},
    )
    peer = next(
        (
            r
            for r in result["rows"]
            if r["backend"].startswith("redlock") and r["library"] != "task-locks"
        ),
        {},
    )
    if "median_us" in ours and "median_us" in peer:
        lines += [
            "",
            "redlock:// vs pottery on the same masters: cycle "
            f"{ours['round_median_us'] / peer['round_median_us']:.2f}x pottery's time "
            f"(typical round {ours['round_median_us']:.0f} vs {peer['round_median_us']:.0f} µs "
            f"over {ours['rounds']} rotated rounds), hand-offs "
            f"{ours['handoffs_per_s'] / max(peer['handoffs_per_s'], 1e-9):.1f}x pottery's rate.",
        ]
    return "\n".join(lines)


def floor_markdown(label: str, floor: dict[str, Any]) -> list[str]:
    """The cycle beside its floor, in prose: two raw SELECT 1 round trips and a durable
    write (the django:// target), or two bare gateway requests (the etcd target)."""
    statements = floor.get("statements", [])
    if "range2_us" in floor:
        return [
            f"{label}: cycle {floor['cycle_us']:.0f} µs = {floor['ratio']:.2f}x two bare "
            f"gateway requests (a range of a missing key, {floor['range2_us']:.0f} µs) over "
            "the backend's own HTTP client, alternating blocks; the least a lease-based "
            f"cycle sends (grant, put, delete), bare: {floor['bare3_us']:.0f} µs = "
            f"{floor['bare3_us'] / floor['range2_us']:.2f}x. {len(statements)} requests "
            "per cycle: " + ", ".join(f"`{s}`" for s in statements),
        ]
    count = sum(len(s.split("; ")) for s in statements)
    base = pg_floor_us(floor)
    bare = (
        f"; the cycle's own statements sent raw on that connection (no lock code): "
        f"{floor['bare_cycle_us']:.0f} µs = {floor['bare_cycle_us'] / base:.2f}x the floor"
        if "bare_cycle_us" in floor
        else ""
    )
    return [
        f"{label}: cycle {floor['cycle_us']:.0f} µs = {floor['cycle_us'] / base:.2f}x its "
        f"floor ({base:.0f} µs), two raw `SELECT 1` round trips then one durable one-row "
        f"write (its commit's WAL flush) timed as one call; apart they took "
        f"{floor['select1x2_us']:.0f} µs and {floor['durable_write_us']:.0f} µs. All measured "
        f"in the same child in alternating blocks{bare}. {count} statements in "
        f"{len(statements)} round trips per cycle: " + " / ".join(f"`{s}`" for s in statements),
    ]


def run_pg_floor(quick: bool = True) -> dict[str, Any]:
    """Only the django:// (PostgreSQL) target, for runs that skip this module's
    :func:`run` and :func:`run_targets` (``--smoke``): one child, no contention."""
    label, alias = "django (PostgreSQL)", "pg"
    reason = django_reason(alias)
    if reason:
        return {"rows": [{"backend": label, "library": "task-locks", "status": reason}]}
    floors: list[dict[str, Any]] = []
    measure_django(alias, 100 if quick else 600, 0.0, floors)
    row = {"backend": label, "library": "task-locks", "floor": summarise_floor(floors)}
    lines = [*floor_markdown(label, row["floor"]), "", "(Every backend side by side: full run.)"]
    return {"rows": [row], "markdown": "\n".join(lines)}


def run_targets(
    quick: bool = True, peers_python: str | None = None, peers: dict[str, str] | None = None
) -> dict[str, Any]:
    """Only the three target cells (Redlock vs pottery on the same masters, the etcd and
    PostgreSQL cycles beside their floors), for the runner's ``--quick``."""
    return run(quick=quick, peers_python=peers_python, peers=peers, only_targets=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--only-targets", action="store_true", help="only the Redlock, etcd and PostgreSQL cells"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--django-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.django_worker:
        alias, cycles, seconds = args.django_worker
        django_worker(alias, int(cycles), float(seconds))
        return 0
    result = run(quick=args.quick, only_targets=args.only_targets)
    print(result["markdown"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
