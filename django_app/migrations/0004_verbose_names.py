"""Verbose names for the audit history's fields, so the admin can show them translated.

Only labels change (Django keeps them in the migration state); no table changes.
"""

import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("task_locks", "0003_event_kinds_and_times"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="lockevent",
            options={
                "default_permissions": ("view",),
                "ordering": ("-created_at", "-id"),
                "verbose_name": "lock event",
                "verbose_name_plural": "lock events",
            },
        ),
        migrations.AlterField(
            model_name="lockevent",
            name="actor",
            field=models.CharField(
                blank=True,
                default="",
                help_text="Who caused it (operator, process).",
                max_length=255,
                verbose_name="actor",
            ),
        ),
        migrations.AlterField(
            model_name="lockevent",
            name="created_at",
            field=models.DateTimeField(
                db_index=True, default=django.utils.timezone.now, verbose_name="time"
            ),
        ),
        migrations.AlterField(
            model_name="lockevent",
            name="detail",
            field=models.TextField(blank=True, default="", verbose_name="detail"),
        ),
        migrations.AlterField(
            model_name="lockevent",
            name="fence",
            field=models.BigIntegerField(blank=True, null=True, verbose_name="fence"),
        ),
        migrations.AlterField(
            model_name="lockevent",
            name="kind",
            field=models.CharField(
                choices=[
                    ("acquired", "acquired"),
                    ("released", "released"),
                    ("lost", "lost"),
                    ("forced", "forced"),
                    ("conflict", "conflict"),
                    ("renewal_failed", "renewal_failed"),
                    ("renewal_late", "renewal_late"),
                    ("duplicate", "duplicate"),
                    ("error", "error"),
                ],
                db_index=True,
                max_length=16,
                verbose_name="kind",
            ),
        ),
        migrations.AlterField(
            model_name="lockevent",
            name="owner",
            field=models.TextField(
                blank=True, default="", help_text="The holder, as JSON.", verbose_name="owner"
            ),
        ),
    ]
