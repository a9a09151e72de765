"""The benchmark runner still works end to end, so ``make bench`` cannot rot unnoticed.

Runs ``bench/run.py --smoke --no-peers`` (its own redis-server, tiny counts, no peer
installation, a few seconds) and checks that every core measurement produced numbers and
that both output files were written. Speed targets are NOT asserted here: they live in
``bench/results.md``; a loaded test machine must not fail the suite.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "bench" / "run.py"


def load_bench(module: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """One of bench/'s modules (they import each other by plain name, from bench/, the
    folder a script's run puts first on sys.path: here for this test only)."""
    monkeypatch.syspath_prepend(str(RUNNER.parent))
    spec = importlib.util.spec_from_file_location(
        f"bench_{module}", RUNNER.with_name(f"{module}.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(90)
def test_smoke_run_measures_every_core_part_and_writes_both_files(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(RUNNER), "--smoke", "--no-peers", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())

    floor = next(iter(results["floor"].values()))
    assert floor["ping"]["median_us"] > 0 and floor["set"]["median_us"] > 0
    rows = {(r["label"], r["backend"]): r for r in results["uncontended"]}
    for key in [
        ("task-locks", "redis"),
        ("task-locks", "memory"),
        ("redis-py Lock", "redis"),
        ("floor: fenced cycle, no lock code", "redis"),
    ]:
        assert rows[key].get("median_us", 0) > 0, rows[key]
        assert rows[key]["p99_us"] >= rows[key]["median_us"]
    # The same scripts' commands sent raw: the floor runs as many Redis commands as ours.
    assert rows[("floor: fenced cycle, no lock code", "redis")]["server_calls"] == 8.0
    ring = results["wakeup"]["ring"]
    assert ring.get("members") == 4 and ring.get("rate", 0) > 0, ring

    ours = results["contention"]["task-locks|2|0.001"]
    assert ours["acquisitions"] > 0
    assert 0 < ours["utilisation"] <= 1
    assert 0 < ours["fairness"] <= 1
    assert "redis-py Lock|2|0.001" in results["contention"]
    # The opt-out client hand-off (handoff=client) runs in the same rounds, Redis commands
    # counted.
    handoff = results["contention"]["task-locks-client|2|0.001"]
    assert handoff["acquisitions"] > 0
    assert ours["server_calls_per_acq"] > 0 and handoff["server_calls_per_acq"] > 0

    (renewal,) = results["renewal"]
    assert "error" not in renewal, renewal
    assert renewal["rounds"] >= 1 and renewal["lost"] == 0
    assert renewal["calls_per_round"] >= 1 and renewal["memory_per_lease"] > 0

    # Peers that were not installed are reported, never silently dropped.
    assert results["peers"]["python-redis-lock"].startswith("not installed:")
    verdicts = {t["what"]: t["verdict"] for t in results["targets"]}
    assert set(verdicts.values()) <= {"PASS", "MISS", "n/a"}
    assert verdicts["uncontended cycle / redis-py Lock (median)"] in {"PASS", "MISS"}
    # The contention targets, once for each of our two hand-offs.
    for name in ("task-locks (default", "task-locks-client (opt-out"):
        assert any(what.startswith(name) for what in verdicts), verdicts

    markdown = (tmp_path / "results.md").read_text()
    for heading in ["## Targets", "## The floor", "## Uncontended", "## Contention", "## Renewal"]:
        assert heading in markdown
    assert "python-redis-lock | not installed: skipped (--no-peers)" in markdown
    # The singleton run profile (bench/celery_profile.py, quick) is written by the report,
    # and the record measured by hand kept under it.
    profile = results["celery_profile"]
    assert profile["status"] == "ok", profile
    assert profile["singleton_us"] > 0 and profile["parts_us"]
    assert "## Celery: where a singleton run's time goes" in markdown
    assert "| part of one singleton run" in markdown
    assert "### Recorded by hand" in markdown
    assert (tmp_path / "results.png").read_bytes().startswith(b"\x89PNG")


def test_contention_figures_from_known_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes taking turns: rate, utilisation, fairness and hand-off come out exact."""
    runner = load_bench("measure", monkeypatch)
    # [asked, acquired, releasing]: A holds 0-1, B waits from 0.5 and gets it at 1.1, A asks
    # again at 1.5 and gets it at 2.2 after B releases at 2.0; the window is 0-4 s.
    a = [[0.0, 0.0, 1.0], [1.5, 2.2, 3.0]]
    b = [[0.5, 1.1, 2.0]]
    stats = runner.contention_stats([([a, b], 0.0, 4.0)])
    assert stats["acquisitions"] == 3
    assert stats["rate"] == pytest.approx(0.75)
    assert stats["utilisation"] == pytest.approx((1.0 + 0.9 + 0.8) / 4)
    assert stats["fairness"] == pytest.approx(0.5)
    assert stats["handoffs"] == 2
    assert stats["handoff_median_us"] == pytest.approx(100_000, rel=1e-6)  # 0.1 s
    assert stats["handoff_p99_us"] == pytest.approx(200_000, rel=1e-6)  # 0.2 s


def test_contention_targets_pass_or_miss_with_the_measured_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Known figures in, verdicts and reasons out, for both of our hand-offs."""
    targets = load_bench("targets", monkeypatch)

    def cell(rate: float, calls: float, fairness: float = 1.0, util: float = 0.95) -> dict:
        return {
            "rate": rate,
            "fairness": fairness,
            "fairness_min": fairness,
            "utilisation": util,
            "handoff_median_us": 150.0,
            "server_calls_per_acq": calls,
            "blpop_per_acq": 1.0,
        }

    contention = {}
    for hold in (0.0, 0.0002, 0.001):
        contention[f"python-redis-lock|4|{hold}"] = cell(1000, 10)
        contention[f"task-locks-client|4|{hold}"] = cell(900, 17, fairness=0.9, util=0.7)
        contention[f"task-locks|4|{hold}"] = cell(1300, 8)
    results = {
        "uncontended": [],
        "floor": {"our client (.venv)": {"ping": {"median_us": 60.0}}},
        "contention": contention,
    }
    rows = {t.what: t for t in targets.check_targets(results)}
    client = "task-locks-client (opt-out handoff=client): "
    server = "task-locks (default, server hand-off): "
    rate0 = "4 procs, hold 0: rate / python-redis-lock"
    assert rows[client + rate0].verdict == "MISS"
    assert "900 vs 1000 acq/s" in rows[client + rate0].note
    assert rows[server + rate0].verdict == "PASS"
    cmds = "Redis cmds per contended acquisition / python-redis-lock's (4 procs, hold 0)"
    assert rows[client + cmds].verdict == "MISS" and "17.0 vs 10.0" in rows[client + cmds].note
    assert rows[server + cmds].verdict == "PASS"
    ping = "hand-off median / PING round trip (4 procs, 1 ms hold)"
    assert rows[server + ping].value == pytest.approx(2.5)
    assert rows[server + ping].verdict == "PASS"
    util = "4 procs, 1 ms hold / 2 ms outside: time inside the lock / wall time"
    assert rows[client + util].verdict == "MISS" and rows[server + util].verdict == "PASS"


def test_the_floors_say_what_no_lock_code_reaches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Known figures in: the uncontended target names the fenced floor's ratio, and the
    hold-0 rate target the token ring's ceiling against python-redis-lock."""
    targets = load_bench("targets", monkeypatch)

    def row(label: str, typical: float, server_us: float) -> dict:
        return {
            "label": label,
            "backend": "redis",
            "median_us": typical,
            "round_median_us": typical,
            "acquire_median_us": typical / 2,
            "release_median_us": typical / 2,
            "client_cpu_us": 150.0,
            "server_us": server_us,
            "server_calls": 8.0,
        }

    results = {
        "uncontended": [
            row("task-locks", 330.0, 90.0),
            row("redis-py Lock", 300.0, 30.0),
            row("floor: fenced cycle, no lock code", 321.0, 88.0),
        ],
        "floor": {"our client (.venv)": {"ping": {"median_us": 100.0}}},
        "contention": {
            f"{lib}|4|0.0": {
                "rate": 3000.0,
                "handoff_median_us": 300.0,
                "fairness": 1.0,
                "fairness_min": 1.0,
            }
            for lib in ("task-locks", "python-redis-lock")
        },
        "wakeup": {"ring": {"members": 4, "rate": 3300.0, "handoff_us": 303.0}},
    }
    rows = {t.what: t for t in targets.check_targets(results)}
    unc = rows["uncontended cycle / redis-py Lock (median)"]
    assert unc.verdict == "MISS" and "takes 321 µs = 1.07x" in unc.note, unc.note
    hold0 = rows["task-locks (default, server hand-off): 4 procs, hold 0: rate / python-redis-lock"]
    assert "make 3300 hand-offs/s = 1.10x python-redis-lock's rate" in hold0.note, hold0.note

    # Celery: a plain task that also sends the run lock's round trip as bare scripts.
    rates = {"plain": 1000.0, "plain+floor": 800.0, "singleton_task": 600.0}
    results["celery"] = {"status": "ok", "throughput": {**rates, "celery-singleton": 750.0}}
    rows = {t.what: t for t in targets.check_targets(results)}
    plain = rows["Celery: @singleton_task / plain task throughput"]
    assert plain.verdict == "MISS" and "runs 800/s = 0.80x plain" in plain.note, plain.note
    peer = rows["Celery: @singleton_task / celery-singleton throughput"]
    assert "= 1.07x celery-singleton" in peer.note, peer.note


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ['lock_on="both"', "limit=3"])
def test_a_celery_mode_leaves_one_key_per_run_and_one_shared_counter(
    redis_url: str, mode: str
) -> None:
    """The Celery footprint cell's one mode (``bench/celery_footprint.py``), a few runs:
    each run's key keeps its release tombstone (a minute), nothing else is per run, and
    only the database's fence counter lives longer."""
    done = subprocess.run(
        [sys.executable, str(RUNNER.with_name("celery_footprint.py")), "--one", "ours", mode,
         "--url", redis_url, "--n", "40"],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["left_keys"] == 40 + 1, found
    assert found["left_keys_beyond_60s"] == 1, found


def test_celery_footprint_targets_name_the_worst_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two keys a run (a second lock beside the run's) is a MISS, and says which mode."""
    targets = load_bench("targets", monkeypatch)

    def mode(keys: int, lasting: int) -> dict[str, int]:
        return {"cycles": 100, "left_keys": keys, "left_keys_beyond_60s": lasting}

    found = {"status": "ok", "modes": {"run": mode(101, 1), "both": mode(201, 1)}}
    per_run, lasting = targets._celery_footprint_targets(found)
    assert per_run.verdict == "MISS" and per_run.value == 2.0 and "both" in per_run.note
    assert lasting.verdict == "PASS"
    found["modes"]["both"] = mode(101, 1)
    found["modes"]["celery-singleton"] = mode(0, 0)  # a peer: not one of ours
    assert [t.verdict for t in targets._celery_footprint_targets(found)] == ["PASS", "PASS"]
    assert targets._celery_footprint_targets({"status": "skipped"})[0].verdict == "n/a"


def test_lock_footprint_targets_say_what_a_live_lock_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory per live lock against python-redis-lock's, with what each key and value
    hold; keys left beyond 60 s after unique-name cycles: shared state only."""
    targets = load_bench("targets", monkeypatch)

    def lib(live: float, key: float, value: float, left: int, lasting: int) -> dict:
        return {
            "live_bytes_per_lock": live,
            "live_keys_per_lock": 1.0,
            "live_key_chars_per_lock": key,
            "live_value_bytes_per_lock": value,
            "cycles": 1000,
            "left_keys": left,
            "left_keys_beyond_60s": lasting,
        }

    found = {"task-locks": lib(216, 31, 122, 1001, 1), "python-redis-lock": lib(171, 23, 24, 0, 0)}
    memory, lasting = targets._lock_footprint_targets(found)
    assert memory.verdict == "MISS" and memory.value == pytest.approx(216 / 171)
    assert "a value of 122 vs 24 B" in memory.note and "the fence" in memory.note, memory.note
    assert "floor" not in memory.note  # (not measured)
    assert lasting.verdict == "PASS" and "1,001 keys right after" in lasting.note
    # The floor: a bare token, fence and owner under python-redis-lock's key.
    found["task-locks"]["record_floor"] = {
        "live_bytes_per_lock": 192.0,
        "live_key_chars_per_lock": 22.0,
        "live_value_bytes_per_lock": 58.0,
    }
    memory, _ = targets._lock_footprint_targets(found)
    assert "owner (host|pid|thread, 58 B) takes 192 B = 1.12x" in memory.note, memory.note
    found["task-locks"] = lib(160, 31, 40, 2001, 1001)  # a key per name kept beyond 60 s
    memory, lasting = targets._lock_footprint_targets(found)
    assert memory.verdict == "PASS" and lasting.verdict == "MISS"
    assert [t.verdict for t in targets._lock_footprint_targets({})] == ["n/a", "n/a"]


def test_the_commands_target_says_which_commands_and_the_floor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A contended acquisition's commands, by name, each library's; the server hand-off's
    note also counts the least any fenced hand-off inside the server runs."""
    targets = load_bench("targets", monkeypatch)
    mine = {"server_calls_by_command": {"evalsha": 2.0, "get": 3.0, "blpop": 1.0, "ttl": 0.01}}
    prl = {"server_calls_by_command": {"set": 2.0, "blpop": 1.0}}
    note = targets._commands_note(mine, prl, server_handoff=True)
    assert "ours: evalsha 2.0, get 3.0, blpop 1.0;" in note and "ttl" not in note, note
    assert "python-redis-lock's: set 2.0, blpop 1.0" in note
    assert "at least 11 per contended acquisition" in note
    assert "at least 11" not in targets._commands_note(mine, prl, server_handoff=False)


def test_backend_targets_pass_or_miss_with_the_measured_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Redlock against pottery, etcd against two bare requests, django:// against its
    floor: known figures in, ratios, verdicts and reasons out (or "n/a" with why)."""
    targets = load_bench("targets", monkeypatch)
    backends = {
        "status": "ok",
        "rows": [
            {
                "backend": "redlock (3 masters)",
                "library": "task-locks",
                "round_median_us": 1000.0,
                "rounds": 3,
                "handoffs_per_s": 400.0,
            },
            {
                "backend": "redlock (3 masters)",
                "library": "pottery 3.0.1 Redlock",
                "round_median_us": 1250.0,
                "rounds": 3,
                "handoffs_per_s": 300.0,
            },
            {
                "backend": "etcd (1 member)",
                "library": "task-locks",
                "floor": {
                    "cycle_us": 4000.0,
                    "range2_us": 2000.0,
                    "bare3_us": 3400.0,
                    "statements": ["lease/grant", "kv/txn", "kv/txn"],
                },
            },
            {
                "backend": "django (PostgreSQL)",
                "library": "task-locks",
                "floor": {
                    "cycle_us": 440.0,
                    "select1x2_us": 100.0,
                    "durable_write_us": 300.0,
                    "bare_cycle_us": 420.0,
                    "statements": ["WITH live", "WITH d"],
                },
            },
        ],
    }
    results = {"uncontended": [], "floor": {}, "contention": {}, "backends": backends}
    rows = {t.what.split(" ")[0]: t for t in targets.check_targets(results)}
    redlock, etcd, django = rows["redlock"], rows["etcd"], rows["django"]
    assert redlock.value == pytest.approx(0.8) and redlock.verdict == "PASS"
    assert "1000 vs 1250 µs over 3 rotated rounds" in redlock.note
    assert etcd.value == pytest.approx(2.0) and etcd.verdict == "MISS"
    assert "3 requests per cycle" in etcd.note and "= 1.70x already" in etcd.note
    assert django.value == pytest.approx(1.1) and django.verdict == "PASS"
    assert "floor 400 µs" in django.note and "= 1.05x" in django.note
    # Since the floor is timed as one call (its parts apart swing with the CPU's state),
    # that figure decides; the parts' sum above is for results from before it.
    backends["rows"][-1]["floor"]["floor_us"] = 200.0
    django = next(t for t in targets.check_targets(results) if t.what.startswith("django"))
    assert django.value == pytest.approx(2.2) and django.verdict == "MISS"
    assert "floor 200 µs" in django.note and "apart 100 + 300" in django.note

    missing = {"uncontended": [], "floor": {}, "contention": {}, "backends": {"rows": []}}
    missing["backends"]["rows"] = [
        {"backend": "redlock (3 masters)", "library": "pottery Redlock", "status": "no pip"},
    ]
    rows = {t.what.split(" ")[0]: t for t in targets.check_targets(missing)}
    assert rows["redlock"].verdict == "n/a" and rows["redlock"].note == "no pip"
    assert rows["etcd"].verdict == "n/a" and rows["django"].verdict == "n/a"


@pytest.mark.timeout(60)
def test_the_layer_breakdown_runs_and_prints_each_layer() -> None:
    """bench/layers.py (its own redis-server, one short round): every subject measured."""
    done = subprocess.run(
        [sys.executable, str(RUNNER.with_name("layers.py")), "--rounds", "1", "--block", "20"],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for subject in ("Lock cycle (redis, defaults)", "backend calls only", "floor: two bare"):
        assert f"| {subject}" in done.stdout, done.stdout
    assert "Lock, plan and lease:" in done.stdout
