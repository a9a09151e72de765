"""etcd (consensus): ``etcd://host[:port][,host[:port]...][?options]`` (port 2379 by default).

Locks that stay correct while a majority of the etcd cluster is up: every decision is a
Raft-replicated transaction, and a lock's fence is the key's ``create_revision``, which
the cluster's single revision counter makes strictly increasing per name.

``etcd3gw`` is used only as the HTTP transport to etcd's v3 JSON gateway (``/v3/...``):
its own ``Lock`` has no keep-alive, exposes no revision and lets ``with lock:`` enter even
when the acquire failed, so the protocol below is ours.

- **acquire**: grant a lease of ``ceil(ttl)`` seconds, then one transaction: if the key's
  ``create_revision == 0`` (absent), put our value (token, owner, lease) with that lease;
  else read the holder. A failed acquire revokes its lease at once instead of leaking
  it, and reports the holder's remaining lease TTL so the caller knows how long to wait.
- **renew**: lease keep-alive; an answer without a TTL (or TTL 0) means the lease is
  gone. A keep-alive alone proves nothing about the key, so ownership is then checked by
  a transaction comparing the key's ``create_revision`` with ours before the renewal is
  reported (one transaction for a whole batch; a batch that fails is read back per key).
- **release**: a transaction deleting the key only if its ``create_revision`` and value
  are still ours, then a lease revoke.
- **wait**: a watch on the key (DELETE events only) from the revision at which we saw it
  held, so a release between our failed acquire and the watch is not missed; it ends at
  the first event or after the timeout.
- **holders**: a range read over the prefix, plus each holder's lease TTL.

Every request has a short timeout (``timeout``, default 2 s). A request that could not
even be delivered (connection refused) moves on to the next endpoint; reads, lease
calls and the acquire transaction (idempotent: a retry finds our own token) also move on
after other transport errors. Errors from ``requests``/``etcd3gw`` become
:class:`~task_locks.errors.BackendUnavailable` (or :class:`~task_locks.errors.LockError`
for a refused request) here.

Limits: lease TTLs are whole seconds (rounded up) and the server enforces a minimum
(1.5 election timeouts rounded up: 2 s with etcd's defaults); the leader checks expiry
about every 500 ms, so a dead holder's lock ends within ``ceil(ttl)`` + 0.5 s; a new
leader restarts every lease's TTL, so a leader change can lengthen (never shorten) a
dead holder's lock. ``renewals`` is not tracked (a keep-alive leaves no trace in the
key) and ``acquired_at`` is the acquiring client's clock. No TLS or authentication.

asyncio: every call runs the sync one in a worker thread (``Backend``'s adapter); a
waiting :class:`~task_locks.AsyncLock` holds one thread of the adapter's wait pool
(:data:`~task_locks.backends.base.ASYNC_WAIT_THREADS` per process) for its watch, so
waiters never hold up the renewals and releases queued in the loop's default executor.

Options: ``prefix`` (default ``task_locks/``), ``timeout`` (seconds per request).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from base64 import b64decode, b64encode
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, NoReturn
from urllib.parse import urlsplit

import etcd3gw
import requests
from etcd3gw import exceptions as etcd_errors
from requests.adapters import HTTPAdapter

from ..errors import BackendUnavailable, InvalidArgument, LockError
from ..types import AcquireResult, Holder, Owner, RenewItem
from .base import Backend

_OPTIONS: Final = {"prefix", "timeout"}
#: HTTP connections kept per endpoint (threads beyond this open short-lived ones).
_POOL_SIZE: Final = 32
#: Names whose last-seen revision is remembered for watches (a bounded hint).
_SEEN_MAX: Final = 10_000
#: Transport failures: the server may or may not have seen the request.
_TRANSPORT = (
    etcd_errors.ConnectionFailedError,
    etcd_errors.ConnectionTimeoutError,
    etcd_errors.InternalServerError,
    requests.RequestException,
    OSError,
)


def _b64(data: bytes) -> str:
    return b64encode(data).decode()


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key starting with ``prefix`` (etcd's range_end)."""
    tail = bytearray(prefix)
    while tail:
        if tail[-1] < 0xFF:
            tail[-1] += 1
            return bytes(tail)
        tail.pop()
    return b"\0"  # every key


def _undelivered(exc: BaseException) -> bool:
    """True when the request surely never reached the server (safe to send elsewhere)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, requests.ConnectTimeout | ConnectionRefusedError):
            return True
        text = str(seen)
        if "Connection refused" in text or "NewConnectionError" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@dataclass(frozen=True, slots=True)
class _Held:
    """What we know of one of our locks: enough for token-checked renew and release."""

    lease: int
    revision: int  # the key's create_revision: our fence
    value: bytes

    def compare(self, key: str) -> list[dict[str, Any]]:
        """Txn conditions: ``key`` (base64) is still this lock, created by us, our value."""
        return [
            {"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": self.revision},
            {"key": key, "result": "EQUAL", "target": "VALUE", "value": _b64(self.value)},
        ]


class EtcdBackend(Backend):
    schemes = ("etcd",)
    capabilities = frozenset({"consensus", "fencing", "holders", "multiprocess", "wakeup"})

    def __init__(self, url: str) -> None:
        super().__init__(url)
        parts = urlsplit(url)
        query = self._options(_OPTIONS)
        if "@" in parts.netloc:
            raise InvalidArgument(f"{self.server}: etcd authentication is not supported")
        if parts.path.strip("/"):
            raise InvalidArgument(
                f"{self.server}: an etcd URL has no path; use ?prefix= to pick a key prefix"
            )
        self.prefix = query.get("prefix", "task_locks/").encode()
        self.timeout = self._number(query, "timeout", 2.0, positive=True)
        self.endpoints = self._endpoints(parts.netloc)
        self._current = 0
        self._pid = -1
        self._clients: list[etcd3gw.Etcd3Client] = []
        self._guard = threading.Lock()
        self._held: dict[tuple[str, str], _Held] = {}
        self._seen: dict[str, int] = {}  # name -> a store revision at which it was held

    def _endpoints(self, netloc: str) -> list[tuple[str, int]]:
        endpoints = []
        for item in netloc.split(","):
            item = item.strip()
            host, _, port = item.rpartition(":") if ":" in item else (item, ":", "2379")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise InvalidArgument(
                    f"{self.server}: expected host[:port][,host[:port]...], got {item!r}"
                )
            endpoints.append((host.strip("[]"), int(port)))
        return endpoints

    # -- transport -------------------------------------------------------------------------

    def _client_list(self) -> list[etcd3gw.Etcd3Client]:
        # A forked child must not share its parent's HTTP connections.
        if self._pid != os.getpid():
            with self._guard:
                if self._pid != os.getpid():
                    self._clients = [self._make_client(h, p) for h, p in self.endpoints]
                    self._held = {}
                    self._pid = os.getpid()
        return self._clients

    def _make_client(self, host: str, port: int) -> etcd3gw.Etcd3Client:
        session = requests.Session()
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=_POOL_SIZE, max_retries=0)
        session.mount("http://", adapter)
        return etcd3gw.Etcd3Client(
            host=host, port=port, timeout=self.timeout, api_path="/v3/", session=session
        )

    def _order(self) -> Iterator[tuple[int, etcd3gw.Etcd3Client]]:
        clients = self._client_list()
        start = self._current
        for step in range(len(clients)):
            index = (start + step) % len(clients)
            yield index, clients[index]

    def _post(self, name: str | None, path: str, payload: dict[str, Any], retry: bool) -> Any:
        """One gateway request; on failure, the next endpoint when that is safe."""
        failures: list[str] = []
        last: BaseException | None = None
        for index, client in self._order():
            try:
                answer = client.post(client.get_url(path), json=payload)
                self._current = index
                return answer
            except _TRANSPORT as exc:
                last = exc
                failures.append(f"{client.host}:{client.port}: {self._reason(exc)}")
                self._current = (index + 1) % len(self.endpoints)
                if not (retry or _undelivered(exc)):
                    break
            except etcd_errors.Etcd3Exception as exc:
                self._refused(name, path, exc)
        what = f"lock {name!r}" if name else "listing locks"
        raise BackendUnavailable(
            f"{what}: etcd at {self.server} is unavailable ({path}): " + "; ".join(failures),
            name=name,
            server=self.server,
        ) from last

    def _reason(self, exc: BaseException) -> str:
        if _undelivered(exc):
            return "connection refused"
        if isinstance(exc, etcd_errors.ConnectionTimeoutError | requests.Timeout):
            return f"no answer within {self.timeout:g}s"
        detail = getattr(exc, "detail_text", None)
        if detail:
            try:
                return str(json.loads(detail).get("message", detail))
            except (ValueError, AttributeError):
                return str(detail)
        return str(exc) or type(exc).__name__

    def _refused(self, name: str | None, path: str, exc: etcd_errors.Etcd3Exception) -> NoReturn:
        what = f"lock {name!r}" if name else "listing locks"
        raise LockError(
            f"{what}: etcd at {self.server} refused {path}: {self._reason(exc)}", name=name
        ) from exc

    # -- requests ----------------------------------------------------------------------------

    def _key(self, name: str) -> bytes:
        return self.prefix + name.encode()

    def _txn(self, name: str | None, txn: dict[str, Any], retry: bool = False) -> Any:
        return self._post(name, "/kv/txn", txn, retry)

    def _range(self, name: str | None, key: bytes, end: bytes | None = None) -> list[Any]:
        payload: dict[str, Any] = {"key": _b64(key)}
        if end is not None:
            payload["range_end"] = _b64(end)
        answer = self._post(name, "/kv/range", payload, retry=True)
        return list(answer.get("kvs", []))

    def _note_held(self, name: str, answer: Any) -> None:
        """Remember a store revision at which ``name`` was held: the watch starts after it."""
        revision = int(answer.get("header", {}).get("revision", 0))
        if len(self._seen) > _SEEN_MAX:
            self._seen.clear()  # only a hint: a waiter without one reads the key first
        if revision > self._seen.get(name, 0):
            self._seen[name] = revision

    def _lease_ttl(self, name: str | None, lease: int) -> float | None:
        """Seconds the lease still lives (etcd rounds down), ``None`` if unknown."""
        if not lease:
            return None
        answer = self._post(name, "/lease/timetolive", {"ID": lease}, retry=True)
        ttl = int(answer.get("TTL", 0))
        return float(ttl) if ttl >= 0 else 0.0

    def _revoke(self, name: str, lease: int) -> None:
        """Revoke a lease we no longer need; one that already expired is fine."""
        try:
            self._post(name, "/lease/revoke", {"ID": lease}, retry=True)
        except LockError as exc:
            if "not found" not in str(exc):
                raise

    def _decode(self, kv: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        raw = b64decode(kv.get("value", ""))
        try:
            data = json.loads(raw)
        except ValueError:
            data = {}
        return (data if isinstance(data, dict) else {}), raw

    def _holder(self, kv: dict[str, Any]) -> Holder:
        data, _ = self._decode(kv)
        name = b64decode(kv["key"])[len(self.prefix) :].decode(errors="replace")
        ttl = self._lease_ttl(name, int(kv.get("lease", 0)))
        return Holder(
            name=name,
            fence=int(kv.get("create_revision", 0)),
            owner=Owner.from_json(json.dumps(data.get("owner", {}))),
            acquired_at=data.get("acquired"),
            # etcd reports whole seconds rounded down: an upper bound is one more.
            expires_at=None if ttl is None else time.time() + ttl + 1,
            token=str(data.get("token", "")),
        )

    # -- the protocol ------------------------------------------------------------------------

    def acquire(self, name: str, token: str, ttl_ms: int, owner: Owner) -> AcquireResult:
        key = self._key(name)
        grant = self._post(name, "/lease/grant", {"TTL": max(1, math.ceil(ttl_ms / 1000))}, True)
        lease = int(grant["ID"])
        value = json.dumps(
            {
                "token": token,
                "owner": json.loads(owner.to_json()),
                "lease": lease,
                "acquired": time.time(),
                "ttl_ms": ttl_ms,
            },
            separators=(",", ":"),
        ).encode()
        txn = {
            "compare": [
                {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
            ],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value), "lease": lease}}],
            "failure": [{"request_range": {"key": _b64(key)}}],
        }
        try:
            answer = self._txn(name, txn, retry=True)
        except LockError:
            self._revoke_quietly(name, lease)
            raise
        if answer.get("succeeded"):
            revision = int(answer["header"]["revision"])
            self._held[(name, token)] = _Held(lease, revision, value)
            self._seen.pop(name, None)
            return AcquireResult(revision)
        self._revoke(name, lease)  # never leak the lease of a failed attempt
        kvs = answer["responses"][0].get("response_range", {}).get("kvs", [])
        if not kvs:  # gone between compare and read cannot happen in one txn; be safe
            return AcquireResult(None, retry_after=0.0)
        self._note_held(name, answer)
        kv = kvs[0]
        data, raw = self._decode(kv)
        revision = int(kv.get("create_revision", 0))
        if data.get("token") == token:  # our own earlier attempt got through: idempotent
            self._held[(name, token)] = _Held(int(kv.get("lease", 0)), revision, raw)
            return AcquireResult(revision)
        remaining = self._lease_ttl(name, int(kv.get("lease", 0)))
        return AcquireResult(
            None,
            # whole seconds, rounded down; the watch wakes us sooner anyway
            retry_after=None if remaining is None else remaining + 1.0,
            holder=Owner.from_json(json.dumps(data.get("owner", {}))),
            holder_fence=revision,
            holder_acquired_at=data.get("acquired"),
        )

    def _revoke_quietly(self, name: str, lease: int) -> None:
        try:
            self._revoke(name, lease)
        except LockError:
            pass  # it expires by its TTL

    def _ours(self, name: str, token: str) -> _Held | None:
        """Our lock's lease and revision: remembered, or read back (another process's)."""
        held = self._held.get((name, token))
        if held is not None:
            return held
        for kv in self._range(name, self._key(name)):
            data, raw = self._decode(kv)
            if data.get("token") == token:
                return _Held(int(kv.get("lease", 0)), int(kv.get("create_revision", 0)), raw)
        return None

    def renew(self, name: str, token: str, ttl_ms: int) -> bool:
        return self.renew_many([RenewItem(name, token, ttl_ms)])[0]

    def renew_many(self, items: Sequence[RenewItem], timeout: float | None = None) -> list[bool]:
        # Each request is already bounded by the ``timeout`` option (default 2 s); the
        # watchdog marks a lease lost at its deadline whatever a call still waits for.
        if not items:
            return []
        results: list[bool] = []
        alive: list[tuple[int, RenewItem, _Held]] = []
        for index, item in enumerate(items):
            held = self._ours(item.name, item.token)
            ok = False
            if held is not None:
                answer = self._post(item.name, "/lease/keepalive", {"ID": held.lease}, True)
                ok = int(answer.get("result", {}).get("TTL", 0)) > 0
            results.append(ok)
            if ok and held is not None:
                alive.append((index, item, held))
            else:
                self._held.pop((item.name, item.token), None)
        if alive and not self._still_ours([(i.name, h) for _, i, h in alive]):
            # Someone's key changed: check each (rare; one read per key).
            for index, item, held in alive:
                results[index] = self._still_ours([(item.name, held)])
                if not results[index]:
                    self._held.pop((item.name, item.token), None)
        return results

    def _still_ours(self, keys: list[tuple[str, _Held]]) -> bool:
        """One transaction: does every key still have our create_revision and value?"""
        compare = [c for name, held in keys for c in held.compare(_b64(self._key(name)))]
        answer = self._txn(keys[0][0], {"compare": compare, "success": [], "failure": []}, True)
        return bool(answer.get("succeeded"))

    def release(self, name: str, token: str) -> bool:
        held = self._held.pop((name, token), None) or self._ours(name, token)
        if held is None:
            return False
        key = _b64(self._key(name))
        txn = {
            "compare": held.compare(key),
            "success": [{"request_delete_range": {"key": key}}],
            "failure": [],
        }
        released = bool(self._txn(name, txn).get("succeeded"))
        self._revoke_quietly(name, held.lease)  # only ever carried this one key
        return released

    def force_release(self, name: str) -> bool:
        for kv in self._range(name, self._key(name)):
            key = kv["key"]
            revision = int(kv.get("create_revision", 0))
            txn = {
                "compare": [
                    {"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": revision}
                ],
                "success": [{"request_delete_range": {"key": key}}],
                "failure": [],
            }
            released = bool(self._txn(name, txn).get("succeeded"))
            if int(kv.get("lease", 0)):
                self._revoke_quietly(name, int(kv["lease"]))
            return released
        return False

    def holders(self, prefix: str = "") -> list[Holder]:
        start = self._key(prefix)
        kvs = self._range(prefix or None, start, _prefix_end(start))
        return sorted((self._holder(kv) for kv in kvs), key=lambda h: h.name)

    def holder(self, name: str) -> Holder | None:
        kvs = self._range(name, self._key(name))
        return self._holder(kvs[0]) if kvs else None

    def wait(self, name: str, timeout: float) -> None:
        seen = self._seen.get(name)
        if seen is None:  # we never saw it held: look once
            answer = self._post(name, "/kv/range", {"key": _b64(self._key(name))}, retry=True)
            if not answer.get("kvs"):
                return
            self._note_held(name, answer)
            seen = self._seen.get(name, 0)
        request = {
            "create_request": {
                "key": _b64(self._key(name)),
                "start_revision": seen + 1,
                "filters": ["NOPUT"],
            }
        }
        failures: list[str] = []
        for index, client in self._order():
            try:
                self._watch(client, request, timeout)
                self._current = index
                return
            except (requests.RequestException, OSError) as exc:
                failures.append(f"{client.host}:{client.port}: {exc}")
                self._current = (index + 1) % len(self.endpoints)
        raise BackendUnavailable(
            f"lock {name!r}: cannot watch for its release, etcd at {self.server} is "
            "unavailable: " + "; ".join(failures),
            name=name,
            server=self.server,
        )

    def _watch(self, client: etcd3gw.Etcd3Client, request: dict[str, Any], timeout: float) -> None:
        """Return at the first DELETE event on the key, or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        response = client.session.post(
            client.get_url("/watch"),
            json=request,
            stream=True,
            timeout=(self.timeout, max(0.001, timeout)),
        )
        try:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line:
                    continue
                result = json.loads(line).get("result", {})
                if result.get("events") or result.get("canceled") or result.get("compact_revision"):
                    return
                if time.monotonic() >= deadline:
                    return
        except requests.ConnectionError as exc:
            if "Read timed out" in str(exc) or isinstance(exc, requests.ReadTimeout):
                return  # the timeout ran out with no release: a normal end of the wait
            raise
        except requests.exceptions.ChunkedEncodingError:
            return  # the stream broke off: a spurious wake-up is fine
        finally:
            response.close()

    def close(self) -> None:
        for client in self._clients:
            client.session.close()
        self._clients = []
        self._pid = -1


__all__ = ["EtcdBackend"]
