"""The tasks the Celery tests run in real ``celery worker`` processes (``-A celery_tasks``).

URLs come from the environment the test fixtures set (``TL_CELERY_*``), so the test
process and every worker share one broker, one result backend and one lock server.
Each task records what it did in Redis (``log`` lists of JSON intervals) so the tests
can check, from the outside, that no two runs of a key overlapped.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import redis
from celery import Celery, signals

from task_locks import LockLost
from task_locks.celery import current_lease, singleton_task
from task_locks.celery.peers import PeerCheckedTask
from task_locks.peers import PeerKeys

BROKER = os.environ.get("TL_CELERY_BROKER", "redis://127.0.0.1:6379/13")
RESULTS = os.environ.get("TL_CELERY_RESULTS", "redis://127.0.0.1:6379/14")
LOCKS = os.environ.get("TL_CELERY_LOCKS", "redis://127.0.0.1:6379/15")
if RESULTS == "django-db":  # django-celery-results: results in the Django database
    import django

    django.setup()  # DJANGO_SETTINGS_MODULE=dbresults_settings (test_celery_canvas.py)

app = Celery("celery_tasks", broker=BROKER, backend=RESULTS, set_as_current=False)
app.conf.update(
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    task_default_queue=os.environ.get("TL_CELERY_QUEUE", "tl_default"),
    task_routes={
        "celery_tasks.enqueue_task": {"queue": "tl_pending"},
        "celery_tasks.both_task": {"queue": "tl_pending"},
        "celery_tasks.redelivered_task": {"queue": "tl_redeliver"},
        "celery_tasks.limited_redelivered_task": {"queue": "tl_redeliver"},
        "celery_tasks.both_burst_task": {"queue": "tl_pending"},
        "celery_tasks.enqueue_burst_task": {"queue": "tl_pending"},
    },
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("TL_VISIBILITY_TIMEOUT", "3600")),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    # Where a beat election lives: singleton tasks read its term to refuse stale ticks.
    task_locks_beat_backend=LOCKS,
)
store = redis.Redis.from_url(LOCKS)


def record(log: str, **fields: Any) -> None:
    store.rpush(log, json.dumps({"pid": os.getpid(), **fields}))


def work(self: Any, log: str, seconds: float) -> dict[str, Any]:
    """The critical section: sleep, and record the interval and who ran it."""
    lease = current_lease()
    start = time.time()
    time.sleep(seconds)
    end = time.time()
    fields = {
        "start": start,
        "end": end,
        "task_id": self.request.id,
        "worker": self.request.hostname,
        "fence": lease.fence if lease else None,
    }
    record(log, **fields)
    return fields


common: dict[str, Any] = {"app": app, "backend": LOCKS, "bind": True, "key": "t:{key}"}


@singleton_task(**common, ttl=10, on_conflict="wait", wait_timeout=60)
def wait_task(self: Any, key: str, log: str, seconds: float) -> dict[str, Any]:
    return work(self, log, seconds)


@singleton_task(**common, ttl=10, on_conflict="retry", retry_countdown=0.2, max_retries=None)
def retry_task(self: Any, key: str, log: str, seconds: float) -> dict[str, Any]:
    return work(self, log, seconds)


@singleton_task(**common, ttl=10, on_conflict="skip")
def skip_task(self: Any, key: str, log: str, seconds: float) -> dict[str, Any]:
    return work(self, log, seconds)


@singleton_task(**common, ttl=10, on_conflict="raise")
def raise_task(self: Any, key: str, log: str, seconds: float) -> dict[str, Any]:
    return work(self, log, seconds)


@singleton_task(**common, ttl=60, on_conflict="raise")
def hold_task(self: Any, key: str, log: str, seconds: float) -> str:
    """Holds the key for a long time (ttl=60): killing it must free the key much sooner."""
    record(log, event="started", task_id=self.request.id)
    time.sleep(seconds)
    return "finished"


@singleton_task(**common, ttl=10, on_conflict="raise")
def retrying_task(self: Any, key: str, log: str, times: int) -> str:
    """Retries itself ``times`` times; every attempt must hold the key, none deadlock."""
    lease = current_lease()
    assert lease is not None
    holder = lease.backend.holder(lease.name)
    record(
        log,
        attempt=self.request.retries,
        fence=lease.fence,
        holder_task_id=holder.owner.task_id if holder else None,
    )
    if self.request.retries < times:
        raise self.retry(countdown=0.1)
    return "done"


@singleton_task(**common, ttl=60, on_conflict="raise")
def failing_task(self: Any, key: str, log: str) -> None:
    record(log, event="started")
    raise ValueError("boom")


@singleton_task(**common, ttl=60, on_conflict="raise", soft_time_limit=1)
def soft_limited_task(self: Any, key: str, log: str) -> None:
    record(log, event="started")
    time.sleep(20)  # interrupted by SoftTimeLimitExceeded after 1 s


@singleton_task(**common, ttl=60, on_conflict="raise", time_limit=1)
def hard_limited_task(self: Any, key: str, log: str) -> None:
    record(log, event="started")
    time.sleep(20)  # the worker's main process kills this child after 1 s


@singleton_task(**common, ttl=30, on_conflict="raise", max_hold=2, on_lost="fail")
def hung_task(self: Any, key: str, log: str, seconds: float) -> str:
    """Hangs; max_hold=2 must mark its lease lost and free the key after about 2 s."""
    lease = current_lease()
    assert lease is not None
    start = time.time()
    record(log, event="started", task_id=self.request.id)
    lost = lease.lost.wait(seconds)
    record(log, event="lost" if lost else "not lost", after=time.time() - start)
    time.sleep(1.0)  # still "working" after the key went to someone else
    return "returned"


@singleton_task(**common, ttl=30, lock_on="enqueue")
def enqueue_task(self: Any, key: str, log: str) -> str:
    record(log, event="ran", task_id=self.request.id)
    return "ran"


@singleton_task(**common, ttl=30, lock_on="both", on_conflict="skip")
def both_task(self: Any, key: str, log: str, seconds: float) -> dict[str, Any]:
    return work(self, log, seconds)


@singleton_task(**common, ttl=10, lock_on="both", on_conflict="skip")
def both_retrying_task(self: Any, key: str, log: str, countdown: float) -> str:
    """Retries itself once; with lock_on="both" the key stays taken during the countdown."""
    record(log, attempt=self.request.retries, task_id=self.request.id, at=time.time())
    if self.request.retries < 1:
        raise self.retry(countdown=countdown)
    return "done"


@singleton_task(**common, ttl=4, on_conflict="skip", acks_late=True)
def redelivered_task(self: Any, key: str, log: str, seconds: float) -> dict[str, Any]:
    """Runs past the broker's visibility_timeout, so Redis delivers it a second time."""
    return work(self, log, seconds)


@singleton_task(**common, ttl=10, on_conflict="wait", wait_timeout=60, limit=2)
def limited_task(self: Any, key: str, log: str, seconds: float) -> dict[str, Any]:
    """At most two runs of one key at once; records its interval and its permit."""
    permit = current_lease()
    start = time.time()
    time.sleep(seconds)
    fields = {
        "start": start,
        "end": time.time(),
        "task_id": self.request.id,
        "lease_type": type(permit).__name__,
        "slot": getattr(permit, "slot", None),
        "fence": permit.fence if permit else None,
    }
    record(log, **fields)
    return fields


@singleton_task(**common, ttl=60, on_conflict="raise", limit=2)
def limited_hold_task(self: Any, key: str, log: str, seconds: float) -> str:
    """Holds one of two permits for a long time (ttl=60): killing it must free it sooner."""
    record(log, event="started", task_id=self.request.id)
    time.sleep(seconds)
    return "finished"


@singleton_task(**common, ttl=10, on_conflict="wait", wait_timeout=60)
async def async_task(self: Any, key: str, log: str, seconds: float) -> dict[str, Any]:
    lease = current_lease()
    start = time.time()
    await asyncio.sleep(seconds)
    fields = {
        "start": start,
        "end": time.time(),
        "task_id": self.request.id,
        "lease_type": type(lease).__name__,
        "fence": lease.fence if lease else None,
    }
    record(log, **fields)
    return fields


@singleton_task(**common, ttl=4, on_conflict="skip", acks_late=True, limit=3)
def limited_redelivered_task(self: Any, key: str, log: str, seconds: float) -> dict[str, Any]:
    """``limit=3``, running past the visibility_timeout: Redis delivers it a second time."""
    return work(self, log, seconds)


# The fault matrix's tasks (tests/celery/test_celery_faults.py): one per limit x on_conflict.
@singleton_task(**common, ttl=10, on_conflict="skip", limit=1)
def dup_skip_1(self: Any, key: str, log: str, seconds: float) -> dict[str, Any]:
    return work(self, log, seconds)


@singleton_task(**common, ttl=10, on_conflict="skip", limit=3)
def dup_skip_3(self: Any, key: str, log: str, seconds: float) -> dict[str, Any]:
    return work(self, log, seconds)


@singleton_task(**common, ttl=10, on_conflict="wait", wait_timeout=30, limit=1)
def dup_wait_1(self: Any, key: str, log: str, seconds: float) -> dict[str, Any]:
    return work(self, log, seconds)


@singleton_task(**common, ttl=10, on_conflict="wait", wait_timeout=30, limit=3)
def dup_wait_3(self: Any, key: str, log: str, seconds: float) -> dict[str, Any]:
    return work(self, log, seconds)


@singleton_task(**common, ttl=30, lock_on="both", on_conflict="skip")
def both_burst_task(self: Any, key: str, log: str, seconds: float) -> dict[str, Any]:
    return work(self, log, seconds)


@singleton_task(**common, ttl=30, lock_on="enqueue")
def enqueue_burst_task(self: Any, key: str, log: str, seconds: float) -> dict[str, Any]:
    return work(self, log, seconds)


@singleton_task(**common, ttl=30, lock_on="enqueue", enqueue_ttl=1)
def short_queue_task(self: Any, key: str, log: str, seconds: float) -> dict[str, Any]:
    """Its publish-time lock lasts 1 s: a queue slower than that outlives it."""
    return work(self, log, seconds)


@singleton_task(**common, ttl=30, lock_on="both", enqueue_ttl=1)
def short_both_task(self: Any, key: str, log: str, seconds: float) -> dict[str, Any]:
    return work(self, log, seconds)


@singleton_task(**common, ttl=60, lock_on="both", on_conflict="raise")
def both_hold_task(self: Any, key: str, log: str, seconds: float) -> str:
    """``"both"``, holding the key a long time (ttl=60): killing it must free the key sooner."""
    record(log, event="started", task_id=self.request.id)
    time.sleep(seconds)
    return "finished"


@singleton_task(**common, lock_on="enqueue")
def default_queue_task(self: Any, key: str, log: str, seconds: float) -> dict[str, Any]:
    """No ttl, no enqueue_ttl: the defaults decide how long its queued lock lasts."""
    return work(self, log, seconds)


#: Tasks whose every delivery is counted in ``<log>:deliveries``.
_COUNTED = {
    f"celery_tasks.{name}"
    for name in (
        "redelivered_task", "limited_redelivered_task",
        "dup_skip_1", "dup_skip_3", "dup_wait_1", "dup_wait_3",
        "both_burst_task", "enqueue_burst_task",
    )
}  # fmt: skip


@signals.task_prerun.connect
def _count_deliveries(task_id: str, task: Any, args: Any, **_: Any) -> None:
    """Every delivery that reached a worker child, before the lock is even looked at."""
    if task.name in _COUNTED:
        record(args[1] + ":deliveries", task_id=task_id, at=time.time())


@singleton_task(**common, ttl=10, on_conflict="skip")
def options_task(self: Any, key: str, log: str, retries: int = 0) -> dict[str, Any]:
    """Reports the lock options its run got (apply_async(lock_options=...));
    retries itself ``retries`` times first."""
    lease = current_lease()
    assert lease is not None
    record(log, task_id=self.request.id, ttl=lease.ttl, attempt=self.request.retries)
    if self.request.retries < retries:
        raise self.retry(countdown=0.1)
    return {"ttl": lease.ttl, "on_conflict": self.on_conflict, "wait_timeout": self.wait_timeout}


@singleton_task(**common, ttl=10, on_conflict="raise", ignore_result=True)
def fire_and_forget_task(self: Any, key: str, log: str) -> None:
    """No stored result: its release is sent after the run; a refused run records
    nothing."""
    record(log, event="ran", task_id=self.request.id)


@app.task(name="celery_tasks.gil_task")
def gil_task(log: str, count: int) -> None:
    """Not a singleton task: one C call that keeps the GIL (``sum`` over a ``range``), then
    records when it ended (its release must not wait for the next task to yield the GIL)."""
    sum(range(count))
    record(log, event="gil released", at=time.time())


# The lock service is down: a worker started with TL_OUTAGE_LOCKS gives
# these tasks a lock server of their own that the tests stop and start.
outage: dict[str, Any] = {**common, "backend": os.environ.get("TL_OUTAGE_LOCKS", LOCKS)}


@singleton_task(**outage, ttl=10)
def outage_fail_task(self: Any, key: str, log: str) -> str:
    """The default, ``lock_unavailable="fail"``."""
    record(log, event="ran", attempt=self.request.retries)
    return "ran"


@singleton_task(
    **outage, ttl=10, lock_unavailable="retry", default_retry_delay=0.3, max_retries=None
)
def outage_retry_task(self: Any, key: str, log: str) -> str:
    record(log, event="ran", attempt=self.request.retries)
    return "ran"


@singleton_task(
    **outage,
    ttl=10,
    lock_unavailable="retry",
    retry_backoff=True,
    retry_backoff_max=1,
    retry_jitter=False,
    max_retries=2,
)
def outage_limited_task(self: Any, key: str, log: str) -> str:
    record(log, event="ran", attempt=self.request.retries)
    return "ran"


# gevent and eventlet pools: short TTLs, so a run lasts several renewals.
@singleton_task(**common, ttl=1, on_conflict="skip")
def short_ttl_task(self: Any, key: str, log: str, seconds: float) -> dict[str, Any]:
    """Runs for ``seconds`` (> 2 TTLs); records whether its lease was still held at the end."""
    lease = current_lease()
    assert lease is not None
    fields = work(self, log, seconds)
    record(log + ":kept", task_id=self.request.id, held=lease.held, lost=lease.lost.is_set())
    return fields


def _hub_blocking_body(log: str, count: int) -> bool:
    """One C call (``sum`` over a ``range``) longer than the TTL: under gevent or eventlet it
    blocks the hub, so the lease's renewal cannot run and the lock expires meanwhile."""
    lease = current_lease()
    assert lease is not None
    record(log, event="started")
    sum(range(count))
    held = lease.held
    record(log, event="call ended", held=held)
    return held


@singleton_task(**common, ttl=1, on_conflict="raise")
def hub_blocking_task(self: Any, key: str, log: str, count: int) -> bool:
    return _hub_blocking_body(log, count)


@singleton_task(**common, ttl=1, on_conflict="raise", on_lost="fail")
def hub_blocking_fail(self: Any, key: str, log: str, count: int) -> bool:
    return _hub_blocking_body(log, count)


@singleton_task(**common, ttl=1, on_conflict="raise", on_lost="ignore")
def hub_blocking_ignore(self: Any, key: str, log: str, count: int) -> bool:
    return _hub_blocking_body(log, count)


# Redeliveries and recycled children.
def _first_delivery(self: Any, log: str) -> bool:
    """Record this delivery's start; ``True`` for the message's first one."""
    entry = {"pid": os.getpid(), "event": "started", "task_id": self.request.id, "at": time.time()}
    return int(store.rpush(log, json.dumps(entry))) == 1


@singleton_task(**common, ttl=60, on_conflict="raise", acks_late=True, reject_on_worker_lost=True)
def reject_on_lost_task(self: Any, key: str, log: str, seconds: float) -> str:
    """The first delivery holds the key ``seconds`` (long: its child is killed); the
    message comes back (``reject_on_worker_lost``) and the redelivery returns at once."""
    if _first_delivery(self, log):
        time.sleep(seconds)
    return "finished"


@singleton_task(**common, ttl=3, on_conflict="raise", acks_late=True)
def crash_task(self: Any, key: str, log: str, seconds: float) -> str:
    """``acks_late``, ttl=3: the whole worker running the first delivery is killed (no
    main process is left to release); the broker redelivers the message elsewhere."""
    if _first_delivery(self, log):
        time.sleep(seconds)
    return "finished"


# -- canvases (tests/celery/test_celery_canvas.py): one task per outcome of a held key ------


@singleton_task(**common, ttl=10, on_conflict="skip")
def canvas_skip(self: Any, key: str, n: int) -> int:
    return n


@singleton_task(**common, ttl=10, on_conflict="skip", skip_as="failure")
def canvas_skip_failure(self: Any, key: str, n: int) -> int:
    return n


@singleton_task(**common, ttl=10, on_conflict="raise")
def canvas_raise(self: Any, key: str, n: int) -> int:
    return n


@singleton_task(**common, ttl=10, on_conflict="wait", wait_timeout=30)
def canvas_wait(self: Any, key: str, n: int) -> int:
    return n


@singleton_task(**common, ttl=10, on_conflict="retry", retry_countdown=0.3, max_retries=None)
def canvas_retry(self: Any, key: str, n: int) -> int:
    return n


@app.task
def echo(value: Any) -> Any:
    """A chain's next link: what it was given (a skipped link's Skipped marker)."""
    return value


@app.task
def collect(values: list[Any]) -> list[Any]:
    """A chord's callback: the header's results."""
    return values


@app.task
def chord_failed(request: Any, exc: BaseException, traceback: Any, log: str) -> None:
    """A chord's errback: records that it ran and what failed."""
    record(log, errback=type(exc).__name__)


# -- on_lost (tests/celery/test_celery_outcomes.py): a run whose lock is force-released -----


def _lost_body(self: Any, key: str, log: str, seconds: float, step: float) -> str:
    """Holds the key, says so, then "works" for ``seconds`` (sleeps of ``step``) unless
    interrupted."""
    start = time.time()
    record(log, event="started", task_id=self.request.id, at=start)
    try:
        while time.time() - start < seconds:
            time.sleep(step)
    except LockLost as exc:
        record(log, event="interrupted", after=time.time() - start, error=str(exc))
        raise
    record(log, event="finished", after=time.time() - start)
    return "finished"


@singleton_task(**common, ttl=1.5, on_conflict="raise")
def lost_interrupt(self: Any, key: str, log: str, seconds: float, step: float) -> str:
    return _lost_body(self, key, log, seconds, step)


@singleton_task(**common, ttl=30, on_conflict="raise")
def lost_interrupt_noticed(self: Any, key: str, log: str, seconds: float, step: float) -> str:
    """Renewed every 10 s: an interrupt within a second comes from the release notice.
    The body starts once the worker's listener is subscribed (a release before that is
    found by renewal, by design)."""
    from task_locks import notices
    from task_locks.celery import current_lease

    lease = current_lease()
    listener = None if lease is None else notices.listener(lease.backend, create=False)
    if listener is not None:
        listener.ready.wait(10)
    return _lost_body(self, key, log, seconds, step)


@singleton_task(**common, ttl=1.5, on_conflict="raise", on_lost="fail")
def lost_fail(self: Any, key: str, log: str, seconds: float, step: float) -> str:
    return _lost_body(self, key, log, seconds, step)


@singleton_task(**common, ttl=1.5, on_conflict="raise", on_lost="ignore")
def lost_ignore(self: Any, key: str, log: str, seconds: float, step: float) -> str:
    return _lost_body(self, key, log, seconds, step)


@singleton_task(**common, ttl=1.5, on_conflict="raise", ignore_result=True)
def lost_interrupt_unstored(self: Any, key: str, log: str, seconds: float, step: float) -> str:
    """No result stored: its outcome must be the same as with a stored result."""
    return _lost_body(self, key, log, seconds, step)


@singleton_task(**common, ttl=1.5, on_conflict="raise", on_lost="fail", ignore_result=True)
def lost_fail_unstored(self: Any, key: str, log: str, seconds: float, step: float) -> str:
    return _lost_body(self, key, log, seconds, step)


@signals.task_failure.connect
def _record_failure(
    sender: Any, task_id: str, exception: BaseException, args: Any, **_: Any
) -> None:
    """How a lost_* run ended, seen in the worker (no result backend needed)."""
    if sender.name.startswith("celery_tasks.lost_"):
        record(
            args[1] + ":end",
            state="FAILURE",
            error=type(exception).__name__,
            message=str(exception),
        )


@signals.task_success.connect
def _record_success(sender: Any, result: Any, **_: Any) -> None:
    if sender.name.startswith("celery_tasks.lost_"):
        record(sender.request.args[1] + ":end", state="SUCCESS", result=result)


# -- a lock_on="both" PeerCheckedTask meeting an old library's key ------------------------


@singleton_task(
    **common,
    ttl=10,
    lock_on="both",
    on_conflict="skip",
    base=PeerCheckedTask,
    lock_peers=PeerKeys(LOCKS, "peer:{name}"),
)
def peer_both_task(self: Any, key: str, log: str) -> str:
    record(log, event="ran", task_id=self.request.id)
    return "ran"
