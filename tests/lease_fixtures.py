"""The autouse fixture of the directories whose tests leave leases renewing on failure.

Imported into a directory's conftest (tests/core, tests/conformance), it is autouse there
only: elsewhere a test's leases are its own business.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from task_locks import watchdog


@pytest.fixture(autouse=True)
def no_leftover_renewals() -> Iterator[None]:
    """A failing test may leave leases behind: stop renewing them before its backends close
    (the root conftest's teardown closes them after this one) and for the next test."""
    yield
    watchdog.thread_renewer().schedule.clear()
