"""The simulator's etcd model against a real etcd: the production backend over each, the
same operations, the same answers and the same store after every step.

Hypothesis draws sequences of the ``EtcdBackend`` calls a lock makes (acquire, with the
same token again as a retry or a publish-time lock does, renew with the TTL or another
one, which moves the key onto a new lease, release, force release of the holder seen or of
a wrong fence, holder, holders) and raw gateway requests the backend never sends but the
model must still get right (transactions comparing each target with each result, puts
on a revoked lease, revokes, keep-alives of unknown leases). Two backends, built from the
same URL, send them: one to a real etcd, one through :class:`ModelSession` to the model.

What differs by nature is normalised before comparing: revisions count from the store's
revision when the example began (each side its own), lease ids by the order in which
each side granted them, and the clock's readings (``acquired``, ``expires_at``) are
dropped; ``timetolive`` and ``retry_after`` may differ by the second the two sides'
clocks straddle. Every TTL is long enough that nothing expires inside an example; the
expiry of a lease, which a real etcd notices up to about half a second late, is the
test of its own below.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from task_locks.backends.etcd import EtcdBackend
from task_locks.errors import LockError
from task_locks.types import Owner
from tests.servers import EtcdServer, wait_until

from .etcd_model import EtcdModel, ModelSession

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

NAMES = ["a", "b/ö"]
TOKENS = ["t0", "t1"]
OWNER = Owner(host="h", pid=1, thread="t")
ttls = st.sampled_from([30_000, 45_500, 60_000])
names = st.sampled_from(NAMES)
tokens = st.sampled_from(TOKENS)
targets = st.sampled_from(["VERSION", "CREATE", "MOD", "VALUE", "LEASE"])
results = st.sampled_from(["EQUAL", "NOT_EQUAL", "GREATER", "LESS"])

operations = st.one_of(
    st.tuples(st.just("acquire"), names, tokens, ttls),
    st.tuples(st.just("renew"), names, tokens, ttls),
    st.tuples(st.just("release"), names, tokens),
    st.tuples(st.just("force"), names, st.sampled_from(["seen", "wrong", "any"])),
    st.tuples(st.just("holder"), names),
    st.tuples(st.just("holders")),
    st.tuples(st.just("compare"), names, targets, results, st.sampled_from([0, 1, 2, 3])),
    st.tuples(st.just("put_on_revoked"), names),
    st.tuples(st.just("keepalive_unknown")),
    st.tuples(st.just("keepalive_last")),
    st.tuples(st.just("revoke_unknown")),
    st.tuples(st.just("delete_missing")),
)


class Recorder:
    """A session that remembers the lease ids it saw granted, in order."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.headers = getattr(inner, "headers", {})
        self.granted: list[int] = []

    def post(self, url: str, **kwargs: Any) -> Any:
        answer = self.inner.post(url, **kwargs)
        if url.endswith("/lease/grant") and answer.status_code == 200:
            self.granted.append(int(answer.json()["ID"]))
        return answer

    def close(self) -> None:
        self.inner.close()


class Side:
    """One backend and what normalises its answers."""

    def __init__(self, backend: EtcdBackend, session: Recorder, base: int) -> None:
        self.backend, self.session, self.base = backend, session, base
        self.fences: dict[str, int] = {}

    def lease(self, lease_id: int) -> str:
        if not lease_id:
            return "none"
        if lease_id in self.session.granted:
            return f"L{self.session.granted.index(lease_id)}"
        return "foreign"

    def rev(self, revision: int) -> int:
        return revision - self.base if revision else 0

    def value(self, raw: bytes) -> Any:
        try:
            data = json.loads(raw)
        except ValueError:
            return raw
        if isinstance(data, dict):
            data.pop("acquired", None)
            if "lease" in data:
                data["lease"] = self.lease(int(data["lease"]))
        return data

    def post(self, path: str, payload: dict[str, Any]) -> tuple[int, Any]:
        client = self.backend._client_list()[0]
        answer = client.session.post(client.get_url(path), json=payload)
        return answer.status_code, answer.json()

    def store(self) -> list[Any]:
        prefix = self.backend.prefix
        _, body = self.post(
            "/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix[:-1] + b"0")}
        )
        return [
            (
                base64.b64decode(kv["key"]).decode(),
                self.rev(int(kv["create_revision"])),
                self.rev(int(kv["mod_revision"])),
                int(kv["version"]),
                self.value(base64.b64decode(kv.get("value", ""))),
                self.lease(int(kv.get("lease", 0))),
            )
            for kv in body.get("kvs", [])
        ]

    def run(self, op: tuple[Any, ...]) -> Any:
        try:
            return self._run(op)
        except LockError as exc:
            return ("error", type(exc).__name__)

    def _run(self, op: tuple[Any, ...]) -> Any:
        kind, backend = op[0], self.backend
        if kind == "acquire":
            _, name, token, ttl = op
            got = backend.acquire(name, token, ttl, OWNER)
            if got.fence is not None:
                self.fences[name] = got.fence
                return ("acquired", self.rev(got.fence))
            return ("held", self.rev(got.holder_fence or 0), got.holder, got.retry_after)
        if kind == "renew":
            return backend.renew(op[1], op[2], op[3])
        if kind == "release":
            return backend.release(op[1], op[2])
        if kind == "force":
            _, name, which = op
            fence = {"seen": self.fences.get(name, self.base + 1), "wrong": 1, "any": None}
            return backend.force_release(name, fence[which])
        if kind == "holder":
            found = backend.holder(op[1])
            return None if found is None else (found.name, self.rev(found.fence), found.owner)
        if kind == "holders":
            return [(h.name, self.rev(h.fence), h.owner) for h in backend.holders()]
        if kind == "compare":
            _, name, target, result, amount = op
            key = backend.prefix + name.encode()
            field = {
                "VERSION": "version",
                "CREATE": "create_revision",
                "MOD": "mod_revision",
                "LEASE": "lease",
            }
            compare: dict[str, Any] = {"key": _b64(key), "target": target, "result": result}
            if target == "VALUE":
                compare["value"] = _b64(b"{" * amount)
            elif target == "LEASE":
                granted = self.session.granted
                compare["lease"] = granted[-1] if granted and amount else 0
            elif target in ("CREATE", "MOD"):
                compare[field[target]] = self.base + amount if amount else 0
            else:
                compare[field[target]] = amount
            txn = {
                "compare": [compare],
                "success": [{"request_range": {"key": _b64(key)}}],
                "failure": [],
            }
            status, body = self.post("/kv/txn", txn)
            return status, bool(body.get("succeeded")), len(body.get("responses", []))
        if kind == "put_on_revoked":
            _, body = self.post("/lease/grant", {"TTL": 30})
            lease = int(body["ID"])
            self.session.granted.append(lease)
            self.post("/lease/revoke", {"ID": lease})
            key = backend.prefix + op[1].encode()
            put = {"request_put": {"key": _b64(key), "value": _b64(b"x"), "lease": lease}}
            status, body = self.post("/kv/txn", {"compare": [], "success": [put]})
            return status, body.get("code"), body.get("message")
        if kind == "keepalive_unknown":
            status, body = self.post("/lease/keepalive", {"ID": 12345})
            return status, body["result"].get("TTL")
        if kind == "keepalive_last":  # the newest lease this side granted, if any
            if not self.session.granted:
                return None
            _, body = self.post("/lease/keepalive", {"ID": self.session.granted[-1]})
            return body["result"].get("TTL")
        if kind == "revoke_unknown":
            status, body = self.post("/lease/revoke", {"ID": 12345})
            return status, body.get("code"), body.get("message")
        if kind == "delete_missing":  # deletes nothing: the store's revision stays
            _, body = self.post("/kv/deleterange", {"key": _b64(backend.prefix + b"none")})
            return body.get("deleted"), self.rev(int(body["header"]["revision"]))
        raise AssertionError(op)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _same(op: tuple[Any, ...], real: Any, model: Any) -> bool:
    """Equal, but for a holder's ``retry_after`` (whole seconds that may straddle)."""
    if op[0] == "acquire" and real and real[0] == "held" and model and model[0] == "held":
        close = (real[3] is None) == (model[3] is None) and (
            real[3] is None or abs(real[3] - model[3]) <= 1.0
        )
        return real[:3] == model[:3] and close
    return bool(real == model)


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    """An etcd of this module's own: no other test's lease may end (and raise the store's
    revision) while an example runs."""
    server = EtcdServer().start()
    yield server
    server.cleanup()


def _sides(etcd: EtcdServer) -> tuple[Side, Side, EtcdModel]:
    url = etcd.url(prefix=f"d{uuid.uuid4().hex[:8]}/")
    real = EtcdBackend(url)
    client = real._client_list()[0]
    client.session = Recorder(client.session)
    base = int(
        requests.post(f"{etcd.client_url}/v3/kv/range", json={"key": "AA=="}).json()["header"][
            "revision"
        ]
    )
    model = EtcdModel(time.monotonic, revision=base)
    simulated = EtcdBackend(url)
    for client in simulated._client_list():
        client.session = Recorder(ModelSession(model))
    for backend in (real, simulated):
        # Revoke at once, in the call, as the simulation does (etcd_world.etcd_backend):
        # the two recordings are compared request by request.
        backend._revoke_later = backend._revoke_quietly  # type: ignore[method-assign]
    return (
        Side(real, real._client_list()[0].session, base),
        Side(simulated, simulated._client_list()[0].session, base),
        model,
    )


def _clear(side: Side) -> None:
    """Delete what the example left, so no later expiry moves the store's revision."""
    prefix = side.backend.prefix
    side.post("/kv/deleterange", {"key": _b64(prefix), "range_end": _b64(prefix[:-1] + b"0")})
    for lease in side.session.granted:
        side.post("/lease/revoke", {"ID": lease})
    side.backend.close()


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(operations, min_size=1, max_size=14))
def test_the_model_answers_as_etcd_does(etcd: EtcdServer, ops: list[tuple[Any, ...]]) -> None:
    real, model_side, _ = _sides(etcd)
    try:
        for step, op in enumerate(ops):
            got_real, got_model = real.run(op), model_side.run(op)
            assert _same(op, got_real, got_model), (step, op, got_real, got_model)
            assert real.store() == model_side.store(), (step, op)
    finally:
        _clear(real)


def test_a_lease_that_ends_frees_its_key_on_both(etcd: EtcdServer) -> None:
    """A lock whose lease is not kept alive is gone on both sides after its TTL (the real
    etcd within about half a second more), and the next holder's fence is the same."""
    real, model_side, _ = _sides(etcd)
    try:
        for side in (real, model_side):
            assert side.run(("acquire", "a", "t0", 1000))[0] == "acquired"
        wait_until(lambda: real.run(("holder", "a")) is None, 5, "the real lease to end")
        assert model_side.run(("holder", "a")) is None
        assert real.run(("acquire", "a", "t1", 30_000)) == model_side.run(
            ("acquire", "a", "t1", 30_000)
        )
        assert real.store() == model_side.store()
    finally:
        _clear(real)
