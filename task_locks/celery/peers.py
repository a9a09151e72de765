"""``PeerCheckedTask``: a singleton task whose run lock waits out an old library's key.

For rolling deploys from celery-singleton, celery-once or a Redis lock library (see
:mod:`task_locks.peers` and ``docs/migrating.md``)::

    from task_locks.celery.peers import PeerCheckedTask
    from task_locks.peers import PeerKeys, celery_singleton_key

    def old_key(name):  # "sync:42" -> celery-singleton's key of sync_account(42)
        return celery_singleton_key("tasks.sync_account", [int(name.split(":")[1])])

    @singleton_task(key="sync:{account_id}", base=PeerCheckedTask,
                    lock_peers=PeerKeys("redis://...", old_key))
    def sync_account(account_id): ...

The run lock (``lock_on="run"``/``"both"``, ``limit=1``) is a
:class:`~task_locks.peers.PeerCheckedLock`: while a peer key for the run's lock name
exists, the run meets a held lock and ``on_conflict`` applies as usual. The publish-time
lock of ``lock_on="enqueue"``/``"both"`` and ``limit`` > 1 are not peer-checked.
"""

from __future__ import annotations

from ..lock import AsyncLock, Lock
from ..peers import AsyncPeerCheckedLock, PeerCheckedLock, PeerKeys
from ..semaphore import AsyncSemaphore, Semaphore
from .task import SingletonTask


class PeerCheckedTask(SingletonTask):
    """A :class:`~task_locks.celery.SingletonTask` whose run lock is peer-checked."""

    #: The peer keys to wait out (``None``: an ordinary singleton task).
    lock_peers: PeerKeys | None = None

    def run_lock(self, name: str) -> Lock | Semaphore:
        if self.lock_peers is None or self.lock_limit != 1:
            return super().run_lock(name)
        return PeerCheckedLock(name, peers=self.lock_peers, **self.lock_arguments())

    def async_run_lock(self, name: str) -> AsyncLock | AsyncSemaphore:
        if self.lock_peers is None or self.lock_limit != 1:
            return super().async_run_lock(name)
        return AsyncPeerCheckedLock(name, peers=self.lock_peers, **self.lock_arguments())


__all__ = ["PeerCheckedTask"]
