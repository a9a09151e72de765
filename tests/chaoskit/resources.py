"""The protected resource: a register updated by read-modify-write, guarded three ways.

Each write reads the register, appends its own id and writes the result back, so
overlapping holders can lose each other's writes, and every accepted write gets a
``version`` from the resource (its order of acceptance) for the checker.

- ``fenced``: :class:`task_locks.fencing.FencedStore` on a Redis the nemesis never
  touches; the read claims the fence (``read(fence=...)``), the write is fenced.
- ``django``: ``django_app.fencing.fenced()`` around ``SELECT ... FOR UPDATE`` and
  ``UPDATE`` on PostgreSQL.
- ``unfenced``: the same register in Redis with no guard at all (what a lock alone
  gives you).
"""

from __future__ import annotations

from typing import Any

import redis

from task_locks.fencing import FencedStore

#: The unguarded write: store the value and count it, nothing else.
PLAIN_WRITE = """
redis.call('hset', KEYS[1], 'value', ARGV[1])
return redis.call('hincrby', KEYS[1], 'version', 1)
"""

REGISTER_TABLE = "chaos_register"


class FencedRedisRegister:
    guard = "fenced"

    def __init__(self, url: str, name: str) -> None:
        self.store = FencedStore(redis.Redis.from_url(url), prefix="chaos:fenced:")
        self.name = name

    def write(self, fence: int, write_id: str) -> int:
        current = self.store.read(self.name, fence=fence)
        value = (current.value or b"").decode() + " " + write_id
        return self.store.write(self.name, value, fence)

    def final(self) -> str | None:
        value = self.store.read(self.name).value
        return None if value is None else value.decode()


class PlainRedisRegister:
    guard = "unfenced"

    def __init__(self, url: str, name: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.key = f"chaos:plain:{name}"
        self.script = self.client.register_script(PLAIN_WRITE)

    def write(self, fence: int, write_id: str) -> int:
        value = (self.client.hget(self.key, "value") or b"").decode() + " " + write_id
        return int(self.script(keys=[self.key], args=[value]))

    def final(self) -> str | None:
        value = self.client.hget(self.key, "value")
        return None if value is None else value.decode()


class DjangoRegister:
    guard = "django"

    def __init__(self, alias: str, name: str) -> None:
        self.alias = alias
        self.name = name

    def write(self, fence: int, write_id: str) -> int:
        from django.db import connections, transaction

        from django_app.fencing import fenced

        with transaction.atomic(using=self.alias), fenced(self.name, fence, using=self.alias):
            with connections[self.alias].cursor() as cursor:
                cursor.execute(
                    f"SELECT value, version FROM {REGISTER_TABLE} WHERE name = %s FOR UPDATE",
                    [self.name],
                )
                row = cursor.fetchone()
                value, version = (row[0], row[1]) if row else ("", 0)
                value = f"{value} {write_id}"
                if row:
                    cursor.execute(
                        f"UPDATE {REGISTER_TABLE} SET value = %s, version = %s WHERE name = %s",
                        [value, version + 1, self.name],
                    )
                else:
                    cursor.execute(
                        f"INSERT INTO {REGISTER_TABLE} (name, value, version) VALUES (%s, %s, %s)",
                        [self.name, value, 1],
                    )
        return int(version) + 1

    def final(self) -> str | None:
        from django.db import connections

        with connections[self.alias].cursor() as cursor:
            cursor.execute(f"SELECT value FROM {REGISTER_TABLE} WHERE name = %s", [self.name])
            row = cursor.fetchone()
        return None if row is None else str(row[0])


def create_register_table(cursor: Any) -> None:
    cursor.execute(
        f"CREATE TABLE IF NOT EXISTS {REGISTER_TABLE} "
        "(name varchar(255) PRIMARY KEY, value text NOT NULL, version bigint NOT NULL)"
    )


def open_registers(config: dict[str, Any]) -> list[Any]:
    """The registers a run writes to, in the order every write visits them."""
    name = config["resource"]
    registers: list[Any] = [
        PlainRedisRegister(config["resource_redis"], name),
        FencedRedisRegister(config["resource_redis"], name),
    ]
    if config.get("django_resource"):
        registers.append(DjangoRegister(config["django_resource"], name))
    return registers
