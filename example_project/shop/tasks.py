"""One singleton task per conflict policy, one keyed by argument, one fenced write.

Each records its run in ``JobRun`` so the demo (and you) can check that no two runs of a
key ever overlapped. The ``time.sleep`` calls stand for real work.
"""

from __future__ import annotations

import os
import time

from django.db import transaction
from django.db.models import F

from django_app.fencing import fenced
from task_locks.celery import current_lease, singleton_task

from .models import Invoice, JobRun


def _run(job: str, key: str, seconds: float, retries: int = 0) -> int:
    lease = current_lease()
    run = JobRun.objects.create(
        job=job,
        key=key,
        started=time.time(),
        pid=os.getpid(),
        fence=lease.fence if lease else None,
        retries=retries,
    )
    time.sleep(seconds)  # the work itself
    run.ended = time.time()
    run.lease_lost = bool(lease is not None and lease.lost.is_set())
    run.save(update_fields=["ended", "lease_lost"])
    return run.pk


@singleton_task(key="sync:{account_id}", ttl=30, on_conflict="skip")
def sync_account(account_id: int, seconds: float = 1.0) -> int:
    """Skip: a duplicate call while one runs is dropped; its result is a Skipped."""
    return _run("sync_account", f"sync:{account_id}", seconds)


@singleton_task(key="search-index", ttl=30, on_conflict="wait", wait_timeout=120)
def rebuild_search_index(seconds: float = 0.3) -> int:
    """Wait: every call runs, one after the other, woken by the previous release."""
    return _run("rebuild_search_index", "search-index", seconds)


@singleton_task(
    key="mail:{invoice_id}",
    ttl=30,
    on_conflict="retry",
    retry_countdown=0.5,
    max_retries=50,
    bind=True,
)
def send_invoice_mail(self, invoice_id: int, seconds: float = 0.2) -> int:
    """Retry: a duplicate is retried later (jittered countdown) instead of holding a slot."""
    return _run("send_invoice_mail", f"mail:{invoice_id}", seconds, self.request.retries)


@singleton_task(key="rates", ttl=30, on_conflict="raise")
def refresh_exchange_rates(seconds: float = 0.2) -> int:
    """Raise: a duplicate fails at once with LockHeld naming the holder (state FAILURE)."""
    return _run("refresh_exchange_rates", "rates", seconds)


@singleton_task(key="invoice:{invoice_id}", ttl=30, on_conflict="wait", wait_timeout=120)
def charge_invoice(invoice_id: int, amount_cents: int) -> int:
    """A fenced write: even a holder that paused past its TTL cannot overwrite a newer one.

    ``fenced()`` raises StaleFence instead of writing if a newer fence already wrote.
    """
    lease = current_lease()
    assert lease is not None  # always set inside a singleton task's run
    with transaction.atomic(), fenced(f"invoice:{invoice_id}", lease.fence):
        Invoice.objects.filter(pk=invoice_id).update(
            amount_cents=F("amount_cents") + amount_cents, charged_by_fence=lease.fence
        )
    return _run("charge_invoice", f"invoice:{invoice_id}", 0.05)
