"""``django_app.fencing`` on every configured database (SQLite, PostgreSQL, MySQL/MariaDB).

The test model is built here, under an app label that is not installed, and its table
is created and dropped by this module: no migration of anyone's app is involved, and
``makemigrations --check`` elsewhere never sees it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from django.apps import apps
from django.conf import settings
from django.db import connections, models, transaction

from django_app.fencing import FencedModel, advance_fence, fenced
from django_app.models import ResourceFence
from task_locks import InvalidArgument, Lock, StaleFence

ALIASES = [alias for alias in ("default", "pg", "mysql") if alias in settings.DATABASES]
LABEL = "task_locks_fencing_tests"


def _per_alias(transactional: bool = False) -> list:
    return [
        pytest.param(a, marks=pytest.mark.django_db(databases=[a], transaction=transactional))
        for a in ALIASES
    ]


@pytest.fixture(scope="module")
def invoice_model(django_db_setup, django_db_blocker) -> Iterator[type[FencedModel]]:
    class Invoice(FencedModel):
        number = models.CharField(max_length=32)
        total = models.IntegerField(default=0)
        note = models.CharField(max_length=64, default="")

        class Meta:
            app_label = LABEL
            db_table = "task_locks_fencing_test_invoice"

    with django_db_blocker.unblock():
        for alias in ALIASES:
            with connections[alias].schema_editor() as editor:
                editor.create_model(Invoice)
    yield Invoice
    with django_db_blocker.unblock():
        for alias in ALIASES:
            with connections[alias].schema_editor() as editor:
                editor.delete_model(Invoice)
    del apps.all_models[LABEL]
    apps.clear_cache()


@pytest.fixture
def Invoice(invoice_model: type[FencedModel], request) -> Iterator[type[FencedModel]]:
    yield invoice_model
    alias = getattr(request.node, "callspec", None) and request.node.callspec.params.get("alias")
    if alias:  # transactional tests commit: leave nothing behind
        invoice_model.objects.using(alias).all().delete()


def _mark(alias: str, resource: str) -> int | None:
    row = ResourceFence.objects.using(alias).filter(resource=resource).first()
    return None if row is None else row.fence


# -- fenced(resource, fence) ------------------------------------------------------------


@pytest.mark.parametrize("alias", _per_alias())
def test_fenced_advances_the_mark_and_refuses_an_older_fence(alias: str, Invoice) -> None:
    invoice = Invoice.objects.using(alias).create(number="7")
    with transaction.atomic(using=alias), fenced("invoice:7", 33, using=alias):
        Invoice.objects.using(alias).filter(pk=invoice.pk).update(total=100)
    with transaction.atomic(using=alias), fenced("invoice:7", 33, using=alias):
        Invoice.objects.using(alias).filter(pk=invoice.pk).update(note="same holder again")
    with transaction.atomic(using=alias), fenced("invoice:7", 34, using=alias):
        Invoice.objects.using(alias).filter(pk=invoice.pk).update(total=200)
    assert _mark(alias, "invoice:7") == 34

    with pytest.raises(StaleFence) as refused:
        with transaction.atomic(using=alias), fenced("invoice:7", 33, using=alias):
            Invoice.objects.using(alias).filter(pk=invoice.pk).update(total=-1)
    assert (refused.value.resource, refused.value.fence, refused.value.current) == (
        "invoice:7",
        33,
        34,
    )
    assert "invoice:7" in str(refused.value)
    assert Invoice.objects.using(alias).get(pk=invoice.pk).total == 200
    assert _mark(alias, "invoice:7") == 34


@pytest.mark.parametrize("alias", _per_alias())
def test_a_failing_block_rolls_back_its_writes_and_the_mark(alias: str, Invoice) -> None:
    invoice = Invoice.objects.using(alias).create(number="8")
    with pytest.raises(RuntimeError):
        with transaction.atomic(using=alias), fenced("invoice:8", 50, using=alias):
            Invoice.objects.using(alias).filter(pk=invoice.pk).update(total=5)
            raise RuntimeError("the job failed half-way")
    assert Invoice.objects.using(alias).get(pk=invoice.pk).total == 0
    assert _mark(alias, "invoice:8") is None
    with fenced("invoice:8", 49, using=alias):  # opens its own transaction when needed
        Invoice.objects.using(alias).filter(pk=invoice.pk).update(total=9)
    assert _mark(alias, "invoice:8") == 49


@pytest.mark.parametrize("alias", _per_alias())
def test_a_refusal_inside_an_outer_transaction_leaves_it_usable(alias: str, Invoice) -> None:
    with transaction.atomic(using=alias):
        advance_fence("r", 10, using=alias)
        with pytest.raises(StaleFence):
            with fenced("r", 9, using=alias):
                pass
        Invoice.objects.using(alias).create(number="after the refusal")
    assert Invoice.objects.using(alias).filter(number="after the refusal").exists()


@pytest.mark.parametrize("alias", _per_alias())
def test_fences_beyond_32_bits_and_leases_are_accepted(alias: str, Invoice, redis_url) -> None:
    big = 1_790_000_000_000_000  # Redis fences are server microseconds
    with fenced("r", big, using=alias):
        pass
    with pytest.raises(StaleFence):
        with fenced("r", big - 1, using=alias):
            pass
    with Lock("r", ttl=5, backend=redis_url) as lease:
        with fenced("r", lease, using=alias):  # a lease's fence is the server's clock
            pass
    assert _mark(alias, "r") == lease.fence


@pytest.mark.parametrize(
    ("resource", "fence", "message"),
    [("", 1, "resource"), ("x" * 256, 1, "255"), ("r", -1, "fence"), ("r", "3", "fence")],
)
@pytest.mark.django_db
def test_bad_input_is_refused(resource, fence, message) -> None:
    with pytest.raises(InvalidArgument, match=message):
        with fenced(resource, fence):
            pass


# -- FencedModel: save(fence=...) and update(..., fence=...) ----------------------------


@pytest.mark.parametrize("alias", _per_alias())
def test_save_with_a_fence_refuses_a_stale_holder_in_the_update_itself(alias: str, Invoice) -> None:
    first = Invoice(number="9", total=1)
    first.save(using=alias, fence=33)
    first.total = 2
    first.save(using=alias, fence=33)
    newer = Invoice.objects.using(alias).get(pk=first.pk)
    newer.total = 3
    newer.save(using=alias, fence=34)

    first.total = 99  # client 1 wakes up with its old fence
    with pytest.raises(StaleFence) as refused:
        first.save(using=alias, fence=33)
    assert refused.value.resource == f"{LABEL}.invoice:{first.pk}"
    assert (refused.value.fence, refused.value.current) == (33, 34)
    assert first.fence == 33  # the instance keeps saying what it last wrote with
    row = Invoice.objects.using(alias).get(pk=first.pk)
    assert (row.total, row.fence) == (3, 34)


@pytest.mark.parametrize("alias", _per_alias())
def test_a_plain_save_never_lowers_the_rows_fence(alias: str, Invoice) -> None:
    stale = Invoice(number="10")
    stale.save(using=alias, fence=5)
    Invoice.objects.using(alias).filter(pk=stale.pk).update(total=1, fence=6)
    stale.note = "edited in the admin"
    stale.save(using=alias)  # unfenced: writes the data, leaves the fence alone
    row = Invoice.objects.using(alias).get(pk=stale.pk)
    assert (row.note, row.fence) == ("edited in the admin", 6)
    stale.save(using=alias, update_fields=["note"], fence=6)
    with pytest.raises(StaleFence):
        stale.save(using=alias, update_fields=["note"], fence=5)


@pytest.mark.parametrize("alias", _per_alias())
def test_queryset_update_with_a_fence_is_all_or_nothing(alias: str, Invoice) -> None:
    objects = Invoice.objects.using(alias)
    a = objects.create(number="a", fence=10)
    b = objects.create(number="b", fence=20)
    assert objects.filter(pk=a.pk).update(total=1, fence=15) == 1
    assert objects.get(pk=a.pk).fence == 15

    with pytest.raises(StaleFence) as refused:
        objects.filter(pk__in=[a.pk, b.pk]).update(total=7, fence=16)
    assert refused.value.resource == f"{LABEL}.invoice:{b.pk}"
    assert (refused.value.fence, refused.value.current) == (16, 20)
    assert [(r.total, r.fence) for r in objects.order_by("number")] == [(1, 15), (0, 20)]

    assert objects.filter(pk__in=[a.pk, b.pk]).update(total=8, fence=20) == 2
    assert objects.filter(number="nothing").update(total=1, fence=1) == 0


# -- concurrency and the Kleppmann scenario, committed for real -------------------------


@pytest.mark.parametrize("alias", _per_alias(transactional=True))
def test_an_older_holder_waits_for_the_newer_ones_transaction_then_is_refused(
    alias: str, Invoice
) -> None:
    invoice = Invoice.objects.using(alias).create(number="11")
    newer_inside = threading.Event()
    finish_newer = threading.Event()
    outcome: list[object] = []

    def newer() -> None:
        try:
            with transaction.atomic(using=alias), fenced("invoice:11", 34, using=alias):
                newer_inside.set()
                assert finish_newer.wait(10)
                Invoice.objects.using(alias).filter(pk=invoice.pk).update(total=34)
        finally:
            connections[alias].close()

    def older() -> None:
        try:
            with transaction.atomic(using=alias), fenced("invoice:11", 33, using=alias):
                Invoice.objects.using(alias).filter(pk=invoice.pk).update(total=33)
            outcome.append("written")
        except StaleFence as exc:
            outcome.append(exc)
        finally:
            connections[alias].close()

    holder = threading.Thread(target=newer)
    holder.start()
    assert newer_inside.wait(10)
    late = threading.Thread(target=older)
    late.start()
    late.join(0.3)
    assert late.is_alive()  # blocked on the mark's row, not racing past it
    finish_newer.set()
    holder.join(10)
    late.join(30)
    assert isinstance(outcome[0], StaleFence) and outcome[0].current == 34
    assert Invoice.objects.using(alias).get(pk=invoice.pk).total == 34


@pytest.mark.parametrize("alias", _per_alias(transactional=True))
def test_kleppmann_paused_holder_is_refused_by_fenced(alias: str, Invoice, redis_url) -> None:
    """Client 1's pause is modelled by ``renew=False``: a frozen holder renews nothing.

    (The Redis twin of this test really SIGSTOPs a process; here the point is the
    database guard, so both clients live in this process.)
    """
    invoice = Invoice.objects.using(alias).create(number="7")
    lease_1 = Lock("invoice:7", ttl=0.3, backend=redis_url, renew=False).acquire(timeout=5)
    with transaction.atomic(using=alias), fenced("invoice:7", lease_1.fence, using=alias):
        Invoice.objects.using(alias).filter(pk=invoice.pk).update(note="client 1 began")

    # Client 1 is frozen; its TTL runs out and client 2 gets the lock and writes.
    with Lock("invoice:7", ttl=5, backend=redis_url).acquire(timeout=5) as lease_2:
        assert lease_2.fence > lease_1.fence
        with transaction.atomic(using=alias), fenced("invoice:7", lease_2, using=alias):
            Invoice.objects.using(alias).filter(pk=invoice.pk).update(note="client 2")

    # Client 1 wakes up, still "holding" in its own mind, and writes with fence 1.
    with pytest.raises(StaleFence) as refused:
        with transaction.atomic(using=alias), fenced("invoice:7", lease_1.fence, using=alias):
            Invoice.objects.using(alias).filter(pk=invoice.pk).update(note="client 1")
    assert refused.value.fence == lease_1.fence
    assert refused.value.current == lease_2.fence
    assert Invoice.objects.using(alias).get(pk=invoice.pk).note == "client 2"
    assert _mark(alias, "invoice:7") == lease_2.fence


# -- isolation levels: a stale fence is refused loudly, never "0 rows" ------------------


def _isolation_cases() -> list:
    """(alias, OPTIONS isolation_level) for every stricter-than-default level we can run."""
    # MySQL's SERIALIZABLE is left out: its plain reads take shared locks, so the newer
    # holder cannot commit under the stale one's snapshot (no stale read to guard).
    cases = []
    if "mysql" in ALIASES:
        cases += [("mysql", "repeatable read")]
    if "pg" in ALIASES:
        from psycopg import IsolationLevel

        cases += [("pg", IsolationLevel.REPEATABLE_READ), ("pg", IsolationLevel.SERIALIZABLE)]
    return [
        pytest.param(alias, level, marks=pytest.mark.django_db(databases=[alias], transaction=True))
        for alias, level in cases
    ]


@pytest.fixture
def isolation(request, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Reconnect ``alias`` with ``OPTIONS["isolation_level"] = level`` (Django's own path)."""
    alias, level = request.node.callspec.params["alias"], request.node.callspec.params["level"]
    connections[alias].close()
    options = dict(connections[alias].settings_dict.get("OPTIONS", {}), isolation_level=level)
    monkeypatch.setitem(connections[alias].settings_dict, "OPTIONS", options)
    yield
    connections[alias].close()  # the next test reconnects with the original OPTIONS


def _serialization_failure(exc: BaseException) -> bool:
    """PostgreSQL's refusal under REPEATABLE READ / SERIALIZABLE (SQLSTATE 40001)."""
    cause = exc.__cause__
    return getattr(cause, "sqlstate", None) == "40001"


@pytest.mark.parametrize(("alias", "level"), _isolation_cases())
def test_a_stale_fence_is_refused_loudly_under_stricter_isolation(
    alias: str, level: object, Invoice, isolation: None
) -> None:
    """The stale holder's transaction read (took its snapshot) before the newer holder
    committed: its fenced writes must raise StaleFence (or, on PostgreSQL, the
    database's serialization failure), and write nothing, whatever the level."""
    from django.db import OperationalError

    objects = Invoice.objects.using(alias)
    invoice = Invoice(number="12.9", total=1)
    invoice.save(using=alias, fence=33)
    with fenced("invoice:12.9", 33, using=alias):
        pass

    def newer_holder() -> None:
        try:
            with fenced("invoice:12.9", 34, using=alias):
                objects.filter(pk=invoice.pk).update(total=34, fence=34)
        finally:
            connections[alias].close()

    attempts = {
        "fenced": lambda: _fenced_write(alias, objects, invoice.pk),
        "queryset update": lambda: objects.filter(pk=invoice.pk).update(total=-1, fence=33),
        "save": lambda: _stale_save(objects, invoice.pk, alias),
    }
    for what, attempt in attempts.items():
        with pytest.raises((StaleFence, OperationalError)) as refused:
            with transaction.atomic(using=alias):
                assert objects.get(pk=invoice.pk).total in (1, 34)  # the snapshot is taken
                writer = threading.Thread(target=newer_holder)
                writer.start()
                writer.join(30)
                assert not writer.is_alive()
                result = attempt()
                pytest.fail(f"{what}: a stale fence wrote (or matched {result!r} rows) silently")
        if isinstance(refused.value, OperationalError):
            assert connections[alias].vendor == "postgresql", f"{what}: {refused.value!r}"
            assert _serialization_failure(refused.value), f"{what}: {refused.value!r}"
        else:
            assert (refused.value.fence, refused.value.current) == (33, 34), what
        row = objects.get(pk=invoice.pk)
        assert (row.total, row.fence) == (34, 34), what
        assert _mark(alias, "invoice:12.9") == 34


def _fenced_write(alias: str, objects, pk: int) -> int:
    with fenced("invoice:12.9", 33, using=alias):
        return objects.filter(pk=pk).update(total=-1)


def _stale_save(objects, pk: int, alias: str) -> None:
    stale = objects.get(pk=pk)
    stale.total = -1
    stale.save(using=alias, fence=33)
