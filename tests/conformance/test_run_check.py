"""A Celery run's check, decided in the acquire's own server step, on every backend.

A run's acquire carries its task id (``RunCheck``): the server refuses it when a run of
the same task id already holds the lock, or any other name it is told to look at (a
semaphore's other slots), even under the publish-time token both copies of a message
carry; it takes over the publish-time lock under a token of its own. This is what lets
a singleton task take one lock per run, with no second ``#task:`` lock beside it.
"""

from __future__ import annotations

import secrets
import threading

import pytest
from deployments import REDIS_TOPOLOGIES, Deployment, build_deployment, deployment_params

from task_locks import LockHeld, Semaphore, get_backend
from task_locks._friends import acquire_as_run
from task_locks.backends.base import Backend, RunChecked
from task_locks.owner import owner_context
from task_locks.types import Owner, RunCheck


@pytest.fixture(params=deployment_params(*REDIS_TOPOLOGIES))
def deployment(request: pytest.FixtureRequest) -> Deployment:
    """Every conformance deployment, Redis Sentinel and Cluster too."""
    return build_deployment(request, request.param)


TTL_MS = 10_000


def run_owner(task_id: str) -> Owner:
    return Owner(host="h", pid=1, thread="t", task_id=task_id, task_name="t.x", worker="w@h")


def checked(deployment: Deployment) -> RunChecked:
    backend: Backend = get_backend(deployment.url)
    assert isinstance(backend, RunChecked), f"{backend!r} has no run check"
    assert "run_check" in backend.capabilities
    return backend


def fresh() -> str:
    return secrets.token_hex(16)


def test_a_second_run_of_one_task_id_is_refused_naming_it(deployment: Deployment) -> None:
    backend = checked(deployment)
    name = f"run-check-{fresh()}"
    run = RunCheck("task-1", (name,))
    first = backend.acquire_run(name, fresh(), TTL_MS, run_owner("task-1"), run)
    assert first.acquired
    copy = backend.acquire_run(name, fresh(), TTL_MS, run_owner("task-1"), run)
    assert not copy.acquired and copy.holder is not None
    assert copy.holder.task_id == "task-1" and copy.holder_fence == first.fence
    assert run.is_copy(copy)
    other = RunCheck("task-2", (name,))
    refused = backend.acquire_run(name, fresh(), TTL_MS, run_owner("task-2"), other)
    assert not refused.acquired and not other.is_copy(refused)


def test_a_retried_acquire_of_the_same_token_is_still_granted(deployment: Deployment) -> None:
    backend = checked(deployment)
    name = f"run-check-{fresh()}"
    token = fresh()
    run = RunCheck("task-1", (name,))
    first = backend.acquire_run(name, token, TTL_MS, run_owner("task-1"), run)
    again = backend.acquire_run(name, token, TTL_MS, run_owner("task-1"), run)
    assert again.acquired and again.fence == first.fence
    assert backend.release(name, token)


def test_the_publish_time_lock_is_taken_over_once_under_the_runs_token(
    deployment: Deployment,
) -> None:
    backend = checked(deployment)
    name = f"run-check-{fresh()}"
    queued_token = fresh()
    queued = backend.acquire(name, queued_token, TTL_MS, Owner(task_id="task-1"))
    assert queued.acquired
    run = RunCheck("task-1", (name,), take_over=queued_token)
    mine = fresh()
    taken = backend.acquire_run(name, mine, TTL_MS, run_owner("task-1"), run)
    assert taken.acquired and taken.fence == queued.fence  # one step, same fence
    # A second delivery carries the same publish-time token: it meets the run, refused.
    copy = backend.acquire_run(name, fresh(), TTL_MS, run_owner("task-1"), run)
    assert not copy.acquired and run.is_copy(copy)
    assert not backend.release(name, queued_token)  # the queued token holds nothing now
    assert backend.release(name, mine)


def test_a_queued_lock_of_another_task_is_simply_held(deployment: Deployment) -> None:
    backend = checked(deployment)
    name = f"run-check-{fresh()}"
    other_token = fresh()
    assert backend.acquire(name, other_token, TTL_MS, Owner(task_id="task-2")).acquired
    run = RunCheck("task-1", (name,), take_over=fresh())
    refused = backend.acquire_run(name, fresh(), TTL_MS, run_owner("task-1"), run)
    assert not refused.acquired and not run.is_copy(refused)
    assert refused.holder is not None and refused.holder.task_id == "task-2"
    assert backend.release(name, other_token)


def test_every_slot_is_seen_and_the_holders_slot_named(deployment: Deployment) -> None:
    backend = checked(deployment)
    names = tuple(f"semaphore:run-check-{fresh()}#{index}" for index in range(3))
    if not backend.checks_together(names):
        assert deployment.kind == "cluster"  # the slots' keys live in other hash slots
        return
    run = RunCheck("task-1", names)
    first = backend.acquire_run(names[2], fresh(), TTL_MS, run_owner("task-1"), run)
    assert first.acquired
    copy = backend.acquire_run(names[0], fresh(), TTL_MS, run_owner("task-1"), run)
    assert not copy.acquired and run.is_copy(copy)
    assert copy.holder_name == names[2] and copy.holder_fence == first.fence
    other = RunCheck("task-2", names)
    assert backend.acquire_run(names[0], fresh(), TTL_MS, run_owner("task-2"), other).acquired


def test_a_semaphore_run_refuses_its_copy_at_once(deployment: Deployment) -> None:
    name = f"run-check-{fresh()}"
    sem = Semaphore(name, 3, ttl=10, backend=deployment.url)
    backend = checked(deployment)
    if not backend.checks_together(sem.slot_names):
        assert deployment.kind == "cluster"  # Celery takes a guard lock there instead
        return
    with owner_context(task_id="task-1", worker="w@h"):
        permit = acquire_as_run(sem, None, "task-1").acquire(timeout=None)
        copy = acquire_as_run(Semaphore(name, 3, ttl=10, backend=deployment.url), None, "task-1")
        with pytest.raises(LockHeld) as held:
            copy.acquire(timeout=None)  # no wait: it met its own task id
    assert held.value.holder is not None and held.value.holder.name == permit.name
    permit.release()


def test_only_the_same_task_id_is_a_copy(deployment: Deployment) -> None:
    """An id that another one starts with, or one named in another field, is not it:
    the run takes a free slot beside that holder."""
    backend = checked(deployment)
    names = tuple(f"semaphore:run-check-{fresh()}#{index}" for index in range(2))
    lookalike = Owner(host="h", task_id="task-10", task_name='"task_id": "task-1"', worker="w")
    assert backend.acquire(names[1], fresh(), TTL_MS, lookalike).acquired
    run = RunCheck("task-1", names if backend.checks_together(names) else names[:1])
    assert backend.acquire_run(names[0], fresh(), TTL_MS, run_owner("task-1"), run).acquired


def test_two_copies_racing_for_two_free_slots_never_both_win(deployment: Deployment) -> None:
    """The check and the take are one step: copies started together on two free slots
    of one semaphore, again and again; at most one of each pair takes its slot."""
    backend = checked(deployment)
    for round_ in range(15):
        names = tuple(f"semaphore:run-race-{fresh()}#{index}" for index in range(2))
        if not backend.checks_together(names):
            assert deployment.kind == "cluster"
            return
        run = RunCheck(f"task-{round_}", names)
        start = threading.Barrier(2)
        won: list[tuple[str, str]] = []

        def copy(
            slot: str,
            run: RunCheck = run,
            start: threading.Barrier = start,
            won: list[tuple[str, str]] = won,
        ) -> None:
            token = fresh()
            start.wait(timeout=10)
            if backend.acquire_run(slot, token, TTL_MS, run_owner(run.task_id), run).acquired:
                won.append((slot, token))

        threads = [threading.Thread(target=copy, args=(slot,)) for slot in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)
        assert len(won) == 1, won  # one runs: never both, never neither
        for slot, token in won:
            backend.release(slot, token)


def test_a_retry_waits_for_its_previous_attempts_permit(deployment: Deployment) -> None:
    """A retry (``give_up_on_copy=False``) meeting its own task id waits for it, and when
    its wait runs out says who holds it, as a lock does (Celery then refuses a copy)."""
    name = f"run-check-{fresh()}"
    sem = Semaphore(name, 2, ttl=10, backend=deployment.url)
    if not checked(deployment).checks_together(sem.slot_names):
        assert deployment.kind == "cluster"
        return
    with owner_context(task_id="task-1", worker="w@h"):
        previous = acquire_as_run(sem, None, "task-1").acquire(timeout=None)
        retry = Semaphore(name, 2, ttl=10, backend=deployment.url)
        with pytest.raises(LockHeld) as held:
            acquire_as_run(retry, None, "task-1", give_up_on_copy=False).acquire(timeout=0.2)
        assert held.value.holder is not None and held.value.holder.owner.task_id == "task-1"
        previous.release()
        again = Semaphore(name, 2, ttl=10, backend=deployment.url)
        acquire_as_run(again, None, "task-1", give_up_on_copy=False).acquire(timeout=5).release()
