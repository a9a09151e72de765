"""Every audit kind of the event stream; an event row keeps the time it happened."""

import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("task_locks", "0002_names_without_pad_space_on_mysql"),
    ]

    operations = [
        migrations.AlterField(
            model_name="lockevent",
            name="created_at",
            field=models.DateTimeField(db_index=True, default=django.utils.timezone.now),
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
            ),
        ),
    ]
