"""Front ends a cron wrapper and an on-call engineer rely on.

Exit statuses (one table, in docs/operations.md), options after the verb, and a configuration
error that names the setting.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from django_helpers import cli, finish, manage
from servers import free_port, wait_until

from django_app import conf
from task_locks import InvalidArgument, Lock, get_backend
from task_locks.verbs import EX_CONFIG, EX_LEASE_LOST, EX_TEMPFAIL, EX_UNAVAILABLE


@pytest.mark.parametrize(
    ("command", "lock"),
    [(["locked_sleep"], "sleepy:a"), (["decorated_job", "acme"], "job:acme")],
    ids=["LockedCommand", "locked_command"],
)
def test_locked_command_with_an_unreachable_backend_exits_69_in_one_line(
    command: list[str], lock: str
) -> None:
    down = f"redis://127.0.0.1:{free_port()}/0?connect_timeout=1"
    status, _, err = finish(manage(*command, backend_url=down))
    assert status == EX_UNAVAILABLE == 69, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "unavailable" in lines[0] and lock in lines[0], err


def test_locked_command_with_a_backend_needing_a_password_exits_78(redis_factory) -> None:  # type: ignore[no-untyped-def]
    server = redis_factory(extra=["--requirepass", "s3cret"])
    status, _, err = finish(manage("locked_sleep", backend_url=server.url()))
    assert status == EX_CONFIG == 78, err
    assert "Traceback" not in err and "requires a password" in err
    status, _, err = finish(cli("list", backend_url=server.url()))
    assert status == EX_CONFIG, err
    assert "requires a password" in err


@pytest.mark.django_db(transaction=True)
def test_options_work_after_the_verb(redis_url: str) -> None:
    with Lock("after:1", ttl=30, backend=redis_url):
        status, out, err = finish(
            manage(
                "locks", "list", "--settings", "tests.django.settings", "--verbosity", "0",
                backend_url=redis_url,
            )
        )  # fmt: skip
        assert status == 0, err
        assert "after:1" in out
        status, out, err = finish(cli("list", "--url", redis_url, backend_url="memory://"))
        assert status == 0, err
        assert "after:1" in out
        status, out, err = finish(cli("show", "after:1", "--url", redis_url, backend_url="x://"))
        assert status == 0 and "after:1" in out, err


def test_run_that_lost_its_lease_has_its_own_status(
    redis_url: str, tmp_path: Path, spawned: list[subprocess.Popen[str]]
) -> None:
    started = tmp_path / "started"
    proc = cli(
        "run", "lease-lost", "--ttl", "1", "--", "sh", "-c", f"touch {started} && exec sleep 30",
        backend_url=redis_url,
    )  # fmt: skip
    spawned.append(proc)
    wait_until(lambda: started.exists() or proc.poll() is not None, 30, "the program to start")
    assert get_backend(redis_url).force_release("lease-lost")  # an operator took it away
    status, _, err = finish(proc)
    assert status == EX_LEASE_LOST != EX_TEMPFAIL, err
    assert "lost lock 'lease-lost'" in err
    assert EX_LEASE_LOST not in (1, 2, 3, 69, 75, 78, 126, 127) and EX_LEASE_LOST < 128


def test_misconfigured_names_the_setting(settings: object) -> None:
    settings.TASK_LOCKS = {"BACKEND": "nosuch://x"}  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgument) as caught:
        Lock("x", ttl=5, backend=conf.backend()).acquire()
    assert "the lock settings are misconfigured: settings.TASK_LOCKS['BACKEND']" in str(caught.value)
    assert "task-locks" not in str(caught.value)  # the CLIs' own prefix: said once


def test_the_readme_has_every_exit_status_in_one_table() -> None:
    import re

    from task_locks import verbs

    readme = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    documented = dict(re.findall(r"^\| (\d+) \| `(EX_[A-Z_]+)` \|", readme, re.MULTILINE))
    constants = {str(getattr(verbs, n)): n for n in dir(verbs) if n.startswith("EX_")}
    assert documented == constants
