"""The documentation site's sources beyond their code blocks (those are run by
tests/test_readme.py, with the README's): the operations page's ``LOGGING`` snippet prints
each line once under a Celery worker.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPERATIONS = ROOT / "docs" / "operations.md"


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
