"""The documentation site's sources beyond their code blocks (those are run by
tests/test_readme.py, with the README's): every public name documents itself (the API
reference pages are generated from these docstrings by mkdocstrings in ``make docs``), and
the operations page's ``LOGGING`` snippet prints each line once under a Celery worker.
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
OPERATIONS = ROOT / "docs" / "operations.md"

#: Packages whose ``__all__`` is the public API.
PACKAGES = ["task_locks", "task_locks.celery"]
#: The Django app's public modules (``django_app.<name>``): each name in their ``__all__``,
#: or, without one, each class and function they define whose name has no underscore.
DJANGO_MODULES = [
    "admin", "apps", "audit", "backend", "checks", "commands", "conf", "fencing", "metrics",
    "models", "tasks",
]  # fmt: skip
#: Modules whose classes are Django's hooks (a ModelAdmin's methods are called by the admin,
#: not by users): their classes need a docstring, their methods do not.
HOOK_MODULES = {"django_app.admin", "django_app.apps"}


def _ours(value: Any) -> bool:
    module = getattr(value, "__module__", "") or ""
    return module.split(".")[0] in {"task_locks", "django_app"}


def _public_names(module: ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and getattr(value, "__module__", None) == module.__name__
    ]


def _members(cls: type) -> Iterator[tuple[str, Any]]:
    """The public methods and properties a user calls on ``cls``, wherever in our
    package's part of its MRO they are defined."""
    seen: set[str] = set()
    for klass in cls.__mro__:
        if not _ours(klass):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if inspect.isfunction(value) or isinstance(value, property):
                yield name, value


def _undocumented() -> list[str]:
    missing: list[str] = []
    modules = [importlib.import_module(m) for m in PACKAGES]
    modules += [importlib.import_module(f"django_app.{m}") for m in DJANGO_MODULES]
    for module in modules:
        if not (module.__doc__ or "").strip():
            missing.append(module.__name__)
        for name in _public_names(module):
            value = getattr(module, name)
            where = f"{module.__name__}.{name}"
            if not (inspect.isclass(value) or callable(value)) or not _ours(value):
                continue  # constants: documented by a #: comment beside them
            if not (inspect.getdoc(value) or "").strip():
                missing.append(where)
            if inspect.isclass(value) and module.__name__ not in HOOK_MODULES:
                for member, attribute in _members(value):
                    if not (inspect.getdoc(attribute) or "").strip():
                        missing.append(f"{where}.{member}")
    return sorted(set(missing))


def test_every_public_name_has_a_docstring() -> None:
    # A shared task (django_app.tasks) is a proxy that reads its docstring from the
    # current Celery app's registry: give it a finalized app of its own, whatever app an
    # earlier test in this process left current.
    from celery import Celery
    from celery._state import get_current_app

    previous = get_current_app()
    checker = Celery("docstring-check", set_as_current=True)
    checker.finalize()
    try:
        missing = _undocumented()
    finally:
        previous.set_current()
        checker.close()
    assert not missing, f"{len(missing)} public names without a docstring: {missing}"


def _logging_block() -> str:
    from tests.test_readme import readme_blocks

    blocks = [b for b in readme_blocks(path=OPERATIONS) if "LOGGING = {" in b.code]
    assert len(blocks) == 1, [b.where for b in blocks]
    return blocks[0].code


def _lines_printed(logging_block: str) -> list[str]:
    """Apply ``logging_block`` as a Django site does, then set logging up as a Celery worker
    does (its handler on the root logger), log one line under ``task_locks``: what is printed."""
    script = textwrap.dedent(
        """
        import logging.config, sys
        from celery import Celery

        namespace = {}
        exec(sys.argv[1], namespace)
        logging.config.dictConfig(namespace["LOGGING"])  # django.setup() in the worker
        app = Celery("proj")
        app.log.setup_logging_subsystem(loglevel="INFO", logfile=None, colorize=False)
        logging.getLogger("task_locks.lock").warning("lock 'sync:42' was lost: marker")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, logging_block],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return [line for line in (done.stdout + done.stderr).splitlines() if "marker" in line]


def test_the_logging_snippet_prints_each_line_once_under_a_celery_worker() -> None:
    block = _logging_block()
    assert len(_lines_printed(block)) == 1, _lines_printed(block)
    # The snippet's propagate=False is what does it: without it, every line is doubled.
    assert len(_lines_printed(block.replace('"propagate": False', '"propagate": True'))) == 2


def test_the_api_reference_pages_name_every_public_name() -> None:
    """docs/reference/ has a ``::: package.NAME`` entry for each name of each ``__all__``,
    so a new public name cannot be left out of the generated reference."""
    text = "\n".join(p.read_text() for p in (ROOT / "docs" / "reference").glob("*.md"))
    for package in PACKAGES:
        module = importlib.import_module(package)
        missing = [n for n in module.__all__ if f"::: {package}.{n}\n" not in text + "\n"]
        assert not missing, f"docs/reference/ lacks {package}: {missing}"


def test_troubleshooting_has_an_entry_per_error_exit_status_and_check() -> None:
    """docs/troubleshooting.md: a heading for every exception a user can catch, every exit
    status the CLIs and commands use, and every system check id."""
    import re

    import task_locks
    from django_app import checks
    from task_locks import verbs
    from task_locks.celery import DuplicateTask

    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    headings = "\n".join(re.findall(r"^#{2,4} (.+)$", text, re.M))
    errors = [
        value.__name__
        for name in task_locks.__all__
        if inspect.isclass(value := getattr(task_locks, name))
        and issubclass(value, task_locks.LockError)
    ] + [DuplicateTask.__name__, "RenewalUndecided"]
    missing = [e for e in errors if f"`{e}`" not in text]
    statuses = {str(getattr(verbs, n)) for n in dir(verbs) if n.startswith("EX_")}
    missing += [f"exit {s}" for s in sorted(statuses) if f"\n### {s}\n" not in f"\n{text}"]
    ids = set(re.findall(r"task_locks\.[EW]\d{3}", checks.__doc__ or ""))
    missing += [i for i in sorted(ids) if f"`{i}`" not in headings]
    assert len(ids) >= 7 and len(statuses) >= 8
    assert not missing, f"docs/troubleshooting.md has no entry for {missing}"


#: The broker of docs/celery.md's RabbitMQ app (the machine's RabbitMQ, default user).
RABBITMQ = ("127.0.0.1", 5672)


def test_the_plain_celery_app_runs_on_rabbitmq(redis_url: str, tmp_path: Path) -> None:
    """docs/celery.md's RabbitMQ app with the quick start's worker command and send.py: one
    call runs, its duplicate is skipped (a ready Skipped result), as on the Redis broker."""
    import socket

    from tests.test_readme import WITH_A_WORKER, readme_blocks, run_plain_celery_app

    try:
        socket.create_connection(RABBITMQ, timeout=2).close()
    except OSError as exc:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"no RabbitMQ on {RABBITMQ}: {exc}")
    blocks = [
        b
        for b in readme_blocks(path=ROOT / "docs" / "celery.md")
        if b.reason.startswith(f"{WITH_A_WORKER} on RabbitMQ")
    ]
    assert len(blocks) == 1 and "amqp://" in blocks[0].code, blocks
    # A queue of this run's own on the machine's RabbitMQ: nobody else's leftovers or
    # parallel runs in it; deleted afterwards.
    queue = f"docs-rabbitmq-{os.getpid()}"
    app = blocks[0].code + f"\napp.conf.task_default_queue = {queue!r}\n"
    try:
        run_plain_celery_app(redis_url, tmp_path, Path(sys.executable).parent, [ROOT], app_code=app)
    finally:
        from kombu import Connection

        with Connection("amqp://guest:guest@{}:{}//".format(*RABBITMQ)) as connection:
            connection.default_channel.queue_delete(queue)


def test_make_test_builds_the_site_strictly_with_its_links_checked() -> None:
    """``make test`` runs ``make docs``, a strict build in which every internal link,
    anchor and nav entry that does not resolve is a warning, so it fails the build."""
    import re

    yaml = pytest.importorskip("yaml")  # mkdocs's own dependency (the docs extra)

    makefile = (ROOT / "Makefile").read_text()
    prerequisites = re.search(r"^test: (.*)$", makefile, re.M)
    assert prerequisites is not None and "docs" in prerequisites.group(1).split()
    assert "mkdocs build --strict" in makefile.split("\ndocs:", 1)[1].split("\n\n", 1)[0]

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["strict"] is True
    checks = {f"{group}.{key}": value for group in ("nav", "links")
              for key, value in config["validation"][group].items()}  # fmt: skip
    assert checks and set(checks.values()) == {"warn"}, checks
    assert {"links.not_found", "links.anchors", "nav.not_found"} <= set(checks)
