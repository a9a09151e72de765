"""``manage.py locks`` and the ``task-locks`` CLI: one set of verbs."""

from __future__ import annotations

import io
import json
import signal
import socket
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.management import call_command
from django.utils import timezone
from django_helpers import cli, finish, manage
from servers import wait_until

from django_app.models import LockEvent
from task_locks import Lock, NotOwned, get_backend
from task_locks.listing import format_duration


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("front", [manage, cli], ids=["manage.py", "task-locks"])
def test_run_holds_the_lock_for_the_program(
    front: object, redis_url: str, tmp_path: Path, spawned: list[subprocess.Popen[str]]
) -> None:
    started = tmp_path / "started"
    prefix = ("locks",) if front is manage else ()
    run = front  # type: ignore[assignment]
    first = run(
        *prefix, "run", "nightly", "--ttl", "2", "--",
        "sh", "-c", f"touch {started} && exec sleep 30",
        backend_url=redis_url,
    )  # fmt: skip
    spawned.append(first)
    wait_until(lambda: started.exists() or first.poll() is not None, 30, "the first program")
    assert started.exists(), finish(first)

    second = run(*prefix, "run", "nightly", "--", "true", backend_url=redis_url)
    status, out, err = finish(second)
    assert status == 75, err
    assert "lock 'nightly' is held by command " in err and "sleep 30" in err
    assert f"pid {first.pid}" in err

    holder = get_backend(redis_url).holder("nightly")
    assert holder is not None and holder.owner.pid == first.pid

    first.send_signal(signal.SIGTERM)  # forwarded to the program; the lock is released
    status, _, err = finish(first)
    assert status == 128 + signal.SIGTERM, err
    assert get_backend(redis_url).holder("nightly") is None

    status, out, err = finish(
        run(*prefix, "run", "nightly", "--", "sh", "-c", "echo hi; exit 7", backend_url=redis_url)
    )
    assert (status, out) == (7, "hi\n"), err


@pytest.mark.django_db(transaction=True)
def test_run_renews_past_its_ttl_and_waits(
    redis_url: str, tmp_path: Path, spawned: list[subprocess.Popen[str]]
) -> None:
    started, finished = tmp_path / "started", tmp_path / "finished"
    holder = manage(
        "locks", "run", "renewed", "--ttl", "0.5", "--",
        "sh", "-c", f"touch {started} && sleep 2 && touch {finished}",
        backend_url=redis_url,
    )  # fmt: skip
    spawned.append(holder)
    wait_until(lambda: started.exists() or holder.poll() is not None, 30, "the holder")
    # The holder's 0.5 s TTL is renewed for its 2 s: the waiter runs only after it ended.
    waiter = manage(
        "locks", "run", "renewed", "--wait", "30", "--",
        "sh", "-c", f"test -f {finished} && echo after",
        backend_url=redis_url,
    )  # fmt: skip
    spawned.append(waiter)
    status, out, err = finish(waiter)
    assert (status, out) == (0, "after\n"), err
    assert finish(holder)[0] == 0


@pytest.mark.django_db(transaction=True)
def test_list_show_release_in_process(redis_settings: str) -> None:
    out = io.StringIO()
    call_command("locks", "list", stdout=out)
    assert out.getvalue() == "no locks held\n"

    lease = Lock("report:42", ttl=30, backend=redis_settings).acquire()
    out = io.StringIO()
    call_command("locks", "list", "report:", stdout=out)
    header, row = out.getvalue().splitlines()
    assert header.split() == ["NAME", "HOLDER", "FENCE", "HELD", "FOR", "EXPIRES", "IN"]
    assert row.startswith("report:42") and str(lease.fence) in row
    assert f"on {socket.gethostname()} pid" in row

    out = io.StringIO()
    call_command("locks", "list", "--json", stdout=out)
    [item] = json.loads(out.getvalue())
    assert item["name"] == "report:42" and item["fence"] == lease.fence
    assert "token" not in json.dumps(item)

    out = io.StringIO()
    call_command("locks", "show", "report:42", stdout=out)
    assert f"fence:       {lease.fence}" in out.getvalue()

    err = io.StringIO()
    with pytest.raises(SystemExit) as refused:
        call_command("locks", "release", "report:42", stderr=err)
    assert refused.value.code == 2 and "--force" in err.getvalue()
    with pytest.raises(SystemExit) as unconfirmed:  # no terminal to ask on
        call_command("locks", "release", "report:42", "--force", stderr=io.StringIO())
    assert unconfirmed.value.code == 1
    assert get_backend(redis_settings).holder("report:42") is not None

    out = io.StringIO()
    call_command("locks", "release", "report:42", "--force", "--yes", stdout=out)
    assert "released 'report:42'" in out.getvalue()
    assert get_backend(redis_settings).holder("report:42") is None
    event = LockEvent.objects.get(kind="forced")
    assert event.name == "report:42" and event.fence == lease.fence
    assert "manage.py locks" in event.actor
    with pytest.raises(NotOwned):  # the holder is told when it next talks to the lock
        lease.release()
    with pytest.raises(SystemExit) as missing:
        call_command("locks", "show", "report:42", stderr=io.StringIO())
    assert missing.value.code == 1


@pytest.mark.django_db(transaction=True)
def test_prune_deletes_old_events() -> None:
    old = LockEvent.objects.create(kind="lost", name="a")
    LockEvent.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=40))
    LockEvent.objects.create(kind="lost", name="b")
    out = io.StringIO()
    call_command("locks", "prune", stdout=out)
    assert "deleted 1 lock event" in out.getvalue()
    assert list(LockEvent.objects.values_list("name", flat=True)) == ["b"]
    call_command("locks", "prune", "--days", "0", stdout=io.StringIO())
    assert not LockEvent.objects.exists()


def test_cli_list_and_errors(redis_url: str) -> None:
    lease = Lock("cli:1", ttl=30, backend=redis_url).acquire()
    status, out, err = finish(cli("list", "--json", backend_url=redis_url))
    assert status == 0, err
    assert [h["name"] for h in json.loads(out)] == ["cli:1"]
    status, out, err = finish(cli("release", "cli:1", "--force", "--yes", backend_url=redis_url))
    assert status == 0 and "released 'cli:1'" in out
    assert get_backend(redis_url).holder("cli:1") is None
    with pytest.raises(NotOwned):
        lease.release()
    status, _, err = finish(cli("--url", "nope://x", "list", backend_url=redis_url))
    assert status == 2 and "unknown lock backend scheme" in err
    status, _, err = finish(cli("--url", "redis://127.0.0.1:1/0", "list", backend_url=redis_url))
    assert status == 69 and "127.0.0.1:1" in err


def test_format_duration() -> None:
    assert [format_duration(s) for s in (None, -1, 3.21, 65, 7260, 90000)] == [
        "-", "expired", "3.2s", "1m05s", "2h01m", "1d01h",
    ]  # fmt: skip
