"""Reads a history and says what went wrong.

Rules (from the issue, made precise):

- A **hold** runs from an acquire's ``ok`` to the invoke of the same process's next
  release (or to its death, or the end of the run). Holds of different processes must
  not overlap; each overlapping pair counts once (``overlaps``).
- An acquire whose outcome is unknown (``info``, or no completion at all) *may* have
  taken the lock: it counts as held from its invoke until its TTL ran out. Such a hold
  never acts (the client did not learn it held the lock), so its overlaps with real
  holds are reported apart (``possible_overlaps``).
- **Fences**: an acquire that starts after another completed must get a larger fence
  (``fence_regressions`` counts the ones that did not).
- **Writes**, per guard (per resource): a write is *stale when attempted* if, when it
  was sent, a lock with a newer fence had already been granted; it is *stale when
  accepted* if the resource accepted it after accepting a newer fence (the resource's
  own order: the ``version`` it returned). The fences a resource accepts never go down:
  ``stale_accepted`` must be 0 for a fenced resource.
- **Lost writes**: an acknowledged write whose id is missing from the resource's final
  value (each write appends its id to what it read).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

OPERATIONS = ("acquire", "write", "release")


@dataclass
class Op:
    p: Any
    f: str
    invoke: dict[str, Any]
    complete: dict[str, Any] | None = None

    @property
    def type(self) -> str:
        """``ok``, ``fail``, ``info``, or ``unknown`` (no completion: the process died)."""
        return self.complete["type"] if self.complete else "unknown"

    @property
    def start(self) -> float:
        return float(self.invoke["t"])

    @property
    def end(self) -> float | None:
        return None if self.complete is None else float(self.complete["t"])

    def get(self, key: str, default: Any = None) -> Any:
        if self.complete is not None and key in self.complete:
            return self.complete[key]
        return self.invoke.get(key, default)


@dataclass(frozen=True)
class Hold:
    p: Any
    start: float
    end: float
    fence: int | None
    certain: bool


@dataclass
class GuardResult:
    writes: int = 0
    accepted: int = 0
    refused: int = 0
    unknown: int = 0
    stale_attempted: int = 0
    stale_accepted: int = 0
    lost: int = 0
    lost_ids: list[str] = field(default_factory=list)


@dataclass
class CheckResult:
    operations: int = 0
    holds: int = 0
    unknown_acquires: int = 0
    overlaps: int = 0
    overlap_seconds: float = 0.0
    possible_overlaps: int = 0
    fence_regressions: int = 0
    lost_leases: int = 0
    faults: int = 0
    guards: dict[str, GuardResult] = field(default_factory=dict)
    #: Errors that are not LockErrors escaping the API (a contract violation), first few.
    unexpected: list[str] = field(default_factory=list)
    overlap_examples: list[tuple[Hold, Hold]] = field(default_factory=list)

    @property
    def stale_accepted_fenced(self) -> int:
        """Stale writes that a fencing guard let through (must be 0)."""
        return sum(g.stale_accepted for name, g in self.guards.items() if name != "unfenced")


def operations(events: list[dict[str, Any]]) -> list[Op]:
    """Pair each invoke with the completion that follows it in the same process."""
    ops: list[Op] = []
    pending: dict[Any, Op] = {}
    for event in sorted(events, key=lambda e: e["t"]):
        if event["f"] not in OPERATIONS:
            continue
        p = event["p"]
        if event["type"] == "invoke":
            pending.pop(p, None)  # a previous op without completion stays unknown
            op = Op(p, event["f"], event)
            pending[p] = op
            ops.append(op)
        else:
            op = pending.pop(p, None)
            if op is not None and op.f == event["f"]:
                op.complete = event
    return ops


def _deaths(events: list[dict[str, Any]]) -> dict[Any, float]:
    deaths: dict[Any, float] = {}
    for event in events:
        if event["f"] == "nemesis" and event.get("action") == "kill":
            deaths.setdefault(event["target"], float(event["t"]))
        elif event["f"] == "process" and event["type"] == "exit":
            deaths.setdefault(event["p"], float(event["t"]))
    return deaths


def holds(events: list[dict[str, Any]], ops: list[Op] | None = None) -> list[Hold]:
    ops = operations(events) if ops is None else ops
    end_of_run = max((float(e["t"]) for e in events), default=0.0)
    deaths = _deaths(events)
    by_process: dict[Any, list[Op]] = defaultdict(list)
    for op in ops:
        by_process[op.p].append(op)
    found: list[Hold] = []
    for p, mine in by_process.items():
        for index, op in enumerate(mine):
            if op.f != "acquire":
                continue
            if op.type == "ok":
                release = next(
                    (o for o in mine[index + 1 :] if o.f in ("release", "acquire")), None
                )
                if release is not None:
                    end = release.start
                else:
                    end = deaths.get(p, end_of_run)
                found.append(Hold(p, float(op.end or op.start), end, op.get("fence"), True))
            elif op.type in ("info", "unknown"):
                ttl = float(op.invoke.get("ttl", 0.0))
                end = op.start + ttl
                found.append(Hold(p, op.start, end, None, False))
    return found


def _overlap(a: Hold, b: Hold) -> float:
    return min(a.end, b.end) - max(a.start, b.start)


def check(events: list[dict[str, Any]], finals: dict[str, str | None] | None = None) -> CheckResult:
    """Everything the checker knows about one run; ``finals`` maps guard -> final value."""
    finals = finals or {}
    ops = operations(events)
    result = CheckResult(operations=len(ops))
    result.faults = sum(
        1 for e in events if e["f"] == "nemesis" and e.get("action") in FAULT_ACTIONS
    )
    result.lost_leases = sum(1 for e in events if e["f"] == "lost")
    for event in events:
        if event.get("unexpected") and len(result.unexpected) < 5:
            result.unexpected.append(f"{event['f']}: {event.get('error')}")

    found = holds(events, ops)
    certain = sorted((h for h in found if h.certain), key=lambda h: h.start)
    maybe = [h for h in found if not h.certain]
    result.holds = len(certain)
    result.unknown_acquires = len(maybe)
    for i, a in enumerate(certain):
        for b in certain[i + 1 :]:
            if b.start >= a.end:
                # sorted by start: later holds may still overlap a, keep scanning only
                # while they start before a ends
                break
            if a.p != b.p and _overlap(a, b) > 0:
                result.overlaps += 1
                result.overlap_seconds += _overlap(a, b)
                if len(result.overlap_examples) < 5:
                    result.overlap_examples.append((a, b))
    for u in maybe:
        result.possible_overlaps += sum(1 for h in certain if h.p != u.p and _overlap(h, u) > 0)

    # Fences: every acquire that began after another one completed got a larger fence.
    granted = sorted(
        (op for op in ops if op.f == "acquire" and op.type == "ok" and op.get("fence") is not None),
        key=lambda op: op.end or op.start,
    )
    granted_at = [op.end or op.start for op in granted]
    granted_max: list[int] = []
    for op in granted:
        granted_max.append(max(int(op.get("fence")), granted_max[-1] if granted_max else -1))
    for op in granted:
        before = bisect.bisect_left(granted_at, op.start)
        if before and int(op.get("fence")) <= granted_max[before - 1]:
            result.fence_regressions += 1

    # Writes, per guard.
    writes: dict[str, list[Op]] = defaultdict(list)
    for op in ops:
        if op.f == "write":
            writes[op.invoke.get("guard", "default")].append(op)
    for guard, mine in writes.items():
        g = GuardResult(writes=len(mine))
        accepted = [op for op in mine if op.type == "ok"]
        g.accepted = len(accepted)
        g.refused = sum(1 for op in mine if op.type == "fail")
        g.unknown = sum(1 for op in mine if op.type in ("info", "unknown"))
        for op in mine:
            before = bisect.bisect_left(granted_at, op.start)
            newest = granted_max[before - 1] if before else -1
            if int(op.invoke["fence"]) < newest:
                g.stale_attempted += 1
        highest = -1
        for op in sorted(accepted, key=lambda o: int(o.get("version"))):
            fence = int(op.invoke["fence"])
            if fence < highest:
                g.stale_accepted += 1
            highest = max(highest, fence)
        final = finals.get(guard)
        if final is not None:
            present = set(final.split())
            g.lost_ids = [op.invoke["id"] for op in accepted if op.invoke["id"] not in present]
            g.lost = len(g.lost_ids)
        result.guards[guard] = g
    return result


#: Nemesis actions that are faults (as opposed to heals and notes).
FAULT_ACTIONS = frozenset(
    {
        "pause",
        "kill",
        "pause-server",
        "restart-server",
        "failover",
        "kill-leader",
        "latency",
        "blackhole",
        "reset",
        "skew",
    }
)
