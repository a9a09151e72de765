"""The holders page in a real headless Chromium (acceptance 4).

Debian's ``chromium`` (installed by ``scripts/install-servers.sh``) driven by Playwright's
Python package (the ``test`` extra); Playwright never downloads a browser of its own.
The screenshot is saved to ``tests/artifacts/holders.png`` for a person to look at.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.contrib.auth.models import User

from task_locks import Lease, Lock, owner_context

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

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason="Debian chromium is not installed (make servers)"
)


@pytest.fixture
def held(redis_settings: str) -> Iterator[Lease]:
    with owner_context(command="manage.py nightly_report"):
        lease = Lock("nightly-report", ttl=30, backend=redis_settings).acquire()
    yield lease
    lease.release()


@pytest.mark.django_db(transaction=True)
def test_holders_page_in_chromium(live_server: object, held: Lease) -> None:
    from playwright.sync_api import sync_playwright

    # All ORM work happens before Playwright starts: its sync API runs an event loop in
    # this thread, where Django refuses synchronous database calls.
    User.objects.create_superuser("admin", "admin@example.com", "secret-pw")
    base = str(live_server)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "holders.png"
    shot.unlink(missing_ok=True)

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 700})
            page.goto(f"{base}/admin/login/?next=/admin/")
            page.fill("#id_username", "admin")
            page.fill("#id_password", "secret-pw")
            page.click("input[type=submit]")
            page.wait_for_selector("#content-main")
            page.click("text=Lock holders")
            page.wait_for_selector("#result_list")
            row = page.locator('#result_list tr[data-lock="nightly-report"]')
            assert row.count() == 1, "the held lock is listed"
            cells = row.locator("td").all_inner_texts()
            assert str(held.fence) in cells
            assert "manage.py nightly_report" in cells
            assert page.locator("h1").first.inner_text() == "Lock holders"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
