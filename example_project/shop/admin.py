import datetime as dt

from django.contrib import admin
from django.utils import timezone
from django.utils.html import format_html

from task_locks.listing import format_duration

from .models import Invoice, JobRun


def _time(epoch):
    """A run's time in TIME_ZONE, to the millisecond (runs last fractions of a second), with
    the zone; the date and the time each on one line so a narrow column wraps between them."""
    if epoch is None:
        return None  # the admin shows its empty value, "-"
    local = timezone.localtime(dt.datetime.fromtimestamp(epoch, tz=dt.UTC))
    return format_html(
        '<span style="white-space: nowrap">{}</span> <span style="white-space: nowrap">{}</span>',
        local.strftime("%Y-%m-%d"),
        f"{local:%H:%M:%S}.{local.microsecond // 1000:03d} {local:%Z}",
    )


@admin.register(Invoice)
class InvoiceAdmin(admin.ModelAdmin):
    list_display = ["number", "amount_cents", "charged_by_fence"]


@admin.register(JobRun)
class JobRunAdmin(admin.ModelAdmin):
    """Every run of a protected job: read the start times and durations to see that no two
    runs of one key overlapped."""

    # When it ended is "started" + "took": one time column fewer, so the table fits.
    list_display = ["job", "key", "started_at", "took", "pid", "fence", "lease_lost"]
    list_filter = ["job", "lease_lost"]
    search_fields = ["key"]
    ordering = ["-started"]

    @admin.display(description="started", ordering="started")
    def started_at(self, run):
        return _time(run.started)

    @admin.display(description="ended", ordering="ended")
    def ended_at(self, run):
        return _time(run.ended)

    @admin.display(description="took")
    def took(self, run):
        return "running" if run.ended is None else format_duration(run.ended - run.started)
