"""Moved to :mod:`task_locks.keys` (shared with ``@locked``); this path keeps working."""

from __future__ import annotations

from ..keys import KeySpec, TaskKey

__all__ = ["KeySpec", "TaskKey"]
