"""Prometheus metrics from the lock event stream (extra ``metrics``: prometheus_client).

::

    from task_locks.metrics import install
    install()                       # prometheus_client's default registry, or registry=...

With the Django app, ``TASK_LOCKS["METRICS"] = True`` calls it at start-up. The ``lock``
label is the lock name's *family*, the part before the first ``:`` (``sync:42`` ->
``sync``), never the full name, which would give one time series per account id; a
semaphore's (and a ``limit > 1`` singleton task's) is its own name's family.

``outcome`` is ``acquired`` (also after a wait: a ``wait`` policy that met a holder and
then got the lock counts once, as acquired, its wait in ``task_locks_wait_seconds``),
``conflict`` (given up at once: ``timeout=0``, a skip), ``timeout`` (given up after
waiting a timeout > 0) or ``error`` (backend unreachable).
``task_locks_held`` counts leases taken and not yet released, lost or handed over (a
published task's queued lock goes on to its worker: the publisher reports it released).
``reason`` of ``task_locks_lost_total`` is one of :data:`LOST_REASONS`.

The collectors are fed by a subscriber of :mod:`task_locks.events`, in the events'
dispatcher thread: counting never happens on a lock's path.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from . import events
from .events import LockEvent

#: Buckets for waits and holds: from a hand-off (ms) to a long job (an hour).
SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600)
#: Buckets for renewal round trips.
RENEWAL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

_installed: dict[int, _Collectors] = {}
_guard = threading.Lock()


class _Collectors:
    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.acquisitions = Counter(
            "task_locks_acquisitions",
            "Lock acquisitions by outcome (acquired, conflict, timeout, error).",
            ["lock", "outcome"],
            registry=registry,
        )
        self.wait = Histogram(
            "task_locks_wait_seconds",
            "Time spent waiting for a lock before it was acquired or given up.",
            ["lock"],
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self.hold = Histogram(
            "task_locks_hold_seconds",
            "Time a lock was held, from acquire to release or loss.",
            ["lock"],
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self.held = Gauge(
            "task_locks_held",
            "Leases this process holds now.",
            ["lock"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.lost = Counter(
            "task_locks_lost", "Leases lost, by reason.", ["lock", "reason"], registry=registry
        )
        self.renewal = Histogram(
            "task_locks_renewal_seconds",
            "Round trip of one renewal batch, per backend.",
            ["backend"],
            buckets=RENEWAL_BUCKETS,
            registry=registry,
        )
        self.dropped = Counter(
            "task_locks_events_dropped",
            "Lock events dropped because the event queue was full.",
            registry=registry,
        )
        self._dropped_seen = 0
        self.subscription = events.subscribe(self.observe, batch=True, name="prometheus")

    def observe(self, batch: Sequence[LockEvent]) -> None:
        for event in batch:
            self._observe(event)
        dropped = events.dropped()
        if dropped > self._dropped_seen:
            self.dropped.inc(dropped - self._dropped_seen)
            self._dropped_seen = dropped

    def _observe(self, event: LockEvent) -> None:
        family = event.family
        match event:
            case events.Acquired(waited=waited):
                self.acquisitions.labels(family, "acquired").inc()
                self.held.labels(family).inc()
                if waited is not None:
                    self.wait.labels(family).observe(waited)
            case events.Conflict(waited=waited, timeout=timeout):
                self.acquisitions.labels(family, "timeout" if timeout else "conflict").inc()
                if waited is not None:
                    self.wait.labels(family).observe(waited)
            case events.Error():
                self.acquisitions.labels(family, "error").inc()
            case events.Released(reason=events.HANDED_OVER):
                self.held.labels(family).dec()  # held here only while it was published
            case events.Released(held=held):
                self.held.labels(family).dec()
                if held is not None:
                    self.hold.labels(family).observe(held)
            case events.Lost(held=held, reason=reason):
                self.held.labels(family).dec()
                if held is not None:
                    self.hold.labels(family).observe(held)
                self.lost.labels(family, reason.value).inc()  # as the lease decided it
            case events.Renewed(duration=duration) if duration is not None:
                self.renewal.labels(event.backend.split("://", 1)[0]).observe(duration)


#: ``reason`` labels of ``task_locks_lost_total``: the values of
#: :class:`~task_locks.events.LostReason`, the reason the lease's code decided (never read
#: from a message): ``max_hold`` exceeded; ``unreachable``: renewals failed until the TTL
#: ran out; ``deadline``: no renewal answered in time (a stalled link, a paused process, a
#: ``renew=False`` lease held past its TTL); ``forced``: the token was gone before the TTL
#: ran out (a force release, a server restart or failover); ``unknown``: a release got no
#: reply; ``dropped``: a renewed lease was garbage-collected while held; ``other``: a loss
#: reported from outside a lease.
LOST_REASONS = tuple(reason.value for reason in events.LostReason)


def install(registry: Any = None) -> None:
    """Register the collectors in ``registry`` (default: prometheus_client's); idempotent."""
    try:
        import prometheus_client
    except ImportError as exc:  # pragma: no cover - the extra is missing
        raise ImportError(
            "task_locks.metrics needs prometheus_client: install task-locks with its metrics "
            "extra (from a checkout, the only way today: pip install -e '.[metrics]')"
        ) from exc
    registry = prometheus_client.REGISTRY if registry is None else registry
    with _guard:
        if id(registry) not in _installed:
            _installed[id(registry)] = _Collectors(registry)


def uninstall(registry: Any = None) -> None:
    """Stop feeding and unregister the collectors (tests, reloads)."""
    import prometheus_client

    registry = prometheus_client.REGISTRY if registry is None else registry
    with _guard:
        collectors = _installed.pop(id(registry), None)
    if collectors is None:
        return
    collectors.subscription.close()
    for name in ("acquisitions", "wait", "hold", "held", "lost", "renewal", "dropped"):
        registry.unregister(getattr(collectors, name))


__all__ = ["LOST_REASONS", "install", "uninstall"]
