"""The package imports and its public surface is exactly what the docs promise."""

import task_locks


def test_public_surface_is_sorted_and_complete() -> None:
    assert task_locks.__all__ == sorted(task_locks.__all__)
    for name in ["Lock", "AsyncLock", "Lease", "get_backend", "configure", "LockError",
                 "LockHeld", "LockLost", "NotOwned", "StaleFence", "BackendUnavailable"]:
        assert name in task_locks.__all__
        assert hasattr(task_locks, name)
