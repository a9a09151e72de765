"""The speed targets (the uncontended cycle, contention and hand-off, Celery throughput,
django:// on PostgreSQL, Redlock against pottery, etcd against bare requests), checked as
ratios from one run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common import FLOOR, fmt, pg_floor_us, ratio


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


#: The two ways task-locks hands a contended lock over, each checked against the contention targets.
OURS = (
    ("task-locks", "task-locks (default, server hand-off)"),
    ("task-locks-client", "task-locks-client (opt-out handoff=client)"),
)


def check_targets(results: dict[str, Any]) -> list[Target]:
    unc = {(r["label"], r["backend"]): r for r in results["uncontended"] if "median_us" in r}
    # The typical round (median of each round's median), where the run has it: rounds
    # alternate, so a burst of load from other jobs in a few rounds does not decide it.
    typical = "round_median_us"
    ours = unc.get(("task-locks", "redis"), {}).get(typical)
    redis_py = unc.get(("redis-py Lock", "redis"), {}).get(typical)
    ping = results["floor"].get(FLOOR, {}).get("ping", {}).get("median_us")
    typical_ping = results.get("floor_round_ping_us", {}).get(FLOOR, ping)
    mine_calls = unc.get(("task-locks", "redis"), {}).get("server_calls")
    prl_calls = unc.get(("python-redis-lock", "redis"), {}).get("server_calls")
    woken = unc.get(("task-locks", "redis"), {}).get("wakeups_per_cycle")
    cell = results["contention"]
    ours_1ms = cell.get("task-locks|4|0.001", {})
    celery = results.get("celery", {})
    targets = [
        Target(
            "uncontended cycle / redis-py Lock (median)",
            ratio(ours, redis_py),
            1.05,
            False,
            note=_uncontended_note(unc),
        ),
        Target(
            "uncontended cycle: Redis cmds / python-redis-lock's",
            ratio(mine_calls, prl_calls),
            1.0,
            False,
            note=f"{fmt(mine_calls)} vs {fmt(prl_calls)} (INFO commandstats, commands inside "
            "scripts counted)",
        ),
        Target(
            "uncontended cycle: background thread wake-ups per cycle",
            woken,
            0.01,
            False,
            unit="",
            note="the deadline watch's and the renewal lanes' wake-ups: a lease released "
            "before its first renewal is due costs none (at most 1 per 100 cycles, the "
            "threads' own timers)",
        ),
        Target(
            "uncontended cycle / two raw PING round trips (median)",
            ratio(ours, 2 * typical_ping if typical_ping else None),
            2.5,
            False,
        ),
        Target(
            "4 procs, 1 ms hold: rate / redis-py Lock (default sleep=0.1)",
            ratio(ours_1ms.get("rate"), cell.get("redis-py Lock|4|0.001", {}).get("rate")),
            1.5,
            True,
        ),
        Target(
            "4 procs, 1 ms hold: fairness (slowest / fastest)",
            ours_1ms.get("fairness"),
            0.8,
            True,
            unit="",
        ),
    ]
    for lib, name in OURS:
        if not any(key.startswith(f"{lib}|") for key in cell):
            continue  # not in this plan's libraries (--smoke measures only some)
        targets += contention_targets(cell, lib, name, ping, results.get("wakeup", {}))
    plain = _celery_rate(celery, "plain")
    mine = _celery_rate(celery, "singleton_task")
    missing = "" if celery.get("status") == "ok" else celery.get("status", "not measured")
    rates = f"@singleton_task {fmt(mine, 0)}/s, plain {fmt(plain, 0)}/s"
    targets += [
        Target(
            "Celery: @singleton_task / plain task throughput",
            ratio(mine, plain),
            0.85,
            True,
            note=missing or rates + _celery_floor_note(celery, "plain"),
        ),
        Target(
            "Celery: @singleton_task / celery-singleton throughput",
            ratio(mine, _celery_rate(celery, "celery-singleton")),
            1.0,
            True,
            note=missing
            or f"celery-singleton {fmt(_celery_rate(celery, 'celery-singleton'), 0)}/s"
            + _celery_floor_note(celery, "celery-singleton"),
        ),
        Target(
            "Celery: @singleton_task / celery-once throughput",
            ratio(mine, _celery_rate(celery, "celery-once")),
            1.0,
            True,
            note=missing
            or f"celery-once {fmt(_celery_rate(celery, 'celery-once'), 0)}/s"
            + _celery_floor_note(celery, "celery-once"),
        ),
        *_lock_footprint_targets(results.get("footprint", {})),
        *_celery_footprint_targets(results.get("celery_footprint", {})),
        _django_pg_target(results.get("backends", {})),
        _redlock_target(results.get("backends", {})),
        _etcd_target(results.get("backends", {})),
    ]
    return targets


def _lock_footprint_targets(found: dict[str, Any]) -> list[Target]:
    """What a lock keeps in Redis (bench/workers.py ``footprint``): memory per live lock
    against python-redis-lock's, with what each one's key and value hold; and the keys
    left beyond 60 s after cycles of unique names (shared state only)."""
    ours, prl = found.get("task-locks", {}), found.get("python-redis-lock", {})
    memory_note = "not measured" if not ours else "python-redis-lock not measured"
    if ours and prl:
        memory_note = f"{ours['live_bytes_per_lock']:.0f} vs {prl['live_bytes_per_lock']:.0f} B"
        if "live_value_bytes_per_lock" in ours and "live_value_bytes_per_lock" in prl:
            memory_note += (
                f"; per live lock a key of {ours['live_key_chars_per_lock']:.0f} vs "
                f"{prl['live_key_chars_per_lock']:.0f} characters and a value of "
                f"{ours['live_value_bytes_per_lock']:.0f} vs "
                f"{prl['live_value_bytes_per_lock']:.0f} B: beside its token our record "
                "holds the fence, the acquire time, the owner (JSON: host, pid, thread), "
                "the waiter count and the last release id, and its key the prefix and the "
                "name's hash-tag braces; python-redis-lock's value is its token alone"
            )
        memory_note += _record_floor_note(ours.get("record_floor"), prl)
    lasting = ours.get("left_keys_beyond_60s")
    return [
        Target(
            "Redis memory per live lock / python-redis-lock's",
            ratio(ours.get("live_bytes_per_lock"), prl.get("live_bytes_per_lock")),
            1.0,
            False,
            note=memory_note,
        ),
        Target(
            "unique-name Lock cycles: keys left beyond 60 s (shared state only)",
            None if lasting is None else float(lasting),
            1.0,
            False,
            unit="",
            note=(
                f"after {ours['cycles']:,} cycles, each of a name of its own: "
                f"{ours['left_keys']:,} keys right after (each name's release tombstone "
                "lives 60 s), and beyond 60 s only the database's fence counter"
                if ours
                else "not measured"
            ),
        ),
    ]


def _record_floor_note(floor: dict[str, Any] | None, prl: dict[str, Any]) -> str:
    """The least memory a live lock naming its holder and fence costs (bench/workers.py
    ``record_floor``), against python-redis-lock's."""
    if not floor or "live_bytes_per_lock" not in floor:
        return ""
    return (
        f"; floor: python-redis-lock's key with a value of only a token, a fence and the "
        f"owner (host|pid|thread, {floor['live_value_bytes_per_lock']:.0f} B) takes "
        f"{floor['live_bytes_per_lock']:.0f} B = "
        f"{fmt(ratio(floor['live_bytes_per_lock'], prl['live_bytes_per_lock']), 2)}x: a "
        "value over 44 bytes is no longer stored inside its key's object, so no record "
        "that names its holder and its fence is as small as a bare token here"
    )


def _celery_footprint_targets(found: dict[str, Any]) -> list[Target]:
    """One lock per run, whatever the options: the keys each mode's runs leave right
    after (a run's record keeps its release tombstone a minute), and beyond 60 s."""
    modes = {k: v for k, v in (found.get("modes") or {}).items() if "left_keys" in v}
    ours = {k: v for k, v in modes.items() if k not in ("celery-singleton", "celery-once")}
    missing = "" if ours else found.get("status", "not measured")

    def worst(value: Any) -> tuple[float | None, str]:
        if not ours:
            return None, missing
        label, r = max(ours.items(), key=lambda item: value(item[1]))
        return value(r), f"worst: {label}"

    per_run, per_run_note = worst(
        lambda r: (r["left_keys"] - r["left_keys_beyond_60s"]) / r["cycles"]
    )
    lasting, lasting_note = worst(lambda r: float(r["left_keys_beyond_60s"]))
    return [
        Target(
            "Celery: keys a run leaves for a minute, worst mode (one lock per run)",
            per_run,
            1.0,
            False,
            unit="",
            note=per_run_note,
        ),
        Target(
            "Celery: keys left beyond 60 s after N runs, worst mode (shared state only)",
            lasting,
            1.0,
            False,
            unit="",
            note=lasting_note,
        ),
    ]


def contention_targets(
    cell: dict[str, Any],
    lib: str,
    name: str,
    ping: float | None,
    wakeup: dict[str, Any] | None = None,
) -> list[Target]:
    """The contention targets (a)-(d) for one of our hand-offs, against
    python-redis-lock in the same rotated rounds; a MISS says what was measured."""
    out: list[Target] = []
    prl_missing = "python-redis-lock not measured (not installed or failed)"

    def pair(n: int, hold: float) -> tuple[dict[str, Any], dict[str, Any]]:
        return cell.get(f"{lib}|{n}|{hold}", {}), cell.get(f"python-redis-lock|{n}|{hold}", {})

    def rate_note(mine: dict[str, Any], prl: dict[str, Any]) -> str:
        if not mine:
            return cell.get(f"{lib}|failed", {}).get("error", "cell not measured")
        if not prl:
            return prl_missing
        return (
            f"{mine['rate']:.0f} vs {prl['rate']:.0f} acq/s; hand-off median "
            f"{mine['handoff_median_us']:.0f} vs {prl['handoff_median_us']:.0f} µs; Redis cmds/acq "
            f"{fmt(mine.get('server_calls_per_acq'))} vs {fmt(prl.get('server_calls_per_acq'))}"
        )

    # (a) short critical sections: hold 0, and hold 0.2 ms with 0.4 ms outside.
    for hold, what in ((0.0, "hold 0"), (0.0002, "hold 0.2 ms / 0.4 ms outside")):
        mine, prl = pair(4, hold)
        out.append(
            Target(
                f"{name}: 4 procs, {what}: rate / python-redis-lock",
                ratio(mine.get("rate"), prl.get("rate")),
                1.2,
                True,
                note=rate_note(mine, prl) + (_ring_note(wakeup, prl) if not hold else ""),
            )
        )
        out.append(
            Target(
                f"{name}: 4 procs, {what}: fairness (slowest / fastest)",
                mine.get("fairness"),
                0.95,
                True,
                unit="",
                note=(
                    f"min over rounds {mine['fairness_min']:.2f}, "
                    f"python-redis-lock {fmt(prl.get('fairness'), 2)}"
                    if mine
                    else "cell not measured"
                ),
            )
        )
    # (b) 1 ms hold, 2 ms outside: the lock busy holding most of the time.
    mine, prl = pair(4, 0.001)
    out.append(
        Target(
            f"{name}: 4 procs, 1 ms hold / 2 ms outside: rate / python-redis-lock",
            ratio(mine.get("rate"), prl.get("rate")),
            1.05,
            True,
            note=rate_note(mine, prl),
        )
    )
    util_note = "cell not measured"
    if mine:
        h = mine["handoff_median_us"]
        util_note = (
            f"hand-off median {h:.0f} µs: with a 1 ms hold the lock is busy at most "
            f"{1000 / (1000 + h):.2f} of the time; python-redis-lock "
            f"{fmt(prl.get('utilisation'), 2)}"
        )
        ring = (wakeup or {}).get("ring", {})
        if "handoff_us" in ring:
            ceiling = 1000 / (1000 + ring["handoff_us"])
            util_note += (
                f"; ceiling: a bare LPUSH/BLPOP hand-off between processes takes "
                f"{ring['handoff_us']:.0f} µs here (the ring), so no lock whose every "
                f"hand-off wakes a blocked process is busy more than {ceiling:.2f} of the time"
            )
    out.append(
        Target(
            f"{name}: 4 procs, 1 ms hold / 2 ms outside: time inside the lock / wall time",
            mine.get("utilisation"),
            0.9,
            True,
            unit="",
            note=util_note,
        )
    )
    # Same direction at 2 and 8 processes, and with a 10 ms hold (where measured).
    for n, hold, what in ((2, 0.001, "2 procs, 1 ms"), (8, 0.001, "8 procs, 1 ms"),
                          (4, 0.01, "4 procs, 10 ms")):  # fmt: skip
        mine, prl = pair(n, hold)
        if mine:
            out.append(
                Target(
                    f"{name}: {what} hold / {2 * hold * 1000:g} ms outside: "
                    "rate / python-redis-lock",
                    ratio(mine.get("rate"), prl.get("rate")),
                    1.0,
                    True,
                    note=rate_note(mine, prl),
                )
            )
    # (c) hand-off median against a PING round trip, 4 procs, 1 ms hold.
    mine, prl = pair(4, 0.001)
    handoff = mine.get("handoff_median_us")
    out.append(
        Target(
            f"{name}: hand-off median / PING round trip (4 procs, 1 ms hold)",
            ratio(handoff, ping),
            3.0,
            False,
            note=(
                f"hand-off {handoff:.0f} µs, PING {ping:.0f} µs (client and server on "
                f"different CPUs); python-redis-lock {fmt(prl.get('handoff_median_us'), 0)} µs"
                + _wakeup_note(wakeup)
                if handoff and ping
                else "not measured"
            ),
        )
    )
    # (d) Redis commands per contended acquisition, each short-section workload and 1 ms.
    for hold, what in ((0.0, "hold 0"), (0.0002, "hold 0.2 ms"), (0.001, "hold 1 ms")):
        mine, prl = pair(4, hold)
        calls, theirs = mine.get("server_calls_per_acq"), prl.get("server_calls_per_acq")
        out.append(
            Target(
                f"{name}: Redis cmds per contended acquisition / python-redis-lock's "
                f"(4 procs, {what})",
                ratio(calls, theirs),
                1.0,
                False,
                note=(
                    f"{calls:.1f} vs {theirs:.1f} (INFO commandstats, commands inside "
                    f"scripts counted); BLPOP/acq {mine.get('blpop_per_acq', 0):.2f} vs "
                    f"{prl.get('blpop_per_acq', 0):.2f}"
                    + _commands_note(mine, prl, server_handoff=lib == "task-locks")
                    if calls and theirs
                    else prl_missing
                    if calls
                    else "not measured"
                ),
            )
        )
    return out


def _commands_note(mine: dict[str, Any], prl: dict[str, Any], *, server_handoff: bool) -> str:
    """Which commands make up a contended acquisition, each library's (measured); for the
    server hand-off, the least any fenced one runs (counted)."""

    def spelled(cell: dict[str, Any]) -> str:
        by_command = cell.get("server_calls_by_command") or {}
        return ", ".join(f"{name} {n:.1f}" for name, n in by_command.items() if n >= 0.05)

    note = ""
    if spelled(mine) and spelled(prl):
        note = f"; per acquisition ours: {spelled(mine)}; python-redis-lock's: {spelled(prl)}"
    if server_handoff:
        note += (
            "; floor: any hand-off inside the server with a fence from the server's clock "
            "and counter runs at least 11 per contended acquisition: the waiter's try "
            "(its script, reading the record, joining the queue), its wait (BLPOP), and "
            "the release (its script, reading the record, popping the queue, the clock "
            "and the counter for the fence, writing the record, pushing the grant), 12 "
            "with the grant's expiry that keeps a dead waiter's grant from staying; "
            "python-redis-lock's 10 keep no fence and no order"
        )
    return note


def _wakeup_note(wakeup: dict[str, Any] | None) -> str:
    """The floor under any hand-off: a bare push waking a process blocked on a list."""
    if not wakeup or "wakeup" not in wakeup:
        return ""
    wake, ping = wakeup["wakeup"]["median_us"], wakeup["ping"]["median_us"]
    return (
        f"; floor: a bare LPUSH waking a process blocked in BLPOP takes {wake:.0f} µs "
        f"= {wake / ping:.1f}x the unpinned PING ({ping:.0f} µs) on this machine"
    )


def _ring_note(wakeup: dict[str, Any] | None, prl: dict[str, Any]) -> str:
    """The ceiling under hold 0: a ring of processes passing one token by LPUSH/BLPOP."""
    ring = (wakeup or {}).get("ring", {})
    if "rate" not in ring or not prl.get("rate"):
        return ""
    return (
        f"; ceiling: {ring['members']} processes passing one token round by LPUSH/BLPOP, "
        f"no lock code, make {ring['rate']:.0f} hand-offs/s = {ring['rate'] / prl['rate']:.2f}x "
        "python-redis-lock's rate: a lock's extra client and server work per hand-off "
        "decides the rest"
    )


def _uncontended_note(unc: dict[tuple[str, str], dict[str, Any]]) -> str:
    ours, rp = unc.get(("task-locks", "redis")), unc.get(("redis-py Lock", "redis"))
    if not ours or not rp:
        return "not measured"
    return (
        f"typical round {fmt(ours.get('round_median_us'), 0)} vs "
        f"{fmt(rp.get('round_median_us'), 0)} µs over {ours.get('rounds', 0)} rounds; all "
        f"samples {ours['median_us']:.0f} vs {rp['median_us']:.0f} µs (acquire "
        f"{ours['acquire_median_us']:.0f} vs {rp['acquire_median_us']:.0f}, release "
        f"{ours['release_median_us']:.0f} vs {rp['release_median_us']:.0f}); client CPU "
        f"{fmt(ours.get('client_cpu_us'), 0)} vs {fmt(rp.get('client_cpu_us'), 0)} µs, "
        f"Redis cmds {fmt(ours.get('server_calls'), 1)} vs {fmt(rp.get('server_calls'), 1)}, "
        f"Redis CPU {fmt(ours.get('server_us'), 0)} vs {fmt(rp.get('server_us'), 0)} µs"
        + _fenced_floor_note(unc, rp)
    )


def _fenced_floor_note(unc: dict[tuple[str, str], dict[str, Any]], rp: dict[str, Any]) -> str:
    """What the guarantees cost with no lock code: the same scripts' commands sent raw
    (bench/workers.py: ``FencedFloor``)."""
    floor = unc.get(("floor: fenced cycle, no lock code", "redis"))
    if not floor or not floor.get("round_median_us") or not rp.get("round_median_us"):
        return ""
    return (
        f"; floor: a fenced, resend-safe cycle sent as two bare scripts (the same commands "
        f"as ours, no lock code) takes {floor['round_median_us']:.0f} µs = "
        f"{floor['round_median_us'] / rp['round_median_us']:.2f}x (Redis CPU "
        f"{fmt(floor.get('server_us'), 0)} µs, client CPU {fmt(floor.get('client_cpu_us'), 0)} µs)"
    )


def target_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """:func:`check_targets` as the results' ``targets`` rows (with each verdict)."""
    return [dict(vars(t), verdict=t.verdict) for t in check_targets(results)]


def _backend_row(backends: dict[str, Any], label: str, ours: bool = True) -> dict[str, Any]:
    """bench/backends_bench.py's row for ``label``: ours, or (``ours=False``) the peer's."""
    return next(
        (
            r
            for r in backends.get("rows", [])
            if r.get("backend") == label and (r.get("library") == "task-locks") == ours
        ),
        {},
    )


def _not_measured(backends: dict[str, Any], *rows: dict[str, Any]) -> str:
    for row in rows:
        if row.get("status") or row.get("floor_status"):
            return str(row.get("status") or row.get("floor_status"))
    return str(backends.get("status") or "not measured")


#: django:// on PostgreSQL: the cycle against two round trips plus one durable flush.
DJANGO_PG_LIMIT = 1.2
#: redlock:// against pottery's Redlock on the same three masters.
REDLOCK_LIMIT = 1.1
#: etcd:// against two bare gateway requests over the same HTTP client.
ETCD_LIMIT = 1.5


def _django_pg_target(backends: dict[str, Any]) -> Target:
    """django:// on PostgreSQL: an uncontended cycle within 1.2x its floor, two raw
    ``SELECT 1`` round trips plus one durable one-row write (the acquire must commit
    durably), timed as one call, all in the same child in alternating blocks
    (bench/backends_bench.py: ``pg_floor``)."""
    what = (
        f"django (PostgreSQL) cycle / floor (two SELECT 1 + one durable write) "
        f"<= {DJANGO_PG_LIMIT}x"
    )
    row = _backend_row(backends, "django (PostgreSQL)")
    floor = row.get("floor")
    if not floor:
        return Target(what, None, DJANGO_PG_LIMIT, False, note=_not_measured(backends, row))
    base = pg_floor_us(floor)
    value = floor["cycle_us"] / base
    note = (
        f"cycle {floor['cycle_us']:.0f} µs, floor {base:.0f} µs (two SELECT 1 then a durable "
        f"write, one call; apart {floor['select1x2_us']:.0f} + {floor['durable_write_us']:.0f}); "
        f"{len(floor.get('statements', []))} round trips per cycle"
    )
    if "bare_cycle_us" in floor:
        note += (
            f"; the cycle's own statements sent raw (no lock code): "
            f"{floor['bare_cycle_us']:.0f} µs = {floor['bare_cycle_us'] / base:.2f}x"
        )
    if "bare_lock_us" in floor:
        note += (
            f"; the least any row lock's cycle sends (insert one row, durable; delete it, "
            f"no flush wait), bare: {floor['bare_lock_us']:.0f} µs = "
            f"{floor['bare_lock_us'] / base:.2f}x"
        )
    return Target(what, value, DJANGO_PG_LIMIT, False, note=note)


def _redlock_target(backends: dict[str, Any]) -> Target:
    """redlock:// against pottery's Redlock on the same three masters, typical rotated round."""
    what = f"redlock (3 masters) cycle / pottery Redlock's (typical round) <= {REDLOCK_LIMIT}x"
    ours = _backend_row(backends, "redlock (3 masters)")
    peer = _backend_row(backends, "redlock (3 masters)", ours=False)
    mine, theirs = ours.get("round_median_us"), peer.get("round_median_us")
    if not mine or not theirs:
        return Target(what, None, REDLOCK_LIMIT, False, note=_not_measured(backends, ours, peer))
    note = (
        f"{mine:.0f} vs {theirs:.0f} µs over {ours.get('rounds', 0)} rotated rounds "
        f"({peer.get('library', 'pottery')}); hand-offs "
        f"{ours['handoffs_per_s']:.0f} vs {peer['handoffs_per_s']:.0f}/s; ours also syncs "
        "the fence counter on every master (one more parallel round trip)"
    )
    return Target(what, mine / theirs, REDLOCK_LIMIT, False, note=note)


def _etcd_target(backends: dict[str, Any]) -> Target:
    """etcd:// (one member): the cycle against two bare gateway requests over the backend's
    own HTTP client, alternating blocks."""
    what = f"etcd (1 member) cycle / two bare gateway requests <= {ETCD_LIMIT}x"
    row = _backend_row(backends, "etcd (1 member)")
    floor = row.get("floor")
    if not floor:
        return Target(what, None, ETCD_LIMIT, False, note=_not_measured(backends, row))
    value = floor["cycle_us"] / floor["range2_us"]
    requests = floor.get("statements", [])
    note = (
        f"cycle {floor['cycle_us']:.0f} µs, two ranges of a missing key "
        f"{floor['range2_us']:.0f} µs; {len(requests)} requests per cycle on the caller's "
        f"path ({', '.join(requests)}; the lease revoke follows from the revoker thread)"
    )
    if value > ETCD_LIMIT and "bare3_us" in floor:
        bare = floor["bare3_us"] / floor["range2_us"]
        note += (
            f"; the least any lease-based cycle sends over this gateway (grant a lease, put "
            f"the key with it, delete it: the put must name a lease that exists, and each "
            f"is a Raft write), sent bare with no lock code, takes {floor['bare3_us']:.0f} µs "
            f"= {bare:.2f}x already"
        )
    return Target(what, value, ETCD_LIMIT, False, note=note)


def _celery_floor_note(celery: dict[str, Any], against: str) -> str:
    """The floor of a lock taken in the worker (``plain+floor``: a plain task that also
    sends the run lock's one round trip as bare scripts) beside ``against``'s rate."""
    floor, other = _celery_rate(celery, "plain+floor"), _celery_rate(celery, against)
    if floor is None or not other:
        return ""
    return (
        f"; floor: a plain task that also sends the run lock's one round trip as two bare "
        f"scripts (no lock code) runs {floor:,.0f}/s = {floor / other:.2f}x {against}"
    )


def _celery_rate(celery: dict[str, Any], variant: str) -> float | None:
    """``variant``'s median tasks/s (bench/celery_bench.py's ``throughput``), if measured."""
    rates = celery.get("throughput") or {}
    value = rates.get(variant) if isinstance(rates, dict) else None
    return float(value) if isinstance(value, int | float) else None
