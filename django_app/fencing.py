"""Fencing at the resource for data kept in a Django database.

A lock cannot stop a holder that paused past its TTL from waking up and writing: by
then a newer holder has the lock. The database can, if every write says which fence
it comes from and the database refuses fences older than one it already accepted.
Two guards, for two shapes of data:

``fenced(resource, fence)``
    For any writes, to any tables. It advances a per-resource high-water mark (the
    ``task_locks_resource_fence`` table) inside the current transaction and raises
    :class:`~task_locks.StaleFence` if a newer fence already got there. The mark's row
    stays locked until the transaction ends, so the writes in the block commit together
    with the mark, or not at all, and a newer holder waits for them instead of racing
    them. Enter it *before* reading what you will write (read-modify-write is covered)::

        with transaction.atomic(), fenced(f"invoice:{pk}", lease.fence):
            invoice = Invoice.objects.get(pk=pk)
            invoice.total += amount
            invoice.save()

    ``fenced()`` opens its own ``atomic()`` block too (a savepoint when nested), so it
    is never left outside a transaction.

``FencedModel``
    For rows that carry their own fence: an abstract model adding a ``fence`` column.
    ``obj.save(fence=lease.fence)`` and ``Model.objects.filter(...).update(...,
    fence=lease.fence)`` write only rows whose stored fence is not newer, *in the same
    UPDATE statement* (``... WHERE fence <= %s``), and raise ``StaleFence`` when a row
    was refused. A plain ``save()`` never writes the ``fence`` column of an existing
    row, so it can never lower the mark.

The same fence may write any number of times (a holder writes as often as it likes
under its own lease); only an older one is refused. SQL is portable: SQLite,
PostgreSQL and MySQL/MariaDB behave the same, at any isolation level. A stale write is
refused loudly, never "0 rows": MySQL/MariaDB under REPEATABLE READ are guarded by
reading the refusing fence with a locking read (see ``_latest``); PostgreSQL under
REPEATABLE READ or SERIALIZABLE refuses a fence that moved after the transaction's
snapshot with a serialization failure (``OperationalError``, SQLSTATE 40001), before
anything is written, and the retried transaction then gets ``StaleFence``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connections, models, router, transaction
from django.utils import timezone

from task_locks.errors import InvalidArgument, StaleFence

from .models import ResourceFence

RESOURCE_LENGTH = ResourceFence._meta.get_field("resource").max_length or 255


def _fence_number(fence: object, resource: str) -> tuple[int, str | None]:
    """``fence`` as an int (a lease is accepted too), and the lock's name if known."""
    lock_name = None
    if not isinstance(fence, int) and hasattr(fence, "fence"):
        lock_name = getattr(fence, "name", None)
        fence = fence.fence
    if isinstance(fence, bool) or not isinstance(fence, int) or fence < 0:
        raise InvalidArgument(
            f"resource {resource!r}: a fence must be a non-negative int or a lease, got {fence!r}",
            name=resource,
        )
    return fence, lock_name


def _stale(resource: str, fence: int, current: int | None, lock_name: str | None) -> StaleFence:
    return StaleFence(
        f"resource {resource!r} refused a write with fence {fence}: fence {current} already "
        "wrote to it (the lock was lost and taken by a newer holder)",
        name=lock_name or resource,
        resource=resource,
        fence=fence,
        current=current,
    )


def _latest(queryset: Any) -> Any:
    """``queryset`` as a locking read (``SELECT ... FOR UPDATE``) inside a transaction.

    Why: after a guarded write matched no row, the reason is read back. Under MySQL's and
    MariaDB's REPEATABLE READ a plain read inside the transaction sees its *snapshot*,
    taken at its first read, from before the newer holder committed: it would report no
    newer fence, and the stale write would pass as "0 rows". A locking read sees the
    latest committed row on InnoDB; on PostgreSQL under REPEATABLE READ or SERIALIZABLE
    a row changed since the snapshot makes the database refuse the transaction
    (serialization failure, SQLSTATE 40001), which is loud too. SQLite has one writer
    at a time and no FOR UPDATE (Django leaves it out there).
    """
    if connections[queryset.db].in_atomic_block:
        return queryset.select_for_update()
    return queryset  # autocommit: every statement reads the latest committed rows


def advance_fence(resource: str, fence: Any, *, using: str | None = None) -> None:
    """Raise ``resource``'s high-water mark to ``fence``, or raise ``StaleFence``.

    Call it inside a transaction (``fenced()`` does): the mark's row stays locked until
    commit. Two statements, both race-free: create the row if missing (a no-op when it
    exists), then move the mark only if it is not newer.
    """
    if not isinstance(resource, str) or not resource.strip():
        raise InvalidArgument(f"a resource must be a non-empty string, got {resource!r}")
    if len(resource) > RESOURCE_LENGTH:
        raise InvalidArgument(
            f"a resource name must be at most {RESOURCE_LENGTH} characters, got {len(resource)}",
            name=resource[:40] + "...",
        )
    number, lock_name = _fence_number(fence, resource)
    using = using or router.db_for_write(ResourceFence)
    marks = ResourceFence.objects.db_manager(using)
    now = timezone.now()
    marks.bulk_create(
        [ResourceFence(resource=resource, fence=number, updated_at=now)], ignore_conflicts=True
    )
    if marks.filter(resource=resource, fence__lte=number).update(fence=number, updated_at=now):
        return
    current = _latest(marks.filter(resource=resource)).values_list("fence", flat=True).first()
    raise _stale(resource, number, current, lock_name)


@contextmanager
def fenced(resource: str, fence: Any, *, using: str | None = None) -> Iterator[None]:
    """Run the block's writes only if ``fence`` is the newest ``resource`` has seen.

    ``fence`` is ``lease.fence`` (or the lease). ``using`` is the database alias (by
    default the router's choice for writing ``ResourceFence``); the block's writes
    must go to the same database to commit atomically with the mark.
    """
    using = using or router.db_for_write(ResourceFence)
    with transaction.atomic(using=using):
        advance_fence(resource, fence, using=using)
        yield


class FencedQuerySet(models.QuerySet):
    """``update(..., fence=N)`` writes only rows whose fence is not newer than ``N``."""

    def update(self, fence: Any = None, **kwargs: Any) -> int:
        """Like ``QuerySet.update``; with ``fence``, all matched rows or none.

        The guarded ``UPDATE ... WHERE fence <= N`` sets ``fence = N`` on every row it
        writes. If some matched row already carries a newer fence, the whole update is
        rolled back and :class:`~task_locks.StaleFence` names that row.
        """
        if fence is None:
            return super().update(**kwargs)
        label = self.model._meta.label_lower
        number, lock_name = _fence_number(fence, label)
        with transaction.atomic(using=self.db):
            written = models.QuerySet.update(self.filter(fence__lte=number), fence=number, **kwargs)
            newer = _latest(self.filter(fence__gt=number)).order_by("-fence")
            newer = newer.values_list("pk", "fence")
            refused = newer.first()
            if refused is not None:
                raise _stale(f"{label}:{refused[0]}", number, refused[1], lock_name)
        return written


FencedManager = models.Manager.from_queryset(FencedQuerySet)


class FencedModel(models.Model):
    """Rows that remember the newest fence that wrote them, and refuse older ones.

    ``save(fence=lease.fence)`` on an existing row is ``UPDATE ... WHERE pk = %s AND
    fence <= %s``: a stale holder's save changes nothing and raises ``StaleFence``.
    A new row is inserted with the fence. Use ``FencedManager`` (the default
    ``objects``) or ``FencedQuerySet`` for a guarded ``update(..., fence=...)``.
    """

    fence = models.BigIntegerField(
        default=0, editable=False, help_text="The newest fence that wrote this row."
    )

    objects = FencedManager()

    class Meta:
        abstract = True

    def save(self, *args: Any, fence: Any = None, **kwargs: Any) -> None:
        if fence is None:
            super().save(*args, **kwargs)
            return
        number, lock_name = _fence_number(fence, self._meta.label_lower)
        update_fields = kwargs.get("update_fields")
        if update_fields is not None and "fence" not in update_fields:
            kwargs["update_fields"] = [*update_fields, "fence"]
        previous = self.fence
        self.fence = number
        self._pending_fence = (number, lock_name)
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        try:
            # A savepoint: a refusal leaves the caller's transaction usable.
            with transaction.atomic(using=using):
                super().save(*args, **kwargs)
        except BaseException:
            self.fence = previous
            raise
        finally:
            del self._pending_fence

    def _do_update(
        self,
        base_qs: Any,
        using: Any,
        pk_val: Any,
        values: Any,
        update_fields: Any,
        forced_update: Any,
    ) -> bool:
        local = base_qs.model._meta.local_concrete_fields
        if not any(field.attname == "fence" for field in local):
            return super()._do_update(base_qs, using, pk_val, values, update_fields, forced_update)
        pending = getattr(self, "_pending_fence", None)
        if pending is None:  # a plain save never moves the mark, least of all down
            values = [value for value in values if value[0].attname != "fence"]
            return super()._do_update(base_qs, using, pk_val, values, update_fields, forced_update)
        number, lock_name = pending
        guarded = base_qs.filter(fence__lte=number)
        if super()._do_update(guarded, using, pk_val, values, update_fields, forced_update):
            return True
        current = _latest(base_qs.filter(pk=pk_val)).values_list("fence", flat=True).first()
        if current is None:
            return False  # no such row: Django inserts it (or reports a forced update)
        raise _stale(f"{self._meta.label_lower}:{pk_val}", number, current, lock_name)


__all__ = [
    "FencedManager",
    "FencedModel",
    "FencedQuerySet",
    "advance_fence",
    "fenced",
]
