"""Elections and semaphores in ``task-locks list``, ``manage.py locks list`` and the admin.

A real :class:`~task_locks.Election` (leader ``candidate-a``) and a real
:class:`~task_locks.Semaphore` (limit 3, 2 permits held) on the test Redis. The listings
show the leader, term and since of the election and "2 / 3" with each permit of the
semaphore; force release still works per permit and per election, and is audited.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import quote

import pytest
from django.core.management import call_command
from django.test import Client
from django_helpers import cli, finish, staff

from django_app.models import LockEvent
from task_locks import Election, NotOwned, Semaphore, get_backend
from task_locks.election import Leadership
from task_locks.semaphore import Permit

HOLDERS = "/admin/task_locks/lockholder/"
FORCE = "/admin/task_locks/lockholder/force-release/"


@dataclass
class Coordination:
    url: str
    leadership: Leadership
    permits: list[Permit]

    @property
    def election_lock(self) -> str:
        return "election:beat"


@pytest.fixture
def coordination(redis_settings: str) -> Iterator[Coordination]:
    """``beat`` led by ``candidate-a``; ``exports`` (limit 3) with 2 permits taken."""
    leadership = Election("beat", ttl=30, backend=redis_settings, identity="candidate-a").campaign(
        timeout=5
    )
    semaphore = Semaphore("exports", limit=3, ttl=30, backend=redis_settings)
    permits = [semaphore.acquire(timeout=5) for _ in range(2)]
    yield Coordination(redis_settings, leadership, permits)
    leadership.resign()
    for permit in permits:
        if permit.held:
            try:
                permit.release()
            except NotOwned:
                pass  # force-released by the test


def test_cli_list_text_and_json(coordination: Coordination) -> None:
    status, out, err = finish(cli("list", backend_url=coordination.url))
    assert status == 0, err
    elections, semaphores = out.rstrip("\n").split("\n\n")
    header, row = elections.splitlines()
    assert header.split()[:3] == ["ELECTION", "LEADER", "TERM"]
    assert row.split()[:3] == ["beat", "candidate-a", str(coordination.leadership.term)]
    lines = semaphores.splitlines()
    assert lines[0].split()[:4] == ["SEMAPHORE", "HOLDERS", "/", "LIMIT"]
    assert lines[1].split()[:4] == ["exports", "2", "/", "3"]
    listed = [line.split()[4 if i == 0 else 0] for i, line in enumerate(lines[1:])]
    assert listed == sorted(p.name for p in coordination.permits)

    status, out, err = finish(cli("list", "--json", backend_url=coordination.url))
    assert status == 0, err
    election, semaphore = json.loads(out)
    assert (election["kind"], election["name"], election["leader"], election["term"]) == (
        "election",
        "election:beat",
        "candidate-a",
        coordination.leadership.term,
    )
    assert election["since"] is not None and election["expires_in"] > 0
    assert (semaphore["kind"], semaphore["summary"], semaphore["limit"]) == (
        "semaphore",
        "2 / 3",
        3,
    )
    assert sorted(p["slot"] for p in semaphore["holders"]) == sorted(
        p.slot for p in coordination.permits
    )


@pytest.mark.django_db(transaction=True)
def test_manage_py_list_and_release_one_permit(coordination: Coordination) -> None:
    out = io.StringIO()
    call_command("locks", "list", "--json", stdout=out)
    assert [e["kind"] for e in json.loads(out.getvalue())] == ["election", "semaphore"]

    gone, kept = coordination.permits
    out = io.StringIO()
    call_command("locks", "release", gone.name, "--force", "--yes", stdout=out)
    assert f"released '{gone.name}'" in out.getvalue()
    out = io.StringIO()
    call_command("locks", "list", "semaphore:", stdout=out)
    header, row = out.getvalue().splitlines()
    assert header.startswith("SEMAPHORE")
    assert row.split()[:5] == ["exports", "1", "/", "3", kept.name]
    with pytest.raises(NotOwned):
        gone.release()
    event = LockEvent.objects.get(kind="forced")
    assert (event.name, event.fence) == (gone.name, gone.fence)

    call_command("locks", "release", "election:beat", "--force", "--yes", stdout=io.StringIO())
    assert get_backend(coordination.url).holder("election:beat") is None
    assert coordination.leadership.resign() is False


@pytest.mark.django_db(transaction=True)
def test_admin_shows_elections_and_semaphores_and_releases_each(
    client: Client, coordination: Coordination
) -> None:
    client.force_login(staff("ops", "view_lockholder", "force_release_lock"))
    html = client.get(HOLDERS).text
    term = coordination.leadership.term
    assert 'id="election_list"' in html and 'data-election="beat"' in html
    assert '<td class="lock-leader">candidate-a</td>' in html
    assert f'<td class="lock-term">{term}</td>' in html
    assert 'id="semaphore_list"' in html and 'data-semaphore="exports"' in html
    assert "2 / 3" in html
    for permit in coordination.permits:
        assert f'data-lock="{permit.name}"' in html
        assert f"?name={quote(permit.name, safe='')}" in html, "a force release per permit"
    assert f"?name={quote('election:beat', safe='')}" in html
    assert 'id="result_list"' not in html, "no plain locks held"
    # The footer counts what each table shows: no plain lock, one election, two permits.
    assert '<span data-count="locks">0</span>' in html
    assert '<span data-count="elections">1</span>' in html
    assert '<span data-count="permits">2</span>' in html

    only = client.get(HOLDERS, {"q": "semaphore:"}).text
    assert 'data-semaphore="exports"' in only and 'data-election="beat"' not in only

    gone, kept = coordination.permits
    confirm = client.get(FORCE, {"name": gone.name}).text
    assert f"permit #{gone.slot} of semaphore &#x27;exports&#x27; (limit 3)" in confirm
    done = client.post(FORCE, {"name": gone.name, "fence": str(gone.fence)}, follow=True)
    assert f"Released lock “{gone.name}”" in done.text
    assert "1 / 3" in done.text and f'data-lock="{gone.name}"' not in done.text
    assert get_backend(coordination.url).holder(kept.name) is not None

    confirm = client.get(FORCE, {"name": "election:beat"}).text
    assert "ends that term" in confirm
    done = client.post(FORCE, {"name": "election:beat", "fence": str(term)}, follow=True)
    assert "Released lock “election:beat”" in done.text
    assert 'id="election_list"' not in done.text
    # The operator's two force releases, in order (the holders, in this same process,
    # also hear of them at once through the release notices and log their losses).
    forced = LockEvent.objects.filter(kind="forced").order_by("id")
    assert list(forced.values_list("name", flat=True)) == [gone.name, "election:beat"]
