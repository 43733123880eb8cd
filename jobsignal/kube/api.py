"""The Kubernetes API as the watcher needs it: paged LIST and WATCH of ConfigMaps.

Raw HTTP through httpx and its own transport. `open_kube_client` builds the
client from a `KubeConnection`: TLS, the proxy the connection names (none:
straight to the server), ``User-Agent: jobsignal/<version>``
(so audit logs and API Priority and Fairness can tell jobsignal apart) and, for
exec credential plugins, an httpx auth hook that fetches the credential before
each request and drops it after a 401. Every failure leaves this module as one
of the `ApiError` classes below, so the watcher reasons about Kubernetes
outcomes (gone, unauthorized, throttled, unavailable, malformed) and never
about httpx, sockets, JSON or plugins.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Mapping
from contextlib import aclosing, asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol, cast

import httpx
import trio

from jobsignal.kube import documents
from jobsignal.kube.credentials import KubeConfigError, KubeConnection, load_client_certificate
from jobsignal.kube.exec_plugin import ExecCredentialError
from jobsignal.logs import RateLimitedLog
from jobsignal.version import __version__

if TYPE_CHECKING:
    from jobsignal.kube.exec_credentials import ExecCredentials

log = logging.getLogger(__name__)


class ApiError(Exception):
    """A failed Kubernetes API call; the message is safe to log."""


class ApiUnavailable(ApiError):
    """Network failure, timeout or 5xx: back off and retry."""


class Gone(ApiError):
    """410: the resourceVersion is too old; relist."""


class Unauthorized(ApiError):
    """401: credentials were refused (a rotated token): re-read them."""


class Throttled(ApiError):
    """429: retry after the time the server asked for, if any."""

    def __init__(self, message: str, retry_after: float | None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class BadResponse(ApiError):
    """A response that is not what the Kubernetes API sends (bad JSON, wrong shape)."""


class PageTooLarge(BadResponse):
    """A LIST page over `KubeApi`'s byte bound: ask for fewer ConfigMaps a page."""


class TokenProvider(Protocol):
    def current(self) -> str: ...


def _error_for(status: int, body: bytes, headers: Mapping[str, str]) -> ApiError:
    message = _status_message(body) or f"HTTP {status}"
    text = f"HTTP {status}: {message}"
    if status == 410:
        return Gone(text)
    if status == 401:
        return Unauthorized(text)
    if status == 429:
        return Throttled(text, _retry_after(headers.get("retry-after")))
    if status >= 500:
        return ApiUnavailable(text)
    return ApiError(text)


def _status_message(body: bytes) -> str:
    try:
        parsed, _ = documents.loads(body)
    except ValueError:
        return ""
    message = parsed.get("message") if isinstance(parsed, dict) else None
    return str(message)[:200] if message else ""


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None  # an HTTP date: fall back to the normal backoff
    return max(0.0, min(seconds, 600.0))


def user_agent() -> str:
    """``jobsignal/<version>``: how the API server sees jobsignal."""
    return f"jobsignal/{__version__}"


def open_kube_client(connection: KubeConnection, *, timeout: httpx.Timeout) -> httpx.AsyncClient:
    """An httpx client for the API server *connection* describes; use it with ``async with``.

    Requests go through `connection.proxy` when it names one (the cluster's
    ``proxy-url`` or the environment's proxy for this server, decided by
    `kube.credentials` as client-go decides it); httpx's own reading of the
    environment is off (``trust_env=False``), so NO_PROXY's CIDRs are not
    second-guessed. With an exec plugin, connections are not kept alive
    (``Connection: close``, no idle connection kept): a renewed client
    certificate must be presented by the very next request (the API server
    checks it per request), and the watcher's few requests gain little from
    reuse.
    """
    auth: httpx.Auth | None = None
    headers = {"User-Agent": user_agent()}
    limits = httpx.Limits()
    if connection.exec_credentials is not None:
        auth = ExecAuth(connection.exec_credentials, connection.verify)
        headers["Connection"] = "close"
        limits = httpx.Limits(max_keepalive_connections=0)
    return httpx.AsyncClient(
        base_url=connection.base_url,
        # (A plain-http server's requests never use this context; httpx wants one.)
        verify=connection.verify or ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT),
        proxy=connection.proxy,
        trust_env=False,
        auth=auth,
        headers=headers,
        timeout=timeout,
        limits=limits,
    )


class ExecAuth(httpx.Auth):
    """Exec plugin credentials on each request: a bearer token and/or a client certificate.

    The credential comes from `ExecCredentials` (cached, renewed before
    expiry). A 401 drops it, so the next request runs the plugin again; the
    refused request is not retried here (the caller backs off, as client-go's
    callers do). A client certificate is loaded into the connection's
    SSLContext, which applies to every handshake from then on (a plain-http
    server has no context: a certificate would have nothing to prove).
    """

    def __init__(self, credentials: ExecCredentials, tls: ssl.SSLContext | None) -> None:
        self._credentials = credentials
        self._tls = tls
        self._loaded: tuple[bytes, bytes] | None = None

    def sync_auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response]:
        raise RuntimeError("exec credentials need an async client (trio)")

    async def async_auth_flow(
        self, request: httpx.Request
    ) -> AsyncGenerator[httpx.Request, httpx.Response]:
        credential, _ = await self._credentials.get()
        certificate, key = credential.client_certificate, credential.client_key
        renewed = (certificate, key) != self._loaded
        if self._tls is not None and certificate is not None and key is not None and renewed:
            load_client_certificate(self._tls, certificate, key, self._credentials.plugin.label)
            self._loaded = (certificate, key)
        if credential.token is not None:
            request.headers["Authorization"] = f"Bearer {credential.token}"
        response = yield request
        if response.status_code == 401:
            self._credentials.invalidate(credential)


def configmaps_path(namespace: str | None) -> str:
    if namespace:
        return f"/api/v1/namespaces/{namespace}/configmaps"
    return "/api/v1/configmaps"


# The most bytes of one LIST page read (decoded, if the server compressed it):
# what a hostile or broken server can make the watcher hold. 500 job-summary
# ConfigMaps of 40 servers each (27 KB) take about 13 MB; ClusterD's largest
# slices, 1,000 servers (0.7 MB each), would not fit 500 to a page, so a page
# over the bound is asked for again in smaller pages (kube/watcher.py), down
# to one ConfigMap, which fits with room to spare: at most 1 MiB of data, even
# JSON-escaped (6 bytes for 1), with its metadata.
MAX_LIST_PAGE_BYTES = 64 * 1024 * 1024


class KubeApi:
    def __init__(
        self,
        client: httpx.AsyncClient,
        tokens: TokenProvider | None,
        *,
        read_timeout: float,
        max_page_bytes: int = MAX_LIST_PAGE_BYTES,
    ) -> None:
        self._client = client
        self._tokens = tokens
        self._read_timeout = read_timeout
        self._max_page_bytes = max_page_bytes
        self._faults = RateLimitedLog(log)

    def _decode(self, data: bytes, what: str) -> Any:
        """A document the API server sent (ValueError when it is not JSON)."""
        document, dropped = documents.loads(data)
        if dropped:
            self._faults.warning(
                "nested_too_deep",
                "%s nested deeper than %d levels: %d values below that depth were not"
                " read (a ConfigMap's managedFields?)",
                what,
                documents.MAX_DEPTH,
                dropped,
            )
        return document

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self._tokens is not None:
            try:
                token = self._tokens.current()
            except KubeConfigError as error:
                # A token file caught mid-rewrite: retry after a backoff.
                raise ApiUnavailable(f"cannot read the bearer token: {error}") from None
            headers["Authorization"] = f"Bearer {token}"
        return headers

    async def list_page(self, namespace: str | None, params: Mapping[str, str]) -> dict[str, Any]:
        """One page of a ConfigMap LIST, as the decoded ConfigMapList.

        The body is read up to the byte bound and no further: a longer one is
        `PageTooLarge`, an error's body is read up to 64 KiB for its message.
        """
        try:
            with trio.fail_after(self._read_timeout):
                request = self._client.build_request(
                    "GET", configmaps_path(namespace), params=dict(params), headers=self._headers()
                )
                response = await self._client.send(request, stream=True)
                try:
                    if response.status_code != 200:
                        body = await _read_bounded(response)
                        raise _error_for(response.status_code, body, response.headers)
                    content = await _read_within(response, self._max_page_bytes)
                finally:
                    with trio.CancelScope(shield=True):
                        await response.aclose()
        except (httpx.HTTPError, trio.TooSlowError, OSError) as error:
            raise ApiUnavailable(f"LIST failed: {_describe(error)}") from None
        except (ExecCredentialError, KubeConfigError) as error:
            # A plugin that failed now may work later (its identity provider was down).
            raise ApiUnavailable(f"LIST failed: no credentials: {error}") from None
        if content is None:
            raise PageTooLarge(
                f"LIST page of up to {params.get('limit', 'all')} ConfigMaps is over"
                f" {self._max_page_bytes} bytes"
            )
        try:
            page = self._decode(content, "LIST response")
        except ValueError:
            raise BadResponse("LIST response is not JSON") from None
        if not isinstance(page, dict) or not isinstance(page.get("items", []), list):
            raise BadResponse("LIST response is not a ConfigMapList")
        return page

    @asynccontextmanager
    async def watch(
        self, namespace: str | None, params: Mapping[str, str]
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Open a WATCH; yields an iterator of decoded watch events.

        Each event must arrive within the read timeout: a silent connection
        (no events, no bookmarks) is treated as dead.
        """
        request = self._client.build_request(
            "GET",
            configmaps_path(namespace),
            params={**params, "watch": "1"},
            headers=self._headers(),
        )
        try:
            with trio.fail_after(self._read_timeout):
                response = await self._client.send(request, stream=True)
        except (httpx.HTTPError, trio.TooSlowError, OSError) as error:
            raise ApiUnavailable(f"WATCH failed: {_describe(error)}") from None
        except (ExecCredentialError, KubeConfigError) as error:
            raise ApiUnavailable(f"WATCH failed: no credentials: {error}") from None
        try:
            if response.status_code != 200:
                body = await _read_bounded(response)
                raise _error_for(response.status_code, body, response.headers)
            # Closed here, not left to the garbage collector, when the caller stops early.
            async with aclosing(self._events(response)) as events:
                yield events
        finally:
            with trio.CancelScope(shield=True):
                await response.aclose()

    async def _events(self, response: httpx.Response) -> AsyncGenerator[dict[str, Any], None]:
        chunks = response.aiter_bytes()
        lines = LineSplitter(MAX_WATCH_LINE_BYTES)
        while True:
            try:
                with trio.fail_after(self._read_timeout):
                    ready = await _next_lines(chunks, lines)
            except trio.TooSlowError:
                raise ApiUnavailable(
                    f"WATCH silent for {self._read_timeout:g}s (no event, no bookmark)"
                ) from None
            except (httpx.HTTPError, OSError) as error:
                raise ApiUnavailable(f"WATCH broken: {_describe(error)}") from None
            if not ready:
                return
            for line in ready:
                if not line.strip():
                    continue
                try:
                    event = self._decode(line, "WATCH event")
                except ValueError:
                    raise BadResponse(
                        f"WATCH sent a line that is not JSON: {line[:80]!r}"
                    ) from None
                if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
                    raise BadResponse("WATCH sent an event without an object")
                yield event


# The longest line of a WATCH accepted: one event, a ConfigMap of at most 1 MiB
# of data even with every character JSON-escaped (6 bytes for 1), plus its
# metadata. A longer one is malformed input, not a reason to buffer without end.
MAX_WATCH_LINE_BYTES = 8 * 1024 * 1024


class LineSplitter:
    """Splits a byte stream into its lines (each without its `\\n`), holding at
    most `limit` bytes of a line not yet ended (`BadResponse` beyond)."""

    __slots__ = ("_limit", "_size", "_started")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        # The start of a line not yet ended, in the chunks it came in.
        self._started: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        """The lines that `chunk` ends, in order."""
        if b"\n" not in chunk:
            self._hold(chunk)
            return []
        lines = chunk.split(b"\n")
        rest = lines.pop()
        if self._started:
            self._started.append(lines[0])
            lines[0] = b"".join(self._started)
            if len(lines[0]) > self._limit:
                raise self._too_long()
        self._started, self._size = [], 0
        self._hold(rest)
        return lines

    def finish(self) -> list[bytes]:
        """The last line, when the stream ended without its newline."""
        last = b"".join(self._started)
        self._started, self._size = [], 0
        return [last] if last else []

    def _hold(self, part: bytes) -> None:
        if part:
            self._started.append(part)
            self._size += len(part)
            if self._size > self._limit:
                raise self._too_long()

    def _too_long(self) -> BadResponse:
        return BadResponse(f"WATCH sent a line over {self._limit} bytes")


async def _next_lines(chunks: AsyncIterator[bytes], lines: LineSplitter) -> list[bytes]:
    """Read until at least one line ends; none once the stream has ended."""
    async for chunk in chunks:
        if ready := lines.feed(chunk):
            return ready
    return lines.finish()


async def _read_within(response: httpx.Response, limit: int) -> bytes | None:
    """The whole body, or None as soon as it is over `limit` bytes (the rest unread)."""
    chunks: list[bytes] = []
    size = 0
    # An async generator (httpx types it as an iterator), closed here when the
    # rest of the body is left unread rather than by the garbage collector.
    body = cast(AsyncGenerator[bytes, None], response.aiter_bytes())
    async with aclosing(body):
        async for chunk in body:
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
    return b"".join(chunks)


async def _read_bounded(response: httpx.Response, limit: int = 64 * 1024) -> bytes:
    body = b""
    try:
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) >= limit:
                break
    except httpx.HTTPError:
        pass
    return body


def _describe(error: BaseException) -> str:
    """The error's type and message, and the reason under it when the message
    does not say it: over trio, httpx's ConnectError and ReadError often carry
    no text of their own, and the OS or OpenSSL error is their cause."""
    text = str(error)
    reason = _underlying_reason(error)
    if reason and reason not in text:
        text = f"{text} ({reason})" if text else reason
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _underlying_reason(error: BaseException) -> str:
    """The text of the innermost exception under `error` that has one (each of a
    group's, joined: trio tries every address of a host)."""
    found = ""
    seen: set[int] = set()
    cause: BaseException | None = error.__cause__ or error.__context__
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, BaseExceptionGroup):
            return "; ".join(sorted({str(inner) for inner in cause.exceptions if str(inner)}))
        found = str(cause) or found
        cause = cause.__cause__ or cause.__context__
    return found
