"""``list`` / ``show`` / ``release`` group elections and semaphores.

In-process against memory:// and the test Redis: the operator verbs of
:mod:`task_locks.verbs` (shared by ``task-locks`` and ``manage.py locks``) and the listing
they print (:mod:`task_locks.listing`, also the admin's) on a real election, a real
semaphore and a plain lock. The subprocess CLI, ``manage.py locks`` and
the admin page are covered in ``tests/django/test_coordination_views.py``.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from task_locks import Election, Lease, Lock, NotOwned, Semaphore, get_backend, owner_context
from task_locks.election import Leadership
from task_locks.listing import group_holders
from task_locks.semaphore import Permit
from task_locks.verbs import EX_OK, cmd_list, cmd_release, cmd_show


@dataclass
class Held:
    election: str
    leadership: Leadership
    semaphore: str
    permits: list[Permit]
    lock: Lease


@pytest.fixture
def held(local_url: str) -> Iterator[Held]:
    """A plain lock, an election led by ``candidate-a``, and 2 of 3 permits taken."""
    suffix = uuid.uuid4().hex[:6]
    with owner_context(command="nightly report"):
        lock = Lock(f"report:{suffix}", ttl=30, backend=local_url).acquire()
    leadership = Election(
        f"beat-{suffix}", ttl=30, backend=local_url, identity="candidate-a"
    ).campaign(timeout=1)
    semaphore = Semaphore(f"exports-{suffix}", limit=3, ttl=30, backend=local_url)
    permits = [semaphore.acquire(timeout=1) for _ in range(2)]
    yield Held(f"beat-{suffix}", leadership, f"exports-{suffix}", permits, lock)
    leadership.resign()
    for lease in [*permits, lock]:
        if lease.held:
            try:
                lease.release()
            except NotOwned:
                pass  # force-released by the test


def run_list(url: str, *, as_json: bool = False, prefix: str = "") -> str:
    out = io.StringIO()
    assert cmd_list(get_backend(url), prefix, as_json, out) == EX_OK
    return out.getvalue()


def test_group_holders_sorts_locks_elections_and_semaphores(local_url: str, held: Held) -> None:
    listing = group_holders(get_backend(local_url).holders())
    assert [h.name for h in listing.locks] == [held.lock.name]
    [(leader, election_lock)] = listing.elections
    assert (leader.election, leader.identity, leader.term) == (
        held.election,
        "candidate-a",
        held.leadership.term,
    )
    assert election_lock.name == f"election:{held.election}"
    [sem] = listing.semaphores
    assert (sem.name, sem.summary) == (held.semaphore, "2 / 3")
    assert [h.name for h in sem.holders] == sorted(p.name for p in held.permits)
    assert listing.count == 4


def test_list_text_shows_leader_term_and_holders_over_limit(local_url: str, held: Held) -> None:
    tables = run_list(local_url).rstrip("\n").split("\n\n")
    assert len(tables) == 3, tables
    plain, elections, semaphores = (t.splitlines() for t in tables)

    assert plain[0].split() == ["NAME", "HOLDER", "FENCE", "HELD", "FOR", "EXPIRES", "IN"]
    assert plain[1].startswith(held.lock.name) and "command 'nightly report'" in plain[1]

    assert elections[0].split()[:4] == ["ELECTION", "LEADER", "TERM", "SINCE"]
    cells = elections[1].split()
    assert cells[:3] == [held.election, "candidate-a", str(held.leadership.term)]
    assert cells[3].endswith("Z") and cells[-1] == f"election:{held.election}"

    assert semaphores[0].split()[:5] == ["SEMAPHORE", "HOLDERS", "/", "LIMIT", "PERMIT"]
    first, second = semaphores[1:]
    assert first.split()[:4] == [held.semaphore, "2", "/", "3"]
    permit_names = sorted(p.name for p in held.permits)
    assert first.split()[4] == permit_names[0]
    assert second.split()[0] == permit_names[1], "a permit row under its semaphore"


def test_list_json_groups_permits_under_their_semaphore(local_url: str, held: Held) -> None:
    entries = json.loads(run_list(local_url, as_json=True))
    assert [e["kind"] for e in entries] == ["lock", "election", "semaphore"]
    plain, election, semaphore = entries
    assert plain["name"] == held.lock.name and plain["fence"] == held.lock.fence

    assert election["name"] == f"election:{held.election}"
    assert (election["election"], election["leader"], election["term"]) == (
        held.election,
        "candidate-a",
        held.leadership.term,
    )
    assert election["since"] == pytest.approx(held.leadership.since, abs=1.0)
    assert election["expires_in"] > 0

    assert (semaphore["semaphore"], semaphore["limit"], semaphore["held"]) == (
        held.semaphore,
        3,
        2,
    )
    assert semaphore["summary"] == "2 / 3"
    by_slot = {p["slot"]: p for p in semaphore["holders"]}
    assert by_slot.keys() == {p.slot for p in held.permits}
    for permit in held.permits:
        assert by_slot[permit.slot]["name"] == permit.name
        assert by_slot[permit.slot]["fence"] == permit.fence
    assert "token" not in json.dumps(entries)

    only = json.loads(run_list(local_url, as_json=True, prefix="semaphore:"))
    assert [e["semaphore"] for e in only] == [held.semaphore]


def test_show_names_the_role(local_url: str, held: Held) -> None:
    backend = get_backend(local_url)
    out = io.StringIO()
    assert cmd_show(backend, f"election:{held.election}", False, out, io.StringIO()) == EX_OK
    assert f"the leadership of election '{held.election}' (candidate-a, term " in out.getvalue()

    permit = held.permits[0]
    out = io.StringIO()
    assert cmd_show(backend, permit.name, True, out, io.StringIO()) == EX_OK
    shown = json.loads(out.getvalue())
    assert (shown["semaphore"], shown["slot"], shown["limit"]) == (held.semaphore, permit.slot, 3)


def test_force_release_frees_one_permit_or_one_term(local_url: str, held: Held) -> None:
    backend = get_backend(local_url)
    gone, kept = held.permits
    questions: list[str] = []

    def confirm(question: str) -> bool:
        questions.append(question)
        return True

    out, err = io.StringIO(), io.StringIO()
    status = cmd_release(
        backend, gone.name, force=True, yes=False, out=out, err=err, confirm=confirm
    )
    assert status == EX_OK, err.getvalue()
    assert f"permit #{gone.slot} of semaphore '{held.semaphore}' (limit 3)" in questions[0]
    [sem] = group_holders(backend.holders()).semaphores
    assert sem.summary == "1 / 3" and [h.name for h in sem.holders] == [kept.name]
    with pytest.raises(NotOwned):  # the permit's holder is told when it next talks
        gone.release()

    election_lock = f"election:{held.election}"
    status = cmd_release(
        backend, election_lock, force=True, yes=True, out=io.StringIO(), err=io.StringIO()
    )
    assert status == EX_OK
    assert group_holders(backend.holders()).elections == []
    assert held.leadership.resign() is False, "the deposed leader's resignation is refused"
    successor = Election(held.election, ttl=30, backend=local_url, identity="candidate-b")
    leadership = successor.try_campaign()
    assert leadership is not None and leadership.term > held.leadership.term
    leadership.resign()


def test_the_listing_is_not_the_cli() -> None:
    """The admin reads holders through :mod:`task_locks.listing`, which needs none of the
    CLI: no verbs, no parser; and the verbs do not offer the listing's names a second time
    (one module to import each from)."""
    probe = (
        "import sys, task_locks.listing as listing\n"
        "assert 'task_locks.verbs' not in sys.modules, 'listing imports the CLI verbs'\n"
        "assert 'argparse' not in sys.modules, 'listing imports a parser'\n"
        "import task_locks.verbs as verbs\n"
        "again = [n for n in verbs.__all__ if n in listing.__all__]\n"
        "assert again == [], again\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, timeout=60)
