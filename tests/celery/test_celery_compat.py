"""The Celery compatibility shim (the support matrix runs Celery 5.3 to the newest)."""

from __future__ import annotations

from types import SimpleNamespace

from task_locks.celery import _celery_compat


def test_before_5_6_a_result_is_ignored_if_the_task_or_the_request_says_so() -> None:
    ignored = _celery_compat._before_5_6
    for task_ignores in (False, True):
        for request_ignores in (None, False, True):
            task = SimpleNamespace(ignore_result=task_ignores)
            request = SimpleNamespace(ignore_result=request_ignores)
            assert ignored(task, request) is bool(task_ignores or request_ignores)
    assert ignored(SimpleNamespace(ignore_result=False), object()) is False


def test_the_installed_celery_answers_for_the_task_by_default() -> None:
    task = SimpleNamespace(ignore_result=True)
    assert _celery_compat.get_actual_ignore_result(task, None) is True
    task = SimpleNamespace(ignore_result=False)
    assert _celery_compat.get_actual_ignore_result(task, None) is False
