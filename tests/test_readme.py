"""Every code block in README.md and docs/ is run here, or says why not, so neither can rot.

Each fenced block has a marker on the line right above it: ``<!-- run: how -->`` or
``<!-- not-run: why -->``. Python blocks marked ``run`` are executed one by one, each in
a fresh namespace, in a subprocess set up like a user's project: the example project's
Django settings (its own SQLite database in a temporary folder), Celery in eager mode
(blocks marked "published to the test Redis broker": a real publish, no worker), and
every lock on the test Redis. Shell blocks marked ``run`` run in bash from the
repository root with ``.venv/bin`` first on ``PATH``. The README's Redis URL
(``redis://127.0.0.1:6379/0``, the usual local server) is replaced by the test server's
URL everywhere, so these tests never touch a Redis they did not start.

A block's definitions are also exercised: a ``TASK_LOCKS`` dict must pass the app's
system checks, a ``LockedCommand`` is run with ``call_command``, a ``LOGGING`` dict is
applied. The reference tables are checked against the code (every ``TASK_LOCKS`` key and
every ``singleton_task`` option, with its default).

The same goes for every page of the documentation site in ``docs/`` (:data:`DOCS`): their
blocks carry the same markers and run the same way (docs/migrating.md's "after" code, one
block per peer, docs/fencing.md's worked example...). The reference tables moved with their
sections: the ``@singleton_task`` options are in docs/celery.md, ``TASK_LOCKS`` in
docs/configuration.md.

``python tests/test_readme.py BLOCKS.json RESULTS.json`` is the subprocess's entry point.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The documentation site's pages (mkdocs.yml): their blocks are run like the README's.
DOCS = sorted((ROOT / "docs").rglob("*.md"))
CELERY_DOC = ROOT / "docs" / "celery.md"
COMPARISON = ROOT / "docs" / "comparison.md"
EXAMPLE = ROOT / "example_project"
#: The Redis URL the README uses; the tests substitute their own server's.
README_REDIS = "redis://127.0.0.1:6379/0"
RUNNABLE = {"python", "sh"}
#: A ``run`` marker whose reason says this: the block publishes for real, to the test
#: Redis as broker, and no worker consumes (what is queued stays queued).
PUBLISHED = "published to the test Redis broker"
#: Linked from the README, written by `make bench` (may be absent in a fresh checkout).
GENERATED = {"bench/results.md", "bench/results.png"}

FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"^<!--\s*(run|not-run):\s*(\S.*?)\s*-->$")


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # "run", "not-run" or None
    reason: str
    file: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line} ({self.lang or 'no language'})"


def readme_blocks(text: str | None = None, path: Path = README) -> list[Block]:
    text = path.read_text() if text is None else text
    lines = text.splitlines()
    found = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        above = lines[line - 2].strip() if line >= 2 else ""
        marker = MARKER.match(above)
        found.append(
            Block(
                line=line,
                lang=match.group(1),
                code=match.group(2),
                marker=marker.group(1) if marker else None,
                reason=marker.group(2) if marker else "",
                file=str(path.relative_to(ROOT)),
            )
        )
    return found


#: The marker of blocks run together by :func:`test_plain_celery_app_with_a_worker`.
WITH_A_WORKER = "with a real Celery worker"


def to_run(lang: str, paths: list[Path] | None = None) -> list[Block]:
    """The ``run`` blocks of ``lang`` that run on their own (not the worker example's), in
    ``paths`` (default: the README and every docs page)."""
    return [
        b
        for path in (paths if paths is not None else [README, *DOCS])
        for b in readme_blocks(path=path)
        if b.marker == "run" and b.lang == lang and not b.reason.startswith(WITH_A_WORKER)
    ]


def localised(code: str, redis_url: str) -> str:
    return code.replace(README_REDIS, redis_url)


# -- the README's shape ------------------------------------------------------------------


def test_readme_starts_with_the_two_commands() -> None:
    text = README.read_text()
    first = readme_blocks(text)[0]
    assert first.lang == "sh"
    assert [line.split("#")[0].strip() for line in first.code.splitlines()] == [
        "make demo",
        "make test",
    ]
    # Nothing but the title (and the block's marker) comes before it.
    before = text[: text.index("```")].splitlines()
    assert [line for line in before if line.strip() and not line.startswith("<!--")] == [
        "# task-locks"
    ]


def test_every_block_is_run_or_says_why_not() -> None:
    blocks = readme_blocks()
    assert len(blocks) >= 10
    unmarked = [b.where for b in blocks if b.marker is None]
    assert not unmarked, f"mark these <!-- run: how --> or <!-- not-run: why -->: {unmarked}"
    unrunnable = [b.where for b in blocks if b.marker == "run" and b.lang not in RUNNABLE]
    assert not unrunnable, f"only {sorted(RUNNABLE)} blocks can be run: {unrunnable}"
    run = [b for b in blocks if b.marker == "run"]
    assert {b.lang for b in run} == RUNNABLE
    assert len(run) > len(blocks) / 2, "most blocks should run"
    for block in run:
        # Every Redis the README names is the one the tests redirect to their own server.
        assert "6379" not in block.code.replace(README_REDIS, ""), block.where
        if block.lang == "python":
            ast.parse(block.code, filename=block.where)


def _slugs(text: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown text."""
    slugs = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
        slugs.add(slug.replace(" ", "-"))
    return slugs


def test_links_and_anchors_resolve() -> None:
    text = README.read_text()
    slugs = _slugs(text)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        if target.startswith("#"):
            assert target[1:] in slugs, f"no heading for {target}"
        elif target not in GENERATED:
            path, _, anchor = target.partition("#")
            assert (ROOT / path).exists(), f"README links to missing {target}"
            if anchor:
                assert anchor in _slugs((ROOT / path).read_text()), f"no heading for {target}"


# -- the reference tables match the code ----------------------------------------------


def _readme_default(option: str, text: str) -> str:
    row = re.search(rf"^\| `{option}` \| ([^|]*) \|", text, re.M)
    assert row is not None, f"singleton_task option {option!r} missing from docs/celery.md"
    return row.group(1).strip().strip("`")


def test_singleton_task_options_are_documented_with_their_defaults() -> None:
    from task_locks.celery import singleton_task

    text = CELERY_DOC.read_text()
    parameters = inspect.signature(singleton_task).parameters.values()
    options = [p for p in parameters if p.kind is p.KEYWORD_ONLY]
    assert len(options) >= 10
    for option in options:
        default = option.default
        expected = (
            default.__name__
            if inspect.isclass(default)
            else json.dumps(default)
            if isinstance(default, str)
            else repr(default)
        )
        assert _readme_default(option.name, text) == expected, option.name


def test_task_locks_reference_block_is_the_defaults() -> None:
    from django_app import conf

    reference = [b for b in to_run("python") if "EVENT_RETENTION_DAYS" in b.code]
    assert len(reference) == 1
    namespace: dict[str, Any] = {}
    exec(reference[0].code, namespace)
    documented = namespace["TASK_LOCKS"]
    assert set(documented) == set(conf.DEFAULTS)
    for key, default in conf.DEFAULTS.items():
        value = list(default) if isinstance(default, tuple) else default
        assert documented[key] == value, key


# -- the blocks run ----------------------------------------------------------------------


def test_python_blocks_run(redis_url: str, tmp_path: Path) -> None:
    blocks = to_run("python", [README])
    outputs = run_python_blocks(blocks, redis_url, tmp_path)
    printed = "\n".join(outputs.values())
    # What the blocks say they do, they did.
    assert "holding fence" in printed and "got it without waiting" in printed
    assert "refreshed under fence" in printed
    assert "leading, term" in printed and "one of at most 3 renders" in printed
    assert "building the report under fence" in printed  # the LockedCommand ran
    assert "celery result: SUCCESS" in printed  # the singleton task ran under its lock


def run_python_blocks(blocks: list[Block], redis_url: str, tmp_path: Path) -> dict[str, str]:
    """Run ``blocks`` in the user-like subprocess; each block's output, by ``where``."""
    spec = tmp_path / "blocks.json"
    spec.write_text(
        json.dumps(
            [
                {
                    "where": b.where,
                    "code": localised(b.code, redis_url),
                    "publish": PUBLISHED in b.reason,
                }
                for b in blocks
            ]
        )
    )
    results_file = tmp_path / "results.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "TASK_LOCKS"))}
    env.update(
        DJANGO_SETTINGS_MODULE="demo_site.settings",
        DEMO_VAR_DIR=str(tmp_path / "var"),
        TASK_LOCKS_URL=redis_url,
        PYTHONPATH=os.pathsep.join([str(EXAMPLE), str(ROOT)]),
    )
    done = subprocess.run(
        [sys.executable, __file__, str(spec), str(results_file)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and results_file.exists(), done.stdout + done.stderr
    results = json.loads(results_file.read_text())
    assert [r["where"] for r in results] == [b.where for b in blocks]
    failed = [f"{r['where']}:\n{r['output']}\n{r['error']}" for r in results if r["error"]]
    assert not failed, "\n\n".join(failed)
    return {r["where"]: r["output"] for r in results}


# -- the guides in docs/ --------------------------------------------------------------------

MIGRATING = ROOT / "docs" / "migrating.md"
PEERS = ["celery-singleton", "celery-once", "python-redis-lock", "redis-py Lock", "pottery Redlock"]


def _sections(path: Path) -> dict[str, list[Block]]:
    """The blocks under each ``## `` heading of ``path``."""
    text = path.read_text()
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"^## (.+)$", text, re.M)]
    sections: dict[str, list[Block]] = {title: [] for _, title in starts}
    for block in readme_blocks(text, path):
        offset = len("\n".join(text.splitlines()[: block.line - 1]))
        title = [t for start, t in starts if start <= offset]
        if title:
            sections[title[-1]].append(block)
    return sections


def test_docs_blocks_are_marked_and_parse() -> None:
    assert len([b for path in DOCS for b in readme_blocks(path=path)]) >= 30
    for path in DOCS:
        blocks = readme_blocks(path=path)
        unmarked = [b.where for b in blocks if b.marker is None]
        assert not unmarked, f"mark these <!-- run: how --> or <!-- not-run: why -->: {unmarked}"
        for block in blocks:
            if block.marker == "run":
                assert block.lang in RUNNABLE, block.where
                assert "6379" not in block.code.replace(README_REDIS, ""), block.where
            if block.lang == "python" and block.marker == "run":
                ast.parse(block.code, filename=block.where)


def test_migrating_guide_has_a_run_after_block_per_peer() -> None:
    sections = _sections(MIGRATING)
    for peer in PEERS:
        title = next((t for t in sections if t.replace("`", "") == peer), None)
        assert title is not None, f"docs/migrating.md has no section for {peer}"
        blocks = sections[title]
        assert any(b.marker == "not-run" and b.lang == "python" for b in blocks), peer
        assert any(b.marker == "run" and b.lang == "python" for b in blocks), peer
        table = MIGRATING.read_text().split(f"## {title}", 1)[1].split("\n## ", 1)[0]
        assert table.count("\n| ") >= 8, f"{peer}: the mapping table is missing or short"


def test_readme_comparison_links_the_migrating_guide() -> None:
    """The comparison (docs/comparison.md) links each peer's section of the guide."""
    assert "(docs/comparison.md)" in README.read_text()
    comparison = COMPARISON.read_text()
    assert "(migrating.md)" in comparison
    # In the table itself: a row whose cells link each peer's section of the guide.
    rows = [line for line in comparison.splitlines() if line.startswith("|")]
    peers = [cell.strip() for cell in rows[0].strip("|").split("|")][2:]
    guide = [row for row in rows if "](migrating.md" in row]
    assert len(guide) == 1, guide
    cells = [cell.strip() for cell in guide[0].strip("|").split("|")][2:]
    assert len(cells) == len(peers)
    sections = _sections(MIGRATING)
    for peer, cell in zip(peers, cells, strict=True):
        anchor = re.fullmatch(r"\[guide\]\(migrating\.md#([\w-]+)\)", cell)
        assert anchor is not None, (peer, cell)
        title = next(t for t in sections if anchor.group(1) in _slugs(f"## {t}"))
        assert title.replace("`", "") == peer.replace("`", ""), (peer, title)


def test_lock_options_row_names_every_per_call_option() -> None:
    from task_locks.celery.options import PER_CALL

    row = re.search(r"^\| `lock_options` \|.*$", CELERY_DOC.read_text(), re.M)
    assert row is not None, "lock_options missing from the @singleton_task options table"
    for key in PER_CALL:
        assert f"`{key}`" in row.group(0), key


def test_docs_links_and_anchors_resolve() -> None:
    for path in DOCS:
        text = path.read_text()
        slugs = set()
        for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
            slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
            slugs.add(slug.replace(" ", "-"))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            if target.startswith("#"):
                assert target[1:] in slugs, f"{path.name}: no heading for {target}"
            else:
                assert (path.parent / target.split("#")[0]).exists(), f"{path.name}: {target}"


def test_docs_python_blocks_run(redis_url: str, tmp_path: Path) -> None:
    blocks = to_run("python", DOCS)
    outputs = run_python_blocks(blocks, redis_url, tmp_path)
    printed = "\n".join(outputs.values())
    # What the pages' blocks say they do, they did.
    assert "refused a write with fence" in printed and "A's release refused" in printed
    assert "second acquire refused:" in printed  # docs/locks.md
    assert "lock service down, the task did not run:" in printed  # docs/celery.md
    assert "metrics view: task_locks_" in printed  # docs/metrics.md's URLconf, scraped
    # celery-singleton, PeerCheckedTask
    assert printed.count("celery result: SUCCESS") >= 2
    # celery-once: published for real, the second publish is refused and caught
    assert "already queued, retry in 60 s" in printed
    assert "the queued copy is the first: True" in printed
    assert "report under fence" in printed and "report 2026-12-01 under fence" in printed
    assert "exporting under fence" in printed
    assert "printing under fence" in printed and "nightly run" in printed
    assert "old code still holds it:" in printed and "new code holds it, fence" in printed
    assert "sync:42 free for new code: False" in printed
    assert "after the old run ended: True" in printed


def test_shell_blocks_run(redis_url: str, tmp_path: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "DJANGO_SETTINGS_MODULE" and not k.startswith(("CELERY_", "TASK_LOCKS"))
    }
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["DEMO_VAR_DIR"] = str(tmp_path / "var")
    blocks = to_run("sh")
    assert blocks
    for block in blocks:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", localised(block.code, redis_url)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"{block.where}\n{done.stdout}\n{done.stderr}"
        if "task-locks run" in block.code:
            assert "only one of me runs at a time" in done.stdout, done.stdout


def test_plain_celery_app_with_a_worker(redis_url: str, tmp_path: Path) -> None:
    """The plain (non-Django) Celery app as written: ``tasks.py`` in a folder, the README's
    worker command started there, then ``send.py``: one call runs, its duplicate is
    skipped, and both ``.get()``."""
    run_plain_celery_app(redis_url, tmp_path, Path(sys.executable).parent, [ROOT])


def run_plain_celery_app(
    redis_url: str,
    tmp_path: Path,
    bin_dir: Path,
    pythonpath: list[Path],
    app_code: str | None = None,
) -> None:
    """The README's plain Celery app, its worker and ``send.py``, run with the ``python``
    and ``celery`` of ``bin_dir`` and ``pythonpath`` besides ``tmp_path``; ``app_code``
    replaces its ``tasks.py`` (the same app on another broker)."""
    blocks = [b for b in readme_blocks() if b.reason.startswith(WITH_A_WORKER)]
    assert [b.lang for b in blocks] == ["python", "sh", "python"], [b.where for b in blocks]
    app, worker_command, sender = blocks
    assert app.code.startswith("# tasks.py") and sender.code.startswith("# send.py")
    (tmp_path / "tasks.py").write_text(localised(app_code or app.code, redis_url))
    (tmp_path / "send.py").write_text(localised(sender.code, redis_url))
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "DJANGO_SETTINGS_MODULE" and not k.startswith(("CELERY_", "TASK_LOCKS"))
    }
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(map(str, [tmp_path, *pythonpath]))
    sent, worker_log = send_beside_a_worker(
        worker_command.code.strip(), [str(bin_dir / "python"), "send.py"], tmp_path, env, tmp_path
    )
    assert sent.returncode == 0, f"{sent.stdout}\n{sent.stderr}\n{worker_log}"
    assert sent.stdout.strip().splitlines()[-1] == "['skipped', 'synced 42']", worker_log
    assert "skipped: lock 'sync:42' is held by" in worker_log, worker_log


def send_beside_a_worker(
    worker_command: str, sender: list[str], cwd: Path, env: dict[str, str], logs: Path
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Start ``worker_command`` (a shell line) in ``cwd``, run ``sender`` there while it
    runs (the sender waits for its results, long enough for the worker to start), stop
    the worker; the sender's outcome and the worker's log."""
    log = logs / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen(
            ["bash", "-c", "exec " + worker_command],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        sent = subprocess.run(sender, cwd=cwd, env=env, capture_output=True, text=True, timeout=90)
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=5)
    return sent, log.read_text(errors="replace")


# -- the subprocess: runs the Python blocks like a user's project would ------------------


def _run_blocks(spec: Path, results_file: Path) -> None:
    import contextlib
    import io
    import logging.config
    import traceback

    import django

    django.setup()
    from celery.result import EagerResult
    from demo_site.celery import app
    from django.core.management import call_command
    from django.test import RequestFactory
    from django.test.utils import override_settings

    from django_app import checks, conf
    from django_app.commands import LockedCommand
    from django_app.metrics import metrics_view

    call_command("migrate", verbosity=0)
    # No worker here: tasks run in-process, through the same __call__ a worker uses.
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True

    @contextlib.contextmanager
    def without_env_url() -> Iterator[None]:
        saved = os.environ.pop("TASK_LOCKS_URL", None)
        try:
            yield
        finally:
            if saved is not None:
                os.environ["TASK_LOCKS_URL"] = saved

    @contextlib.contextmanager
    def published(really: bool) -> Iterator[None]:
        """Not eager: a current app that publishes to the test Redis (no worker)."""
        if not really:
            yield
            return
        from celery import Celery

        publisher = Celery("docs_publisher", broker=os.environ["TASK_LOCKS_URL"])
        publisher.set_current()  # shared tasks (singleton_task without app=) resolve here
        try:
            yield
        finally:
            publisher.close()
            app.set_current()

    def exercise(namespace: dict[str, Any], out: io.StringIO) -> None:
        module = namespace["__name__"]
        if isinstance(namespace.get("TASK_LOCKS"), dict):
            # Checked as written, in a project without TASK_LOCKS_URL: with the variable
            # set, a BACKEND that differs from it is refused (task_locks.E005).
            with override_settings(TASK_LOCKS=namespace["TASK_LOCKS"]), without_env_url():
                problems = checks.check_settings()
            assert not problems, f"TASK_LOCKS fails the system checks: {problems}"
        if isinstance(namespace.get("LOGGING"), dict):
            logging.config.dictConfig(namespace["LOGGING"])
        for pattern in namespace.get("urlpatterns", []):
            # A URLconf with the metrics view: scraped as Prometheus would.
            if getattr(pattern, "callback", None) is not metrics_view:
                continue
            response = pattern.callback(RequestFactory().get(f"/{pattern.pattern}"))
            assert response.status_code == 200, (pattern, response.status_code)
            body = response.content.decode()
            sample = next(line for line in body.splitlines() if line.startswith("task_locks_"))
            out.write(f"metrics view: {sample}\n")
        for value in list(namespace.values()):
            if (
                inspect.isclass(value)
                and issubclass(value, LockedCommand)
                and value.__module__ == module
            ):
                call_command(value(), stdout=out)
            if isinstance(value, EagerResult):
                out.write(f"celery result: {value.state}\n")
                value.get()

    results = []
    for number, block in enumerate(json.loads(spec.read_text())):
        out = io.StringIO()
        error = ""
        namespace: dict[str, Any] = {"__name__": f"readme_block_{number}"}
        try:
            with contextlib.redirect_stdout(out), published(block.get("publish", False)):
                exec(compile(block["code"], block["where"], "exec"), namespace)
                exercise(namespace, out)
        except BaseException:
            error = traceback.format_exc()
        finally:
            conf.apply()  # undo a block's configure(): the next one starts afresh
        results.append({"where": block["where"], "output": out.getvalue(), "error": error})
    results_file.write_text(json.dumps(results))


if __name__ == "__main__":
    _run_blocks(Path(sys.argv[1]), Path(sys.argv[2]))
