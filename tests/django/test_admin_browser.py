"""The admin's lock pages in a real headless Chromium.

Debian's ``chromium`` (installed by ``scripts/install-servers.sh``) driven by Playwright's
Python package (the ``test`` extra); Playwright never downloads a browser of its own.
Screenshots are saved to ``tests/artifacts/*.png`` for a person to look at:
``holders.png`` (every table), ``holders-paused.png`` (auto-refresh paused, a lock taken
meanwhile not shown yet), ``holders-filtered.png`` (filters by kind and host),
``events.png`` (the Lock events page), ``events-grouped.png`` (conflicts of every policy,
repeats counted, a long actor) and ``events-by-policy.png`` (filtered by policy), and
``jobruns.png`` (the example project's Job runs).
Each page must fit its window: no table wider than the page, no column cut off.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from servers import free_port, wait_until

from django_app import audit
from task_locks import Election, Lock, Owner, Semaphore, events, owner_context
from task_locks.owner import current_owner

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
BROWSER_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
#: Times as the pages show them: to the second, with the time zone.
TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [A-Z]{3}"
PASSWORD = "adm1n-s3cret"

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason="Debian chromium is not installed (make servers)"
)


@pytest.fixture
def shop_url(redis_factory: Any, settings: Any) -> str:
    """A Redis that requires a password; TASK_LOCKS names it with KEY_PREFIX 'shop:'."""
    server = redis_factory(extra=["--requirepass", PASSWORD])
    url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
    settings.TASK_LOCKS = {"BACKEND": url, "KEY_PREFIX": "shop:", "AUDIT": True}
    return f"{url}?prefix=shop:"


@pytest.fixture
def held(shop_url: str) -> Iterator[dict[str, Any]]:
    """Two plain locks on two hosts, an election with its leader, two semaphore permits."""
    with ExitStack() as stack:
        with owner_context(command="manage.py nightly_report"):
            report = stack.enter_context(Lock("nightly-report", ttl=30, backend=shop_url))
        with owner_context(task_name="shop.sync_account", task_id="abc-1", host="worker-2"):
            stack.enter_context(Lock("sync:42", ttl=30, backend=shop_url))
        election = Election("reports", ttl=30, backend=shop_url, identity="beat@web-1")
        stack.enter_context(election.campaign())
        exports = Semaphore("exports", 3, ttl=30, backend=shop_url)
        with owner_context(command="manage.py export"):
            stack.enter_context(exports.acquire())
            stack.enter_context(exports.acquire())
        yield {"report": report, "stack": stack}


def _logged_in(browser: Any, base: str, then: str) -> Any:
    """A 1400 px wide page, logged in as the superuser ``admin``, on its way to ``then``."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(f"{base}/admin/login/?next={then}")
    page.fill("#id_username", "admin")
    page.fill("#id_password", "secret-pw")
    page.click("input[type=submit]")
    return page


def _rows(page: Any, table: str) -> int:
    return int(page.locator(f"#{table} tbody tr").count())


def _count(page: Any, what: str) -> int:
    return int(page.locator(f'.lock-footer [data-count="{what}"]').inner_text())


#: Each table's overflow past its box and its right edge, against the window's width.
_TABLES = """() => [...document.querySelectorAll("#content table")].map(t => {
    const box = t.closest(".results") || t.parentElement;
    return {id: t.id, overflow: box.scrollWidth - box.clientWidth,
            right: Math.round(t.getBoundingClientRect().right), window: window.innerWidth};
})"""


def _assert_fits(page: Any) -> None:
    """Every table fits the page: nothing to scroll sideways, no column cut off."""
    tables = page.evaluate(_TABLES)
    assert tables, "no table on the page"
    assert all(t["overflow"] <= 0 and t["right"] <= t["window"] for t in tables), tables
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")


def _one_line_each(page: Any, selector: str) -> None:
    """A time's date and its time of day each stay on one line (a column may wrap
    between them, never inside "01:27:24 UTC")."""
    lines = page.locator(selector).evaluate_all("els => els.map(e => e.getClientRects().length)")
    assert lines and set(lines) == {1}, lines


@pytest.mark.django_db(transaction=True)
def test_admin_pages_in_chromium(live_server: object, held: dict[str, Any], shop_url: str) -> None:
    from playwright.sync_api import expect, sync_playwright

    # All ORM work happens before Playwright starts: its sync API runs an event loop in
    # this thread, where Django refuses synchronous database calls.
    User.objects.create_superuser("admin", "admin@example.com", "secret-pw")
    report = held["report"]
    audit.record(
        events.Forced(name="sync:7", fence=3, owner=current_owner(), actor="ops (admin)"), sync=True
    )
    audit.record(events.RenewalFailed(name="sync:8", owner=current_owner()), sync=True)
    # A long name with nowhere to break must wrap in its cell, not widen the table.
    audit.record(events.Lost(name="report:" + "x" * 160, owner=current_owner()), sync=True)
    base = str(live_server)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shots = {
        n: ARTIFACTS / f"{n}.png"
        for n in ("holders", "holders-paused", "holders-filtered", "events")
    }
    for shot in shots.values():
        shot.unlink(missing_ok=True)

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        try:
            page = _logged_in(browser, base, "/admin/")
            page.wait_for_selector("#content-main")
            page.click("text=Lock holders")
            page.wait_for_selector("#result_list")
            assert page.locator("h1").first.inner_text() == "Lock holders"
            # Auto-refresh is on by default, every few seconds.
            expect(page.locator("#lock-autorefresh-status")).to_have_text("auto-refresh every 5 s")

            row = page.locator('#result_list tr[data-lock="nightly-report"]')
            assert row.count() == 1, "the held lock is listed"
            cells = row.locator("td").all_inner_texts()
            assert str(report.fence) in cells
            assert "manage.py nightly_report" in cells
            assert re.fullmatch(TIME, cells[4]), cells  # acquired: seconds and zone

            # The footer counts what the tables show.
            assert _count(page, "locks") == _rows(page, "result_list") == 2
            assert _count(page, "elections") == _rows(page, "election_list") == 1
            assert _count(page, "permits") == _rows(page, "semaphore_list") == 2
            assert re.fullmatch(TIME, page.locator(".lock-read-at").inner_text())

            # The backend as typed, without its password.
            help_text = page.locator("#searchbar_helptext").inner_text()
            assert "prefix=shop:" in help_text and "%3A" not in help_text, help_text
            assert PASSWORD not in page.content()

            # An election's leader, once.
            election = page.locator('#election_list tr[data-election="reports"]')
            assert election.inner_text().count("beat@web-1") == 1, election.inner_text()
            # Every column visible, the force-release buttons included.
            _assert_fits(page)
            _one_line_each(page, "td.lock-time span")
            assert page.locator("td.lock-action a").count() == 5
            page.screenshot(path=str(shots["holders"]), full_page=True)

            # Auto-refresh: on by default; a lock taken now shows up without a reload.
            page.goto(f"{base}/admin/task_locks/lockholder/?refresh=1")
            expect(page.locator("#lock-autorefresh-status")).to_have_text("auto-refresh every 1 s")
            with owner_context(command="manage.py late"):
                held["stack"].enter_context(Lock("late-arrival", ttl=30, backend=shop_url))
            page.wait_for_selector('#result_list tr[data-lock="late-arrival"]', timeout=15_000)
            assert _count(page, "locks") == 3

            # Paused: nothing changes under the operator's eyes until resumed.
            page.click("#lock-autorefresh")
            expect(page.locator("#lock-autorefresh-status")).to_have_text("auto-refresh paused")
            refreshes = page.locator("#lock-live").get_attribute("data-refreshes")
            with owner_context(command="manage.py later"):
                held["stack"].enter_context(Lock("while-paused", ttl=30, backend=shop_url))
            # Absence can only be shown by waiting: three refresh periods.
            page.wait_for_timeout(3_000)
            assert page.locator('tr[data-lock="while-paused"]').count() == 0
            assert page.locator("#lock-live").get_attribute("data-refreshes") == refreshes
            page.screenshot(path=str(shots["holders-paused"]), full_page=True)
            page.reload()  # the pause is remembered in this browser
            page.wait_for_selector('#result_list tr[data-lock="while-paused"]')
            expect(page.locator("#lock-autorefresh-status")).to_have_text("auto-refresh paused")
            page.click("#lock-autorefresh")
            expect(page.locator("#lock-autorefresh-status")).to_have_text("auto-refresh every 1 s")

            # Filters beside the name search: kind, host, job.
            page.goto(f"{base}/admin/task_locks/lockholder/?refresh=0")
            page.select_option("#lock-filter-kind", "election")
            page.wait_for_url(re.compile(r"kind=election"))
            assert page.locator("#result_list").count() == 0
            assert page.locator("#semaphore_list").count() == 0
            assert _rows(page, "election_list") == _count(page, "elections") == 1
            page.select_option("#lock-filter-kind", "")
            page.select_option("#lock-filter-host", "worker-2")
            page.wait_for_url(re.compile(r"host=worker-2"))
            listed = page.locator("#result_list tbody tr").evaluate_all(
                "rows => rows.map(r => r.dataset.lock)"
            )
            assert listed == ["sync:42"]
            _assert_fits(page)
            page.screenshot(path=str(shots["holders-filtered"]), full_page=True)
            page.goto(f"{base}/admin/task_locks/lockholder/?refresh=0")
            page.fill("#lock-filter-job", "nightly")
            page.press("#lock-filter-job", "Enter")
            page.wait_for_url(re.compile(r"job=nightly"))
            listed = page.locator("#result_list tbody tr").evaluate_all(
                "rows => rows.map(r => r.dataset.lock)"
            )
            assert listed == ["nightly-report"]
            assert _count(page, "elections") == _count(page, "permits") == 0

            # Lock events: times to the second with the zone, kinds named as in AUDIT.
            page.goto(f"{base}/admin/task_locks/lockevent/")
            page.wait_for_selector("#result_list")
            page.screenshot(path=str(shots["events"]), full_page=True)  # kept on failure
            kinds = page.locator("#result_list td.field-kind").all_inner_texts()
            assert "forced" in kinds and "renewal_failed" in kinds, kinds
            assert "force-released" not in page.content()
            times = page.locator("#result_list th.field-when, #result_list td.field-when")
            assert all(re.fullmatch(TIME, t) for t in times.all_inner_texts()), times
            assert times.count() >= 2
            _assert_fits(page)
            _one_line_each(page, "#result_list .field-when span")
            page.screenshot(path=str(shots["events"]), full_page=True)
        finally:
            browser.close()
    for shot in shots.values():
        assert shot.stat().st_size > 10_000, shot


#: A worker's actor as the audit writes it: long, and every part of it matters.
LONG_ACTOR = "celery@worker-7.eu-west-1.compute.internal pid 4242 (ForkPoolWorker-12)"


def _record_policies() -> None:
    """Conflicts as each front end reports them: five skips against one running task (one
    row, counted), a wait given up, a command's exit 75, a retry, a duplicate publish."""
    task = Owner(task_name="shop.sync_account", task_id="abc-1", host="worker-2", pid=4242)
    command = Owner(command="manage.py nightly_report", host="web-1", pid=77)
    for batch in (3, 2):  # two batches: a repeat folds into the row already written
        for _ in range(batch):
            events.emit(
                events.Conflict(
                    name="sync:42", fence=17, owner=task, policy="skip", actor=LONG_ACTOR
                )
            )
        assert audit.flush(timeout=10)
    events.emit(
        events.Conflict(name="search-index", fence=3, owner=task, policy="wait", actor=LONG_ACTOR)
    )
    events.emit(events.Conflict(name="nightly-report", fence=9, owner=command, policy="exit"))
    events.emit(
        events.Conflict(name="mail:1", fence=4, owner=task, policy="retry", actor=LONG_ACTOR)
    )
    events.emit(events.Duplicate(name="sync:9", fence=5, owner=task, actor=LONG_ACTOR))
    events.emit(
        events.Lost(
            name="rates", fence=2, owner=task, reason=events.LostReason.DEADLINE, actor=LONG_ACTOR
        )
    )
    assert audit.flush(timeout=10)


def _cell(page: Any, name: str, column: str) -> str:
    row = page.locator(
        "#result_list tbody tr", has=page.locator(f'td.field-name:text-is("{name}")')
    )
    assert row.count() == 1, (name, row.count())
    return str(row.locator(f"td.field-{column}").inner_text())


@pytest.mark.django_db(transaction=True)
def test_lock_events_page_in_chromium(live_server: object, settings: Any) -> None:
    """The Lock events page at 1400 px: its own title, each conflict's policy and outcome,
    repeats as one counted row, a filter by policy, and the actor column whole."""
    from playwright.sync_api import sync_playwright

    settings.TASK_LOCKS = {"BACKEND": "memory://events-page", "AUDIT": True}
    User.objects.create_superuser("admin", "admin@example.com", "secret-pw")
    _record_policies()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shots = {n: ARTIFACTS / f"{n}.png" for n in ("events-grouped", "events-by-policy")}
    for shot in shots.values():
        shot.unlink(missing_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        try:
            page = _logged_in(browser, str(live_server), "/admin/task_locks/lockevent/")
            page.wait_for_selector("#result_list")
            page.screenshot(path=str(shots["events-grouped"]), full_page=True)  # kept on failure
            assert page.locator("#content h1").first.inner_text() == "Lock events"
            assert page.title().startswith("Lock events"), page.title()
            assert "Select lock event" not in page.content()
            # One row per (lock, holder, policy): the five skips are one row counted 5.
            assert page.locator('#result_list td.field-name:text-is("sync:42")').count() == 1
            assert re.fullmatch(r"5\nlast \d\d:\d\d:\d\d", _cell(page, "sync:42", "repeats")), (
                _cell(page, "sync:42", "repeats")
            )
            assert _cell(page, "sync:42", "outcome") == "skip: skipped"
            assert _cell(page, "search-index", "outcome") == "wait: gave up waiting"
            assert _cell(page, "nightly-report", "outcome") == "exit: exited with status 75"
            assert _cell(page, "mail:1", "outcome") == "retry: retried later"
            assert _cell(page, "sync:9", "outcome") == "enqueue: not queued"
            assert _cell(page, "rates", "outcome") == "-"
            # The actor is whole: every word of it on the page, nothing cut at the cell edge.
            actors = page.locator("#result_list td.field-actor")
            assert LONG_ACTOR in [a.replace("\n", " ") for a in actors.all_inner_texts()]
            clipped = actors.evaluate_all(
                "cells => cells.filter(c => c.scrollWidth > c.clientWidth).length"
            )
            assert clipped == 0
            _assert_fits(page)
            page.screenshot(path=str(shots["events-grouped"]), full_page=True)

            # Filter by policy: only that policy's conflicts.
            link = page.locator("#changelist-filter a", has_text="exit").first
            page.goto(f"{live_server}/admin/task_locks/lockevent/{link.get_attribute('href')}")
            names = page.locator("#result_list td.field-name").all_inner_texts()
            assert names == ["nightly-report"], names
            _assert_fits(page)
            page.screenshot(path=str(shots["events-by-policy"]), full_page=True)
        finally:
            browser.close()
    for shot in shots.values():
        assert shot.stat().st_size > 10_000, shot


EXAMPLE = Path(__file__).resolve().parents[2] / "example_project"
#: Job runs' times: to the millisecond (runs last fractions of a second), with the zone.
RUN_TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} [A-Z]{3}"
#: Makes the example's admin user and three runs of the demo's jobs, one still running.
JOB_RUNS = """
import time
from django.contrib.auth.models import User
from shop.models import JobRun
User.objects.create_superuser("admin", "admin@example.com", "admin")
now = time.time()
JobRun.objects.create(job="sync_account", key="sync:1", started=now - 3.5, ended=now - 2.25,
                      pid=4242, fence=1796174844421034)
JobRun.objects.create(job="send_invoice_mail", key="mail:17", started=now - 2.0,
                      ended=now - 1.8, pid=4243, fence=1796174844421881, retries=3)
JobRun.objects.create(job="nightly_report", key="nightly-report", started=now - 1.0, pid=4244)
"""


@pytest.fixture
def example_site(tmp_path: Path) -> Iterator[str]:
    """The example project served by ``manage.py runserver`` on its embedded defaults, in a
    private folder (``DEMO_VAR_DIR``), with an admin and a few job runs."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TASK_LOCKS_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)  # pytest-django's; the example has its own
    env.update(DEMO_VAR_DIR=str(tmp_path / "var"), PYTHONUNBUFFERED="1")

    def manage(*args: str) -> None:
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=EXAMPLE,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr

    manage("migrate", "--verbosity", "0")
    manage("shell", "--command", JOB_RUNS)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"],
        cwd=EXAMPLE,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def answers() -> bool:
        assert server.poll() is None, server.communicate()[1]
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            return False

    try:
        wait_until(answers, 60, "the example site to answer", interval=0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate()


def test_example_project_job_runs_in_chromium(example_site: str) -> None:
    """The example's Job runs: readable times (not epoch seconds) and a table that fits."""
    from playwright.sync_api import sync_playwright

    shot = ARTIFACTS / "jobruns.png"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot.unlink(missing_ok=True)
    started = time.monotonic()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{example_site}/admin/login/?next=/admin/shop/jobrun/")
            page.fill("#id_username", "admin")
            page.fill("#id_password", "admin")
            page.click("input[type=submit]")
            page.wait_for_selector("#result_list")
            assert page.locator("#result_list tbody tr").count() == 3
            started_at = page.locator("#result_list .field-started_at").all_inner_texts()
            assert all(re.fullmatch(RUN_TIME, t) for t in started_at), started_at
            took = page.locator("#result_list td.field-took").all_inner_texts()
            assert took == ["running", "0.2s", "1.2s"], took  # newest first
            assert not re.search(r"\d{10}\.\d", page.inner_text("#result_list")), "epoch seconds"
            page.screenshot(path=str(shot), full_page=True)  # kept when a check below fails
            _assert_fits(page)
            _one_line_each(page, "#result_list .field-started_at span")
        finally:
            browser.close()
    assert time.monotonic() - started < 120
    assert shot.stat().st_size > 10_000, shot
