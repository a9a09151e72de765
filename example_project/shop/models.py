"""The example's data: invoices written under a fence, and a log of every job run."""

from django.db import models


class Invoice(models.Model):
    """Charged by a singleton task; ``fenced()`` refuses a write from a stale holder."""

    number = models.CharField(max_length=32, unique=True)
    amount_cents = models.BigIntegerField(default=0)
    charged_by_fence = models.BigIntegerField(null=True, blank=True)

    def __str__(self) -> str:
        return self.number


class JobRun(models.Model):
    """One execution of a protected job, so the demo can prove that none overlapped."""

    job = models.CharField(max_length=100)
    key = models.CharField(max_length=200)
    started = models.FloatField()
    ended = models.FloatField(null=True)
    pid = models.IntegerField()
    fence = models.BigIntegerField(null=True)
    lease_lost = models.BooleanField(default=False)
    #: How many times Celery retried this call before this run (``on_conflict="retry"``).
    retries = models.IntegerField(default=0)

    class Meta:
        indexes = [models.Index(fields=["key"])]

    def __str__(self) -> str:
        return f"{self.job} {self.key}"
