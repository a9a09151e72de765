"""The admin's words are translatable, as Django's and django-celery-beat's.

Names and labels are ``gettext_lazy``, messages ``gettext``, counts plural-aware
(``{% blocktranslate count %}``): checked by rendering the pages in English (1 lock, 2
locks) and in a test language whose catalog this file compiles, where each count must pick
its own plural form. No ``.po`` ships with the app; the test catalog stands in for one.
"""

from __future__ import annotations

import array
import re
import struct
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from django.apps import apps
from django.contrib import admin
from django.test import Client
from django.utils.functional import Promise
from django_helpers import staff

from django_app import audit
from django_app.models import LockEvent, LockHolder
from task_locks import Election, Lock
from task_locks.events import Forced

HOLDERS = "/admin/task_locks/lockholder/"
FORCE = "/admin/task_locks/lockholder/force-release/"
EVENTS = "/admin/task_locks/lockevent/"

#: The test language's words (French: one is singular, two is plural, as ``n > 1``).
#: A key with a NUL is a plural entry: ``singular\0plural`` -> ``form 0\0form 1``.
CATALOG = {
    "": "Content-Type: text/plain; charset=UTF-8\nPlural-Forms: nplurals=2; plural=(n > 1);\n",
    "Task locks": "Verrous de tâches",
    "Lock holders": "Détenteurs de verrous",
    "lock holder": "détenteur de verrou",
    "lock holders": "détenteurs de verrous",
    "lock event": "événement de verrou",
    "lock events": "événements de verrou",
    "time": "heure",
    "kind": "genre",
    "Force release": "Forcer la libération",
    "Elections": "Élections",
    "pause auto-refresh": "suspendre la mise à jour",
    "Lock “%(name)s” is not held.": "Le verrou « %(name)s » est libre.",
    '<span data-count="locks">%(counter)s</span> lock\0'
    '<span data-count="locks">%(counter)s</span> locks': (
        '<span data-count="locks">%(counter)s</span> verrou\0'
        '<span data-count="locks">%(counter)s</span> verrous'
    ),
    '<span data-count="elections">%(counter)s</span> election\0'
    '<span data-count="elections">%(counter)s</span> elections': (
        '<span data-count="elections">%(counter)s</span> élection\0'
        '<span data-count="elections">%(counter)s</span> élections'
    ),
    '<span data-count="permits">%(counter)s</span> semaphore permit\0'
    '<span data-count="permits">%(counter)s</span> semaphore permits': (
        '<span data-count="permits">%(counter)s</span> jeton de sémaphore\0'
        '<span data-count="permits">%(counter)s</span> jetons de sémaphore'
    ),
}


def write_mo(path: Path, messages: dict[str, str]) -> None:
    """A GNU ``.mo`` catalog (the layout of CPython's ``Tools/i18n/msgfmt.py``)."""
    keys = sorted(k.encode() for k in messages)
    values = {k.encode(): v.encode() for k, v in messages.items()}
    ids = strs = b""
    entries = []
    for key in keys:
        entries.append((len(ids), len(key), len(strs), len(values[key])))
        ids += key + b"\0"
        strs += values[key] + b"\0"
    keystart = 7 * 4 + 16 * len(keys)
    valuestart = keystart + len(ids)
    koffsets: list[int] = []
    voffsets: list[int] = []
    for o1, l1, o2, l2 in entries:
        koffsets += [l1, o1 + keystart]
        voffsets += [l2, o2 + valuestart]
    header = struct.pack("Iiiiiii", 0x950412DE, 0, len(keys), 7 * 4, 7 * 4 + len(keys) * 8, 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + array.array("i", koffsets + voffsets).tobytes() + ids + strs)


@pytest.fixture
def french(tmp_path: Path, settings: Any) -> Iterator[None]:
    """The site speaks the test language (Django drops its cached catalogs on the change)."""
    write_mo(tmp_path / "locale" / "fr" / "LC_MESSAGES" / "django.mo", CATALOG)
    settings.LOCALE_PATHS = [str(tmp_path / "locale")]
    settings.LANGUAGE_CODE = "fr"
    yield


def footer(html: str) -> str:
    found = re.search(r'<span class="lock-counts">(.*?)</span> ·', html, re.S)
    assert found, html
    return re.sub(r"<[^>]+>", "", found.group(1))


def hold(backend: str, stack: ExitStack, *names: str) -> None:
    for name in names:
        stack.enter_context(Lock(name, ttl=30, backend=backend))


def test_names_and_labels_are_lazy() -> None:
    """Marked for translation and resolved per request, not frozen at import."""
    assert isinstance(apps.get_app_config("task_locks").verbose_name, Promise)
    for model in (LockHolder, LockEvent):
        assert isinstance(model._meta.verbose_name, Promise), model
        assert isinstance(model._meta.verbose_name_plural, Promise), model
    for field in ("created_at", "kind", "name", "fence", "owner", "actor", "detail"):
        assert isinstance(LockEvent._meta.get_field(field).verbose_name, Promise), field
    events = admin.site._registry[LockEvent]
    for column in ("when", "holder"):
        assert isinstance(getattr(events, column).short_description, Promise), column


@pytest.mark.django_db(transaction=True)
def test_counts_say_one_lock_and_two_locks(client: Client, redis_settings: str) -> None:
    client.force_login(staff("en", "view_lockholder"))
    prefix = f"i18n-{uuid.uuid4().hex[:8]}:"
    with ExitStack() as stack:
        hold(redis_settings, stack, f"{prefix}a")
        one = footer(client.get(HOLDERS, {"q": prefix}).text)
        hold(redis_settings, stack, f"{prefix}b")
        two = footer(client.get(HOLDERS, {"q": prefix}).text)
    assert one.startswith("1 lock · 0 elections · 0 semaphore permits"), one
    assert two.startswith("2 locks · 0 elections"), two


@pytest.mark.django_db(transaction=True)
def test_a_catalog_translates_the_pages_with_plural_forms(
    client: Client, redis_settings: str, french: None
) -> None:
    client.force_login(staff("fr", "view_lockholder", "force_release_lock", "view_lockevent"))
    prefix = f"i18n-{uuid.uuid4().hex[:8]}:"
    with ExitStack() as stack:
        hold(redis_settings, stack, f"{prefix}a")
        election = Election(f"{prefix}e", ttl=30, backend=redis_settings, identity="beat@web-1")
        stack.enter_context(election.campaign())
        one = client.get(HOLDERS, {"q": ""}).text
        hold(redis_settings, stack, f"{prefix}b")
        two = client.get(HOLDERS).text

    assert "Détenteurs de verrous" in one  # the page's title (gettext)
    assert "Verrous de tâches" in one  # the app's verbose name (lazy), in the breadcrumbs
    assert "Forcer la libération" in one and "Élections" in one
    assert "suspendre la mise à jour" in one  # the auto-refresh button
    # French says 0 and 1 in the singular, 2 in the plural: each count took its own form.
    assert footer(one).startswith("1 verrou · 1 élection · 0 jeton de sémaphore"), footer(one)
    assert footer(two).startswith("2 verrous · 1 élection"), footer(two)

    gone = client.get(FORCE, {"name": f"{prefix}nobody"}, follow=True).text
    assert f"Le verrou « {prefix}nobody » est libre." in gone  # a message

    audit.record(Forced(name=f"{prefix}a"), sync=True)
    events = client.get(EVENTS).text
    assert "événements de verrou" in events.lower()  # the model's lazy plural name
    header = events[events.index("column-when") :]
    assert re.match(r'[^<]*>.*?<div class="text"><a [^>]*>Heure</a>', header, re.S), (
        "the time column's lazy label"
    )
    assert "forced" in events, "kinds stay named as in the AUDIT setting"
