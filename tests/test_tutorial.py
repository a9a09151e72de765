"""docs/tutorial.md followed as a new user would: in an empty folder, each of its blocks in
order (the shell steps run, the files written where their first line says, the settings
appended), then its worker and its ``send.py``: one call runs, its duplicate is skipped,
on a Redis broker and on the machine's RabbitMQ.

The only departures from the page are the test's own servers: the page's Redis URL
becomes the test Redis's, and on RabbitMQ a queue of this run's own (deleted afterwards)
keeps other runs' messages out.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme import (
    README_REDIS,
    ROOT,
    WITH_A_WORKER,
    Block,
    readme_blocks,
    send_beside_a_worker,
)

pytestmark = pytest.mark.slow

TUTORIAL = ROOT / "docs" / "tutorial.md"
STEP = f"{WITH_A_WORKER}, from an empty Django project"
ON_RABBITMQ = f"{STEP}, on RabbitMQ"
RABBITMQ = ("127.0.0.1", 5672)
#: The first line of a Python block that is a file: ``# path`` or ``# path: add at the end``.
FILE_LINE = re.compile(r"^# (?P<path>[\w/]+\.py)(?P<append>: add at the end)?")


def _steps() -> list[Block]:
    blocks = [b for b in readme_blocks(path=TUTORIAL) if b.reason.startswith(STEP)]
    assert blocks, "docs/tutorial.md has no steps marked for this test"
    return blocks


def _clean_env(folder: Path) -> dict[str, str]:
    """A shell like a new user's: the suite's virtualenv first on PATH, none of the
    suite's Django, Celery or task-locks settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DJANGO_SETTINGS_MODULE", "PYTHONPATH"}
        and not k.startswith(("CELERY_", "TASK_LOCKS"))
    }
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(folder), str(ROOT)])
    return env


def _follow(folder: Path, env: dict[str, str], redis_url: str, broker: str) -> tuple[str, str]:
    """Runs every step up to the worker; returns the worker command and ``send.py``'s code."""
    worker = sender = None
    for block in _steps():
        code = block.code.replace(README_REDIS, redis_url)
        if block.reason.startswith(ON_RABBITMQ):
            continue  # the broker line, used below when the broker is RabbitMQ
        if block.lang == "sh":
            if code.strip().startswith("celery "):
                worker = code.strip()
                continue
            done = subprocess.run(
                ["bash", "-euc", code],
                cwd=folder,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, f"{block.where}\n{done.stdout}\n{done.stderr}"
            continue
        match = FILE_LINE.match(code)
        assert match, f"{block.where}: a Python step must name its file on its first line"
        if match["path"] == "send.py":
            sender = code
            continue
        path = folder / match["path"]
        if match["append"]:
            assert path.exists(), f"{block.where}: {path.name} should exist by now"
            code = path.read_text() + "\n" + code
        path.write_text(code)
    assert worker and sender, "the page must end with its worker command and send.py"
    return worker, sender


def _rabbitmq_broker_line() -> str:
    (line,) = [b.code for b in _steps() if b.reason.startswith(ON_RABBITMQ)]
    return line


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_the_tutorial_reaches_a_working_worker(broker: str, redis_url: str, tmp_path: Path) -> None:
    if broker == "rabbitmq":
        try:
            socket.create_connection(RABBITMQ, timeout=2).close()
        except OSError as exc:
            if os.environ.get("CI") == "true":
                raise
            pytest.skip(f"no RabbitMQ on {RABBITMQ}: {exc}")
    folder = tmp_path / "site"
    folder.mkdir()
    env = _clean_env(folder)
    # The page's steps up to the worker, with the worker's second broker set in settings
    # after the page's own lines (so they are run as written first).
    queue = f"tutorial-{os.getpid()}"
    worker_command, sender = _follow(folder, env, redis_url, broker)
    if broker == "rabbitmq":
        settings = folder / "proj" / "settings.py"
        settings.write_text(
            settings.read_text()
            + "\n"
            + _rabbitmq_broker_line()
            + f"\nCELERY_TASK_DEFAULT_QUEUE = {queue!r}  # the test's own queue\n"
        )
    (folder / "send.py").write_text(sender)
    try:
        sent, worker_log = send_beside_a_worker(
            worker_command, [sys.executable, "send.py"], folder, env, tmp_path
        )
    finally:
        if broker == "rabbitmq":
            from kombu import Connection

            with Connection("amqp://guest:guest@{}:{}//".format(*RABBITMQ)) as connection:
                connection.default_channel.queue_delete(queue)
    assert sent.returncode == 0, f"{sent.stdout}\n{sent.stderr}\n{worker_log}"
    expected = sender.strip().splitlines()[-1].removeprefix("# ")
    assert sent.stdout.strip().splitlines()[-1] == expected, worker_log
    assert "skipped: lock 'invoice:7' is held by" in worker_log, worker_log
    if broker == "rabbitmq":
        assert "amqp://guest:**@127.0.0.1:5672//" in worker_log, worker_log
