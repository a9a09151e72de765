"""etcd (consensus): ``etcd://host[:port][,host[:port]...][?options]`` (port 2379 by default).

Locks that stay correct while a majority of the etcd cluster is up: every decision is a
Raft-replicated transaction, and a lock's fence is the key's ``create_revision``, which
the cluster's single revision counter makes strictly increasing per name.

``etcd3gw`` is used only as the HTTP transport to etcd's v3 JSON gateway (``/v3/...``):
its own ``Lock`` has no keep-alive, exposes no revision and lets ``with lock:`` enter even
when the acquire failed, so the protocol below is ours.

- **acquire**: grant a lease of ``ceil(ttl)`` seconds, then one transaction: if the key's
  ``create_revision == 0`` (absent), put our value (token, owner, lease) with that lease;
  else read the holder. Held by someone else: the attempt revokes its lease at once
  instead of leaking it, and reports the holder's remaining lease TTL so the caller
  knows how long to wait. Held by our own token with *our* lease: our write went through
  and only its reply was lost (the transaction was retried on another endpoint), so the
  lease is kept, never revoked. Held by our token with another lease (a publish-time
  lock becoming the run lock): a compare-and-swap on create_revision and value moves the
  key onto the fresh lease with the new owner, which resets the TTL and keeps the fence.
  Every put carries a lease, so no key is ever left without an expiry.
- **renew**: lease keep-alive; an answer without a TTL (or TTL 0) means the lease is
  gone. A keep-alive alone proves nothing about the key, so ownership is then checked by
  a transaction comparing the key's ``create_revision`` with ours before the renewal is
  reported (one transaction for a whole batch; a batch that fails is read back per key).
- **release**: a transaction deleting the key only if its ``create_revision`` and value
  are still ours; its answer is the release's. A lost reply is retried on the next
  endpoint; a retry that finds the key gone cannot tell our delete from an expiry, and
  raises :class:`~task_locks.errors.BackendUnavailable` rather than guess. The lease,
  which carries nothing once the key is gone, is revoked after the call returns, by the
  backend's revoker thread (as are the leases of refused acquires): three requests on
  the caller's path, not four. A revoke still queued when the process exits is dropped,
  and that lease ends at its TTL; ``close()`` sends the queued ones first.
- **force release**: a transaction deleting the key only if its ``create_revision`` is
  the fence the operator saw; the holder's lease (from the delete's ``prev_kv``) is
  revoked only when that delete happened. Lost replies as for release.
- **wait**: a watch on the key (DELETE events only) from the revision at which we saw it
  held, so a release between our failed acquire and the watch is not missed; it ends at
  the first event or after the timeout.
- **holders**: a range read over the prefix, plus each holder's lease TTL.

Every request has a short timeout (``timeout``, default 2 s). A request that could not
even be delivered (connection refused) moves on to the next endpoint; reads, lease
calls, the acquire transaction (a retry finds our own token and lease) and the deletes
of release and force release (a retry that finds nothing to delete says it cannot
tell) also move on after other transport errors. Errors from ``requests``/``etcd3gw`` become
:class:`~task_locks.errors.BackendUnavailable` (or :class:`~task_locks.errors.LockError`
for a refused request) here.

Limits: lease TTLs are whole seconds (rounded up), at most :data:`MAX_LEASE_SECONDS`
(etcd's own maximum, about 285 years: a longer TTL is refused before anything is
written), and the server enforces a minimum
(1.5 election timeouts rounded up: 2 s with etcd's defaults); the leader checks expiry
about every 500 ms, so a dead holder's lock ends within ``ceil(ttl)`` + 0.5 s; a new
leader restarts every lease's TTL, so a leader change can lengthen (never shorten) a
dead holder's lock. ``renewals`` is not tracked (a keep-alive leaves no trace in the
key) and ``acquired_at`` is the acquiring client's clock.

asyncio: every call runs the sync one in a worker thread (``Backend``'s adapter); a
waiting :class:`~task_locks.AsyncLock` holds one thread of the adapter's wait pool
(:data:`~task_locks.backends.base.ASYNC_WAIT_THREADS` per process) for its watch, so
waiters never hold up the renewals and releases queued in the loop's default executor.

Options: ``prefix`` (default ``task_locks/``), ``timeout`` (seconds per request).

Security: ``etcds://`` speaks HTTPS (etcd3gw's own TLS support: a ``requests`` session
with ``verify`` and ``cert``). Options ``ca`` (CA bundle file; default: the system's
trust store), ``cert`` and ``key`` (client certificate and its key, for a cluster run
with ``--client-cert-auth``); the server's certificate must name the host in the URL
(``check_hostname=false`` turns only that check off, never the chain check).
``etcd://user:password@...`` (or ``etcds://``) authenticates with etcd's RBAC
(``/v3/auth/authenticate``) on first use and sends the token with every request; an
expired or invalidated token ("invalid auth token") is renewed once per request and the
request resent. A request the user's role does not allow ("permission denied") raises
:class:`~task_locks.errors.InvalidArgument` naming the prefix the role must cover, as
does a wrong user or password: both are configuration errors, not an outage. The
password and token never appear in errors, logs or ``repr``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import queue
import socket
import threading
import time
import weakref
from base64 import b64decode, b64encode
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, NoReturn
from urllib.parse import unquote, urlsplit

import etcd3gw
import requests
from etcd3gw import exceptions as etcd_errors
from requests.adapters import HTTPAdapter

from ..errors import BackendUnavailable, InvalidArgument, LockError
from ..types import AcquireResult, Holder, Owner, RenewItem, RunCheck
from .base import Backend, Capability, RunChecked
from .notices import Notice, NoticeStream, close_streams, retired, track

log = logging.getLogger("task_locks.backends.etcd")

_OPTIONS: Final = {"prefix", "timeout"}
#: Options only ``etcds://`` takes (TLS files and the hostname check).
_TLS_OPTIONS: Final = {"ca", "cert", "key", "check_hostname"}
#: HTTP connections kept per endpoint (threads beyond this open short-lived ones).
_POOL_SIZE: Final = 32
#: Names whose last-seen revision is remembered for watches (a bounded hint).
_SEEN_MAX: Final = 10_000
#: etcd's longest lease (``MaxLeaseTTL`` in its lessor, seconds): a longer grant is refused.
MAX_LEASE_SECONDS: Final = 9_000_000_000
#: Compare-and-swap rounds a same-token acquire tries while the key changes under it.
_TAKE_ROUNDS: Final = 4
#: Transport failures: the server may or may not have seen the request.
_TRANSPORT = (
    etcd_errors.ConnectionFailedError,
    etcd_errors.ConnectionTimeoutError,
    etcd_errors.InternalServerError,
    requests.RequestException,
    OSError,
)


class _Revoker:
    """One daemon thread that revokes the leases a backend no longer needs.

    A released key's lease carries nothing, so its revoke need not hold up the release:
    it only spares etcd a lease that would otherwise live out its TTL. The thread
    belongs to the process that started it (a forked child starts its own, and drops
    what its parent had queued).
    """

    def __init__(self, backend: EtcdBackend) -> None:
        # By weak reference: the thread must not keep its backend alive; once the
        # backend is collected, the thread is told to end.
        self._revoke = weakref.WeakMethod(backend._revoke_quietly)
        self._queue: queue.SimpleQueue[tuple[str, int] | None] = queue.SimpleQueue()
        weakref.finalize(backend, self._queue.put, None)
        self._pid = os.getpid()
        self._stopped = False
        self._thread = threading.Thread(
            target=self._run, name=f"task-locks-revoker {backend.server}", daemon=True
        )
        self._thread.start()

    def serves_this_process(self) -> bool:
        return self._pid == os.getpid() and self._thread.is_alive()

    def submit(self, name: str, lease: int) -> None:
        self._queue.put((name, lease))

    def close(self, timeout: float) -> None:
        """Send what is queued, waiting up to ``timeout``; whatever is left then is
        dropped (those leases end at their TTL)."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._stopped = True

    def _run(self) -> None:
        while (item := self._queue.get()) is not None and not self._stopped:
            revoke = self._revoke()
            if revoke is None:
                return
            try:
                revoke(*item)
            except Exception:  # never let one revoke end the thread; the lease expires
                log.debug("revoking lease %s of %r failed", item[1], item[0], exc_info=True)
            del revoke


class _LeaseGone(LockError):
    """etcd refused a request because the lease it names no longer exists."""


class _TokenExpired(LockError):
    """etcd refused our auth token (idle past ``--auth-token-ttl``, or the user's password
    changed): authenticate again."""


class _TLSAdapter(HTTPAdapter):
    """An HTTPS adapter that may skip the hostname check (``check_hostname=false``) only.

    The certificate chain is still verified against ``ca``: this is for clusters whose
    certificates name a host other than the one dialled (an IP, a tunnel).
    """

    def __init__(self, check_hostname: bool, **kwargs: Any) -> None:
        self._check_hostname = check_hostname
        super().__init__(**kwargs)

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        if not self._check_hostname:
            kwargs["assert_hostname"] = False
        super().init_poolmanager(*args, **kwargs)


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


def _token_refused(exc: etcd_errors.Etcd3Exception) -> bool:
    """etcd says our auth token is no longer valid (see :class:`_TokenExpired`)."""
    detail = str(getattr(exc, "detail_text", "") or "")
    return "invalid auth token" in detail


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


def _absent(key: str) -> dict[str, Any]:
    """Txn condition: ``key`` (base64) does not exist."""
    return {"key": key, "result": "EQUAL", "target": "VERSION", "version": 0}


def _same(kv: dict[str, Any]) -> dict[str, Any]:
    """Txn condition: the key of ``kv`` is unchanged since it was read."""
    return {
        "key": kv["key"],
        "result": "EQUAL",
        "target": "MOD",
        "mod_revision": kv["mod_revision"],
    }


def _a_copy(data: dict[str, Any], mine: set[str], run: RunCheck | None) -> bool:
    """Whether a key's value is held by a run of ``run``'s task id under another token."""
    if run is None or data.get("token") in mine:
        return False
    owner = data.get("owner")
    return isinstance(owner, dict) and owner.get("task_id") == run.task_id


class _Budget:
    """What is left of one call's time bound, across the requests it makes."""

    __slots__ = ("deadline",)

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def bound(self, client: etcd3gw.Etcd3Client) -> etcd3gw.Etcd3Client:
        """``client`` with its timeout cut to what is left (a copy sharing its session)."""
        left = max(0.001, self.deadline - time.monotonic())
        if client.timeout is not None and client.timeout <= left:
            return client
        bounded = copy.copy(client)
        bounded.timeout = left
        return bounded


def _seconds(ttl_ms: int) -> int:
    """The whole-second TTL etcd grants for ``ttl_ms``."""
    return max(1, math.ceil(ttl_ms / 1000))


def _granted_seconds(held: _Held) -> int | None:
    """The TTL ``held``'s lease was granted with, from the value acquire/relet wrote."""
    try:
        ttl_ms = json.loads(held.value).get("ttl_ms")
    except (ValueError, AttributeError):
        return None
    return _seconds(ttl_ms) if isinstance(ttl_ms, int) else None


#: A watch stream with nothing to say for this long is opened again (from the revision
#: it reached): the gateway's stream has no read deadline of its own.
WATCH_SLICE: Final = 5.0
#: Why a lease is lost when etcd reports its key deleted by someone else.
DELETED_NOTICE: Final = (
    "its key was deleted in etcd (an operator's force release, or its etcd lease expired)"
)


class _EtcdNotices:
    """Release notices of one prefix: the DELETE events of one watch on it (``prev_kv``
    gives each deleted key's create revision, our fence).

    Unlike pub/sub, a watch replays: it starts at the lowest fence listened for, so a
    delete between an acquire and the watch is heard, and one resumed after a broken
    stream continues from the revision it reached. Every delete under the prefix is
    streamed (the listener drops those of locks it does not hold): the price of one watch
    per process instead of one per lease. Our own releases are deletes too; the lease
    ignores notices while its holder releases it.
    """

    def __init__(self, backend: EtcdBackend) -> None:
        self._backend = backend
        self._client: etcd3gw.Etcd3Client | None = None
        self._response: requests.Response | None = None
        self._lines: Iterator[bytes] | None = None
        #: The first revision not yet seen (0: from now).
        self._next = 0
        self._created = 0
        self._guard = threading.Lock()

    def open(self, since: int | None) -> None:
        backend = self._backend
        track(backend, self)  # closed with the backend
        start = max(since or 0, self._next)
        request: dict[str, Any] = {
            "create_request": {
                "key": _b64(backend.prefix),
                "range_end": _b64(_prefix_end(backend.prefix)),
                "filters": ["NOPUT"],
                "prev_kv": True,
                **({"start_revision": start} if start else {}),
            }
        }
        failures: list[str] = []
        for _, shared in backend._order():
            client = backend._make_client(shared.host, shared.port)
            try:
                if backend.user is not None:
                    if backend._token is None:
                        backend._authenticate(shared, None)
                    client.session.headers["Authorization"] = backend._token or ""
                response = client.session.post(
                    client.get_url("/watch"),
                    json=request,
                    stream=True,
                    timeout=(backend.timeout, WATCH_SLICE),
                )
                response.raise_for_status()
                lines = response.iter_lines()
                created = json.loads(next(line for line in lines if line)).get("result", {})
                if not created.get("created"):
                    raise BackendUnavailable(f"{backend.server}: the watch was not created")
            except (*_TRANSPORT, ValueError, StopIteration, BackendUnavailable) as exc:
                client.session.close()
                failures.append(f"{client.host}:{client.port}: {exc}")
                continue
            with self._guard:  # the backend's close() may have run meanwhile
                if not retired(self):
                    self._client, self._response, self._lines = client, response, lines
                    self._created = int(created.get("header", {}).get("revision", 0))
                    self._next = max(self._next, start)
                    return
            response.close()
            client.session.close()
            raise BackendUnavailable(f"{backend.server}: closed", server=backend.server)
        raise BackendUnavailable(
            f"release notices: cannot watch {backend.prefix.decode()!r} at {backend.server}: "
            + "; ".join(failures),
            server=backend.server,
        )

    def read(self, timeout: float) -> list[Notice]:
        # ``timeout`` is not honoured to the letter: the stream's socket has the read
        # timeout it was opened with (WATCH_SLICE), and is reopened after it.
        assert self._lines is not None
        try:
            line = next(self._lines, b"")
            while line == b"":
                if self._response is not None and self._response.raw.closed:
                    raise BackendUnavailable("the watch stream ended")
                line = next(self._lines, b"")
        except requests.ConnectionError as exc:
            if not isinstance(exc, requests.ReadTimeout) and "Read timed out" not in str(exc):
                raise BackendUnavailable(f"the watch stream broke: {exc}") from exc
            # Quiet for WATCH_SLICE: history up to the watch's creation was all sent.
            self._next = max(self._next, self._created + 1)
            self.close()
            self.open(None)
            return []
        except requests.RequestException as exc:
            raise BackendUnavailable(f"the watch stream broke: {exc}") from exc
        result = json.loads(line).get("result", {})
        if result.get("compact_revision") or result.get("canceled"):
            # History we asked for is gone: resume from what is left (the listener renews
            # every lease when it reconnects, which finds a delete we missed).
            self._next = max(self._next, int(result.get("compact_revision", 0)))
            raise BackendUnavailable(f"the watch was cancelled ({result})")
        notices = []
        prefix = self._backend.prefix
        for event in result.get("events", []):
            revision = int(event.get("kv", {}).get("mod_revision", 0))
            self._next = max(self._next, revision + 1)
            if event.get("type") != "DELETE":
                continue
            before = event.get("prev_kv") or {}
            key = b64decode(before.get("key", ""))
            fence = int(before.get("create_revision", 0))
            if fence and key.startswith(prefix):
                name = key[len(prefix) :].decode("utf-8", "replace")
                notices.append(Notice(name, fence, DELETED_NOTICE))
        return notices

    def close(self) -> None:
        with self._guard:
            response, client = self._response, self._client
            self._response = self._client = self._lines = None
        if response is not None:
            # Shut the socket down first: closing it while the listener thread reads would
            # wait for that read (its buffer's lock) until the read timeout.
            sock = getattr(getattr(response.raw, "_connection", None), "sock", None)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(Exception):
                response.close()
        if client is not None:
            with contextlib.suppress(Exception):
                client.session.close()


class EtcdBackend(Backend, RunChecked):
    capabilities = frozenset(
        {
            Capability.RUN_CHECK,
            Capability.CONSENSUS,
            Capability.FENCING,
            Capability.HOLDERS,
            Capability.MULTIPROCESS,
            Capability.RELEASE_NOTICE,
            Capability.WAKEUP,
        }
    )

    def __init__(self, url: str) -> None:
        super().__init__(url)
        parts = urlsplit(url)
        self.tls = parts.scheme.lower() == "etcds"
        query = self._options(_OPTIONS | _TLS_OPTIONS if self.tls else _OPTIONS)
        self._tls_files = self._tls(query) if self.tls else {}
        check = query.get("check_hostname", "true").lower()
        if check not in ("true", "1", "yes", "false", "0", "no"):
            raise InvalidArgument(
                f"{self.server}: option check_hostname={check!r} must be true or false"
            )
        self.check_hostname = check in ("true", "1", "yes")
        try:
            self.user, self._password = parts.username, parts.password
        except ValueError as exc:
            raise InvalidArgument(f"{self.server}: malformed credentials") from exc
        if "@" in parts.netloc and (not self.user or self._password is None):
            raise InvalidArgument(
                f"{self.server}: etcd credentials are user:password@ (both, URL-encoded)"
            )
        self.user = unquote(self.user) if self.user else None
        self._password = unquote(self._password) if self._password is not None else None
        self._token: str | None = None
        if parts.path.strip("/"):
            raise InvalidArgument(
                f"{self.server}: an etcd URL has no path; use ?prefix= to pick a key prefix"
            )
        self.prefix = query.get("prefix", "task_locks/").encode()
        self.timeout = self._number(query, "timeout", 2.0, positive=True)
        self.endpoints = self._endpoints(parts.netloc.rsplit("@", 1)[-1])
        self._current = 0
        self._pid = -1
        self._clients: list[etcd3gw.Etcd3Client] = []
        self._guard = threading.Lock()
        self._held: dict[tuple[str, str], _Held] = {}
        self._seen: dict[str, int] = {}  # name -> a store revision at which it was held
        self._revoker: _Revoker | None = None

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

    def _tls(self, query: dict[str, str]) -> dict[str, str]:
        """The TLS files named by ``ca``/``cert``/``key``, each checked to be readable now."""
        files = {k: query[k] for k in ("ca", "cert", "key") if query.get(k)}
        if "key" in files and "cert" not in files:
            raise InvalidArgument(
                f"{self.server}: option key= needs cert= (the client certificate)"
            )
        for option, path in files.items():
            if not os.path.isfile(path) or not os.access(path, os.R_OK):
                raise InvalidArgument(
                    f"{self.server}: option {option}={path!r} is not a readable file"
                )
        return files

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

    def transport(self) -> etcd3gw.Etcd3Client:
        """The HTTP client (etcd3gw over one ``requests`` session) of the endpoint in use:
        where a benchmark sends bare requests over the very transport the locks use."""
        return self._client_list()[self._current]

    def _make_client(self, host: str, port: int) -> etcd3gw.Etcd3Client:
        session = requests.Session()
        pool: dict[str, Any] = {"pool_connections": 1, "pool_maxsize": _POOL_SIZE, "max_retries": 0}
        if self.tls:
            session.mount("https://", _TLSAdapter(self.check_hostname, **pool))
            session.verify = self._tls_files.get("ca", True)
            if "ca" in self._tls_files:
                # requests lets $REQUESTS_CA_BUNDLE / $CURL_CA_BUNDLE override a session's
                # verify: the CA the URL names would be silently ignored.
                session.trust_env = False
            if "cert" in self._tls_files:
                cert = self._tls_files["cert"]
                key = self._tls_files.get("key")
                session.cert = (cert, key) if key else cert
        else:
            session.mount("http://", HTTPAdapter(**pool))
        if session.trust_env:
            # requests reads the environment again (proxies, NO_PROXY, ~/.netrc, the CA
            # bundle) on every request: a tenth of each call's client CPU here. Read it
            # once, now. (A ~/.netrc login is left out: it would replace the RBAC token.)
            protocol = "https" if self.tls else "http"
            url = f"{protocol}://{host}:{port}"
            session.proxies.update(requests.utils.get_environ_proxies(url))
            if session.verify is True:
                bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
                session.verify = bundle or True
            session.trust_env = False
        if self._token:
            session.headers["Authorization"] = self._token
        return etcd3gw.Etcd3Client(
            host=host,
            port=port,
            protocol="https" if self.tls else "http",
            timeout=self.timeout,
            api_path="/v3/",
            session=session,
        )

    def _authenticate(self, client: etcd3gw.Etcd3Client, name: str | None) -> None:
        """Trade user and password for a token, sent from now on by every endpoint's session.

        The request goes without the old token (an expired one would refuse it). A wrong
        user or password is a configuration error: :class:`InvalidArgument`, and neither
        the password nor etcd's answer (which could echo it) is quoted.
        """
        url = client.get_url("/auth/authenticate")
        payload = {"name": self.user, "password": self._password}
        no_token: dict[str, Any] = {"Authorization": None}  # None: drop the session's header
        try:
            response = client.session.post(
                url, json=payload, timeout=self.timeout, headers=no_token
            )
        except requests.Timeout as exc:
            raise etcd_errors.ConnectionTimeoutError(type(exc).__name__) from None
        except requests.ConnectionError as exc:
            # its text names host, port and path, never the request body (the password)
            raise etcd_errors.ConnectionFailedError(str(exc)) from None
        if response.status_code >= 500:
            raise etcd_errors.InternalServerError(f"HTTP {response.status_code}")
        token = response.json().get("token") if response.ok else None
        if not token:
            what = f"lock {name!r}" if name else "listing locks"
            raise InvalidArgument(
                f"{what}: etcd at {self.server} refused the credentials of user "
                f"{self.user!r} (HTTP {response.status_code}): check the user and password",
                name=name,
            )
        self._token = str(token)
        for each in self._clients:
            each.session.headers["Authorization"] = self._token

    def _authorised_post(
        self, client: etcd3gw.Etcd3Client, name: str | None, path: str, payload: dict[str, Any]
    ) -> Any:
        """``client.post``, authenticating first (and once more after an expired token)."""
        if self.user is None:
            return client.post(client.get_url(path), json=payload)
        if self._token is None:
            self._authenticate(client, name)
        try:
            return client.post(client.get_url(path), json=payload)
        except etcd_errors.Etcd3Exception as exc:
            if not _token_refused(exc):
                raise
        self._authenticate(client, name)
        return client.post(client.get_url(path), json=payload)

    def _order(self) -> Iterator[tuple[int, etcd3gw.Etcd3Client]]:
        clients = self._client_list()
        start = self._current
        for step in range(len(clients)):
            index = (start + step) % len(clients)
            yield index, clients[index]

    def _post(
        self,
        name: str | None,
        path: str,
        payload: dict[str, Any],
        retry: bool,
        budget: _Budget | None = None,
    ) -> Any:
        """One gateway request; on failure, the next endpoint when that is safe."""
        return self._send(name, path, payload, retry, budget)[0]

    def _send(
        self,
        name: str | None,
        path: str,
        payload: dict[str, Any],
        retry: bool,
        budget: _Budget | None = None,
    ) -> tuple[Any, bool]:
        """:meth:`_post`, also saying whether an earlier attempt may have been applied.

        ``True`` when the answer comes from a retry after a failure that does not prove
        the request undelivered (a lost or late reply, a reset): the server may then
        have applied the request twice, and a conditional write's "not applied" may
        mean "already applied by the first attempt".
        """
        failures: list[str] = []
        last: BaseException | None = None
        repeated = False
        for index, client in self._order():
            try:
                if budget is not None:
                    client = budget.bound(client)
                answer = self._authorised_post(client, name, path, payload)
                self._current = index
                return answer, repeated
            except _TRANSPORT as exc:
                last = exc
                failures.append(f"{client.host}:{client.port}: {self._reason(exc)}")
                self._current = (index + 1) % len(self.endpoints)
                if not _undelivered(exc):
                    repeated = True
                    if not retry:
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
        reason = self._reason(exc)
        if "permission denied" in reason:
            user = f"user {self.user!r}" if self.user else "this client"
            raise InvalidArgument(
                f"{what}: etcd at {self.server} denied {path} to {user}: its role must "
                f"grant read-write on the key prefix {self.prefix.decode()!r} "
                f"(etcdctl role grant-permission ROLE --prefix readwrite "
                f"{self.prefix.decode()!r})",
                name=name,
            ) from exc
        if "user name is empty" in reason:
            raise InvalidArgument(
                f"{what}: etcd at {self.server} requires authentication: put "
                "user:password@ in the URL",
                name=name,
            ) from exc
        if _token_refused(exc):
            raise _TokenExpired(
                f"{what}: etcd at {self.server} refused the auth token for {path}: {reason}",
                name=name,
            ) from exc
        refusal = _LeaseGone if "lease not found" in reason else LockError
        raise refusal(f"{what}: etcd at {self.server} refused {path}: {reason}", name=name) from exc

    # -- requests ----------------------------------------------------------------------------

    def _key(self, name: str) -> bytes:
        return self.prefix + name.encode()

    def _txn(
        self,
        name: str | None,
        txn: dict[str, Any],
        retry: bool = False,
        budget: _Budget | None = None,
    ) -> Any:
        return self._post(name, "/kv/txn", txn, retry, budget)

    def _range(
        self,
        name: str | None,
        key: bytes,
        end: bytes | None = None,
        budget: _Budget | None = None,
    ) -> list[Any]:
        payload: dict[str, Any] = {"key": _b64(key)}
        if end is not None:
            payload["range_end"] = _b64(end)
        answer = self._post(name, "/kv/range", payload, True, budget)
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
        except _LeaseGone:
            pass

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
        return self._acquire(name, token, ttl_ms, owner, None)

    def acquire_run(
        self, name: str, token: str, ttl_ms: int, owner: Owner, run: RunCheck
    ) -> AcquireResult:
        return self._acquire(name, token, ttl_ms, owner, run)

    def _acquire(
        self, name: str, token: str, ttl_ms: int, owner: Owner, run: RunCheck | None
    ) -> AcquireResult:
        seconds = max(1, math.ceil(ttl_ms / 1000))
        if seconds > MAX_LEASE_SECONDS:
            raise InvalidArgument(
                f"lock {name!r}: a TTL of {ttl_ms / 1000:g}s is longer than etcd's longest "
                f"lease ({MAX_LEASE_SECONDS} s)",
                name=name,
            )
        for attempt in range(2):
            lease = self._grant(name, seconds)
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
            try:
                return self._take(name, token, lease, value, run)
            except _LeaseGone:
                # The grant's reply came after its TTL: the lease ended unused (etcd
                # refused the write, nothing changed). Once more with a fresh lease.
                if attempt:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _grant(self, name: str, seconds: int) -> int:
        """A fresh lease of ``seconds``: every lock key is written with one (never without)."""
        lease = int(self._post(name, "/lease/grant", {"TTL": seconds}, True).get("ID", 0))
        if not lease:
            raise BackendUnavailable(
                f"lock {name!r}: etcd at {self.server} granted no lease",
                name=name,
                server=self.server,
            )
        return lease

    def _take(
        self, name: str, token: str, lease: int, value: bytes, run: RunCheck | None = None
    ) -> AcquireResult:
        """Put ``value`` with our fresh ``lease`` if the key is free or already ``token``'s.

        Free: one transaction creates it (create_revision 0 -> ours). Held by our token
        (a retry after a lost reply, or a publish-time lock becoming the run lock): the
        key is moved onto the fresh lease with the new value (TTL and owner reset) by a
        compare-and-swap on its create_revision and value, which keeps the fence. A
        transaction whose reply was lost and was retried elsewhere finds the key with
        our lease: that is our own write, and ``lease`` is kept. ``lease`` is revoked
        only when the key is someone else's (then it carries nothing).

        A run check (``run``) reads the other names with the key; the write then also
        compares each one unchanged since it was read and seen free of a run of the
        same task id, so the check and the write are one transaction's.
        """
        key = _b64(self._key(name))
        put = [{"request_put": {"key": key, "value": _b64(value), "lease": lease}}]
        others = [] if run is None else [other for other in run.names if other != name]
        other_keys = [_b64(self._key(other)) for other in others]
        read = [{"request_range": {"key": k}} for k in (key, *other_keys)]
        free = [{"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}]
        unchanged = [_absent(k) for k in other_keys]
        mine = {token} if run is None or run.take_over is None else {token, run.take_over}
        ours = mine if run is None or run.mark is None else {*mine, run.mark}
        compare, previous = free + unchanged, None  # previous: the _Held our token had before
        for _ in range(_TAKE_ROUNDS):
            try:
                answer = self._txn(
                    name, {"compare": compare, "success": put, "failure": read}, True
                )
            except LockError:
                if previous is None:
                    # Unknown outcome: the lease carries at most a key created by this
                    # call, which nobody was told they hold; drop it rather than leave
                    # a lock nobody holds for a whole TTL.
                    self._revoke_quietly(name, lease)
                # After a takeover, the key may now be on our lease: revoking it would
                # free a lock its token's holder still believes held. It expires.
                raise
            if answer.get("succeeded"):
                fence = previous.revision if previous else int(answer["header"]["revision"])
                return self._taken(name, token, _Held(lease, fence, value), previous)
            found = [
                (response.get("response_range", {}).get("kvs") or [None])[0]
                for response in answer["responses"]
            ]
            unchanged = []
            for other, other_key, other_kv in zip(others, other_keys, found[1:], strict=True):
                if other_kv is not None and _a_copy(self._decode(other_kv)[0], ours, run):
                    self._revoke_later(name, lease)
                    return self._refusal(name, other_kv, other)
                unchanged.append(_absent(other_key) if other_kv is None else _same(other_kv))
            kv = found[0]
            if kv is None:  # freed since we looked: create it
                compare, previous = free + unchanged, None
                continue
            data, raw = self._decode(kv)
            revision = int(kv.get("create_revision", 0))
            if data.get("token") not in mine or _a_copy(data, ours, run):
                self._revoke_later(name, lease)  # never attached: the key is not ours
                self._note_held(name, answer)
                return self._refusal(name, kv)
            if int(kv.get("lease", 0)) == lease:  # our own write, its reply lost: keep it
                return self._taken(name, token, _Held(lease, revision, raw), previous)
            previous = _Held(int(kv.get("lease", 0)), revision, raw)
            compare = previous.compare(key) + unchanged
        raise BackendUnavailable(
            f"lock {name!r}: its key kept changing under a same-token acquire at {self.server}",
            name=name,
            server=self.server,
        )

    def _refusal(self, name: str, kv: dict[str, Any], other: str | None = None) -> AcquireResult:
        """A refused acquire: who holds ``kv`` (``other``: another name than ``name``)."""
        data, _ = self._decode(kv)
        remaining = self._lease_ttl(name, int(kv.get("lease", 0)))
        return AcquireResult(
            None,
            # whole seconds, rounded down; the watch wakes us sooner anyway
            retry_after=None if remaining is None else remaining + 1.0,
            holder=Owner.from_json(json.dumps(data.get("owner", {}))),
            holder_fence=int(kv.get("create_revision", 0)),
            holder_acquired_at=data.get("acquired"),
            holder_name=other,
        )

    def _taken(self, name: str, token: str, held: _Held, previous: _Held | None) -> AcquireResult:
        self._held[(name, token)] = held
        self._seen.pop(name, None)
        if previous is not None and previous.lease not in (0, held.lease):
            self._revoke_quietly(name, previous.lease)  # the key has left it: it carries nothing
        return AcquireResult(held.revision)

    def _revoke_quietly(self, name: str, lease: int) -> None:
        try:
            self._revoke(name, lease)
        except LockError:
            pass  # it expires by its TTL

    def _revoke_later(self, name: str, lease: int) -> None:
        """Revoke ``lease``, which carries no key of ours, off the caller's path."""
        with self._guard:
            revoker = self._revoker
            if revoker is None or not revoker.serves_this_process():
                revoker = self._revoker = _Revoker(self)
        revoker.submit(name, lease)

    def _ours(self, name: str, token: str, budget: _Budget | None = None) -> _Held | None:
        """Our lock's lease and revision: remembered, or read back (another process's)."""
        held = self._held.get((name, token))
        if held is not None:
            return held
        for kv in self._range(name, self._key(name), budget=budget):
            data, raw = self._decode(kv)
            if data.get("token") == token:
                return _Held(int(kv.get("lease", 0)), int(kv.get("create_revision", 0)), raw)
        return None

    def renew(self, name: str, token: str, ttl_ms: int) -> bool:
        return self.renew_many([RenewItem(name, token, ttl_ms)])[0]

    def renew_many(self, items: Sequence[RenewItem], timeout: float | None = None) -> list[bool]:
        """Keep each item's lease alive; ``timeout`` bounds the whole call.

        The renewal lane passes a bound (its leases' nearest deadline): without it, one
        request whose reply is lost would hold the lane for the ``timeout`` option (2 s
        by default) and the lane's other leases, due meanwhile, would lapse unrenewed.
        """
        if not items:
            return []
        budget = None if timeout is None else _Budget(timeout)
        results: list[bool] = []
        alive: list[tuple[int, RenewItem, _Held]] = []
        for index, item in enumerate(items):
            held = self._ours(item.name, item.token, budget)
            ok = False
            if held is not None and _granted_seconds(held) != _seconds(item.ttl_ms):
                held = self._relet(item, held, budget)  # renew(ttl=...) with a different TTL
            if held is not None:
                keepalive = {"ID": held.lease}
                answer = self._post(item.name, "/lease/keepalive", keepalive, True, budget)
                ok = int(answer.get("result", {}).get("TTL", 0)) > 0
            results.append(ok)
            if ok and held is not None:
                alive.append((index, item, held))
            else:
                self._held.pop((item.name, item.token), None)
        if alive and not self._still_ours([(i.name, h) for _, i, h in alive], budget):
            # Someone's key changed: check each (rare; one read per key).
            for index, item, held in alive:
                results[index] = self._still_ours([(item.name, held)], budget)
                if not results[index]:
                    self._held.pop((item.name, item.token), None)
        return results

    def _relet(self, item: RenewItem, held: _Held, budget: _Budget | None = None) -> _Held | None:
        """Move our key onto a new lease of ``item.ttl_ms``: an etcd lease's TTL is fixed.

        One transaction puts the same value (new lease id and TTL) under the same
        conditions as a release (our create_revision, our value), so the fence is kept.
        ``None`` if the key is no longer ours. A reply lost in transit is settled by
        reading the key back by token.
        """
        name, token = item.name, item.token
        grant = {"TTL": _seconds(item.ttl_ms)}
        lease = int(self._post(name, "/lease/grant", grant, True, budget)["ID"])
        try:
            data = json.loads(held.value)
        except ValueError:
            data = {}
        value = json.dumps(
            {**data, "lease": lease, "ttl_ms": item.ttl_ms}, separators=(",", ":")
        ).encode()
        key = _b64(self._key(name))
        put = {"request_put": {"key": key, "value": _b64(value), "lease": lease}}
        self._held.pop((name, token), None)  # from now on, read it back if unsure
        txn = {"compare": held.compare(key), "success": [put], "failure": []}
        answer = self._txn(name, txn, budget=budget)
        if not answer.get("succeeded"):
            current = self._ours(name, token, budget)
            if current is None or current.lease != lease:  # not ours any more
                self._revoke_quietly(name, lease)
                return None
        self._revoke_quietly(name, held.lease)
        relet = _Held(lease, held.revision, value)
        self._held[(name, token)] = relet
        return relet

    def _still_ours(self, keys: list[tuple[str, _Held]], budget: _Budget | None = None) -> bool:
        """One transaction: does every key still have our create_revision and value?"""
        compare = [c for name, held in keys for c in held.compare(_b64(self._key(name)))]
        txn = {"compare": compare, "success": [], "failure": []}
        answer = self._txn(keys[0][0], txn, True, budget)
        return bool(answer.get("succeeded"))

    def release(self, name: str, token: str) -> bool:
        held = self._held.get((name, token)) or self._ours(name, token)
        if held is None:
            return False
        key = _b64(self._key(name))
        txn = {
            "compare": held.compare(key),
            "success": [{"request_delete_range": {"key": key}}],
            "failure": [],
        }
        released = self._delete_once(name, txn, "release") is not None
        self._held.pop((name, token), None)
        # It carried only this key, and the compare proves the key is not on it now.
        self._revoke_later(name, held.lease)
        return released

    def _delete_once(self, name: str, txn: dict[str, Any], what: str) -> Any | None:
        """Run a conditional delete: its answer if it deleted, ``None`` if its compare failed.

        A lost reply is retried on the next endpoint. If the retry's compare fails, the
        first attempt may have deleted the key, or the key may have gone (expired, been
        taken) before it: neither answer would be sure, so it raises
        :class:`BackendUnavailable` instead.
        """
        answer, repeated = self._send(name, "/kv/txn", txn, retry=True)
        if answer.get("succeeded"):
            return answer
        if repeated:
            raise BackendUnavailable(
                f"lock {name!r}: the {what}'s reply from etcd at {self.server} was lost and "
                "its retry found the holder gone: cannot tell whether this call freed it",
                name=name,
                server=self.server,
            )
        return None

    def force_release(self, name: str, fence: int | None = None) -> bool:
        key = _b64(self._key(name))
        if fence is None:  # legacy: whoever holds it now
            kvs = self._range(name, self._key(name))
            if not kvs:
                return False
            fence = int(kvs[0].get("create_revision", 0))
        if fence <= 0:  # create_revision 0 means "absent": it would "delete" nothing
            return False
        txn = {
            "compare": [
                {"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": fence}
            ],
            "success": [{"request_delete_range": {"key": key, "prev_kv": True}}],
            "failure": [],
        }
        answer = self._delete_once(name, txn, "force release")
        if answer is None:
            return False
        deleted = answer["responses"][0].get("response_delete_range", {})
        for kv in deleted.get("prev_kvs", []):
            if int(kv.get("lease", 0)):  # the holder's lease: it carried only this key
                self._revoke_quietly(name, int(kv["lease"]))
        return int(deleted.get("deleted", 0)) > 0

    def holders(self, prefix: str = "") -> list[Holder]:
        start = self._key(prefix)
        kvs = self._range(prefix or None, start, _prefix_end(start))
        return sorted((self._holder(kv) for kv in kvs), key=lambda h: h.name)

    def holder(self, name: str) -> Holder | None:
        kvs = self._range(name, self._key(name))
        return self._holder(kvs[0]) if kvs else None

    def wait_release(self, name: str, timeout: float) -> None:
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
                if self.user is not None and self._token is None:
                    self._authenticate(client, name)
                try:
                    self._watch(client, request, timeout)
                except requests.HTTPError as exc:
                    if self.user is None or exc.response is None or exc.response.status_code != 401:
                        raise
                    self._authenticate(client, name)  # the token expired: once more
                    self._watch(client, request, timeout)
                self._current = index
                return
            except etcd_errors.Etcd3Exception as exc:
                failures.append(f"{client.host}:{client.port}: {self._reason(exc)}")
                self._current = (index + 1) % len(self.endpoints)
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
        try:
            response = client.session.post(
                client.get_url("/watch"),
                json=request,
                stream=True,
                timeout=(self.timeout, max(0.001, timeout)),
            )
        except requests.ReadTimeout:
            # The gateway sends its headers with the watch's first message, which a loaded
            # server may send after a short wait has run out: the wait's normal end too.
            # (One that cannot connect still fails; the caller's next try finds the rest.)
            return
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

    def release_notices(self) -> NoticeStream:
        """A watch on the prefix's deletes, on an HTTP session of its own."""
        return _EtcdNotices(self)

    def close(self) -> None:
        with self._guard:
            revoker, self._revoker = self._revoker, None
        if revoker is not None and revoker.serves_this_process():
            revoker.close(self.timeout)  # the queued revokes first, while clients are open
        close_streams(self)
        for client in self._clients:
            client.session.close()
        self._clients = []
        self._pid = -1


__all__ = ["MAX_LEASE_SECONDS", "EtcdBackend"]
