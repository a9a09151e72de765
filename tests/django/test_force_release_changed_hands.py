"""An operator's force release frees the holder the operator saw, never a newer one.

Each front end (``task-locks release``, ``manage.py locks release``, the admin) reads the
holder, asks, then frees. The lock may change hands while the question is on screen; the
release must then be refused, atomically on the server (``force_release(name, fence=)``),
the new holder keep its lock, and the refusal be reported and audited, never a "forced"
event naming someone who was not freed.

Every test runs on Redis and on the ``django://`` backend. The hand-over happens for real (holder A releases, holder B acquires on the real server)
at the moment the question is asked: on a terminal (a pty) for the subprocess tests, in
the confirm callback in-process, and between the admin's read and its release through a
thin wrapper around the real backend (the only way to place an HTTP request's two backend
calls on either side of another client's acquire deterministically).
"""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from django.test import Client
from django_helpers import MANAGE, ROOT, staff, subprocess_env

from django_app import conf
from django_app.models import LockEvent
from task_locks import Lock, NotOwned, get_backend
from task_locks.events import LockEvent as StreamEvent
from task_locks.lock import Lease
from task_locks.owner import owner_context
from task_locks.verbs import EX_CHANGED_HANDS, EX_OK, cmd_release

NAME = "nightly-report"
FORCE = "/admin/task_locks/lockholder/force-release/"


@dataclass
class HandOver:
    """Holder A holds ``NAME``; :meth:`__call__` makes B the holder, for real."""

    url: str
    a: Lease
    b: Lease | None = None

    def __call__(self) -> None:
        self.a.release()
        with owner_context(command="holder B"):
            self.b = Lock(NAME, ttl=30, backend=self.url).acquire()

    def holder_fence(self) -> int | None:
        holder = get_backend(self.url).holder(NAME)
        return None if holder is None else holder.fence


#: Every test runs on Redis and on the database (the ``django://`` backend, SQLite).
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(params=["redis", "django"])
def backend_url(request: pytest.FixtureRequest) -> str:
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    return "django://default"


@pytest.fixture
def hand_over(backend_url: str) -> Iterator[HandOver]:
    with owner_context(command="holder A"):
        a = Lock(NAME, ttl=30, backend=backend_url).acquire()
    handing = HandOver(backend_url, a)
    yield handing
    for lease in (handing.a, handing.b):
        if lease is not None and lease.held:
            try:
                lease.release()
            except NotOwned:
                pass  # force-released by the test


def on_a_terminal(
    argv: list[str], env: dict[str, str], on_prompt: Callable[[], None], timeout: float = 30
) -> tuple[int, str]:
    """Run ``argv`` on a pty; when it asks ``[y/N]``, call ``on_prompt`` then answer ``y``."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=str(ROOT), close_fds=True
    )
    os.close(slave)
    output, answered = b"", False
    deadline = time.monotonic() + timeout
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                proc.kill()
                raise AssertionError(f"{argv} did not finish in {timeout}s: {output!r}")
            ready, _, _ = select.select([master], [], [], min(remaining, 0.5))
            if not ready:
                continue
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal (it exited)
                break
            if not chunk:
                break
            output += chunk
            if not answered and b"[y/N]" in output:
                on_prompt()
                os.write(master, b"y\n")
                answered = True
    finally:
        os.close(master)
    status = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    assert answered, f"never asked: {output!r}"
    return status, output.decode(errors="replace").replace("\r\n", "\n")


def changed_hands(text: str, b: Lease) -> bool:
    return bool(
        re.search(
            r"the lock changed hands: now held by command 'holder B'.*\(fence "
            + str(b.fence)
            + r"\); nothing released",
            text,
        )
    )


def test_cmd_release_refuses_a_lock_that_changed_hands_while_asked(hand_over: HandOver) -> None:
    backend = get_backend(hand_over.url)
    events: list[tuple[str, int | None, str]] = []

    def audit(event: StreamEvent) -> None:
        events.append((event.kind, event.fence, event.owner.command if event.owner else ""))

    def confirm(question: str) -> bool:
        assert "holder A" in question and f"fence {hand_over.a.fence}" in question
        hand_over()
        return True

    out, err = io.StringIO(), io.StringIO()
    status = cmd_release(
        backend, NAME, force=True, yes=False, out=out, err=err, audit=audit, confirm=confirm
    )
    assert hand_over.b is not None
    assert status == EX_CHANGED_HANDS, err.getvalue()
    assert changed_hands(err.getvalue(), hand_over.b), err.getvalue()
    assert hand_over.holder_fence() == hand_over.b.fence, "B still holds"
    assert hand_over.b.held and out.getvalue() == ""
    # Recorded as a refusal naming the holder that kept the lock, never as "forced".
    assert events == [("conflict", hand_over.b.fence, "holder B")]

    # Asked about B and confirmed, B is freed, and the audit names B.
    status = cmd_release(
        backend, NAME, force=True, yes=True, out=out, err=err, audit=audit, confirm=confirm
    )
    assert status == EX_OK and hand_over.holder_fence() is None
    assert events[-1] == ("forced", hand_over.b.fence, "holder B")


def test_cli_release_on_a_terminal_refuses_a_lock_that_changed_hands(
    hand_over: HandOver,
) -> None:
    env = subprocess_env(hand_over.url)
    env["TASK_LOCKS_URL"] = hand_over.url
    status, output = on_a_terminal(
        [sys.executable, "-m", "task_locks.cli", "release", NAME, "--force"], env, hand_over
    )
    assert hand_over.b is not None
    assert status == EX_CHANGED_HANDS, output
    assert changed_hands(output, hand_over.b), output
    assert "released" not in output.replace("nothing released", "")
    assert hand_over.holder_fence() == hand_over.b.fence, "B still holds"


def test_manage_py_release_on_a_terminal_refuses_a_lock_that_changed_hands(
    hand_over: HandOver,
) -> None:
    status, output = on_a_terminal(
        [sys.executable, str(MANAGE), "locks", "release", NAME, "--force"],
        subprocess_env(hand_over.url),
        hand_over,
    )
    assert hand_over.b is not None
    assert status == EX_CHANGED_HANDS, output
    assert changed_hands(output, hand_over.b), output
    assert hand_over.holder_fence() == hand_over.b.fence, "B still holds"
    assert not LockEvent.objects.filter(kind="forced").exists()
    refused = LockEvent.objects.get(kind="conflict")
    assert (refused.name, refused.fence) == (NAME, hand_over.b.fence)
    assert refused.owner_data["command"] == "holder B"
    assert f"fence {hand_over.a.fence}" in refused.detail and "refused" in refused.detail


def test_manage_py_release_frees_and_audits_the_holder_it_showed(hand_over: HandOver) -> None:
    status, output = on_a_terminal(
        [sys.executable, str(MANAGE), "locks", "release", NAME, "--force"],
        subprocess_env(hand_over.url),
        lambda: None,
    )
    assert status == EX_OK, output
    assert hand_over.holder_fence() is None
    forced = LockEvent.objects.get(kind="forced")
    assert (forced.fence, forced.owner_data["command"]) == (hand_over.a.fence, "holder A")


def test_manage_py_help_documents_the_changed_hands_status() -> None:
    proc = subprocess.run(
        [sys.executable, str(MANAGE), "locks", "release", "--help"],
        env=subprocess_env("django://default"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"{EX_CHANGED_HANDS}" in proc.stdout and "changed hands" in proc.stdout


# -- the admin ---------------------------------------------------------------------------


@pytest.fixture
def operator(client: Client, backend_url: str, settings: Any) -> Client:
    settings.TASK_LOCKS = {"BACKEND": backend_url}
    client.force_login(staff("ops", "view_lockholder", "force_release_lock", "view_lockevent"))
    return client


def test_admin_confirmation_carries_the_fence_not_the_token_and_refuses_a_new_holder(
    operator: Client, hand_over: HandOver
) -> None:
    page = operator.get(FORCE, {"name": NAME})
    assert page.status_code == 200
    assert f'name="fence" value="{hand_over.a.fence}"' in page.text
    assert hand_over.a.token not in page.text, "the token is a secret"

    hand_over()  # while the question is on screen
    assert hand_over.b is not None
    done = operator.post(FORCE, {"name": NAME, "fence": str(hand_over.a.fence)}, follow=True)
    assert done.status_code == 200
    assert changed_hands(done.text.replace("&#x27;", "'"), hand_over.b), done.text
    assert hand_over.holder_fence() == hand_over.b.fence, "B still holds"
    # The page now asks about B, with B's fence.
    assert f'name="fence" value="{hand_over.b.fence}"' in done.text
    assert not LockEvent.objects.filter(kind="forced").exists()
    assert LockEvent.objects.get(kind="conflict").fence == hand_over.b.fence


class _HandsOverAfterReading:
    """The real backend, except that the first ``holder()`` read hands the lock to B.

    It puts another client's acquire between the admin's read of the holder and its
    release in one POST: the window a check-then-release leaves open.
    """

    def __init__(self, real: Any, hand_over: HandOver) -> None:
        self.real, self.hand_over = real, hand_over

    def holder(self, name: str) -> Any:
        seen = self.real.holder(name)
        if self.hand_over.b is None:
            self.hand_over()
        return seen

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.real, attribute)


def test_admin_release_is_conditional_on_the_server_not_only_on_a_prior_read(
    operator: Client, hand_over: HandOver, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = conf.backend()
    with monkeypatch.context() as patch:
        patch.setattr(conf, "backend", lambda: _HandsOverAfterReading(real, hand_over))
        done = operator.post(FORCE, {"name": NAME, "fence": str(hand_over.a.fence)}, follow=True)
    assert hand_over.b is not None
    assert changed_hands(done.text.replace("&#x27;", "'"), hand_over.b), done.text
    assert hand_over.holder_fence() == hand_over.b.fence, "B still holds"
    assert not LockEvent.objects.filter(kind="forced").exists()


def test_admin_refuses_a_post_without_a_fence(operator: Client, hand_over: HandOver) -> None:
    done = operator.post(FORCE, {"name": NAME}, follow=True)
    assert done.status_code == 200
    assert hand_over.holder_fence() == hand_over.a.fence
    assert not LockEvent.objects.filter(kind="forced").exists()
