"""How long a holder takes to learn of a force release: release notice vs renewal.

Per backend that announces force releases (Redis, etcd, PostgreSQL through django://):
the time from sending ``force_release`` (from a second backend object, its own
connection, as an operator's CLI would) to the holder's ``lease.lost`` being set,

- with the release notice (TTL 30 s: the renewal, 10 s away, cannot be what found it),
- and with notices off (``task_locks.notices.listen`` replaced for the measurement),
  where the next renewal finds the token gone: the release lands at a random point of
  the renewal period (TTL 3 s: every 1 s), so the delay is uniform up to TTL/3.

    .venv/bin/python bench/notice_bench.py           # about a minute
    .venv/bin/python bench/notice_bench.py --quick   # a few seconds per backend
    .venv/bin/python bench/run.py --only-notices     # the same cell through the runner

``bench/run.py`` calls :func:`run` and folds the result into ``bench/results.md``.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))  # this checkout's task_locks

#: The notice's TTL: its renewals come every 10 s.
NOTICE_TTL = 30.0
#: The fallback's TTL: renewals every 1 s, so the delay is uniform over [0, 1 s].
FALLBACK_TTL = 3.0


def log(message: str) -> None:
    print(f"[notice_bench] {message}", file=sys.stderr, flush=True)


@contextmanager
def notices_off() -> Iterator[None]:
    """Leases acquired inside hear nothing: only their renewal finds a force release."""
    from task_locks import notices

    with mock.patch.object(notices, "listen", lambda lease: None):
        yield


def trials(url: str, count: int, ttl: float, noticed: bool) -> list[float]:
    """``count`` force releases of a held lease; seconds from the send to ``lost``."""
    from task_locks import Lock, notices
    from task_locks.backends import backend_class

    scheme = url.split(":", 1)[0]
    operator = backend_class(scheme)(url)  # another connection, as a CLI's would be
    delays: list[float] = []
    with ExitStack() as stack:
        if not noticed:
            stack.enter_context(notices_off())
        for index in range(count):
            name = f"bench-notice-{uuid.uuid4().hex[:8]}-{index}"
            lease = Lock(name, ttl=ttl, backend=url).acquire(0)
            if noticed:
                listener = notices.listener(lease.backend, create=False)
                if listener is None or not listener.ready.wait(10):
                    raise RuntimeError(f"{url}: no release-notice listener subscribed")
            else:
                # A random point of the renewal period (the lease was just renewed).
                time.sleep(random.uniform(0, ttl / 3))
            sent = time.perf_counter()
            if not operator.force_release(name, lease.fence):
                raise RuntimeError(f"{url}: force_release found nothing to free")
            if not lease.lost.wait(ttl):
                raise RuntimeError(f"{url}: the lease was never marked lost")
            delays.append(time.perf_counter() - sent)
    operator.close()
    return delays


def summary(delays: list[float]) -> dict[str, Any]:
    ordered = sorted(delays)
    return {
        "n": len(ordered),
        "median_ms": statistics.median(ordered) * 1000,
        "p95_ms": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] * 1000,
        "max_ms": ordered[-1] * 1000,
    }


def measure(url: str, count: int, fallback_count: int) -> dict[str, Any]:
    noticed = trials(url, count, NOTICE_TTL, True)
    fallback = trials(url, fallback_count, FALLBACK_TTL, False)
    return {"notice": summary(noticed), "renewal": summary(fallback)}


def postgres_worker(count: int, fallback_count: int) -> None:
    """In a child process: Django on the test settings, migrate, measure, print JSON."""
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", database="pg", verbosity=0, interactive=False)
    print(json.dumps(measure("django://pg", count, fallback_count)))


def measure_postgres(count: int, fallback_count: int) -> dict[str, Any]:
    import backends_bench

    reason = backends_bench.django_reason("pg")
    if reason:
        return {"status": reason}
    try:
        line = backends_bench.django_child(
            "pg", __file__, "--pg-worker", str(count), str(fallback_count)
        )
    except RuntimeError as exc:
        return {"status": f"failed: {str(exc)[:300]}"}
    return dict(json.loads(line))


def run(quick: bool = False) -> dict[str, Any]:
    """Every backend with release notices: the notice's delay beside the renewal's."""
    import shutil

    import common  # noqa: F401  (puts tests/ on sys.path for servers)
    import servers

    count, fallback_count = (20, 4) if quick else (100, 10)
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        redis_server = servers.RedisServer().start()
        stack.callback(redis_server.cleanup)
        subjects: list[tuple[str, str | None, str]] = [("redis (1 server)", redis_server.url(), "")]
        if shutil.which("etcd"):
            node = servers.EtcdServer().start()
            stack.callback(node.cleanup)
            subjects.append(("etcd (1 member)", node.url(), ""))
        else:
            subjects.append(("etcd (1 member)", None, "not measured: no etcd binary"))
        for label, url, reason in subjects:
            log(f"{label}: {count} force releases with notices, {fallback_count} without")
            row: dict[str, Any] = {"backend": label}
            row.update({"status": reason} if url is None else measure(url, count, fallback_count))
            rows.append(row)
    log(f"django (PostgreSQL): {count} force releases with notices, {fallback_count} without")
    rows.append({"backend": "django (PostgreSQL)", **measure_postgres(count, fallback_count)})
    result = {"rows": rows, "notice_ttl": NOTICE_TTL, "fallback_ttl": FALLBACK_TTL}
    result["markdown"] = markdown(result)
    return result


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "From sending `force_release` (a second connection) to the holder's `lease.lost`. "
        f"With the release notice (TTL {result['notice_ttl']:g} s, so no renewal within "
        f"{result['notice_ttl'] / 3:g} s could have found it), and with notices off, where "
        f"the next renewal finds it (TTL {result['fallback_ttl']:g} s, the release at a "
        "random point of the renewal period: uniform up to TTL/3, i.e. up to "
        f"{result['notice_ttl'] / 3:g} s at TTL {result['notice_ttl']:g} s).",
        "",
        "| backend | notice: median | p95 | max | renewal: median | max | trials |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        if "notice" not in row:
            lines.append(f"| {row['backend']} | {row.get('status', '?')} | | | | | |")
            continue
        notice, renewal = row["notice"], row["renewal"]
        lines.append(
            f"| {row['backend']} | {notice['median_ms']:.1f} ms | {notice['p95_ms']:.1f} ms "
            f"| {notice['max_ms']:.1f} ms | {renewal['median_ms']:.0f} ms "
            f"| {renewal['max_ms']:.0f} ms | {notice['n']} + {renewal['n']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``--quick``; ``--pg-worker N M`` is the PostgreSQL child (:func:`postgres_worker`)."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--pg-worker"]:
        postgres_worker(int(args[1]), int(args[2]))
    else:
        print(run(quick="--quick" in args)["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
