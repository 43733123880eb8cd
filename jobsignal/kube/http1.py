"""HTTP/1.1 as jobsignal speaks it to the API server: a request out, its response in.

Sans-IO: `encode_request` turns a request into bytes, and a `ResponseReader`
takes the bytes a connection receives and gives back the response's head,
then its body piece by piece, framed as RFC 9112 says (Content-Length,
chunked, or until the connection closes). The API server's bytes are input
like any other: the head, a chunk-size line and the trailers are bounded,
and anything that is not HTTP/1.x is a `ProtocolError`, never a hang or a
buffer without end. Only what the watcher needs is read: no upgrades, no
transfer-coding but chunked (`Content-Encoding: gzip` is decoded above,
by httpx), no interim responses but skipped ones.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# The longest response head read (status line and headers): the API server's
# are a few hundred bytes; Go's own client allows 1 MiB, 64 KiB is ample.
MAX_HEAD_BYTES = 64 * 1024
# The longest chunk-size line (the size in hex and any extensions).
MAX_CHUNK_LINE_BYTES = 1024
# The most trailer bytes read after the last chunk (they are skipped).
MAX_TRAILER_BYTES = 16 * 1024

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: ([^\x00-\x08\x0a-\x1f\x7f]*))?")
# Field values: visible characters, spaces and tabs (obs-text included).
_FIELD_VALUE = re.compile(rb"[^\x00-\x08\x0a-\x1f\x7f]*")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_LINE_END = re.compile(rb"\r?\n")
_HEAD_END = re.compile(rb"\r?\n\r?\n")


class ProtocolError(Exception):
    """The server's bytes are not the HTTP/1.1 response they should be."""


def encode_request(
    method: str, target: bytes, headers: Iterable[tuple[bytes, bytes]], body: bytes = b""
) -> bytes:
    """The bytes of a request; ValueError for a method, target or header that
    would not be one valid request (a CR or LF in a value, say)."""
    if not _TOKEN.fullmatch(method.encode("ascii", "replace")):
        raise ValueError(f"invalid HTTP method {method!r}")
    if not target.startswith(b"/") or any(byte <= 0x20 or byte == 0x7F for byte in target):
        raise ValueError(f"invalid request target {target[:80]!r}")
    lines = [b"%s %s HTTP/1.1" % (method.encode("ascii"), target)]
    for name, value in headers:
        if not _TOKEN.fullmatch(name):
            raise ValueError(f"invalid header name {name[:80]!r}")
        if not _FIELD_VALUE.fullmatch(value):
            raise ValueError(f"invalid value for header {name.decode('ascii')}")
        lines.append(name + b": " + value.strip(b" \t"))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@dataclass(frozen=True, slots=True)
class ResponseHead:
    status: int
    reason: bytes
    # "HTTP/1.0" or "HTTP/1.1", as the server said.
    http_version: bytes
    # Names as sent; several fields of one name stay several entries.
    headers: list[tuple[bytes, bytes]]

    def values(self, name: bytes) -> list[bytes]:
        """Every value of the header `name` (lowercase), comma-separated lists split."""
        found: list[bytes] = []
        for field, value in self.headers:
            if field.lower() == name:
                found.extend(part.strip(b" \t") for part in value.split(b","))
        return [part for part in found if part]


# Body framings.
_LENGTH, _CHUNKED, _UNTIL_CLOSE = "length", "chunked", "until close"
# Where a chunked body is.
_SIZE, _DATA, _DATA_END, _TRAILERS = "size", "data", "data end", "trailers"


class ResponseReader:
    """One response's bytes in (`feed`, `feed_eof`), its head and body out.

    `read_head` until it returns the head, then `read_body` until it returns
    None; both ask for more bytes by returning None (head) or b"" (body).
    `reusable` says, once the body has ended, whether the connection may
    carry another request.
    """

    def __init__(self, *, head_request: bool = False) -> None:
        self._buffer = bytearray()
        self.received = False  # any byte at all
        self._eof = False
        self._head_request = head_request
        self._head: ResponseHead | None = None
        self._framing = ""
        self._remaining = 0  # of the body (length) or of the current chunk
        self._chunk_state = _SIZE
        self._trailer_bytes = 0
        self._ended = False
        self._keep_alive = False

    def feed(self, data: bytes | bytearray) -> None:
        """Bytes received from the connection."""
        self._buffer += data
        self.received = self.received or bool(data)

    def feed_eof(self) -> None:
        """The server closed its side of the connection."""
        self._eof = True

    @property
    def ended(self) -> bool:
        """The whole response has been read."""
        return self._ended

    @property
    def reusable(self) -> bool:
        """The response has ended, its framing allows another request on the
        connection, and the server sent nothing after it."""
        return self._ended and self._keep_alive and not self._buffer and not self._eof

    def read_head(self) -> ResponseHead | None:
        """The response's head; None while more bytes are needed. Interim
        (1xx) responses are skipped."""
        while self._head is None:
            end = _HEAD_END.search(self._buffer, 0, MAX_HEAD_BYTES + 4)
            if end is None:
                if len(self._buffer) > MAX_HEAD_BYTES:
                    raise ProtocolError(f"response head longer than {MAX_HEAD_BYTES} bytes")
                if self._eof:
                    raise ProtocolError(
                        "the server closed the connection before a complete response head"
                        if self._buffer
                        else "the server closed the connection without a response"
                    )
                return None
            raw = self._take(end.start(), separator=len(end.group()))
            head = _parse_head(raw)
            if head.status == 101:
                raise ProtocolError("the server switched protocols, which was not asked for")
            if head.status >= 200:
                self._start_body(head)
                self._head = head
        return self._head

    def _start_body(self, head: ResponseHead) -> None:
        connection = {token.lower() for token in head.values(b"connection")}
        self._keep_alive = head.http_version == b"HTTP/1.1" and b"close" not in connection
        codings = [coding.lower() for coding in head.values(b"transfer-encoding")]
        lengths = set(head.values(b"content-length"))
        if self._head_request or head.status in (204, 304):
            self._framing, self._remaining = _LENGTH, 0
        elif codings:
            if codings != [b"chunked"]:
                raise ProtocolError(
                    f"unsupported transfer-coding {b', '.join(codings)[:80].decode('latin-1')!r}"
                )
            self._framing = _CHUNKED
            if lengths:  # both framings: a sign of smuggling; read this one, then close
                self._keep_alive = False
        elif lengths:
            if len(lengths) > 1 or not all(value.isdigit() for value in lengths):
                raise ProtocolError("invalid Content-Length")
            length = lengths.pop()
            if len(length) > 18:
                raise ProtocolError("invalid Content-Length")
            self._framing, self._remaining = _LENGTH, int(length)
        else:
            self._framing, self._keep_alive = _UNTIL_CLOSE, False
        self._ended = self._framing == _LENGTH and self._remaining == 0

    def read_body(self) -> bytes | None:
        """The next piece of the body; b"" while more bytes are needed, None
        once the body has ended."""
        if self._head is None:
            raise RuntimeError("read_body before the response head")
        if self._ended:
            return None
        if self._framing == _LENGTH:
            return self._take_length()
        if self._framing == _UNTIL_CLOSE:
            if self._buffer:
                return self._take(len(self._buffer))
            if self._eof:
                self._ended = True
                return None
            return b""
        return self._take_chunked()

    def _take(self, size: int, *, separator: int = 0) -> bytes:
        """The first `size` bytes held (copied once), removed with the `separator`
        bytes that follow them."""
        with memoryview(self._buffer) as held:
            piece = bytes(held[:size])
        del self._buffer[: size + separator]
        return piece

    def _take_length(self) -> bytes | None:
        if self._buffer:
            piece = self._take(min(self._remaining, len(self._buffer)))
            self._remaining -= len(piece)
            self._ended = self._remaining == 0
            return piece
        if self._eof:
            raise ProtocolError(
                f"the server closed the connection {self._remaining} bytes short of the body"
            )
        return b""

    def _take_chunked(self) -> bytes | None:
        while True:
            if self._chunk_state == _DATA:
                if not self._buffer:
                    return self._need_more("in a chunk")
                piece = self._take(min(self._remaining, len(self._buffer)))
                self._remaining -= len(piece)
                if self._remaining == 0:
                    self._chunk_state = _DATA_END
                return piece
            line = self._line(
                MAX_CHUNK_LINE_BYTES if self._chunk_state != _TRAILERS else MAX_TRAILER_BYTES
            )
            if line is None:
                return self._need_more("in a chunked body")
            if self._chunk_state == _DATA_END:
                if line:
                    raise ProtocolError("a chunk is longer than its size says")
                self._chunk_state = _SIZE
            elif self._chunk_state == _SIZE:
                size = line.split(b";", 1)[0].strip(b" \t")
                if not _HEX.fullmatch(size):
                    raise ProtocolError(f"invalid chunk size {size[:20]!r}")
                self._remaining = int(size, 16)
                self._chunk_state = _DATA if self._remaining else _TRAILERS
            else:  # trailers: skipped, up to the empty line that ends them
                self._trailer_bytes += len(line) + 2
                if self._trailer_bytes > MAX_TRAILER_BYTES:
                    raise ProtocolError(f"trailers longer than {MAX_TRAILER_BYTES} bytes")
                if not line:
                    self._ended = True
                    return None

    def _line(self, limit: int) -> bytes | None:
        end = _LINE_END.search(self._buffer, 0, limit + 2)
        if end is None:
            if len(self._buffer) > limit:
                raise ProtocolError(f"a line of the chunked body is longer than {limit} bytes")
            return None
        return self._take(end.start(), separator=len(end.group()))

    def _need_more(self, where: str) -> bytes:
        if self._eof:
            raise ProtocolError(f"the server closed the connection {where}")
        return b""


def _parse_head(raw: bytes) -> ResponseHead:
    lines = _LINE_END.split(raw)
    status = _STATUS_LINE.fullmatch(lines[0])
    if status is None:
        raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name):
            # (A line starting with whitespace, a folded value, is refused as RFC 9112 allows.)
            raise ProtocolError(f"invalid header line {line[:80]!r}")
        value = value.strip(b" \t")
        if not _FIELD_VALUE.fullmatch(value):
            raise ProtocolError(f"invalid value for header {name[:80]!r}")
        headers.append((name, value))
    return ResponseHead(
        status=int(status.group(2)),
        reason=status.group(3) or b"",
        http_version=b"HTTP/1." + status.group(1),
        headers=headers,
    )
