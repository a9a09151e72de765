"""The watch a redelivered copy keeps on its own task id's holder (issue 25, item 5):
renewed or released early means alive (refuse the copy), expired unrenewed means dead
(run it). On the in-process ``memory://`` backend, with a real clock and short TTLs."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import pytest

from task_locks import get_backend
from task_locks._steps import drive
from task_locks.celery.redelivery import watch
from task_locks.types import Owner

TTL_MS = 600


@pytest.mark.parametrize(
    ("meanwhile", "dead"),
    [
        (None, True),  # nobody renews it: it expires, its process is gone
        ("renew", False),  # its holder renews it: alive, still running
        ("release", False),  # released well before its expiry: the original finished
    ],
)
def test_a_holder_is_dead_only_if_it_expires_unrenewed(meanwhile: str | None, dead: bool) -> None:
    backend = get_backend(f"memory://watch-{uuid.uuid4().hex}")
    name, token = "t:k", "original"
    assert backend.acquire(name, token, TTL_MS, Owner(task_id="same-id")).acquired
    seen = backend.holder(name)
    assert seen is not None
    actions: dict[str, Callable[[], object]] = {
        "renew": lambda: backend.renew(name, token, TTL_MS),
        "release": lambda: backend.release(name, token),
    }
    timer = threading.Timer(0.15, actions[meanwhile]) if meanwhile else None
    if timer:
        timer.start()
    began = time.monotonic()
    try:
        assert drive(watch(backend, name, seen)) is dead
    finally:
        if timer:
            timer.join()
    assert time.monotonic() - began < TTL_MS / 1000 + 0.5  # never longer than one TTL
