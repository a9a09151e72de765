"""Lock names compare byte for byte on MySQL/MariaDB, trailing blanks included.

``utf8mb4_bin`` (0001) is a PAD SPACE collation: it compares ``"a"`` and ``"a "`` as equal,
which made them one lock. A NO PAD binary collation keeps every byte significant.
"""

from django.db import migrations

#: The columns that hold lock names and resource names (as in 0001_initial).
NAME_COLUMNS = [
    ("task_locks_lock", "name", 512),
    ("task_locks_fence", "name", 512),
    ("task_locks_resource_fence", "resource", 255),
]
NO_PAD_COLLATIONS = ("utf8mb4_0900_bin", "utf8mb4_nopad_bin")  # MySQL 8.0+, MariaDB 10.2+


def _no_pad_names_on_mysql(apps, schema_editor):
    connection = schema_editor.connection
    if connection.vendor != "mysql":
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT collation_name FROM information_schema.collations "
            "WHERE collation_name IN (%s, %s)",
            NO_PAD_COLLATIONS,
        )
        available = {row[0] for row in cursor.fetchall()}
    collation = next((c for c in NO_PAD_COLLATIONS if c in available), None)
    if collation is None:
        raise RuntimeError(
            "task_locks needs a NO PAD binary collation (MySQL 8.0+ utf8mb4_0900_bin or "
            "MariaDB 10.2+ utf8mb4_nopad_bin) so that lock names differing only in trailing "
            "blanks stay distinct locks"
        )
    for table, column, length in NAME_COLUMNS:
        schema_editor.execute(
            f"ALTER TABLE {table} MODIFY {column} varchar({length}) "
            f"CHARACTER SET utf8mb4 COLLATE {collation} NOT NULL"
        )


class Migration(migrations.Migration):
    dependencies = [("task_locks", "0001_initial")]

    operations = [
        migrations.RunPython(
            _no_pad_names_on_mysql, migrations.RunPython.noop, atomic=False, elidable=True
        ),
    ]
