from django.contrib import admin

from .models import Invoice, JobRun


@admin.register(Invoice)
class InvoiceAdmin(admin.ModelAdmin):
    list_display = ["number", "amount_cents", "charged_by_fence"]


@admin.register(JobRun)
class JobRunAdmin(admin.ModelAdmin):
    list_display = ["job", "key", "pid", "fence", "started", "ended", "lease_lost"]
    list_filter = ["job"]
