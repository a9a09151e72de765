"""The targets of issues 2, 8 and 15, checked as ratios from one run."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(BENCH))


from common import FLOOR, ratio  # noqa: E402


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
        _django_pg_target(results.get("backends", {})),
    ]
    return targets


def target_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """:func:`check_targets` as the results' ``targets`` rows (with each verdict)."""
    return [dict(vars(t), verdict=t.verdict) for t in check_targets(results)]


def _django_pg_target(backends: dict[str, Any]) -> Target:
    """Issue 15: django:// on PostgreSQL, an uncontended cycle within 2x two raw
    ``SELECT 1`` round trips, both measured in the same child (bench/backends_bench.py)."""
    what = "django (PostgreSQL) cycle <= 2x two SELECT 1"
    row = next(
        (r for r in backends.get("rows", []) if r.get("backend") == "django (PostgreSQL)"), {}
    )
    floor = row.get("floor")
    if not floor:
        reason = row.get("status") or backends.get("status") or "not measured"
        return Target(what, None, 2.0, False, note=str(reason))
    note = (
        f"cycle {floor['cycle_us']:.0f} µs, two SELECT 1 {floor['select1x2_us']:.0f} µs, "
        f"{len(floor.get('statements', []))} round trips per cycle"
    )
    if floor["ratio"] > 2.0:
        best = (floor["select1x2_us"] + floor["durable_write_us"]) / floor["select1x2_us"]
        note += (
            f"; a durable one-row write alone takes {floor['durable_write_us']:.0f} µs "
            "(its commit waits for the WAL flush) and the acquire must commit durably "
            "(a lost acquire after a crash would mean two holders, a lost fence bump a "
            f"repeated fence): two round trips plus that one flush are already {best:.1f}x"
        )
    return Target(what, floor["ratio"], 2.0, False, note=note)


def _celery_rate(celery: dict[str, Any], variant: str) -> float | None:
    """TODO: adapt to bench/celery_bench.py's result shape once it exists."""
    rates = celery.get("throughput") or {}
    value = rates.get(variant) if isinstance(rates, dict) else None
    return float(value) if isinstance(value, int | float) else None
