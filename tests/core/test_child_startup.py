"""A child process that cannot start fails its test at once, saying why, instead of at a
timeout: the holder processes (:class:`~.support.Child`) and any wait on children
(``servers.wait_until(..., alive=...)``).

The broken start is real: ``PYTHONPATH`` puts first a ``task_locks`` package whose import
raises, as a stale or half-installed checkout would.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from servers import wait_until

from .support import REPLY_TIMEOUT, Child

BROKEN = "raise ImportError('this task_locks is broken on purpose')\n"


@pytest.fixture
def broken_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with a ``task_locks`` that cannot be imported, first on the children's path."""
    package = tmp_path / "task_locks"
    package.mkdir()
    (package / "__init__.py").write_text(BROKEN)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return tmp_path


def test_a_holder_that_cannot_import_the_package_fails_at_once(broken_package: Path) -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match="broken on purpose") as failed:
        Child("redis://127.0.0.1:1/0", "never-taken", 5.0, "sync")
    took = time.monotonic() - started
    assert "exited (code 1) without answering" in str(failed.value)
    assert took < REPLY_TIMEOUT / 3, f"it took {took:.1f}s to notice"


def test_a_wait_on_a_child_that_exited_fails_at_once(broken_package: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import task_locks"],
        cwd=broken_package,  # with -c, the current folder comes first on the path
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    started = time.monotonic()
    with pytest.raises(AssertionError, match="broken on purpose") as failed:
        wait_until(lambda: False, 60, "the child to be ready", alive=[child])
    took = time.monotonic() - started
    assert f"pid {child.pid} exited with code 1" in str(failed.value)
    assert took < 10, f"it took {took:.1f}s to notice"
