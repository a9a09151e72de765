"""The admin's lock pages in a real headless Chromium (acceptance 4; issue 14's admin).

Debian's ``chromium`` (installed by ``scripts/install-servers.sh``) driven by Playwright's
Python package (the ``test`` extra); Playwright never downloads a browser of its own.
Screenshots are saved to ``tests/artifacts/*.png`` for a person to look at:
``holders.png`` (every table), ``holders-paused.png`` (auto-refresh paused, a lock taken
meanwhile not shown yet), ``holders-filtered.png`` (filters by kind and host) and
``events.png`` (the Lock events page).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User

from django_app import audit
from task_locks import Election, Lock, Semaphore, owner_context
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


def _rows(page: Any, table: str) -> int:
    return int(page.locator(f"#{table} tbody tr").count())


def _count(page: Any, what: str) -> int:
    return int(page.locator(f'.lock-footer [data-count="{what}"]').inner_text())


@pytest.mark.django_db(transaction=True)
def test_admin_pages_in_chromium(live_server: object, held: dict[str, Any], shop_url: str) -> None:
    from playwright.sync_api import sync_playwright

    # All ORM work happens before Playwright starts: its sync API runs an event loop in
    # this thread, where Django refuses synchronous database calls.
    User.objects.create_superuser("admin", "admin@example.com", "secret-pw")
    report = held["report"]
    audit.record("forced", "sync:7", fence=3, owner=current_owner(), actor="ops (admin)", sync=True)
    audit.record("renewal_failed", "sync:8", owner=current_owner(), sync=True)
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
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{base}/admin/login/?next=/admin/")
            page.fill("#id_username", "admin")
            page.fill("#id_password", "secret-pw")
            page.click("input[type=submit]")
            page.wait_for_selector("#content-main")
            page.click("text=Lock holders")
            page.wait_for_selector("#result_list")
            assert page.locator("h1").first.inner_text() == "Lock holders"

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
            page.screenshot(path=str(shots["holders"]), full_page=True)

            # Auto-refresh: on by default; a lock taken now shows up without a reload.
            page.goto(f"{base}/admin/task_locks/lockholder/?refresh=1")
            assert page.locator("#lock-autorefresh-status").inner_text() == (
                "auto-refresh every 1 s"
            )
            with owner_context(command="manage.py late"):
                held["stack"].enter_context(Lock("late-arrival", ttl=30, backend=shop_url))
            page.wait_for_selector('#result_list tr[data-lock="late-arrival"]', timeout=15_000)
            assert _count(page, "locks") == 3

            # Paused: nothing changes under the operator's eyes until resumed.
            page.click("#lock-autorefresh")
            assert page.locator("#lock-autorefresh-status").inner_text() == "auto-refresh paused"
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
            assert page.locator("#lock-autorefresh-status").inner_text() == "auto-refresh paused"
            page.click("#lock-autorefresh")
            assert page.locator("#lock-autorefresh-status").inner_text() == "auto-refresh every 1 s"

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
            kinds = page.locator("#result_list td.field-kind").all_inner_texts()
            assert "forced" in kinds and "renewal_failed" in kinds, kinds
            assert "force-released" not in page.content()
            times = page.locator("#result_list th.field-when, #result_list td.field-when")
            assert all(re.fullmatch(TIME, t) for t in times.all_inner_texts()), times
            assert times.count() >= 2
            page.screenshot(path=str(shots["events"]), full_page=True)
        finally:
            browser.close()
    for shot in shots.values():
        assert shot.stat().st_size > 10_000, shot
