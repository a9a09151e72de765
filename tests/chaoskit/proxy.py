"""A fault-injecting TCP proxy: latency, blackhole, reset (this kernel has no netem).

One asyncio loop in a daemon thread serves every proxy of a run. Each client gets
its own proxy per server, so the nemesis can cut one client off while the others
carry on. Modes:

- ``pass``: bytes flow both ways, in order.
- ``latency``: every chunk is delivered ``delay`` seconds after it was read (requests
  and replies can be delayed separately: ``reply_delay`` is "replies in flight").
- ``blackhole``: nothing is read or delivered, in either direction, and new connections
  hang; the bytes wait in the kernel buffers and arrive *after* the heal, late, the
  way TCP retransmissions deliver them after a partition ends.
- ``reset``: every open connection is aborted with an RST, and new ones are reset as
  soon as they are accepted.

Modes for one call under test (the conformance fault matrix arms one, makes the call,
heals): each acts on the bytes in flight, so the server sees exactly what a real lossy
link would let through.

- ``drop_request``: requests are read and thrown away; the server never sees them.
- ``drop_reply``: requests reach the server (which applies them); replies are thrown away.
- ``reset_mid_call``: requests reach the server; the first reply on a connection is
  thrown away and the connection is reset (RST both ways), on every connection while
  the mode lasts, so a client library's retry meets the same fault.
- ``reset_once``: as ``reset_mid_call`` for the first connection that gets a reply,
  then ``pass``: the client library's own retry (new connection) goes through.

One-shot holds, for two calls in flight at once (``hold_next_request``,
``hold_next_reply``): the next chunk read in that direction, on any connection, is
delivered that much later on top of the mode's delay; ``holds_pending()`` says whether
they were used yet. So one call can reach the server after a later one, and its reply
come back first (a renewal overtaken in the network).

A connection that lost bytes in a ``drop_*`` mode has a hole in its byte stream: on
``heal()`` it is reset, as the peer's TCP stack would give up on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Coroutine
from typing import Any

from .clock import now


def _rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Link:
    """One proxied connection: the client side and the server side."""

    def __init__(self, client: asyncio.StreamWriter, server: asyncio.StreamWriter) -> None:
        self.client = client
        self.server = server
        self.tasks: list[asyncio.Task[None]] = []
        #: Bytes were dropped: the stream has a hole, the connection cannot be healed.
        self.tainted = False
        #: A request went up in a ``reset_*`` mode: its reply resets the connection.
        self.doomed = False

    def reset(self) -> None:
        for task in self.tasks:
            task.cancel()
        _rst(self.client)
        _rst(self.server)


class Proxy:
    """Listens on ``port`` (loopback) and forwards to ``target_port``."""

    def __init__(self, hub: ProxyHub, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.hub = hub
        self.target = (target_host, target_port)
        self.port = 0
        self.mode = "pass"
        self.request_delay = 0.0
        self.reply_delay = 0.0
        self._hold: dict[bool, float] = {}  # upstream? -> one-shot extra delay
        self._flowing: asyncio.Event | None = None
        self._links: set[_Link] = set()
        self._server: asyncio.base_events.Server | None = None

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    # -- the nemesis's controls (any thread) -------------------------------------------

    def heal(self) -> None:
        self.hub.call(self._set("pass"))

    def latency(self, reply_delay: float, request_delay: float = 0.0) -> None:
        self.hub.call(self._set("latency", reply_delay, request_delay))

    def hold_next_request(self, seconds: float) -> None:
        self.hub.call(self._set_hold(True, seconds))

    def hold_next_reply(self, seconds: float) -> None:
        self.hub.call(self._set_hold(False, seconds))

    def holds_pending(self) -> int:
        """How many one-shot holds are armed and not used yet."""
        return len(self._hold)

    async def _set_hold(self, upstream: bool, seconds: float) -> None:
        self._hold[upstream] = seconds

    def blackhole(self) -> None:
        self.hub.call(self._set("blackhole"))

    def reset(self) -> None:
        self.hub.call(self._set("reset"))

    def fault(self, mode: str) -> None:
        """Arm one of the per-call modes (``drop_request``, ``drop_reply``, ``reset_*``)."""
        if mode not in _CALL_MODES:
            raise ValueError(f"unknown proxy mode {mode!r}; known: {sorted(_CALL_MODES)}")
        self.hub.call(self._set(mode))

    async def _set(self, mode: str, reply_delay: float = 0.0, request_delay: float = 0.0) -> None:
        assert self._flowing is not None
        self.mode = mode
        self.reply_delay, self.request_delay = reply_delay, request_delay
        if mode == "blackhole":
            self._flowing.clear()
        else:
            self._flowing.set()
        if mode == "reset":
            for link in list(self._links):
                link.reset()
            self._links.clear()
        if mode == "pass":
            for link in [link for link in self._links if link.tainted or link.doomed]:
                link.reset()
                self._links.discard(link)

    # -- the data path ------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:  # the hub is closing: end quietly
            _rst(writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._flowing is not None
        if self.mode == "reset":
            _rst(writer)
            return
        await self._flowing.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            _rst(writer)
            return
        if self.mode == "reset":
            _rst(writer)
            _rst(up_writer)
            return
        link = _Link(writer, up_writer)
        self._links.add(link)
        link.tasks = [
            asyncio.ensure_future(self._pump(reader, up_writer, link, upstream=True)),
            asyncio.ensure_future(self._pump(up_reader, writer, link, upstream=False)),
        ]
        await asyncio.gather(*link.tasks, return_exceptions=True)
        self._links.discard(link)
        for side in (writer, up_writer):
            with contextlib.suppress(Exception):
                side.close()

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: _Link,
        upstream: bool,
    ) -> None:
        assert self._flowing is not None
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.ensure_future(self._send(queue, writer))
        try:
            while True:
                await self._flowing.wait()
                data = await reader.read(65536)
                if not data:
                    break
                if self._drops(link, upstream):
                    continue
                delay = self.request_delay if upstream else self.reply_delay
                delay += self._hold.pop(upstream, 0.0)
                queue.put_nowait((now() + delay, data))
        except (ConnectionError, OSError):
            pass
        finally:
            await queue.put((0.0, b""))  # end of stream: the sender half-closes its side
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await sender

    def _drops(self, link: _Link, upstream: bool) -> bool:
        """Apply a per-call mode to one chunk just read: ``True`` if it is thrown away."""
        mode = self.mode
        if upstream:
            if mode == "drop_request":
                link.tainted = True
                return True
            if mode in ("reset_mid_call", "reset_once"):
                link.doomed = True
            return False
        if mode == "drop_reply":
            link.tainted = True
            return True
        if link.doomed or mode in ("reset_mid_call", "reset_once"):
            # The server has answered, so it applied the request: now lose the answer.
            if mode == "reset_once":
                self.mode = "pass"
            link.reset()
            self._links.discard(link)
            return True
        return False

    async def _send(
        self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter
    ) -> None:
        assert self._flowing is not None
        while True:
            at, data = await queue.get()
            if not data:
                with contextlib.suppress(Exception):
                    writer.write_eof()
                return
            wait = at - now()
            if wait > 0:
                await asyncio.sleep(wait)
            await self._flowing.wait()
            try:
                writer.write(data)
                await writer.drain()
            except (ConnectionError, OSError):
                return

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            link.reset()
        self._links.clear()


_CALL_MODES = frozenset({"drop_request", "drop_reply", "reset_mid_call", "reset_once"})


class ProxyHub:
    """The event loop thread that runs every proxy of a run."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.proxies: list[Proxy] = []
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="chaos-proxy", daemon=True
        )
        self._thread.start()

    def call(self, coroutine: Coroutine[Any, Any, Any], timeout: float = 5.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def proxy(self, target_port: int) -> Proxy:
        proxy = Proxy(self, target_port)
        self.call(proxy._start())
        self.proxies.append(proxy)
        return proxy

    def close(self) -> None:
        for proxy in self.proxies:
            with contextlib.suppress(Exception):
                self.call(proxy._close())

        async def drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.call(drain())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()
