"""The admin's "Task locks" section: **Lock holders** (live) and **Lock events** (history).

Lock holders is not a table: the page reads ``backend.holders()`` on every request, so it
shows what the lock service holds right now, whichever backend ``TASK_LOCKS`` names.
It hangs off the unmanaged :class:`~django_app.models.LockHolder` model so it sits in the
admin index like any model, and viewing it needs ``task_locks.view_lockholder``.
Force release needs ``task_locks.force_release_lock`` and asks for confirmation; the
confirmation form carries the fence of the holder it showed (never the token, which is
the holder's secret), and the release frees only that holder, atomically on the server.
A lock that changed hands meanwhile is left alone: the page says who holds it now,
records a ``conflict`` event and asks again; a release writes a ``forced`` event.

The holders are grouped as ``locks list`` groups them (:func:`task_locks.listing.group_holders`):
plain locks, then elections (leader, term, since, expiry), then semaphores ("holders /
limit", each permit on its own row). An election or a permit is one lock, and is
force-released as one (ending that term, or freeing that permit).
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any
from urllib.parse import unquote, urlencode

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from django.utils.translation import gettext, gettext_lazy

from task_locks import LockError, events
from task_locks.election import LeaderInfo
from task_locks.listing import (
    KINDS,
    Listing,
    changed_hands_message,
    describe_backend,
    describe_holder,
    describe_role,
    filter_holders,
    format_duration,
    group_holders,
    holder_job,
    lock_role,
    slot_index,
    visible,
)
from task_locks.semaphore import SemaphoreInfo
from task_locks.types import Holder, Owner

from . import audit, conf
from .models import LockEvent, LockHolder

FORCE_RELEASE_PERMISSION = "task_locks.force_release_lock"


def _row(holder: Holder) -> dict[str, Any]:
    owner = holder.owner
    return {
        "name": holder.name,
        "job": holder_job(owner),
        "worker": owner.worker or "",
        "host": owner.host,
        "pid": owner.pid or "",
        "fence": holder.fence,
        "acquired": _datetime(holder.acquired_at),
        "held_for": format_duration(holder.held_for),
        "expires_in": format_duration(holder.expires_in),
        "renewals": holder.renewals,
        "description": owner.describe(),
        "role": describe_role(holder),
        "role_kind": lock_role(holder),
    }


def _datetime(epoch: float | None) -> dt.datetime | None:
    return None if epoch is None else dt.datetime.fromtimestamp(epoch, tz=dt.UTC)


def _election_row(info: LeaderInfo, holder: Holder) -> dict[str, Any]:
    return {**_row(holder), "election": info.election, "leader": info.identity, "term": info.term}


def _semaphore_row(info: SemaphoreInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "summary": info.summary,
        "permits": [{**_row(h), "slot": slot_index(h)} for h in info.holders],
    }


def _grouped(listing: Listing) -> dict[str, Any]:
    semaphores = [_semaphore_row(info) for info in listing.semaphores]
    rows = [_row(h) for h in listing.locks]
    elections = [_election_row(info, h) for info, h in listing.elections]
    return {
        "rows": rows,
        "elections": elections,
        "semaphores": semaphores,
        "total": listing.count,
        # The footer counts what each table shows: rows, elections, permits.
        "lock_count": len(rows),
        "election_count": len(elections),
        "permit_count": sum(len(group["permits"]) for group in semaphores),
    }


#: The column titles of the holders page's tables, in order, for the one header template
#: they share (``_table_head.html``; Action follows where the user may force a release).
COLUMNS = {
    "locks": (
        gettext_lazy("Name"),
        gettext_lazy("Job"),
        gettext_lazy("Host"),
        gettext_lazy("PID"),
        gettext_lazy("Fence"),
        gettext_lazy("Acquired"),
        gettext_lazy("Held for"),
        gettext_lazy("Expires in"),
        gettext_lazy("Renewals"),
    ),
    "elections": (
        gettext_lazy("Election"),
        gettext_lazy("Leader"),
        gettext_lazy("Term"),
        gettext_lazy("Since"),
        gettext_lazy("Leading for"),
        gettext_lazy("Expires in"),
        gettext_lazy("Leader's job"),
    ),
    "semaphores": (
        gettext_lazy("Semaphore"),
        gettext_lazy("Holders / limit"),
        gettext_lazy("Permit"),
        gettext_lazy("Job"),
        gettext_lazy("Host"),
        gettext_lazy("PID"),
        gettext_lazy("Fence"),
        gettext_lazy("Held for"),
        gettext_lazy("Expires in"),
    ),
}


#: Seconds between two refreshes of the holders page; ``?refresh=0`` starts paused.
REFRESH_EVERY = 5


def _refresh_every(value: str | None) -> int:
    try:
        seconds = int(value) if value is not None else REFRESH_EVERY
    except ValueError:
        return REFRESH_EVERY
    return max(0, min(seconds, 3600))


class _ReadOnlyAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Nobody adds, edits or deletes these from the admin (viewing needs ``view_*``)."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(LockHolder)
class LockHolderAdmin(_ReadOnlyAdmin):
    """The live holders page (a custom changelist) and its force-release view."""

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm(FORCE_RELEASE_PERMISSION))

    def get_urls(self) -> list[URLPattern]:
        info = self.opts.app_label, self.opts.model_name
        view = self.admin_site.admin_view
        return [
            path("", view(self.changelist_view), name="{}_{}_changelist".format(*info)),
            path(
                "force-release/",
                view(self.force_release_view),
                name="{}_{}_force_release".format(*info),
            ),
        ]

    def _context(self, request: HttpRequest, title: str) -> dict[str, Any]:
        return {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "app_label": self.opts.app_label,
            "title": title,
            # Without the password (describe_backend), and as typed: "prefix=app:", not
            # the percent-encoded "prefix=app%3A" of the URL the settings were folded into.
            "backend": unquote(describe_backend(conf.backend())),
        }

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        prefix = request.GET.get("q", "").strip()
        job = request.GET.get("job", "").strip()
        host = request.GET.get("host", "").strip()
        kind = request.GET.get("kind", "").strip()
        kind = kind if kind in KINDS else ""
        error = None
        try:
            holders = visible(conf.backend().holders(prefix))  # no internal records
        except LockError as exc:
            holders, error = [], str(exc)
        shown = filter_holders(holders, job=job, host=host, kind=kind)
        context = {
            **self._context(request, gettext("Lock holders")),
            "prefix": prefix,
            "job": job,
            "host": host,
            "kind": kind,
            "kinds": KINDS,
            "hosts": sorted({h.owner.host for h in holders if h.owner.host} | ({host} - {""})),
            "filtered": bool(prefix or job or host or kind),
            "refresh_every": _refresh_every(request.GET.get("refresh")),
            # What "resume" runs at when the page started paused (?refresh=0).
            "refresh_period": _refresh_every(request.GET.get("refresh")) or REFRESH_EVERY,
            **_grouped(group_holders(shown)),
            "error": error,
            "can_force_release": self.has_force_release_permission(request),
            "columns": COLUMNS,
            "now": timezone.now(),
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/task_locks/holders.html", context)

    def force_release_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_force_release_permission(request):
            raise PermissionDenied
        data = request.POST if request.method == "POST" else request.GET
        name = data.get("name", "")
        changelist = reverse("admin:task_locks_lockholder_changelist")
        if not name:
            self.message_user(
                request, gettext("No lock name given to force-release."), messages.WARNING
            )
            return HttpResponseRedirect(changelist)
        try:
            holder = conf.backend().holder(name)
        except LockError as exc:
            self.message_user(
                request,
                gettext("Could not read lock “%(name)s”: %(error)s") % {"name": name, "error": exc},
                messages.ERROR,
            )
            return HttpResponseRedirect(changelist)
        if holder is None:
            self.message_user(
                request, gettext("Lock “%(name)s” is not held.") % {"name": name}, messages.WARNING
            )
            return HttpResponseRedirect(changelist)
        if request.method == "POST":
            try:
                fence = int(data.get("fence", ""))
            except ValueError:
                self.message_user(
                    request,
                    gettext(
                        "No holder given for lock “%(name)s”: confirm the release on this page."
                    )
                    % {"name": name},
                    messages.WARNING,
                )
                return HttpResponseRedirect(f"{request.path}?{urlencode({'name': name})}")
            if holder.fence != fence:
                return self._changed_hands(request, name, fence, holder)
            return self._force_release(request, holder, changelist)
        context = {
            **self._context(request, gettext("Are you sure?")),
            "row": _row(holder),
        }
        return TemplateResponse(request, "admin/task_locks/force_release_confirm.html", context)

    def _force_release(self, request: HttpRequest, holder: Holder, changelist: str) -> HttpResponse:
        backend = conf.backend()
        try:
            # Frees only the holder with the fence the operator confirmed, atomically on the
            # server: a lock that changed hands since the read above is left alone.
            released = backend.force_release(holder.name, fence=holder.fence)
            now = None if released else backend.holder(holder.name)
        except LockError as exc:
            self.message_user(
                request,
                gettext("Could not release “%(name)s”: %(error)s")
                % {"name": holder.name, "error": exc},
                messages.ERROR,
            )
            return HttpResponseRedirect(changelist)
        if now is not None:
            return self._changed_hands(request, holder.name, holder.fence, now)
        if released:
            audit.record(
                events.Forced(
                    name=holder.name,
                    fence=holder.fence,
                    owner=holder.owner,
                    actor=self._actor(request),
                    detail=f"force-released in the admin; was held by {describe_holder(holder)}",
                ),
                sync=True,
            )
            self.message_user(
                request,
                gettext("Released lock “%(name)s” (was held by %(holder)s).")
                % {"name": holder.name, "holder": holder.owner.describe()},
                messages.SUCCESS,
            )
        else:
            self.message_user(
                request,
                gettext("Lock “%(name)s” was already free.") % {"name": holder.name},
                messages.INFO,
            )
        return HttpResponseRedirect(changelist)

    def _changed_hands(
        self, request: HttpRequest, name: str, fence: int, now: Holder
    ) -> HttpResponse:
        """Nothing released: say who holds it now, record the refusal, ask about them."""
        audit.record(
            events.Conflict(
                name=name,
                fence=now.fence,
                owner=now.owner,
                actor=self._actor(request),
                detail=f"force release in the admin refused: it was for the holder with fence "
                f"{fence}, and the lock changed hands",
            ),
            sync=True,
        )
        self.message_user(
            request,
            gettext("Lock “%(name)s”: %(what)s.")
            % {"name": name, "what": changed_hands_message(now)},
            messages.WARNING,
        )
        return HttpResponseRedirect(f"{request.path}?{urlencode({'name': name})}")

    @staticmethod
    def _actor(request: HttpRequest) -> str:
        return f"{request.user.get_username()} (admin)"  # type: ignore[union-attr]


#: What a conflict's policy made the caller do: the admin's outcome column.
POLICY_OUTCOMES = {
    "skip": gettext_lazy("skipped"),
    "retry": gettext_lazy("retried later"),
    "wait": gettext_lazy("gave up waiting"),
    "raise": gettext_lazy("raised LockHeld"),
    "exit": gettext_lazy("exited with status 75"),
}


@admin.register(LockEvent)
class LockEventAdmin(_ReadOnlyAdmin):
    """Read-only history: nobody edits the audit trail from the admin.

    Each row says what the caller did (the policy and its outcome: a skip, a wait given
    up and a command's exit 75 are all conflicts, and read differently), and repeats of one
    conflict against one holder are one row with their count (see :mod:`django_app.audit`).
    """

    list_display = ("when", "kind", "outcome", "name", "repeats", "fence", "holder", "actor")
    list_filter = ("kind", "policy", "created_at")
    search_fields = ("name", "actor", "detail")
    date_hierarchy = "created_at"
    ordering = ("-created_at", "-id")
    readonly_fields = (
        "when", "kind", "outcome", "name", "repeats", "fence", "holder", "actor", "detail",
    )  # fmt: skip
    fields = readonly_fields

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        context = {
            "title": gettext("Lock events"),
            "events_intro": gettext(
                "What happened to the locks: conflicts, lost leases, force releases. "
                "Kept for %(days)s days."
            )
            % {"days": f"{conf.lock_settings().event_retention_days:g}"},
            **(extra_context or {}),
        }
        return super().changelist_view(request, extra_context=context)

    @admin.display(description=gettext_lazy("time"), ordering="created_at")
    def when(self, event: LockEvent) -> str:
        """To the second, with the time zone: events a second apart are told apart.

        The date and the time each stay on one line, so a narrow column wraps between them.
        """
        return _local_time(event.created_at)

    @admin.display(description=gettext_lazy("outcome"), ordering="policy")
    def outcome(self, event: LockEvent) -> str:
        """What the caller did: ``skip: skipped``, ``exit: exited with status 75``..."""
        if event.kind == LockEvent.Kind.DUPLICATE:
            return format_html("<b>{}</b>: {}", "enqueue", gettext("not queued"))
        if event.kind != LockEvent.Kind.CONFLICT:
            return "-"
        if not event.policy:
            return gettext("held elsewhere")
        said = POLICY_OUTCOMES.get(event.policy, event.policy)
        return format_html("<b>{}</b>: {}", event.policy, said)

    @admin.display(description=gettext_lazy("count"), ordering="count")
    def repeats(self, event: LockEvent) -> str:
        """How many times it happened (repeats folded into the row), and when it last did."""
        if event.count <= 1 or event.last_at is None:
            return "1"
        last = timezone.localtime(event.last_at)
        return format_html(
            '{}<br><span class="lock-last" title="{}">{} {}</span>',
            event.count,
            last.strftime("%Y-%m-%d %H:%M:%S %Z"),
            gettext("last"),
            last.strftime("%H:%M:%S"),  # within an hour of the row's own time
        )

    @admin.display(description=gettext_lazy("holder"))
    def holder(self, event: LockEvent) -> str:
        return _breakable(Owner.from_json(event.owner).describe() if event.owner_data else "-")

    @admin.display(description=gettext_lazy("actor"), ordering="actor")
    def actor(self, event: LockEvent) -> str:
        return _breakable(event.actor or "-")


#: Where a long host or job name may wrap: after its dots, dashes, brackets...
_BREAK_AFTER = re.compile(r"(?<=[.@\-_/\[(:])")


def _breakable(text: str) -> str:
    """``text`` with line-break opportunities after its separators, so a long host name
    wraps at a dot instead of widening the table (or being cut at a random letter)."""
    return format_html_join(
        mark_safe("<wbr>"), "{}", ((part,) for part in _BREAK_AFTER.split(text))
    )


def _local_time(at: dt.datetime) -> str:
    local = timezone.localtime(at)
    return format_html(
        '<span class="lock-time" style="white-space: nowrap">{}</span> '
        '<span class="lock-time" style="white-space: nowrap">{}</span>',
        local.strftime("%Y-%m-%d"),
        local.strftime("%H:%M:%S %Z"),
    )
