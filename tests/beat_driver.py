"""Drive a Celery beat scheduler in the test's own thread, the way ``celery beat`` does.

A leader that sends nothing in time is hard to read after the fact: the failure says
only that time ran out. So the drive keeps what a reader needs: how long each ``tick()``
took and what it returned, the scheduler's own log lines, and, for a ``tick()`` that
blocks for seconds, every thread's stack at that moment (``faulthandler``).
"""

from __future__ import annotations

import faulthandler
import logging
import tempfile
import time
from collections.abc import Callable
from typing import Any

#: A ``tick()`` blocked this long gets every thread's stack in the failure message.
STUCK_AFTER = 2.0


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.started = time.monotonic()

    def emit(self, record: logging.LogRecord) -> None:
        at = record.created - time.time() + time.monotonic() - self.started
        self.lines.append(f"{at:7.3f}s {record.name} {record.levelname} {record.getMessage()}")


def drive_beat(
    scheduler: Any, done: Callable[[], object], timeout: float, what: str, nap: float = 0.1
) -> None:
    """Call ``scheduler.tick()`` (sleeping what it asks, at most ``nap``) until ``done()``;
    fail after ``timeout`` s with the ticks' timings, the log and any stuck stack."""
    lines = _Lines()
    loggers = [logging.getLogger(name) for name in ("task_locks", "celery.beat", "kombu")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(lines)
        logger.setLevel(logging.INFO)
    ticks: list[tuple[float, float, object]] = []
    started = time.monotonic()
    deadline = started + timeout
    with tempfile.TemporaryFile("w+") as stacks:
        try:
            while not done():
                if time.monotonic() >= deadline:
                    stacks.seek(0)
                    raise AssertionError(
                        _story(what, timeout, ticks, lines.lines, stacks.read(), _state(scheduler))
                    )
                faulthandler.dump_traceback_later(STUCK_AFTER, file=stacks)
                called = time.monotonic()
                try:
                    interval = scheduler.tick()
                finally:
                    faulthandler.cancel_dump_traceback_later()
                ticks.append((called - started, time.monotonic() - called, interval))
                if interval and interval > 0:
                    time.sleep(min(interval, nap))  # beat's own sleep between ticks
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.removeHandler(lines)
                logger.setLevel(level)


def _state(scheduler: Any) -> list[str]:
    """What ``tick()`` decides from: the heap's head and each entry's last run, beside the
    scheduler's clock. A tick returning ``max_interval`` again and again means an empty
    heap or a head far ahead; these lines tell which, and from what."""
    try:
        now = scheduler._when(next(iter(scheduler.schedule.values())), 0)
        heap = sorted(scheduler._heap or [])[:3]
        lines = [
            f"now (scheduler clock, epoch s) {now:.3f}; heap head {len(heap)} of "
            f"{len(scheduler._heap or [])}:"
        ]
        lines += [f"  at {at:.3f} ({at - now:+.3f} s) {entry.name}" for at, _, entry in heap]
        lines += [
            f"  entry {name}: last_run_at {entry.last_run_at!r} schedule {entry.schedule!r}"
            f" tz {getattr(entry.schedule, 'tz', None)!r} now() {entry.default_now()!r}"
            for name, entry in scheduler.schedule.items()
        ]
        return lines
    except Exception as exc:  # a diagnostic must not hide the failure it explains
        return [f"scheduler state unreadable: {exc!r}"]


def _story(
    what: str,
    timeout: float,
    ticks: list[tuple[float, float, object]],
    log: list[str],
    stacks: str,
    state: list[str],
) -> str:
    slowest = sorted(ticks, key=lambda tick: tick[1])[-5:]
    parts = [
        f"{what}: not within {timeout} s ({len(ticks)} ticks;"
        f" slowest at/took/returned: {[(round(a, 3), round(t, 3), r) for a, t, r in slowest]})",
        *state,
        "log:",
        *log[-40:],
    ]
    if stacks:
        parts += [f"stacks of a tick() that ran over {STUCK_AFTER} s:", stacks[-6000:]]
    return "\n".join(parts)
