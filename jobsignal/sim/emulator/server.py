"""The emulator's HTTP(S) front: the ConfigMap endpoints of a Kubernetes API server.

Serves LIST, WATCH and CRUD over HTTP/1.1 (h11 on trio sockets, optional TLS and
bearer-token auth) on the loopback interface only, on top of the pure store in
`state`. It also owns fault injection (`FaultQueue`), the counters that tests read,
and simulated restarts. All timing (bookmarks, watch timeouts) uses trio's clock, so
tests can run it in virtual time.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
import ssl
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qs, unquote, urlsplit

import h11
import trio

from jobsignal.sim.emulator.state import (
    ConfigMap,
    ConfigMapStore,
    EventType,
    ListOptions,
    ListPage,
    RawJson,
    ResourceVersionTooLarge,
    Selector,
    StatusError,
    Subscription,
    default_reason,
)
from jobsignal.util.blocks import for_block
from jobsignal.util.uuids import random_uuid

#: Besides the periodic ones, the API server sends a bookmark just before a watch
#: times out (it aims about two seconds early), so the client can resume from it.
BOOKMARK_BEFORE_TIMEOUT = 2.0
#: How long a LIST for a resourceVersion the store has not reached waits before 504.
TOO_LARGE_RESOURCE_VERSION_WAIT = 3.0
#: The default of the API server's --min-request-timeout; it picks a watch's
#: timeout at random between this and twice it, the emulator uses it as is.
DEFAULT_WATCH_TIMEOUT = 1800.0

RequestKind = Literal["list", "watch"]
FaultTarget = Literal["list", "watch", "any"]

# ---------------------------------------------------------------------------- faults


@dataclass(frozen=True, slots=True)
class HttpError:
    """Answer the next matching request with a plain HTTP error and a Status body.

    429 and 503 carry `Retry-After` when `retry_after` is set.
    """

    status: int
    retry_after: int | None = None
    message: str | None = None
    target: FaultTarget = "any"


@dataclass(frozen=True, slots=True)
class Drop:
    """Close the connection abruptly after `after_events` watch events.

    With `mid_line`, first send the first half of the next event's line. On a LIST
    (target="list") half of the body is sent before the connection drops.
    """

    after_events: int = 0
    mid_line: bool = False
    target: FaultTarget = "watch"


@dataclass(frozen=True, slots=True)
class Stall:
    """Stop sending (no events, no bookmarks, no end) but keep the connection open."""

    after_events: int = 0
    target: FaultTarget = "watch"


@dataclass(frozen=True, slots=True)
class ExpireWatch:
    """Send an ERROR event (Status 410 Expired) after `after_events`, then end."""

    after_events: int = 0
    target: FaultTarget = "watch"


@dataclass(frozen=True, slots=True)
class MalformedLine:
    """Send a line that is not JSON after `after_events`, then carry on normally."""

    after_events: int = 0
    line: bytes = b"{this is not json"
    target: FaultTarget = "watch"


@dataclass(frozen=True, slots=True)
class SplitLines:
    """Send every line of the watch in two chunks, so lines straddle reads."""

    target: FaultTarget = "watch"


Fault = HttpError | Drop | Stall | ExpireWatch | MalformedLine | SplitLines


class FaultQueue:
    """Faults waiting for a request; each is used by the first request it targets."""

    def __init__(self) -> None:
        self._queue: deque[Fault] = deque()

    def push(self, *faults: Fault) -> None:
        for fault in faults:
            if fault.target == "list" and isinstance(fault, ExpireWatch | MalformedLine):
                raise ValueError(f"{type(fault).__name__} only applies to watches")
            self._queue.append(fault)

    def clear(self) -> None:
        self._queue.clear()

    def __len__(self) -> int:
        return len(self._queue)

    def take(self, kind: RequestKind) -> Fault | None:
        """Remove and return the first fault aimed at a request of this kind."""
        for fault in self._queue:
            if fault.target in (kind, "any"):
                self._queue.remove(fault)
                return fault
        return None


# --------------------------------------------------------------------------- records


@dataclass(slots=True)
class EmulatorStats:
    """Counters for tests. `open_*` count what is open now, the others since start."""

    connections: int = 0
    open_connections: int = 0
    tls_handshake_failures: int = 0
    requests: int = 0
    list_requests: int = 0
    watch_requests: int = 0
    unauthorized: int = 0
    open_watches: int = 0
    faults_applied: int = 0


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as received: tests check what a client asked for."""

    method: str
    path: str
    query: Mapping[str, str]
    #: "list", "watch", or the lower-case method for other requests ("post", ...).
    kind: str
    authorization: str | None
    user_agent: str | None = None
    #: The commonName of the client certificate the connection presented, if any.
    client_certificate: str | None = None


# ---------------------------------------------------------------------- the emulator


class KubeEmulator:
    """A running emulator: its URL, store, faults, counters and controls."""

    def __init__(
        self,
        *,
        url: str,
        state: ConfigMapStore,
        ssl_context: ssl.SSLContext | None,
        token: str | None,
        bookmark_interval: float,
        default_watch_timeout: float | None,
    ) -> None:
        if bookmark_interval <= 0:
            raise ValueError("bookmark_interval must be > 0")
        self.url = url
        self.state = state
        self.faults = FaultQueue()
        self.stats = EmulatorStats()
        self.requests: deque[RequestRecord] = deque(maxlen=10_000)
        self.bookmark_interval = bookmark_interval
        self.default_watch_timeout = default_watch_timeout
        self._ssl_context = ssl_context
        self._tokens: frozenset[str] | None = None
        self.set_token(token)
        self._activity = trio.Event()
        self._connections: set[_Connection] = set()

    # -- controls

    def set_token(self, token: str | None, *, also_accept: Iterable[str] = ()) -> None:
        """Require `Authorization: Bearer <token>` from now on (None: no auth).

        Watches already open are not re-checked, as in the API server.
        """
        if token is None:
            self._tokens = None
        else:
            self._tokens = frozenset({token, *also_accept})

    def restart(self, *, lose_history: bool = True, drop_connections: bool = False) -> None:
        """Simulate an API server restart.

        Every open watch ends: cleanly (last chunk, then the connection closes), or
        with `drop_connections` by closing every connection abruptly. Idle keep-alive
        connections are closed either way, as the old server's would be. With
        `lose_history`, watches and list chunks from older versions get 410.
        """
        self.state.restart(lose_history=lose_history)
        for connection in list(self._connections):
            if drop_connections or connection.idle:
                connection.scope.cancel()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Wait until `predicate()` holds; re-checked whenever a counter changes."""
        while not predicate():
            await self._activity.wait()

    async def wait_open_watches(self, count: int) -> None:
        """Wait until exactly `count` watches are streaming."""
        await self.wait_for(lambda: self.stats.open_watches == count)

    async def wait_requests(self, count: int, kind: str | None = None) -> None:
        """Wait until at least `count` requests (of `kind`, e.g. "watch") arrived."""
        await self.wait_for(
            lambda: sum(1 for r in self.requests if kind is None or r.kind == kind) >= count
        )

    # -- internals

    def _bump(self) -> None:
        self._activity.set()
        self._activity = trio.Event()

    def _authorized(self, authorization: str | None) -> bool:
        if self._tokens is None:
            return True
        if authorization is None:
            return False
        scheme, _, credentials = authorization.partition(" ")
        return scheme.lower() == "bearer" and credentials.strip() in self._tokens

    async def _serve_connection(self, stream: trio.abc.Stream) -> None:
        self.stats.connections += 1
        self.stats.open_connections += 1
        self._bump()
        conn_stream: trio.abc.Stream = stream
        connection: _Connection | None = None
        with trio.CancelScope() as scope:
            try:
                if self._ssl_context is not None:
                    tls = trio.SSLStream(
                        stream, self._ssl_context, server_side=True, https_compatible=True
                    )
                    conn_stream = tls
                    try:
                        await tls.do_handshake()
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        self.stats.tls_handshake_failures += 1
                        self._bump()
                        return
                connection = _Connection(self, conn_stream, scope)
                self._connections.add(connection)
                await connection.serve()
            except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
                pass
            finally:
                if connection is not None:
                    self._connections.discard(connection)
                # Count it closed first: in a cancelled scope the await below raises.
                self.stats.open_connections -= 1
                self._bump()
                await trio.aclose_forcefully(conn_stream)


def _peer_common_name(stream: trio.abc.Stream) -> str | None:
    if not isinstance(stream, trio.SSLStream):
        return None
    peer = stream.getpeercert() or {}
    names = [value for rdn in peer.get("subject", ()) for key, value in rdn if key == "commonName"]
    return str(names[0]) if names else None


class _Dropped(Exception):
    """Raised to abandon a connection without ending the response."""


class _ClientGone(Exception):
    """The client closed its end while a response was streaming."""


_COLLECTION_ALL = re.compile(r"^/api/v1/configmaps/?$")
_COLLECTION_NS = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/configmaps/?$")
_OBJECT = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/configmaps/(?P<name>[^/]+)/?$")

_TRUE = {"1", "t", "T", "TRUE", "true", "True"}
_FALSE = {"0", "f", "F", "FALSE", "false", "False"}


def _parse_bool(params: Mapping[str, str], name: str) -> bool:
    """Query booleans as the API server parses them (Go's strconv.ParseBool)."""
    value = params.get(name)
    if value is None or value == "":
        return False
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise StatusError(400, f"invalid boolean for {name}: {value!r}")


def _parse_int(params: Mapping[str, str], name: str) -> int | None:
    value = params.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise StatusError(400, f"invalid integer for {name}: {value!r}") from None


def _encode(obj: Mapping[str, Any]) -> bytes:
    """Compact JSON; each `RawJson` value is spliced in as it is."""
    spliced: dict[str, str] = {}

    def mark(value: object) -> str:
        if not isinstance(value, RawJson):
            raise TypeError(f"cannot encode {type(value).__name__}")
        marker = f"raw-json-{random_uuid()}"
        spliced[marker] = value.text
        return marker

    text = json.dumps(obj, separators=(",", ":"), default=mark)
    for marker, raw in spliced.items():
        text = text.replace(f'"{marker}"', raw, 1)
    return text.encode()


def _json_headers(body: bytes) -> list[tuple[str, str]]:
    return [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]


def _event_line(event_type: str, obj: Mapping[str, Any]) -> bytes:
    return _encode({"type": event_type, "object": obj}) + b"\n"


def _status_error_for_fault(fault: HttpError) -> StatusError:
    code = fault.status
    details: dict[str, Any] | None = None
    if fault.retry_after is not None:
        details = {"retryAfterSeconds": fault.retry_after}
    message = fault.message or {
        401: "Unauthorized",
        410: "The resourceVersion for the provided list is too old.",
        429: "Too many requests, please try again later.",
        500: "Internal error occurred: injected fault",
        503: "The server is currently unable to handle the request",
    }.get(code, f"injected fault {code}")
    return StatusError(code, message, reason=default_reason(code), details=details)


def _object_body(body: bytes) -> dict[str, Any]:
    try:
        decoded = json.loads(body or b"null")
    except ValueError:
        raise StatusError(400, "the request body is not valid JSON") from None
    except RecursionError:  # the API server's decoder stops at 10,000 levels
        raise StatusError(400, "the request body is nested too deeply") from None
    if not isinstance(decoded, dict):
        raise StatusError(400, "the request body must be a JSON object")
    return decoded


def _labels_and_data(obj: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    metadata = obj.get("metadata") or {}
    labels = (metadata.get("labels") or {}) if isinstance(metadata, dict) else {}
    data = obj.get("data") or {}
    if not isinstance(labels, dict) or not isinstance(data, dict):
        raise StatusError(400, "metadata.labels and data must be objects")
    return labels, data


def _merge_patch(target: dict[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """RFC 7386 JSON merge patch (null deletes a key)."""
    result = dict(target)
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            current = result.get(key)
            result[key] = _merge_patch(current if isinstance(current, dict) else {}, value)
        else:
            result[key] = value
    return result


class _Connection:
    """One HTTP/1.1 connection: a loop of requests, some of them long watches."""

    def __init__(
        self, emulator: KubeEmulator, stream: trio.abc.Stream, scope: trio.CancelScope
    ) -> None:
        self.emu = emulator
        self.stream = stream
        self.scope = scope
        self.conn = h11.Connection(h11.SERVER)
        # True while waiting for a request: safe to close on a simulated restart.
        self.idle = False
        # A connection to the server before a simulated restart takes no new requests.
        self.epoch = emulator.state.epoch
        self._client_closed = False
        self.client_certificate = _peer_common_name(stream)

    async def serve(self) -> None:
        while self.emu.state.epoch == self.epoch:
            request = await self._next_request()
            if request is None or self.emu.state.epoch != self.epoch:
                # (A request that arrived as the server restarted is dropped unread,
                # as the old server's connection would be, and takes no fault.)
                return
            head, body = request
            try:
                keep_alive = await self._dispatch(head, body)
            except _Dropped:
                return
            except _ClientGone:
                return
            if not keep_alive or self.conn.our_state is not h11.DONE:
                return
            if self.conn.their_state is not h11.DONE:
                return
            self.conn.start_next_cycle()

    async def _next_request(self) -> tuple[h11.Request, bytes] | None:
        head: h11.Request | None = None
        body = bytearray()
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.idle = head is None
                try:
                    data = await self.stream.receive_some(65536)
                finally:
                    self.idle = False
                self.conn.receive_data(bytes(data))
                continue
            if isinstance(event, h11.Request):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                return head, bytes(body)
            elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                return None

    # -- responses

    async def _send(self, event: h11.Event) -> None:
        data = self.conn.send(event)
        if data:
            await self.stream.send_all(data)

    async def _send_json(
        self, code: int, obj: Mapping[str, Any], headers: Iterable[tuple[str, str]] = ()
    ) -> None:
        await self._send_encoded(code, _encode(obj), headers)

    async def _send_encoded(
        self, code: int, body: bytes, headers: Iterable[tuple[str, str]] = ()
    ) -> None:
        await self._send(h11.Response(status_code=code, headers=[*_json_headers(body), *headers]))
        await self._send(h11.Data(data=body))
        await self._send(h11.EndOfMessage())

    async def _send_error(self, error: StatusError) -> None:
        headers: list[tuple[str, str]] = []
        # The API server turns any Status with retryAfterSeconds into this header.
        retry = (error.details or {}).get("retryAfterSeconds")
        if isinstance(retry, int):
            headers.append(("Retry-After", str(retry)))
        await self._send_json(error.code, error.to_status(), headers)

    # -- routing

    async def _dispatch(self, head: h11.Request, body: bytes) -> bool:
        emu = self.emu
        method = head.method.decode()
        split = urlsplit(head.target.decode("latin-1"))
        path = split.path
        params = {k: v[0] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        authorization = next(
            (v.decode("latin-1") for k, v in head.headers if k == b"authorization"), None
        )
        user_agent = next(
            (v.decode("latin-1") for k, v in head.headers if k == b"user-agent"), None
        )
        is_collection = bool(_COLLECTION_ALL.match(path) or _COLLECTION_NS.match(path))
        kind = method.lower()
        if method == "GET" and is_collection:
            kind = "watch" if params.get("watch") in _TRUE else "list"
        emu.stats.requests += 1
        if kind == "list":
            emu.stats.list_requests += 1
        elif kind == "watch":
            emu.stats.watch_requests += 1
        emu.requests.append(
            RequestRecord(
                method, path, params, kind, authorization, user_agent, self.client_certificate
            )
        )
        emu._bump()

        if not emu._authorized(authorization):
            emu.stats.unauthorized += 1
            emu._bump()
            await self._send_error(StatusError(401, "Unauthorized"))
            return True
        try:
            if kind == "list":
                return await self._collection_get("list", path, params)
            if kind == "watch":
                return await self._collection_get("watch", path, params)
            return await self._other(method, path, params, head, body)
        except StatusError as error:
            await self._send_error(error)
            return True

    async def _collection_get(
        self, kind: Literal["list", "watch"], path: str, params: Mapping[str, str]
    ) -> bool:
        ns_match = _COLLECTION_NS.match(path)
        namespace = unquote(ns_match["ns"]) if ns_match else None
        _parse_bool(params, "watch")  # 400 for a value that is not a boolean
        fault = self.emu.faults.take(kind)
        if fault is not None:
            self.emu.stats.faults_applied += 1
            self.emu._bump()
        if isinstance(fault, HttpError):
            await self._send_error(_status_error_for_fault(fault))
            return True
        if kind == "watch":
            return await self._watch(namespace, params, fault)
        return await self._list(namespace, params, fault)

    async def _other(
        self, method: str, path: str, params: Mapping[str, str], head: h11.Request, body: bytes
    ) -> bool:
        state = self.emu.state
        if method == "GET" and path == "/version":
            await self._send_json(
                200, {"major": "1", "minor": "30", "gitVersion": "v1.30.0-jobsignal-emulator"}
            )
            return True
        if method == "GET" and path in ("/healthz", "/readyz", "/livez"):
            await self._send(
                h11.Response(
                    status_code=200,
                    headers=[("Content-Type", "text/plain"), ("Content-Length", "2")],
                )
            )
            await self._send(h11.Data(data=b"ok"))
            await self._send(h11.EndOfMessage())
            return True
        ns_match = _COLLECTION_NS.match(path)
        obj_match = _OBJECT.match(path)
        if ns_match and method == "POST":
            namespace = unquote(ns_match["ns"])
            obj = _object_body(body)
            metadata = obj.get("metadata") or {}
            name = metadata.get("name") if isinstance(metadata, dict) else None
            if not isinstance(name, str) or not name:
                raise StatusError(422, "ConfigMap is invalid: metadata.name: Required value")
            body_ns = metadata.get("namespace")
            if body_ns not in (None, "", namespace):
                raise StatusError(
                    400,
                    "the namespace of the provided object does not match the namespace sent "
                    "on the request",
                )
            labels, data = _labels_and_data(obj)
            created = state.create_configmap(namespace, name, labels, data)
            await self._send_json(201, created.to_json())
            return True
        if obj_match is None:
            if ns_match or _COLLECTION_ALL.match(path):
                raise StatusError(405, f"the server does not allow this method: {method}")
            raise StatusError(404, "the server could not find the requested resource")
        namespace, name = unquote(obj_match["ns"]), unquote(obj_match["name"])
        if method == "GET":
            await self._send_json(200, state.get(namespace, name).to_json())
        elif method == "PUT":
            obj = _object_body(body)
            metadata = obj.get("metadata") or {}
            if isinstance(metadata, dict) and metadata.get("name") not in (None, name):
                raise StatusError(400, "the name of the object does not match the name on the URL")
            rv_text = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
            expected = int(rv_text) if isinstance(rv_text, str) and rv_text.isdigit() else None
            labels, data = _labels_and_data(obj)
            updated = state.update_configmap(
                namespace, name, labels=labels, data=data, expected_resource_version=expected
            )
            await self._send_json(200, updated.to_json())
        elif method == "PATCH":
            content_type = next(
                (v.decode() for k, v in head.headers if k == b"content-type"), ""
            ).split(";")[0]
            if content_type not in (
                "application/merge-patch+json",
                "application/strategic-merge-patch+json",
            ):
                raise StatusError(415, f"the media type {content_type!r} is not supported")
            current = state.get(namespace, name).to_json()
            patch = _object_body(body)
            try:
                patched = _merge_patch(current, patch)
            except RecursionError:  # decoded (3.13 goes deeper), but too deep to merge
                raise StatusError(400, "the request body is nested too deeply") from None
            labels, data = _labels_and_data(patched)
            updated = state.update_configmap(namespace, name, labels=labels, data=data)
            await self._send_json(200, updated.to_json())
        elif method == "DELETE":
            gone = state.delete_configmap(namespace, name)
            await self._send_json(
                200,
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Success",
                    "details": {"name": name, "kind": "configmaps", "uid": gone.uid},
                },
            )
        else:
            raise StatusError(405, f"the server does not allow this method: {method}")
        return True

    # -- list

    async def _list(
        self, namespace: str | None, params: Mapping[str, str], fault: Fault | None
    ) -> bool:
        options = ListOptions(
            namespace=namespace,
            label_selector=params.get("labelSelector", ""),
            field_selector=params.get("fieldSelector", ""),
            resource_version=params.get("resourceVersion"),
            resource_version_match=params.get("resourceVersionMatch"),
            limit=_parse_int(params, "limit"),
            continue_token=params.get("continue"),
        )
        page = await self._list_waiting(options)
        body = _encode(page.to_json())
        if not isinstance(fault, Drop | Stall):
            await self._send_encoded(200, body)
            return True
        await self._send(h11.Response(status_code=200, headers=_json_headers(body)))
        await self._send(h11.Data(data=body[: len(body) // 2]))
        if isinstance(fault, Stall):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_for_client_close, nursery.cancel_scope)
                await self._stall_until_restart()
                nursery.cancel_scope.cancel()
        raise _Dropped

    async def _list_waiting(self, options: ListOptions) -> ListPage:
        """A list for a version not reached yet waits a little, as the API server does."""
        state = self.emu.state
        with trio.move_on_after(TOO_LARGE_RESOURCE_VERSION_WAIT):
            while True:
                changed = state.changed()
                try:
                    return state.list_configmaps(options)
                except ResourceVersionTooLarge:
                    await changed.wait()
        return state.list_configmaps(options)

    async def _stall_until_restart(self) -> None:
        state = self.emu.state
        epoch = state.epoch
        while state.epoch == epoch:
            await state.changed().wait()

    # -- watch

    async def _watch(
        self, namespace: str | None, params: Mapping[str, str], fault: Fault | None
    ) -> bool:
        emu = self.emu
        if _parse_bool(params, "sendInitialEvents"):
            raise StatusError(
                422, "sendInitialEvents is forbidden: this server does not support watch-list"
            )
        selector = Selector.parse(
            namespace, params.get("labelSelector", ""), params.get("fieldSelector", "")
        )
        bookmarks = _parse_bool(params, "allowWatchBookmarks")
        timeout_seconds = _parse_int(params, "timeoutSeconds")
        timeout = (
            float(timeout_seconds)
            if timeout_seconds is not None and timeout_seconds > 0
            else emu.default_watch_timeout
        )
        subscription = emu.state.subscribe(selector, params.get("resourceVersion") or None)
        await self._send(
            h11.Response(
                status_code=200,
                headers=[
                    ("Content-Type", "application/json"),
                    ("Transfer-Encoding", "chunked"),
                ],
            )
        )
        emu.stats.open_watches += 1
        emu._bump()
        writer = _WatchWriter(self, subscription, fault, bookmarks, timeout)
        # Exceptions are caught inside the nursery so they do not come out wrapped
        # in an exception group.
        dropped = False
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_for_client_close, nursery.cancel_scope)
                try:
                    await writer.run()
                except (_Dropped, trio.BrokenResourceError, trio.ClosedResourceError):
                    dropped = True
                nursery.cancel_scope.cancel()
        finally:
            emu.stats.open_watches -= 1
            emu._bump()
        if self._client_closed:
            raise _ClientGone
        if dropped:
            raise _Dropped
        await self._send(h11.EndOfMessage())
        # After a restart the connection goes too, as the old server's would.
        return not writer.ended_by_restart

    async def _watch_for_client_close(self, scope: trio.CancelScope) -> None:
        """A client that hangs up ends its watch at once, not at the next send."""
        try:
            while True:
                data = await self.stream.receive_some(65536)
                # Anything else the client sends is kept for the next request.
                self.conn.receive_data(bytes(data))
                if not data:
                    break
        except (trio.BrokenResourceError, trio.ClosedResourceError, RuntimeError):
            pass
        self._client_closed = True
        scope.cancel()


@dataclass(eq=False)
class _WatchWriter:
    """Streams one watch: events, bookmarks, the timeout, and any injected fault."""

    connection: _Connection
    subscription: Subscription
    fault: Fault | None
    bookmarks: bool
    timeout: float | None
    sent_events: int = field(default=0, init=False)
    cut_next_line: bool = field(default=False, init=False)
    ended_by_restart: bool = field(default=False, init=False)

    async def _write(self, line: bytes) -> None:
        if self.cut_next_line:
            await self.connection._send(h11.Data(data=line[: len(line) // 2]))
            raise _Dropped
        if isinstance(self.fault, SplitLines) and len(line) > 1:
            half = len(line) // 2
            await self.connection._send(h11.Data(data=line[:half]))
            await self.connection._send(h11.Data(data=line[half:]))
        else:
            await self.connection._send(h11.Data(data=line))

    async def _fault_due(self) -> bool:
        """Apply the fault if its moment has come; False means: stop, end cleanly."""
        fault = self.fault
        if not isinstance(fault, Drop | Stall | ExpireWatch | MalformedLine):
            return True
        if self.sent_events < fault.after_events:
            return True
        self.fault = None
        if isinstance(fault, Drop):
            if not fault.mid_line:
                raise _Dropped
            self.cut_next_line = True
        elif isinstance(fault, Stall):
            await self.connection._stall_until_restart()
            self.ended_by_restart = True
            return False
        elif isinstance(fault, ExpireWatch):
            await self._send_expired(
                f"too old resource version: {self.subscription.resource_version} "
                f"({self.connection.emu.state.resource_version})"
            )
            return False
        else:
            await self._write(fault.line + b"\n")
        return True

    async def _send_expired(self, message: str) -> None:
        status = StatusError(410, message, reason="Expired").to_status()
        await self._write(_event_line("ERROR", status))

    async def _send_event(self, event_type: EventType, obj: ConfigMap) -> None:
        await self._write(_event_line(event_type, obj.to_json()))
        self.sent_events += 1

    async def run(self) -> None:
        """Stream until the watch ends cleanly; raise _Dropped to abandon it."""
        sub = self.subscription
        interval = self.connection.emu.bookmark_interval
        start = trio.current_time()
        deadline = start + self.timeout if self.timeout is not None else math.inf
        next_bookmark = start + interval if self.bookmarks else math.inf
        final_bookmark = math.inf
        if self.bookmarks and self.timeout is not None and self.timeout > BOOKMARK_BEFORE_TIMEOUT:
            final_bookmark = deadline - BOOKMARK_BEFORE_TIMEOUT
        if not await self._fault_due():
            return
        while True:
            changed = sub.changed()
            if sub.ended_by_restart:
                self.ended_by_restart = True
                return
            try:
                batch = sub.next_batch()
            except StatusError as error:
                # A watch from a forgotten version gets 200 and one ERROR event.
                await self._write(_event_line("ERROR", error.to_status()))
                return
            for event_type, obj in batch:
                await self._send_event(event_type, obj)
                if not await self._fault_due():
                    return
            now = trio.current_time()
            if now >= deadline:
                return
            if now >= next_bookmark or now >= final_bookmark:
                bookmark = {
                    "kind": "ConfigMap",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(sub.resource_version)},
                }
                await self._write(_event_line("BOOKMARK", bookmark))
                next_bookmark = now + interval
                if now >= final_bookmark:
                    final_bookmark = math.inf
            with trio.move_on_at(min(deadline, next_bookmark, final_bookmark)):
                await changed.wait()


# ----------------------------------------------------------------------- entry points


def _check_loopback(host: str) -> None:
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"the emulator only binds loopback addresses, not {host!r}")


async def run_emulator(
    task_status: trio.TaskStatus[KubeEmulator] = trio.TASK_STATUS_IGNORED,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    ssl_context: ssl.SSLContext | None = None,
    token: str | None = None,
    bookmark_interval: float = 60.0,
    history_size: int = 1000,
    default_watch_timeout: float | None = DEFAULT_WATCH_TIMEOUT,
    state: ConfigMapStore | None = None,
) -> None:
    """Serve until cancelled; `task_status.started(emulator)` once it accepts connections.

    `host` must be a loopback address. With `ssl_context` it speaks HTTPS (and checks
    client certificates if the context requires them). `state` lets several runs share
    one store; by default a fresh one with `history_size` is made. `open_emulator`
    takes the same arguments and runs one for the length of an `async with` block.
    """
    _check_loopback(host)
    listeners = await trio.open_tcp_listeners(port, host=host)
    try:
        sockname = listeners[0].socket.getsockname()
        shown_host = f"[{host}]" if ":" in host else host
        scheme = "https" if ssl_context is not None else "http"
        emulator = KubeEmulator(
            url=f"{scheme}://{shown_host}:{sockname[1]}",
            state=state if state is not None else ConfigMapStore(history_size=history_size),
            ssl_context=ssl_context,
            token=token,
            bookmark_interval=bookmark_interval,
            default_watch_timeout=default_watch_timeout,
        )
    except BaseException:
        for listener in listeners:
            await trio.aclose_forcefully(listener)
        raise
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, emulator._serve_connection, listeners)
        task_status.started(emulator)


# `async with open_emulator(token="t") as emu:` serves for the length of the block;
# an exception from the block (or a refused host) comes out as itself.
open_emulator = for_block(run_emulator)
