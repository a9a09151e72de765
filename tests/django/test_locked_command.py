"""``LockedCommand`` / ``locked_command``, with real Redis and processes."""

from __future__ import annotations

import io
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from chaoskit.proxy import ProxyHub
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError
from django_helpers import finish, manage
from servers import RedisServer, wait_until

from django_app import audit
from django_app.commands import CommandLockHeld, LockedCommand, locked_command
from django_app.models import LockEvent
from task_locks import Lock, get_backend


@pytest.mark.django_db(transaction=True)
def test_second_run_exits_75_naming_the_holder_and_waits_with_lock_wait(
    redis_url: str, tmp_path: Path, spawned: list[subprocess.Popen[str]]
) -> None:
    marker, stop = tmp_path / "first-running", tmp_path / "first-may-stop"
    first = manage(
        "locked_sleep", "--seconds", "60", "--marker", str(marker), "--until", str(stop),
        backend_url=redis_url,
    )  # fmt: skip
    spawned.append(first)
    wait_until(lambda: marker.exists() or first.poll() is not None, 30, "the first run")
    assert marker.exists(), finish(first)

    second = manage("locked_sleep", backend_url=redis_url)
    waiter = manage("locked_sleep", "--lock-wait", "30", backend_url=redis_url)
    spawned += [second, waiter]
    status, out, err = finish(second)
    assert status == 75, err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert "'sleepy:a'" in line
    assert "command 'manage.py locked_sleep'" in line
    assert f"on {socket.gethostname()} pid {first.pid}" in line
    assert re.search(r"holding it for \d+(\.\d)?s", line), line
    assert waiter.poll() is None, "the waiter waits while the first holds the lock"

    stop.touch()
    status, out, err = finish(first)
    assert (status, err) == (0, ""), err
    first_fence = int(marker.read_text())
    status, out, err = finish(waiter)
    assert status == 0, err
    assert re.fullmatch(r"done a fence=(\d+)\n", out)
    assert int(out.split("=")[1]) > first_fence, "the waiter ran after the first finished"

    # The refused run's conflict names the holder (a waiter that found it held may add a
    # row of its own, under its policy: it names the same holder).
    conflicts = list(LockEvent.objects.filter(kind="conflict", name="sleepy:a"))
    assert conflicts and all(c.owner_data["pid"] == first.pid for c in conflicts), conflicts


@pytest.mark.django_db(transaction=True)
def test_sigterm_releases_the_lock_before_exit(
    redis_url: str, tmp_path: Path, spawned: list[subprocess.Popen[str]]
) -> None:
    marker = tmp_path / "running"
    proc = manage("locked_sleep", "--seconds", "60", "--marker", str(marker), backend_url=redis_url)
    spawned.append(proc)
    wait_until(marker.exists, 20, "the command to hold its lock")
    backend = get_backend(redis_url)
    assert backend.holder("sleepy:a") is not None
    proc.send_signal(signal.SIGTERM)
    status, _, _ = finish(proc)
    assert status == 128 + signal.SIGTERM
    assert backend.holder("sleepy:a") is None, "released at once, not after the TTL"


@pytest.mark.django_db(transaction=True)
def test_conflict_in_process_and_lock_name_template(redis_settings: str) -> None:
    with Lock("sleepy:blue", ttl=10, backend=redis_settings):
        with pytest.raises(CommandLockHeld) as held:
            call_command("locked_sleep", group="blue")
        assert held.value.exit_status == 75
        assert held.value.name == "sleepy:blue"
        out = io.StringIO()
        call_command("locked_sleep", group="red", stdout=out)  # another name: runs
        assert "done red" in out.getvalue()


@pytest.mark.django_db(transaction=True)
def test_no_lock_runs_with_a_warning(redis_settings: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    with Lock("sleepy:a", ttl=10, backend=redis_settings):
        call_command("locked_sleep", "--no-lock", stdout=out, stderr=err)
    assert "done a fence=None" in out.getvalue()
    assert "WARNING" in err.getvalue() and "--no-lock" in err.getvalue()


@pytest.mark.django_db(transaction=True)
def test_decorated_handle_gets_the_options_and_the_lock(redis_settings: str) -> None:
    out = io.StringIO()
    call_command("decorated_job", "acme", stdout=out)
    assert "job for acme under fence" in out.getvalue()
    with Lock("job:acme", ttl=10, backend=redis_settings):
        with pytest.raises(CommandLockHeld):
            call_command("decorated_job", "acme", "--lock-wait", "0.2")


@pytest.mark.django_db(transaction=True)
def test_lock_ttl_option_and_renewal(redis_settings: str) -> None:
    started = time.monotonic()
    out = io.StringIO()
    # ttl 0.5 s, run 1.5 s: only renewal keeps the lock ours until release.
    call_command("locked_sleep", "--lock-ttl", "0.5", "--seconds", "1.5", stdout=out)
    assert "done a" in out.getvalue()
    assert time.monotonic() - started >= 1.5
    with pytest.raises(CommandError, match="lock-ttl"):
        call_command("locked_sleep", "--lock-ttl", "0")


def test_bad_definitions_fail_at_class_creation() -> None:
    with pytest.raises(ImproperlyConfigured, match="lock_ttl"):

        class BadTtl(LockedCommand):
            lock_name = "x"
            lock_ttl = 0

    with pytest.raises(ImproperlyConfigured, match="template"):

        class BadTemplate(LockedCommand):
            lock_name = "x:{unclosed"

    with pytest.raises(ImproperlyConfigured):
        locked_command("")


@pytest.mark.django_db(transaction=True)
def test_template_naming_a_missing_option_is_a_clear_error(redis_settings: str) -> None:
    from django.core.management.base import BaseCommand

    class Command(BaseCommand):
        @locked_command("x:{nope}")
        def handle(self, *args: object, **options: object) -> None:
            raise AssertionError("must not run")

    with pytest.raises(CommandError, match="nope"):
        call_command(Command())


@pytest.mark.django_db(transaction=True)
def test_a_lost_lock_is_recorded_and_fails_the_command(redis_settings: str) -> None:
    backend = get_backend(redis_settings)

    def take_it_away() -> None:
        wait_until(lambda: backend.holder("sleepy:a"), 10, "the command to hold its lock")
        backend.force_release("sleepy:a")

    thief = threading.Thread(target=take_it_away)
    thief.start()
    with pytest.raises(CommandError, match="overlapped"):
        call_command("locked_sleep", "--lock-ttl", "0.6", "--seconds", "1.2", stdout=io.StringIO())
    thief.join(10)
    audit.flush()
    lost = LockEvent.objects.get(kind="lost", name="sleepy:a")
    # Heard from the release notice, or (released before the listener subscribed) renewal.
    assert lost.name == "sleepy:a" and ("renewal" in lost.detail or "notice" in lost.detail)


@pytest.mark.django_db(transaction=True)
def test_audit_setting_picks_the_recorded_kinds(settings: object, redis_url: str) -> None:
    settings.TASK_LOCKS = {"BACKEND": redis_url, "AUDIT": True}  # type: ignore[attr-defined]
    call_command("locked_sleep", stdout=io.StringIO())
    audit.flush()
    assert sorted(LockEvent.objects.values_list("kind", flat=True)) == ["acquired", "released"]
    settings.TASK_LOCKS = {"BACKEND": redis_url, "AUDIT": False}  # type: ignore[attr-defined]
    with Lock("sleepy:a", ttl=5, backend=redis_url), pytest.raises(CommandLockHeld):
        call_command("locked_sleep")
    audit.flush()
    assert LockEvent.objects.count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_command_is_stopped_at_its_lease_deadline_when_renewals_hang(
    redis_server: RedisServer, redis_url: str, tmp_path: Path, spawned: list[subprocess.Popen[str]]
) -> None:
    """Renewals blackholed (a real TCP proxy in front of the real Redis): the command is
    stopped at its lease's local deadline, and only then can another run take the lock."""
    hub = ProxyHub()
    try:
        link = hub.proxy(redis_server.port)
        first_ran, second_ran = tmp_path / "first", tmp_path / "second"
        beats = tmp_path / "beats"
        ttl = 2.0
        first = manage(
            "locked_sleep", "--lock-ttl", str(ttl), "--seconds", "60", "--marker", str(first_ran),
            "--beats", str(beats), backend_url=f"redis://127.0.0.1:{link.port}/0",
        )  # fmt: skip
        spawned.append(first)
        wait_until(lambda: first_ran.exists() or first.poll() is not None, 30, "the first run")
        assert first_ran.exists(), finish(first)
        link.blackhole()
        blackholed_at = time.time()
        second = manage(
            "locked_sleep", "--lock-wait", "30", "--marker", str(second_ran),
            backend_url=redis_url,
        )  # fmt: skip
        spawned.append(second)
        status, _, err = finish(first, ttl + 5)
        # handle() stopped working by the lease's deadline (the process then exits).
        last_beat = float(beats.read_text().split()[-1])
        assert last_beat < blackholed_at + ttl + 0.1, "handle() worked past the deadline"
        assert status == 79, err  # EX_LEASE_LOST
        assert "lost lock 'sleepy:a'" in err and "stopping manage.py locked_sleep" in err, err
        assert "(exit status 79)" in err and "exit status 75" not in err, err  # as it exits
        status, _, err = finish(second)
        assert status == 0, err
        assert int(second_ran.read_text()) > int(first_ran.read_text())
        assert second_ran.stat().st_mtime > last_beat, "the two runs worked at once"
    finally:
        hub.close()


@pytest.mark.parametrize(
    "option", [["--lock-ttl", "-5"], ["--lock-ttl", "0"], ["--lock-wait", "-1"]]
)
def test_a_bad_lock_option_exits_2_with_the_commands_usage(
    redis_url: str, option: list[str]
) -> None:
    """As every bad argument does (``--lock-wait abc``, ``locks run --ttl -5``): 2, the
    command's usage, never 1 through a CommandError raised once the command ran."""
    status, _, err = finish(manage("locked_sleep", *option, backend_url=redis_url))
    assert status == 2, err
    assert "usage: manage.py locked_sleep" in err and f"argument {option[0]}" in err, err


def test_an_unreachable_backend_is_one_sentence(tmp_path: Path) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    status, _, err = finish(manage("locked_sleep", backend_url=f"redis://127.0.0.1:{port}/0"))
    assert status == 69, err
    assert ".;" not in err and "; exiting with status 69" in err, err
