"""The history: every operation as an invoke and a completion, one JSON line each.

Each client process appends to its own file and flushes every line, so a process
killed with SIGKILL leaves a history that ends at its last completed write() call.
An operation without a completion is *unknown*, like a completion of type ``info``.

Event fields: ``p`` (logical process: a client slot's incarnation), ``f`` (``acquire``,
``write``, ``release``, or ``lost`` / ``nemesis`` / ``process`` markers), ``type``
(``invoke``, ``ok``, ``fail`` = definitely did not happen, ``info`` = unknown), ``t``
(:func:`chaoskit.clock.now`), and per operation: ``fence``, ``guard``, ``id``, ``version``,
``current``, ``error``, ``ttl``.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from .clock import now


class Recorder:
    """Appends events for one logical process (or the nemesis) to one file."""

    def __init__(self, path: str | os.PathLike[str], process: int | str) -> None:
        self.process = process
        self._file = open(path, "a", buffering=1, encoding="utf-8")
        self._guard = threading.Lock()

    def event(self, f: str, type: str, **data: Any) -> dict[str, Any]:
        record = {"p": self.process, "f": f, "type": type, "t": now(), **data}
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._guard:
            self._file.write(line)  # line-buffered: one write(2) per event
        return record

    def invoke(self, f: str, **data: Any) -> dict[str, Any]:
        return self.event(f, "invoke", **data)

    def ok(self, f: str, **data: Any) -> dict[str, Any]:
        return self.event(f, "ok", **data)

    def fail(self, f: str, **data: Any) -> dict[str, Any]:
        return self.event(f, "fail", **data)

    def info(self, f: str, **data: Any) -> dict[str, Any]:
        return self.event(f, "info", **data)

    def close(self) -> None:
        self._file.close()


def load(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event of every file in ``directory``, ordered by time.

    A torn last line (a process killed mid-write) is skipped.
    """
    events: list[dict[str, Any]] = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    events.sort(key=lambda e: e["t"])
    return events
