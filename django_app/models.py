"""Tables of the task-locks app.

- :class:`LockRecord` and :class:`FenceCounter` are the ``django://`` backend's storage.
  They are written only with the backend's own SQL (one short transaction per
  operation, expiry judged by the database clock); the ORM models exist for migrations
  and for read-only inspection.
- :class:`ResourceFence` is the last fence a protected resource accepted
  (``django_app.fencing.fenced``).
- :class:`LockEvent` is the audit history shown read-only in the admin.
- :class:`LockHolder` is an unmanaged model without a table: it gives the admin's live
  **Lock holders** page a place in the "Task locks" section and carries the
  ``force_release_lock`` permission.
"""

from __future__ import annotations

import json
from typing import Any

from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

#: Same bound as ``task_locks.lock.MAX_NAME_LENGTH``.
NAME_LENGTH = 512


class LockRecord(models.Model):
    """One lock: present and live while ``expires_at`` (database clock) is in the future."""

    name = models.CharField(max_length=NAME_LENGTH, primary_key=True)
    token = models.CharField(max_length=64)
    fence = models.BigIntegerField(default=0)
    owner = models.TextField(default="", help_text=_("Owner metadata as JSON."))
    acquired_at = models.DateTimeField()
    expires_at = models.DateTimeField(db_index=True)
    renewals = models.IntegerField(default=0)

    class Meta:
        db_table = "task_locks_lock"
        verbose_name = _("lock record")
        default_permissions = ()

    def __str__(self) -> str:
        return self.name


class FenceCounter(models.Model):
    """The last fence handed out per lock name; never deleted, so fences never repeat."""

    name = models.CharField(max_length=NAME_LENGTH, primary_key=True)
    fence = models.BigIntegerField(default=0)

    class Meta:
        db_table = "task_locks_fence"
        verbose_name = _("fence counter")
        default_permissions = ()

    def __str__(self) -> str:
        return f"{self.name}: {self.fence}"


class ResourceFence(models.Model):
    """The highest fence a resource accepted; older fences are refused as stale."""

    resource = models.CharField(max_length=255, primary_key=True)
    fence = models.BigIntegerField()
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "task_locks_resource_fence"
        verbose_name = _("resource fence")
        default_permissions = ()

    def __str__(self) -> str:
        return f"{self.resource}: {self.fence}"


class LockEvent(models.Model):
    """One notable thing that happened to a lock, kept for ``EVENT_RETENTION_DAYS``."""

    class Kind(models.TextChoices):
        # Labels are the values, not translated: the admin names kinds as
        # TASK_LOCKS["AUDIT"] does, and an operator copies them from there.
        ACQUIRED = "acquired", "acquired"
        RELEASED = "released", "released"
        LOST = "lost", "lost"
        FORCED = "forced", "forced"
        CONFLICT = "conflict", "conflict"
        RENEWAL_FAILED = "renewal_failed", "renewal_failed"
        RENEWAL_LATE = "renewal_late", "renewal_late"
        DUPLICATE = "duplicate", "duplicate"
        ERROR = "error", "error"

    #: When it happened (the event's time, not when its batch was written).
    created_at = models.DateTimeField(_("time"), default=timezone.now, db_index=True)
    kind = models.CharField(_("kind"), max_length=16, choices=Kind.choices, db_index=True)
    name = models.CharField(_("lock name"), max_length=NAME_LENGTH, db_index=True)
    fence = models.BigIntegerField(_("fence"), null=True, blank=True)
    owner = models.TextField(
        _("owner"), blank=True, default="", help_text=_("The holder, as JSON.")
    )
    actor = models.CharField(
        _("actor"),
        max_length=255,
        blank=True,
        default="",
        help_text=_("Who caused it (operator, process)."),
    )
    detail = models.TextField(_("detail"), blank=True, default="")
    #: A conflict's (and a duplicate's) policy: what the front end did about the holder.
    policy = models.CharField(
        _("policy"),
        max_length=16,
        blank=True,
        default="",
        db_index=True,
        help_text=_("What the caller did about the holder: skip, retry, wait, raise, exit."),
    )
    #: Repeats folded into this row: the same kind, lock, policy and holder within
    #: :data:`django_app.audit.REPEAT_WINDOW` of the first (a storm of skipped duplicates
    #: is one row with its count, not a page of identical rows).
    count = models.PositiveIntegerField(_("count"), default=1)
    #: When the last repeat happened (``None``: no repeat).
    last_at = models.DateTimeField(_("last repeat"), null=True, blank=True)

    class Meta:
        db_table = "task_locks_event"
        ordering = ("-created_at", "-id")
        verbose_name = _("lock event")
        verbose_name_plural = _("lock events")
        default_permissions = ("view",)

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"

    @property
    def owner_data(self) -> dict[str, Any]:
        """The holder as a dict (from the ``owner`` JSON); empty when there is none or it does not
        parse."""
        try:
            data = json.loads(self.owner) if self.owner else {}
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}


class LockHolder(models.Model):
    """No table: the admin's live holders page and its permission hang off this model."""

    name = models.CharField(max_length=NAME_LENGTH, primary_key=True)

    class Meta:
        managed = False
        db_table = "task_locks_lock"
        verbose_name = _("lock holder")
        verbose_name_plural = _("lock holders")
        default_permissions = ("view",)
        # Stored in the database by name: not translated, as Django's own are not.
        permissions = (("force_release_lock", "Can force-release a lock held by anyone"),)

    def __str__(self) -> str:
        return self.name
