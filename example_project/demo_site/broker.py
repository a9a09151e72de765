"""kombu's filesystem transport, made safe for several worker processes on one machine.

The demo's broker needs no server: messages are files in a folder. Stock kombu 5.x
writes a message by opening its final ``*.msg`` name and then writing into it, so a
consumer polling the folder at that instant can pick up an empty file; and it moves a
consumed file to the system temp folder, which on another file system is a copy (two
consumers can both read it) rather than an atomic rename. Here a message is written
under a name consumers ignore and renamed into place, and consumed files are moved
within the broker folder (``processed_folder``, same file system, atomic rename).

Used only when ``CELERY_BROKER_URL`` is ``filesystem://`` (see ``settings.py``); any
real broker URL (``redis://``, ``amqp://``) uses kombu's own transport.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = final + ".part"  # not "<queue>.msg": _get() and _size() skip it
        try:
            with open(partial, "wb") as f:
                f.write(dumps(payload).encode())
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"cannot add {final!r} to the broker folder") from exc


class Transport(filesystem.Transport):
    Channel = Channel
