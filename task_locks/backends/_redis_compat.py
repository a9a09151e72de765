"""What differs between the redis-py versions we support (5.0.1 to the newest).

- redis-py before 5.3 requires a command name in ``ConnectionPool.get_connection()``; 5.3
  and later take none and warn (``DeprecationWarning``) when one is given: both pools,
  sync and async, go through :func:`get_connection` and :func:`aget_connection`.
- ``Connection.update_current_socket_timeout()`` (7.0) sets a connected socket's timeout
  for one call; before it, :func:`set_socket_timeout` sets the socket's own.
- hiredis (installed with ``redis[hiredis]``) gives :data:`pack_command`, its C packer;
  without it, ``None``, and redis-py's own packer is used.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, cast

__all__ = ["aget_connection", "get_connection", "pack_command", "set_socket_timeout"]


def _hiredis_packer() -> Callable[[tuple[Any, ...]], bytes] | None:
    try:
        from hiredis import pack_command as packer
    except ImportError:  # pragma: no cover - hiredis comes with redis[hiredis]
        return None
    return cast(Callable[[tuple[Any, ...]], bytes], packer)


#: One command (a tuple of str, bytes, int) in the wire protocol, packed in C.
pack_command = _hiredis_packer()


_wants: dict[type, bool] = {}


def _wants_command_name(pool_type: type) -> bool:
    """Whether this pool class's ``get_connection`` requires ``command_name`` (< 5.3)."""
    wants = _wants.get(pool_type)
    if wants is None:
        try:
            signature = inspect.signature(getattr(pool_type, "get_connection"))  # noqa: B009
            parameter = signature.parameters.get("command_name")
        except (AttributeError, TypeError, ValueError):  # pragma: no cover - an odd pool
            parameter = None
        wants = parameter is not None and parameter.default is inspect.Parameter.empty
        _wants[pool_type] = wants
    return wants


def get_connection(pool: Any, command: str) -> Any:
    """A connection from ``pool`` for ``command`` (the name only old redis-py needs)."""
    if _wants_command_name(type(pool)):
        return pool.get_connection(command)
    return pool.get_connection()


async def aget_connection(pool: Any, command: str) -> Any:
    """:func:`get_connection` for a ``redis.asyncio`` pool."""
    if _wants_command_name(type(pool)):
        return await pool.get_connection(command)
    return await pool.get_connection()


def set_socket_timeout(connection: Any, timeout: float | None) -> None:
    """Set a connected ``connection``'s read timeout; ``None``: back to its own.

    A connection not yet connected is left alone (it connects with its own timeout), as
    redis-py's ``update_current_socket_timeout`` does.
    """
    if hasattr(connection, "update_current_socket_timeout"):
        connection.update_current_socket_timeout(-1 if timeout is None else timeout)
        return
    sock = getattr(connection, "_sock", None)
    if sock is not None:
        sock.settimeout(connection.socket_timeout if timeout is None else timeout)
