"""A simulated etcd (v3.4) behind its JSON gateway: the requests task-locks sends, answered
as etcd answers them.

The seam is HTTP: :class:`ModelSession` stands in for the ``requests.Session`` that
``etcd3gw`` posts through, so the production ``EtcdBackend`` (and etcd3gw's own error
mapping) run unchanged over it. Only what the backend sends is implemented, with etcd's
semantics for what the lock protocol depends on:

- revisions: one store revision, raised once by each request that changes something (a
  transaction of several writes is one revision; a delete that deletes nothing is none);
  each key carries ``create_revision`` (the backend's fence), ``mod_revision``,
  ``version`` and its ``lease``;
- transactions: every compare of ``compare`` (targets VERSION, CREATE, MOD, VALUE, LEASE;
  results EQUAL, NOT_EQUAL, GREATER, LESS) against the key as it is, a compare of VALUE on
  a missing key always false (etcd's rule), then the ``success`` or ``failure`` ops
  (range, put, delete_range, each with ``prev_kv``); a put naming a lease that does not
  exist refuses the whole transaction (HTTP 404, code 5), changing nothing;
- leases: granted for ``max(TTL, min_ttl)`` seconds, kept alive to the granted TTL,
  ``timetolive`` in whole seconds rounded down (-1 once gone); a lease that ends (revoked
  or expired) deletes its keys in one revision. The model expires a lease exactly at its
  deadline, where a real etcd's lessor notices within about 500 ms: the earliest expiry,
  the one that is hardest on a holder;
- the gateway's JSON: 64-bit integers as strings, bytes as base64, fields with zero or
  empty values left out, errors as ``{"error", "message", "code"}`` with etcd's HTTP status.

Watches: :meth:`EtcdModel.events_since` returns the history of one key after a revision
(each put and delete), which a simulated ``/watch`` stream delivers; the differential
session answers a watch at once with what happened already (the backend treats an empty
end of stream as a spurious wake-up, which it is allowed to be).
"""

from __future__ import annotations

import base64
import itertools
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

#: What every reply's header names besides the revision (one member, one term).
CLUSTER_ID = "14841639068965178418"
MEMBER_ID = "10276657743932975437"
RAFT_TERM = "2"


class GatewayError(Exception):
    """An error etcd answers with (its HTTP status and gRPC code)."""

    def __init__(self, status: int, code: int, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


LEASE_NOT_FOUND = (404, 5, "etcdserver: requested lease not found")


@dataclass
class KeyValue:
    create_revision: int
    mod_revision: int
    version: int
    value: bytes
    lease: int

    def json(self, key: bytes) -> dict[str, Any]:
        out: dict[str, Any] = {
            "key": _b64(key),
            "create_revision": str(self.create_revision),
            "mod_revision": str(self.mod_revision),
            "version": str(self.version),
        }
        if self.value:
            out["value"] = _b64(self.value)
        if self.lease:
            out["lease"] = str(self.lease)
        return out


@dataclass
class Lease:
    granted: int  # seconds
    expires_at: float
    keys: set[bytes] = field(default_factory=set)


@dataclass(frozen=True)
class Event:
    """One change of a key, as a watch reports it."""

    revision: int
    kind: str  # "PUT" or "DELETE"
    key: bytes


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text or "")


def _int(value: Any) -> int:
    return int(value or 0)


class EtcdModel:
    """One etcd member's store and lessor; ``now`` is its clock in seconds."""

    def __init__(
        self,
        now: Callable[[], float],
        *,
        min_ttl: int = 1,
        revision: int = 1,
        lease_ids: Iterator[int] | None = None,
    ) -> None:
        self.now = now
        self.min_ttl = min_ttl
        self.revision = revision
        self.kv: dict[bytes, KeyValue] = {}
        self.leases: dict[int, Lease] = {}
        self.history: list[Event] = []
        self._lease_ids = lease_ids or itertools.count(7587880000000000001)

    # -- the gateway ---------------------------------------------------------------------

    def handle(self, path: str, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Answer one ``POST /v3<path>``: the HTTP status and the JSON body."""
        self.expire()
        handler = {
            "/kv/range": self._range_request,
            "/kv/put": lambda p: self._txn({"success": [{"request_put": p}]}, single="put"),
            "/kv/deleterange": lambda p: self._txn(
                {"success": [{"request_delete_range": p}]}, single="delete_range"
            ),
            "/kv/txn": self._txn,
            "/lease/grant": self._grant,
            "/lease/revoke": self._revoke_request,
            "/lease/keepalive": self._keepalive,
            "/lease/timetolive": self._timetolive,
        }.get(path)
        if handler is None:
            return 404, {"error": "Not Found", "message": "Not Found", "code": 5}
        try:
            return 200, handler(payload)
        except GatewayError as exc:
            return exc.status, {"error": exc.message, "message": exc.message, "code": exc.code}

    def header(self) -> dict[str, str]:
        return {
            "cluster_id": CLUSTER_ID,
            "member_id": MEMBER_ID,
            "revision": str(self.revision),
            "raft_term": RAFT_TERM,
        }

    # -- time ------------------------------------------------------------------------------

    def expire(self) -> None:
        """End every lease whose deadline has passed (deleting its keys)."""
        now = self.now()
        for lease_id in [i for i, lease in self.leases.items() if lease.expires_at <= now]:
            self._end_lease(lease_id)

    def restart(self) -> None:
        """A member restart keeps the store (etcd persists), and gives every lease a fresh
        TTL (etcd's lessor renews leases on promotion, so none expires during an outage)."""
        now = self.now()
        for lease in self.leases.values():
            lease.expires_at = now + lease.granted

    # -- kv ----------------------------------------------------------------------------------

    def _keys(self, key: bytes, range_end: bytes | None) -> list[bytes]:
        if not range_end:
            return [key] if key in self.kv else []
        if range_end == b"\0":
            return sorted(k for k in self.kv if k >= key)
        return sorted(k for k in self.kv if key <= k < range_end)

    def _range(self, request: dict[str, Any]) -> dict[str, Any]:
        keys = self._keys(_unb64(request.get("key")), _unb64(request.get("range_end")) or None)
        out: dict[str, Any] = {"header": {"revision": str(self.revision)}}
        if keys:
            out["kvs"] = [self.kv[k].json(k) for k in keys]
            out["count"] = str(len(keys))
        return out

    def _range_request(self, request: dict[str, Any]) -> dict[str, Any]:
        answer = self._range(request)
        answer["header"] = self.header()
        return answer

    def _compare(self, compare: dict[str, Any]) -> bool:
        target = compare.get("target", "VERSION")
        result = compare.get("result", "EQUAL")
        keys = self._keys(_unb64(compare.get("key")), _unb64(compare.get("range_end")) or None)
        if not keys:
            if target == "VALUE":
                return False  # etcd: a missing key's value never compares
            kvs = [KeyValue(0, 0, 0, b"", 0)]
        else:
            kvs = [self.kv[k] for k in keys]
        for kv in kvs:
            ours: Any
            theirs: Any
            if target == "VALUE":
                ours, theirs = kv.value, _unb64(compare.get("value"))
            else:
                attribute = {
                    "VERSION": "version",
                    "CREATE": "create_revision",
                    "MOD": "mod_revision",
                    "LEASE": "lease",
                }[target]
                ours, theirs = getattr(kv, attribute), _int(compare.get(attribute))
            holds = {
                "EQUAL": ours == theirs,
                "NOT_EQUAL": ours != theirs,
                "GREATER": ours > theirs,
                "LESS": ours < theirs,
            }[result]
            if not holds:
                return False
        return True

    def _txn(self, request: dict[str, Any], single: str | None = None) -> dict[str, Any]:
        succeeded = all(self._compare(c) for c in request.get("compare", []))
        ops = request.get("success" if succeeded else "failure", [])
        for op in ops:  # a put on a lease that is gone refuses the whole request
            put = op.get("request_put")
            if put is not None and _int(put.get("lease")) and _int(put["lease"]) not in self.leases:
                raise GatewayError(*LEASE_NOT_FOUND)
        revision = self.revision + 1  # the revision of this request's writes, if any
        wrote = False
        responses: list[dict[str, Any]] = []
        for op in ops:
            if "request_range" in op:
                answer = self._range(op["request_range"])
                responses.append({"response_range": answer})
            elif "request_put" in op:
                responses.append({"response_put": self._put(op["request_put"], revision)})
                wrote = True
            elif "request_delete_range" in op:
                answer = self._delete(op["request_delete_range"], revision)
                wrote = wrote or answer.get("deleted") is not None
                responses.append({"response_delete_range": answer})
        if wrote:
            self.revision = revision
        for response in responses:  # every op's header: the request's final revision
            next(iter(response.values()))["header"] = {"revision": str(self.revision)}
        if single is not None:  # /kv/put or /kv/deleterange: the op's own answer
            (answer,) = (next(iter(r.values())) for r in responses)
            answer["header"] = self.header()
            return answer
        out: dict[str, Any] = {"header": self.header()}
        if succeeded:
            out["succeeded"] = True
        if responses:
            out["responses"] = responses
        return out

    def _put(self, request: dict[str, Any], revision: int) -> dict[str, Any]:
        key, value, lease = (
            _unb64(request["key"]),
            _unb64(request.get("value")),
            _int(request.get("lease")),
        )
        old = self.kv.get(key)
        answer: dict[str, Any] = {}
        if old is not None and request.get("prev_kv"):
            answer["prev_kv"] = old.json(key)
        if old is not None and old.lease and old.lease in self.leases:
            self.leases[old.lease].keys.discard(key)
        self.kv[key] = KeyValue(
            create_revision=old.create_revision if old else revision,
            mod_revision=revision,
            version=(old.version if old else 0) + 1,
            value=value,
            lease=lease,
        )
        if lease:
            self.leases[lease].keys.add(key)
        self.history.append(Event(revision, "PUT", key))
        return answer

    def _delete(self, request: dict[str, Any], revision: int) -> dict[str, Any]:
        keys = self._keys(_unb64(request.get("key")), _unb64(request.get("range_end")) or None)
        answer: dict[str, Any] = {}
        if not keys:
            return answer
        answer["deleted"] = str(len(keys))
        if request.get("prev_kv"):
            answer["prev_kvs"] = [self.kv[k].json(k) for k in keys]
        for key in keys:
            kv = self.kv.pop(key)
            if kv.lease and kv.lease in self.leases:
                self.leases[kv.lease].keys.discard(key)
            self.history.append(Event(revision, "DELETE", key))
        return answer

    def events_since(self, key: bytes, revision: int) -> list[Event]:
        """The changes of ``key`` at revisions >= ``revision`` (a watch's start)."""
        return [e for e in self.history if e.key == key and e.revision >= revision]

    # -- leases ------------------------------------------------------------------------------

    def _grant(self, request: dict[str, Any]) -> dict[str, Any]:
        seconds = max(_int(request.get("TTL")), self.min_ttl)
        lease_id = _int(request.get("ID")) or next(self._lease_ids)
        self.leases[lease_id] = Lease(seconds, self.now() + seconds)
        return {"header": self.header(), "ID": str(lease_id), "TTL": str(seconds)}

    def _end_lease(self, lease_id: int) -> None:
        lease = self.leases.pop(lease_id)
        if lease.keys:
            revision = self.revision + 1
            for key in sorted(lease.keys):
                del self.kv[key]
                self.history.append(Event(revision, "DELETE", key))
            self.revision = revision

    def _revoke_request(self, request: dict[str, Any]) -> dict[str, Any]:
        lease_id = _int(request.get("ID"))
        if lease_id not in self.leases:
            raise GatewayError(*LEASE_NOT_FOUND)
        self._end_lease(lease_id)
        return {"header": self.header()}

    def _keepalive(self, request: dict[str, Any]) -> dict[str, Any]:
        lease_id = _int(request.get("ID"))
        result: dict[str, Any] = {"header": self.header(), "ID": str(lease_id)}
        lease = self.leases.get(lease_id)
        if lease is not None:
            lease.expires_at = self.now() + lease.granted
            result["TTL"] = str(lease.granted)
        return {"result": result}

    def _timetolive(self, request: dict[str, Any]) -> dict[str, Any]:
        lease_id = _int(request.get("ID"))
        out: dict[str, Any] = {"header": self.header(), "ID": str(lease_id)}
        lease = self.leases.get(lease_id)
        if lease is None:
            out["TTL"] = "-1"
            return out
        remaining = math.floor(max(0.0, lease.expires_at - self.now()))
        if remaining:
            out["TTL"] = str(remaining)
        out["grantedTTL"] = str(lease.granted)
        return out


class ModelResponse:
    """What ``etcd3gw`` and the backend read of a ``requests.Response``."""

    def __init__(self, status: int, body: dict[str, Any], lines: list[bytes] | None = None):
        self.status_code = status
        self.reason = "OK" if status == 200 else "Not Found"
        self.text = json.dumps(body, separators=(",", ":"))
        self._body = body
        self._lines = lines

    def json(self) -> dict[str, Any]:
        return json.loads(self.text)

    def raise_for_status(self) -> None:
        if self.status_code != 200:
            import requests

            raise requests.HTTPError(f"{self.status_code} {self.reason}", response=self)  # type: ignore[arg-type]

    def iter_lines(self) -> Iterator[bytes]:
        yield from self._lines or []

    def close(self) -> None:
        pass


class ModelSession:
    """A ``requests.Session`` whose posts the model answers directly (no network).

    A ``/watch`` is answered at once with the events already in the key's history after
    its start revision, then the end of the stream.
    """

    def __init__(self, model: EtcdModel) -> None:
        self.model = model
        self.headers: dict[str, Any] = {}

    def post(self, url: str, json: Any = None, **_: Any) -> ModelResponse:
        path = "/" + url.split("/v3/", 1)[1].lstrip("/")
        if path == "/watch":
            create = (json or {}).get("create_request", {})
            self.model.expire()
            key = _unb64(create.get("key"))
            skip = {"NOPUT": "PUT", "NODELETE": "DELETE"}
            dropped = {skip[f] for f in create.get("filters", []) if f in skip}
            events = [
                e
                for e in self.model.events_since(key, _int(create.get("start_revision")))
                if e.kind not in dropped
            ]
            created = {"result": {"header": self.model.header(), "created": True}}
            lines = [_dumps(created)]
            if events:
                result = {
                    "header": self.model.header(),
                    "events": [{"type": e.kind, "kv": {"key": _b64(e.key)}} for e in events],
                }
                lines.append(_dumps({"result": result}))
            return ModelResponse(200, {}, lines)
        status, body = self.model.handle(path, json or {})
        return ModelResponse(status, body)

    def close(self) -> None:
        pass


def _dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()
