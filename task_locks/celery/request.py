"""The worker-side request of a singleton task: lock recovery in the main process.

Celery builds one ``Request`` per received message in the worker's *main* process and
calls its ``on_failure``/``on_timeout``/``terminate`` there when a prefork child is lost
(SIGKILL, OOM: ``WorkerLostError``), hits a hard time limit, or is terminated by
``revoke(terminate=True)``. The child never reaches its ``finally``, so the main process
releases the child's lock: once the child is gone, and only if the lock's owner metadata
names that task id and that pid (token-checked release with ``Holder.token``). This runs
before Celery requeues the message, so a redelivered copy finds the key free.

Registered as ``SingletonTask.Request`` (Celery's documented custom-request hook).
"""

from __future__ import annotations

from typing import Any

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import Terminated, TimeLimitExceeded, WorkerLostError
from celery.worker.request import Request

from .registry import recover_task_locks
from .task import TOKEN_HEADER, SingletonTask

#: Failures that mean the child died (or is being killed) mid-task.
_CHILD_DIED = (WorkerLostError, Terminated, TimeLimitExceeded, SystemExit, KeyboardInterrupt)


class SingletonRequest(Request):  # type: ignore[misc]
    def _recover(self, why: str) -> None:
        task = self.task
        if not isinstance(task, SingletonTask):
            return
        recover_task_locks(
            task,
            self.id,
            self.args,
            self.kwargs,
            token=(self.request_dict or {}).get(TOKEN_HEADER),
            pid=self.worker_pid,
            why=why,
        )

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if isinstance(exc, _CHILD_DIED) and self.time_start:
            self._recover(f"{type(exc).__name__}: {exc}")
        return super().on_failure(
            exc_info, send_failed_event=send_failed_event, return_ok=return_ok
        )

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        if not soft:
            self._recover(f"hard time limit ({timeout}s) exceeded")
        return super().on_timeout(soft, timeout)

    def terminate(self, pool: Any, signal: Any = None) -> Any:
        started = bool(self.time_start)
        result = super().terminate(pool, signal)
        if started:
            self._recover("terminated by revoke(terminate=True)")
        return result


__all__ = ["SingletonRequest"]
