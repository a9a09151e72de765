"""What ``task-locks`` says and exits with, as an operator or a cron wrapper reads it: one
line per fact, the verb's own usage, the status the README's table gives."""

from __future__ import annotations

import io
import logging
import shlex
import sys
import time

import pytest

from task_locks import Lock, get_backend
from task_locks.cli import main
from task_locks.verbs import EX_CONFIG, EX_LEASE_LOST, EX_NOT_HELD, EX_USAGE


def test_a_typo_in_a_redis_url_option_is_named_with_the_option_it_meant(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--url", f"{redis_url}?prefx=shop:", "list"]) == EX_USAGE
    err = capsys.readouterr().err
    assert "unknown option 'prefx' (did you mean 'prefix'?)" in err, err
    assert "__init__()" not in err and "keyword argument" not in err


def test_rediss_on_a_plain_port_exits_78_at_once(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    assert main(["--url", redis_url.replace("redis://", "rediss://", 1), "list"]) == EX_CONFIG
    assert time.monotonic() - started < 2.0
    assert "must say redis://" in capsys.readouterr().err


def test_show_refuses_a_name_run_refuses(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--url", redis_url, "show", "a\nb"]) == EX_USAGE
    assert "control characters" in capsys.readouterr().err
    assert main(["--url", redis_url, "run", "a\nb", "--", "true"]) == EX_USAGE
    assert "control characters" in capsys.readouterr().err


def test_an_option_typo_after_a_verb_prints_that_verbs_usage(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--url", redis_url, "list", "--jsn"])
    assert exited.value.code == EX_USAGE
    err = capsys.readouterr().err
    assert "usage: task-locks list" in err and "unrecognized arguments: --jsn" in err, err


def test_a_piped_answer_is_not_a_confirmation_and_says_why(
    redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # echo y | task-locks release ...
    with Lock("report", ttl=10, backend=redis_url):
        assert main(["--url", redis_url, "release", "report", "--force"]) == EX_NOT_HELD
        err = capsys.readouterr().err
        assert "standard input is not a terminal" in err and "--yes" in err, err
        assert get_backend(redis_url).holder("report") is not None


def test_one_force_release_is_one_line(
    redis_url: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    lease = Lock("report", ttl=10, backend=redis_url).acquire()
    with caplog.at_level(logging.WARNING):
        assert main(["--url", redis_url, "release", "report", "--force", "--yes"]) == 0
    captured = capsys.readouterr()
    said = [*captured.out.splitlines(), *captured.err.splitlines()]
    # The holder (in this same process here) says its own loss, heard from the release
    # notice: the holder's line, not the operator's.
    said += [
        r.getMessage()
        for r in caplog.records
        if "force-released" in r.getMessage() and " lost: " not in r.getMessage()
    ]
    assert [line for line in said if "report" in line and "backend:" not in line] == [
        next(line for line in captured.out.splitlines() if line.startswith("released 'report'"))
    ], said
    lease.lost.wait(1.0)


def _releasing_itself(url: str, name: str, then: str = "") -> list[str]:
    """A program that force-releases the lock ``run`` holds for it (as an operator
    would), then does ``then``."""
    code = f"from task_locks import get_backend; get_backend({url!r}).force_release({name!r})"
    return [sys.executable, "-c", code + (f"; {then}" if then else "")]


def test_run_exits_79_when_the_lease_was_lost_before_its_program_ended(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The program ends at once after the loss, before any renewal: the loss is found at
    the release, and still means its work ran unprotected."""
    argv = _releasing_itself(redis_url, "report")
    assert main(["--url", redis_url, "run", "report", "--ttl", "30", "--", *argv]) == EX_LEASE_LOST
    err = capsys.readouterr().err
    assert f"exit status {EX_LEASE_LOST}" in err, err


def test_run_names_the_program_it_stops_as_a_shell_line(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _releasing_itself(redis_url, "report", "import time; time.sleep(20)")
    started = time.monotonic()
    assert main(["--url", redis_url, "run", "report", "--ttl", "1.5", "--", *argv]) == EX_LEASE_LOST
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert f"stopping {shlex.join(argv)}: SIGTERM now" in err, err
    assert "['" not in err, err
