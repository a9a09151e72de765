"""docs/metrics.md and docs/grafana-dashboard.json match task_locks.metrics, and
the multiprocess wiring they describe counts a forked pool's locks in one scrape."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry

from task_locks import metrics

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "metrics.md"
DASHBOARD = ROOT / "docs" / "grafana-dashboard.json"
#: Sample names each metric type exposes, after its family name.
SUFFIXES = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}


def exposed() -> dict[str, tuple[str, list[str]]]:
    """Every sample name the collectors expose: (family type, label names)."""
    registry = CollectorRegistry()
    metrics.install(registry)
    try:
        families = metrics._installed[id(registry)]
        names: dict[str, tuple[str, list[str]]] = {}
        for attribute in ("acquisitions", "wait", "hold", "held", "lost", "renewal", "dropped"):
            collector = getattr(families, attribute)
            for family in collector.describe():
                labels = list(collector._labelnames)
                for suffix in SUFFIXES[family.type]:
                    names[family.name + suffix] = (family.type, labels)
        return names
    finally:
        metrics.uninstall(registry)


def test_the_documented_metrics_exist_with_their_labels() -> None:
    names = exposed()
    text = DOC.read_text()
    table = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(task_locks_\w+)` \| (\w+) \|([^|]*)\|", table, re.M)
    documented = {name for name, _, _ in rows}
    # Every family is in the table (counters by their _total name), and nothing else.
    families = {n for n, (kind, _) in names.items() if kind != "histogram"} | {
        n.removesuffix("_bucket") for n, (kind, _) in names.items() if kind == "histogram"
    }
    assert documented == {n for n in families if not n.endswith(("_sum", "_count"))}
    for name, kind, labels in rows:
        sample = name + ("_bucket" if kind == "histogram" else "")
        assert names[sample][0] == kind, name
        assert re.findall(r"`(\w+)`", labels) == names[sample][1], name
    # Every name the doc mentions anywhere (queries, alerts) is one the collectors expose.
    for mentioned in set(re.findall(r"\btask_locks_[a-z_]+\b", text)):
        assert mentioned in names or mentioned in documented, mentioned


def test_the_documented_label_values_are_the_ones_counted() -> None:
    table = DOC.read_text().split("## Metrics", 1)[1].split("\n## ", 1)[0]
    outcomes = re.search(r"acquisitions_total` .*?\| ([^|]*) \|$", table, re.M)
    assert outcomes is not None
    assert set(re.findall(r"`(\w+)` \(", outcomes.group(1))) == {
        "conflict",
        "timeout",
        "error",
    } and "`acquired`" in outcomes.group(1)
    reasons = re.search(r"lost_total` .*?\| ([^|]*) \|$", table, re.M)
    assert reasons is not None
    documented = set(re.findall(r"`(\w+)`", reasons.group(1)))
    assert documented == set(metrics.LOST_REASONS)


def test_the_dashboard_is_the_documented_queries() -> None:
    section = DOC.read_text().split("## Grafana", 1)[1].split("\n## ", 1)[0]
    queries = [
        (title, expr.replace("\\|", "|"))
        for title, expr in re.findall(r"^\| ([^|`]+?) \| `(.+)` \|$", section, re.M)
    ]
    assert len(queries) >= 3
    titles = " ".join(title for title, _ in queries)
    assert "conflict rate" in titles and "p95 wait" in titles and "lost leases" in titles
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [(p["title"], p["targets"][0]["expr"]) for p in dashboard["panels"]]
    assert panels == queries
    names = exposed()
    for _, expr in queries:
        for name in re.findall(r"\btask_locks_[a-z_]+\b", expr):
            assert name in names, (name, expr)
    assert "(grafana-dashboard.json)" in DOC.read_text()


def test_the_readme_links_the_metrics_doc() -> None:
    assert "(docs/metrics.md)" in (ROOT / "README.md").read_text()


#: A prefork pool in miniature: collectors installed in the parent, two forked children
#: take locks, one exits (marked dead, as the docs' worker_process_shutdown handler does),
#: and the parent's MultiProcessCollector registry sums them, as the worker's endpoint would.
MULTIPROCESS = textwrap.dedent(
    """
    import os, sys
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess
    from task_locks import Lock, events
    from task_locks.metrics import install

    url = sys.argv[1]
    install()
    children = []
    for number in (1, 2):
        pid = os.fork()
        if pid == 0:
            with Lock(f"mp:{number}", ttl=30, backend=url):
                pass
            if number == 2:
                Lock("kept:2", ttl=30, backend=url).acquire()  # still held at the scrape
            assert events.flush(10), "the child's events were not delivered"
            os._exit(0)
        children.append(pid)
    for pid in children:
        _, status = os.waitpid(pid, 0)
        assert status == 0, status
    multiprocess.mark_process_dead(children[0])
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    sys.stdout.write(generate_latest(registry).decode())
    """
)


def test_multiprocess_mode_sums_a_forked_pool(redis_url: str, tmp_path: Path) -> None:
    directory = tmp_path / "prometheus"
    directory.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run(
        [sys.executable, "-c", MULTIPROCESS, redis_url],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    samples = dict(
        re.findall(r"^(task_locks_\S+) ([0-9.e+-]+)$", done.stdout, re.M),
    )
    acquired = 'task_locks_acquisitions_total{lock="%s",outcome="acquired"}'
    assert float(samples[acquired % "mp"]) == 2.0, done.stdout  # both children, one family
    assert float(samples[acquired % "kept"]) == 1.0, done.stdout
    assert float(samples['task_locks_hold_seconds_count{lock="mp"}']) == 2.0, done.stdout
    # livesum: the exited child's gauge is gone; the one who kept a lock still counts it.
    held = {k: float(v) for k, v in samples.items() if k.startswith("task_locks_held{")}
    assert held.get('task_locks_held{lock="kept"}') == 1.0, done.stdout
    assert held.get('task_locks_held{lock="mp"}', 0.0) == 0.0, done.stdout
