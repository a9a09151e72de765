"""Lock events get their policy as a column, and a count of repeats folded into one row.

Rows written before this kept the policy in ``detail`` ("...; policy skip; ..."): it is
copied into the new column, so the admin's policy column and filter cover them too.
"""

import re

from django.db import migrations, models


def policy_from_detail(apps, schema_editor):
    """On the database being migrated (``migrate --database=...`` migrates one alias)."""
    LockEvent = apps.get_model("task_locks", "LockEvent")
    events = LockEvent.objects.using(schema_editor.connection.alias)
    for event in events.filter(detail__contains="policy ").iterator():
        found = re.search(r"(?:^|; )policy (\w+)", event.detail)
        if found:
            events.filter(pk=event.pk).update(policy=found.group(1)[:16])


class Migration(migrations.Migration):
    dependencies = [
        ("task_locks", "0004_verbose_names"),
    ]

    operations = [
        migrations.AddField(
            model_name="lockevent",
            name="count",
            field=models.PositiveIntegerField(default=1, verbose_name="count"),
        ),
        migrations.AddField(
            model_name="lockevent",
            name="last_at",
            field=models.DateTimeField(blank=True, null=True, verbose_name="last repeat"),
        ),
        migrations.AddField(
            model_name="lockevent",
            name="policy",
            field=models.CharField(
                blank=True,
                db_index=True,
                default="",
                help_text="What the caller did about the holder: skip, retry, wait, raise, exit.",
                max_length=16,
                verbose_name="policy",
            ),
        ),
        migrations.RunPython(policy_from_detail, migrations.RunPython.noop),
    ]
