"""Definition-time checks, lock keys, and direct calls: no worker needed.

Direct calls (``task(...)``) run ``SingletonTask.__call__`` in this process, so they take
the same real Redis lock a worker would.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from task_locks import InvalidArgument, Lease, Lock, LockHeld, Semaphore
from task_locks.celery import SingletonTask, current_lease, singleton_task
from task_locks.semaphore import Permit


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("defs", broker="memory://", backend="cache+memory://", set_as_current=False)
    yield app
    app.close()


# -- 10. bad definitions fail when the task is defined, with a clear message ------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"key": "sync:{acount_id}"},
            "names unknown argument 'acount_id'; the task takes: account_id",
        ),
        ({"key": "sync:{}"}, "positional field"),
        ({"key": "sync:{0}"}, "positional field"),
        ({"key": "sync:{account_id"}, "malformed key template"),
        ({"key": ""}, "must not be empty"),
        ({"key": 42}, "key must be a format string, a callable or None"),
        ({"on_conflict": "ignore"}, "on_conflict must be one of 'skip', 'retry', 'wait', 'raise'"),
        ({"lock_on": "publish"}, "lock_on must be one of 'run', 'enqueue', 'both'"),
        ({"ttl": 0}, "ttl must be a finite number of seconds > 0, got 0"),
        ({"ttl": -5}, "ttl must be a finite number of seconds > 0, got -5"),
        ({"ttl": "60"}, "ttl must be a number of seconds"),
        ({"max_hold": 0}, "max_hold must be a finite number of seconds > 0"),
        ({"wait_timeout": -1}, "wait_timeout"),
        ({"retry_countdown": 0}, "retry_countdown"),
        ({"limit": 0}, "limit must be a whole number of runs from 1 to 1024, got 0"),
        ({"limit": -2}, "limit must be a whole number of runs from 1 to 1024, got -2"),
        ({"limit": 2.5}, "limit must be a whole number of runs from 1 to 1024, got 2.5"),
        ({"limit": True}, "limit must be a whole number of runs from 1 to 1024, got True"),
        ({"limit": "3"}, "limit must be a whole number of runs from 1 to 1024, got '3'"),
        ({"limit": 5000}, "limit must be a whole number of runs from 1 to 1024, got 5000"),
        ({"limit": 2, "lock_on": "enqueue"}, "limit=2 needs lock_on='run', got 'enqueue'"),
        ({"limit": 3, "lock_on": "both"}, "limit=3 needs lock_on='run', got 'both'"),
        ({"lock_unavailable": "wait"}, "lock_unavailable must be one of 'fail', 'retry'"),
        ({"on_lost": "retry"}, "on_lost must be one of 'interrupt', 'fail', 'ignore', got 'retry'"),
        ({"on_lost": None}, "on_lost must be one of 'interrupt', 'fail', 'ignore', got None"),
        ({"skip_as": "skipped"}, "skip_as must be one of 'success', 'failure', got 'skipped'"),
    ],
)
def test_bad_definitions_raise_at_definition_time(
    app: Celery, options: dict[str, Any], message: str
) -> None:
    def sync_account(account_id: int) -> None: ...

    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)")):
        singleton_task(app=app, shared=False, **options)(sync_account)
    with pytest.raises(InvalidArgument, match="sync_account"):  # the message names the task
        singleton_task(**options)(sync_account)  # shared_task flavour: checked just the same


def test_base_class_checks_its_options_when_the_task_class_is_built(app: Celery) -> None:
    with pytest.raises(InvalidArgument, match="names unknown argument 'user'"):

        @app.task(base=SingletonTask, lock_key="report:{user}", lazy=False, shared=False)
        def report(account_id: int) -> None: ...

    with pytest.raises(InvalidArgument, match="on_conflict"):

        class Broken(SingletonTask):  # type: ignore[misc]
            on_conflict = "sometimes"

            def run(self, x: int) -> None: ...

    with pytest.raises(InvalidArgument, match="on_lost must be one of"):

        class Careless(SingletonTask):  # type: ignore[misc]
            on_lost = "shrug"

            def run(self, x: int) -> None: ...


def test_a_singleton_task_expects_lock_lost_beside_its_own_throws(app: Celery) -> None:
    """``LockLost`` is logged as one line (an expected error); a task's own ``throws``
    stay expected too."""
    from task_locks import LockLost

    @singleton_task(app=app, shared=False, throws=(KeyError,))
    def sync_account(account_id: int) -> None: ...

    assert set(sync_account.throws) == {KeyError, LockLost}


def test_base_must_be_a_singleton_task() -> None:
    from celery import Task

    with pytest.raises(InvalidArgument, match="SingletonTask subclass"):
        singleton_task(base=Task)


# -- keys --------------------------------------------------------------------------------------


def test_positional_keyword_and_default_calls_name_the_same_lock(app: Celery) -> None:
    @singleton_task(app=app, shared=False, key="sync:{account_id}:{full}")
    def sync(account_id: int, full: bool = False) -> None: ...

    assert sync.lock_name(7) == sync.lock_name(account_id=7) == "sync:7:False"
    assert sync.lock_name(7, full=False) == "sync:7:False"
    assert sync.lock_name(7, True) == "sync:7:True"


def test_template_fields_reach_into_arguments_and_skip_self(app: Celery) -> None:
    @singleton_task(app=app, shared=False, key="acct:{account.id}:{items[0]}", bind=True)
    def sync(self: Any, account: Any, items: list[int]) -> None: ...

    assert sync.lock_name(SimpleNamespace(id=5), [9, 8]) == "acct:5:9"


def test_callable_key_receives_the_bound_arguments(app: Celery) -> None:
    @singleton_task(
        app=app, shared=False, key=lambda account_id, region="eu": f"{region}/{account_id}"
    )
    def sync(account_id: int, region: str = "eu") -> None: ...

    assert sync.lock_name(3) == sync.lock_name(account_id=3) == "eu/3"


def test_default_key_is_the_task_name_and_a_stable_hash(app: Celery) -> None:
    @singleton_task(app=app, shared=False, name="shop.sync")
    def sync(account_id: int, tags: tuple[str, ...] = ()) -> None: ...

    canonical = json.dumps({"account_id": 1, "tags": []}, sort_keys=True, separators=(",", ":"))
    expected = "shop.sync:" + hashlib.sha1(canonical.encode()).hexdigest()
    assert sync.lock_name(1) == sync.lock_name(account_id=1, tags=()) == expected
    assert sync.lock_name(2) != expected


def test_var_keyword_fields_are_checked_when_called(app: Celery) -> None:
    @singleton_task(app=app, shared=False, key="job:{tenant}")
    def job(**options: Any) -> None: ...

    assert job.lock_name(tenant="acme") == "job:acme"
    with pytest.raises(InvalidArgument, match="cannot be rendered for this call"):
        job.lock_name(other=1)


def test_a_call_that_does_not_match_the_signature_is_a_clear_error(app: Celery) -> None:
    @singleton_task(app=app, shared=False, key="sync:{account_id}")
    def sync(account_id: int) -> None: ...

    with pytest.raises(InvalidArgument, match="does not match the task's signature"):
        sync.lock_name(1, 2)


# -- direct calls take the same lock a worker would --------------------------------------------


def test_direct_call_holds_the_key_and_exposes_the_lease(app: Celery, redis_url: str) -> None:
    seen: dict[str, Any] = {}

    @singleton_task(app=app, shared=False, key="direct:{n}", ttl=5, backend=redis_url, bind=True)
    def job(self: Any, n: int) -> int:
        lease = current_lease()
        assert lease is not None and self.lease is lease
        seen["held_elsewhere"] = Lock(lease.name, backend=redis_url).try_acquire()
        return lease.fence

    fence = job(1)
    assert fence > 0 and seen["held_elsewhere"] is None
    assert current_lease() is None
    assert Lock("direct:1", backend=redis_url).holder() is None  # released


@pytest.mark.parametrize(
    ("on_conflict", "outcome"), [("skip", "returns None"), ("raise", LockHeld)]
)
def test_direct_call_on_a_held_key(
    app: Celery, redis_url: str, on_conflict: str, outcome: Any
) -> None:
    @singleton_task(
        app=app, shared=False, key="held:{n}", ttl=5, backend=redis_url, on_conflict=on_conflict
    )
    def job(n: int) -> str:
        return "ran"

    with Lock("held:1", ttl=5, backend=redis_url):
        if outcome is LockHeld:
            with pytest.raises(LockHeld, match="held:1"):
                job(1)
        else:
            assert job(1) is None
    assert job(1) == "ran"


def test_bare_decorator_registers_a_shared_task() -> None:
    @singleton_task
    def nightly(day: str) -> str:
        return day

    assert isinstance(nightly._get_current_object(), SingletonTask)
    assert nightly.lock_name("mon").startswith(f"{nightly.name}:")
    assert nightly.on_conflict == "skip" and nightly.lock_on == "run"


# -- limit=N ---------------------------------------------------------------------------------


def test_limit_one_is_a_plain_lock_named_by_the_key(app: Celery, redis_url: str) -> None:
    seen: dict[str, Any] = {}

    @singleton_task(app=app, shared=False, key="one:{n}", ttl=5, backend=redis_url, limit=1)
    def job(n: int) -> None:
        seen["lease"] = current_lease()
        seen["holder"] = Lock("one:1", backend=redis_url).holder()

    job(1)
    assert type(seen["lease"]) is Lease and seen["lease"].name == "one:1"
    assert seen["holder"] is not None and seen["holder"].fence == seen["lease"].fence
    assert job.lock_limit == 1 and job.lock_name(1) == "one:1"


@pytest.mark.parametrize("on_conflict", ["skip", "raise"])
def test_limit_n_runs_beside_n_minus_one_holders_and_not_beside_n(
    app: Celery, redis_url: str, on_conflict: str
) -> None:
    """Direct calls take a permit of the semaphore named by the key, as a worker would."""

    @singleton_task(
        app=app, shared=False, key="exports:{tenant}", ttl=5, backend=redis_url,
        limit=3, on_conflict=on_conflict,
    )  # fmt: skip
    def export(tenant: str) -> tuple[str, int]:
        permit = current_lease()
        assert isinstance(permit, Permit)
        return permit.semaphore, permit.limit

    others = Semaphore("exports:acme", limit=3, ttl=5, backend=redis_url)
    first, second = others.acquire(timeout=0), others.acquire(timeout=0)
    try:
        assert export("acme") == ("exports:acme", 3)  # the third permit was free
        third = others.acquire(timeout=0)
        if on_conflict == "raise":
            with pytest.raises(LockHeld, match="all 3 permits are taken"):
                export("acme")
        else:
            assert export("acme") is None  # skipped
        assert export("globex") == ("exports:globex", 3)  # another key, its own permits
        third.release()
    finally:
        first.release()
        second.release()
    assert others.holders() == []


def test_async_task_with_a_limit_runs_under_an_async_permit(app: Celery, redis_url: str) -> None:
    @singleton_task(app=app, shared=False, key="render:{n}", ttl=5, backend=redis_url, limit=2)
    async def render(n: int) -> tuple[str, str, int]:
        permit = current_lease()
        assert permit is not None
        held = Semaphore("render:1", limit=2, backend=redis_url).holders()
        return type(permit).__name__, permit.name, len(held)

    kind, name, held = render(1)
    assert kind == "AsyncPermit" and name.startswith("semaphore:render:1#") and held == 1
    assert Semaphore("render:1", limit=2, backend=redis_url).holders() == []


def test_the_markers_of_runs_that_did_not_run_survive_json_and_pickle() -> None:
    """A skipped run's and a refused stale beat tick's results cross the result backend
    as themselves (json: a kombu type each), and never compare equal to each other."""
    import pickle

    from kombu.utils.json import dumps, loads

    from task_locks.celery import SKIPPED, STALE_TICK, Skipped, StaleTick

    marker = Skipped("sync:42", "a1b2", "task t[a1b2] on w1 pid 7")
    stale = StaleTick("celery-beat:proj", "nightly@1700000000000", 3, 5)
    for value in (marker, stale):
        assert loads(dumps(value)) == value and pickle.loads(pickle.dumps(value)) == value
        assert not value and hash(loads(dumps(value))) == hash(value)
    assert loads(dumps([marker, stale])) == [marker, stale] and marker != stale
    assert marker.state == SKIPPED and stale.state == STALE_TICK
    assert repr(marker) == "Skipped(lock='sync:42', holder_task_id='a1b2')"
    assert repr(stale) == (
        "StaleTick(election='celery-beat:proj', tick='nightly@1700000000000', term=3, "
        "current_term=5)"
    )
