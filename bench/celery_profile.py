"""Where the time of one ``@singleton_task`` run goes (profiled before tuning).

Runs a plain task and a singleton task (distinct keys) in this process through Celery's
own tracer (``build_tracer``: what a solo worker calls per message, signals included),
against a real ``redis-server`` it starts (``tests/servers.py``), and prints:

- the per-run time of each (uninstrumented, median of rounds);
- a table of the singleton run's parts in us and %: each part is timed by wrapping the
  functions that do it with ``time.perf_counter_ns`` and counted *exclusively* (a part
  called inside another is subtracted from the outer one), so the rows add up. The
  wrappers cost a little themselves; the table says the instrumented total too.

    .venv/bin/python bench/celery_profile.py            # 5 rounds of 2,000 runs
    .venv/bin/python bench/celery_profile.py --quick    # 3 rounds of 500: seconds

``make bench`` runs the quick form through :func:`run` (``bench/measure.py``) and
``bench/report.py`` writes its table into ``results.md`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
# This checkout's task_locks, not whatever the virtualenv's editable install points at:
# the profile measures the tree it is in.
sys.path.insert(0, str(ROOT))

from celery import Celery  # noqa: E402
from celery.app import trace as celery_trace  # noqa: E402
from celery.app.trace import build_tracer  # noqa: E402
from common import redis_at  # noqa: E402

from task_locks import events, get_backend, lock  # noqa: E402
from task_locks.backends import redis as redis_backend  # noqa: E402
from task_locks.celery import registry  # noqa: E402
from task_locks.celery import task as task_module  # noqa: E402
from task_locks.celery.task import SingletonTask, singleton_task  # noqa: E402
from task_locks.types import Owner  # noqa: E402

try:  # the run's body step since the per-call options; older trees have task.py's own _Body
    from task_locks._steps import Call as body_step
except ImportError:  # pragma: no cover - an older tree on PYTHONPATH
    body_step = getattr(task_module, "_Body", None)

#: Part name -> the (owner, attribute) pairs whose calls make it up. The order is the
#: table's; what no wrapper covers is the last row (tracer, plan and driver).
PARTS: dict[str, list[tuple[Any, str]]] = {
    "per-call options (lock_options header look-up)": [(task_module, "call_options")],
    "key rendering (lock_key over the arguments)": [(SingletonTask, "_lock_name")],
    "owner metadata (owner_context, current_owner, JSON)": [
        (SingletonTask, "_owner"),
        (lock, "current_owner"),
        (Owner, "to_json"),
    ],
    "acquire round trip (Lock, plan, Redis EVAL, Lease; carries the last run's release)": [
        (getattr(task_module, "_Acquire", None), "run"),
    ],
    "context set-up (current_lease, live leases, watchdog, events context)": [
        (registry.LiveLeases, "add"),
        (registry.LiveLeases, "discard"),
        (lock.Lease, "_watch"),
        (lock.Lease, "_schedule"),
        (lock.Lease, "stop_renewal"),
        (lock.Lease, "_unwatch"),
        (events, "context"),
    ],
    "task body": [(body_step, "run")],
    "release (hand-over to the releaser; shaping and settling it in the next acquire)": [
        (getattr(task_module, "_Release", None), "run"),
        (redis_backend.RedisBackend, "_with_releases"),
        (redis_backend.RedisBackend, "_answer_riders"),
    ],
    "lock events (acquired/released)": [(events, "emit")],
    "Celery signals (prerun/postrun/success receivers)": [
        (celery_trace, "send_prerun"),
        (celery_trace, "send_postrun"),
        (celery_trace, "send_success"),
    ],
}
REST = "Celery tracer, run plan and driver (the rest)"
#: Runs per round and rounds: the default, and the quick form ``make bench`` runs.
FULL: Final = {"n": 2000, "rounds": 5}
QUICK: Final = {"n": 500, "rounds": 3}


class Clock:
    """Exclusive time per part: a stack of running parts, each minus its callees."""

    def __init__(self) -> None:
        self.spent: dict[str, int] = dict.fromkeys([*PARTS, REST], 0)
        self._stack: list[list[int]] = []  # [start, time of timed callees]

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        stack, spent, now = self._stack, self.spent, time.perf_counter_ns
        main, ident = threading.main_thread().ident, threading.get_ident

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if ident() != main:  # the releaser's or watchdog's thread: not the run's path
                return fn(*args, **kwargs)
            frame = [now(), 0]
            stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                took = now() - frame[0]
                stack.pop()
                spent[part] += took - frame[1]
                if stack:
                    stack[-1][1] += took

        return timed

    def wrap_context(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A context manager factory whose creation, enter and exit count to ``part``."""
        timed = self.wrap(part, fn)
        clock = self

        @contextlib.contextmanager
        def managed(*args: Any, **kwargs: Any) -> Iterator[Any]:
            manager = timed(*args, **kwargs)
            value = clock.wrap(part, manager.__enter__)()
            try:
                yield value
            except BaseException:
                if not clock.wrap(part, manager.__exit__)(*sys.exc_info()):
                    raise
            else:
                clock.wrap(part, manager.__exit__)(None, None, None)

        return managed


@contextlib.contextmanager
def instrumented(clock: Clock) -> Iterator[None]:
    saved: list[tuple[Any, str, Any]] = []
    try:
        for part, targets in PARTS.items():
            for owner, attribute in targets:
                if owner is None or attribute not in vars(owner):
                    continue
                original = vars(owner)[attribute]
                saved.append((owner, attribute, original))
                if attribute == "context":
                    setattr(owner, attribute, clock.wrap_context(part, original))
                else:
                    setattr(owner, attribute, clock.wrap(part, original))
        owner_context = task_module.owner_context
        saved.append((task_module, "owner_context", owner_context))
        task_module.owner_context = clock.wrap_context(  # type: ignore[attr-defined]
            "owner metadata (owner_context, current_owner, JSON)", owner_context
        )
        yield
    finally:
        for owner, attribute, original in reversed(saved):
            setattr(owner, attribute, original)


#: ``--mode``: the singleton task's options (``run``: the defaults). The publish step of
#: ``both`` is not in the run (it is the publisher's); its message carries no queued lock,
#: so the run takes a fresh one, as a message published before the lock existed would.
MODES: Final[dict[str, dict[str, Any]]] = {
    "run": {},
    "both": {"lock_on": "both"},
    "wait": {"on_conflict": "wait", "wait_timeout": 5},
    "limit3": {"limit": 3},
}


def make_app(url: str, mode: str = "run") -> tuple[Any, Any, Any]:
    app = Celery("celery_profile", broker="memory://", set_as_current=True)
    app.conf.update(task_ignore_result=True)

    @app.task(name="profile.plain")
    def plain(i: str) -> None:
        pass

    @singleton_task(app=app, name="profile.single", key="bench:{i}", backend=url, **MODES[mode])
    def single(i: str) -> None:
        pass

    return app, plain, single


def tracer(app: Any, task: Any) -> Callable[..., Any]:
    return build_tracer(task.name, task, app=app, hostname="profile@host", eager=False)


def run_many(trace: Callable[..., Any], n: int, tag: str, cpu: list[int] | None = None) -> int:
    """Ns per run of ``n`` runs with distinct arguments (hence distinct keys); ``cpu``
    gets the process's CPU ns per run (every thread: watchdog and releaser too)."""
    cpu_start = time.process_time_ns()
    start = time.perf_counter_ns()
    for i in range(n):
        task_id = f"{tag}-{i}"
        trace(task_id, (f"{tag}:{i}",), {}, {"id": task_id, "delivery_info": {}})
    took = (time.perf_counter_ns() - start) // n
    flush()
    if cpu is not None:
        cpu.append((time.process_time_ns() - cpu_start) // n)
    return took


def flush() -> None:
    """Let the background releaser (if the run path has one) finish before the next round."""
    try:
        from task_locks.celery.releaser import releaser
    except ImportError:  # an older tree: every release is sent in the run
        return
    releaser.flush()


def profile(url: str, n: int, rounds: int, mode: str = "run") -> dict[str, Any]:
    app, plain, single = make_app(url, mode)
    plain_trace, single_trace = tracer(app, plain), tracer(app, single)
    run_many(plain_trace, 200, "warm-p")
    run_many(single_trace, 200, "warm-s")
    flush()
    ping = get_backend(url).client.ping  # the floor: one bare round trip, same client
    start = time.perf_counter_ns()
    for _ in range(n):
        ping()
    ping_ns = (time.perf_counter_ns() - start) // n
    plain_ns: list[int] = []
    single_ns: list[int] = []
    plain_cpu: list[int] = []
    single_cpu: list[int] = []
    for number in range(rounds):
        plain_ns.append(run_many(plain_trace, n, f"p{number}", plain_cpu))
        single_ns.append(run_many(single_trace, n, f"s{number}", single_cpu))
    # The instrumented table: the quietest of ``rounds`` runs (other jobs on the machine
    # only ever add time), so its parts are read from one undisturbed-as-can-be round.
    best: tuple[int, Clock] | None = None
    for number in range(rounds):
        clock = Clock()
        with instrumented(clock):
            took = run_many(tracer(app, single), n, f"i{number}")
        if best is None or took < best[0]:
            best = (took, clock)
    assert best is not None
    instrumented_ns, clock = best
    covered = sum(clock.spent.values())
    clock.spent[REST] = max(0, instrumented_ns * n - covered)
    return {
        "n": n,
        "rounds": rounds,
        "mode": mode,
        "plain_us": statistics.median(plain_ns) / 1000,
        "singleton_us": statistics.median(single_ns) / 1000,
        "plain_best_us": min(plain_ns) / 1000,
        "singleton_best_us": min(single_ns) / 1000,
        "instrumented_us": instrumented_ns / 1000,
        "ping_us": ping_ns / 1000,
        "plain_cpu_us": statistics.median(plain_cpu) / 1000,
        "singleton_cpu_us": statistics.median(single_cpu) / 1000,
        "parts_us": {part: ns / n / 1000 for part, ns in clock.spent.items()},
    }


def table(result: dict[str, Any]) -> str:
    total = result["instrumented_us"]
    lines = [
        f"| part of one singleton run (quietest of {result['rounds']} instrumented rounds) "
        "| us | % |",
        "| --- | ---: | ---: |",
    ]
    for part, us in result["parts_us"].items():
        lines.append(f"| {part} | {us:.1f} | {100 * us / total:.0f} |")
    lines.append(f"| **total (instrumented)** | **{total:.1f}** | 100 |")
    extra = result["singleton_us"] - result["plain_us"]
    lines.append("")
    lines.append(
        f"Uninstrumented, median of {result['rounds']} rounds of {result['n']} runs through "
        f"Celery's tracer in one process (no broker): plain task {result['plain_us']:.1f} "
        f"us/run, singleton {result['singleton_us']:.1f} us/run (+{extra:.1f} us; best "
        f"rounds {result['plain_best_us']:.1f} and {result['singleton_best_us']:.1f}); one "
        f"bare Redis PING from the same client: {result['ping_us']:.1f} us. CPU of the "
        f"process per run (all threads): plain {result['plain_cpu_us']:.1f} us, singleton "
        f"{result['singleton_cpu_us']:.1f} us."
    )
    return "\n".join(lines)


def run(redis_url: str, quick: bool = True) -> dict[str, Any]:
    """``make bench``'s hook (``bench/measure.py``): the profile against ``redis_url``
    (the quick form unless ``quick=False``), with its table as ``markdown``."""
    result = profile(redis_url, **(QUICK if quick else FULL))
    return {**result, "markdown": table(result)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 500 runs")
    parser.add_argument("--n", type=int, help=f"runs per round (default {FULL['n']})")
    parser.add_argument("--rounds", type=int, help=f"default {FULL['rounds']}")
    parser.add_argument("--redis-url", help="an existing server (default: start one)")
    parser.add_argument("--markdown", action="store_true", help="the table only")
    parser.add_argument("--mode", choices=sorted(MODES), default="run", help="task options")
    args = parser.parse_args()
    sizes = dict(QUICK if args.quick else FULL)
    sizes.update({k: v for k, v in (("n", args.n), ("rounds", args.rounds)) if v})
    with redis_at(args.redis_url) as url:
        result = profile(url, **sizes, mode=args.mode)
    print(table(result))


if __name__ == "__main__":
    main()
