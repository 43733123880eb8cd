"""The HTTP/1.1 response reader (kube/http1.py): framing, reuse and hostile bytes.

Every response is fed whole and then one byte at a time: the reader must not
depend on how the bytes were cut.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobsignal.kube import http1
from jobsignal.kube.http1 import ProtocolError, ResponseReader, encode_request


def read(
    raw: bytes, *, eof: bool = False, head_request: bool = False
) -> tuple[http1.ResponseHead, bytes, ResponseReader]:
    """The head and body of `raw` fed whole, checked equal when fed byte by byte."""
    results = []
    for pieces in ([raw], [raw[i : i + 1] for i in range(len(raw))]):
        reader = ResponseReader(head_request=head_request)
        head = None
        body = b""
        for piece in [*pieces, None]:
            if piece is None:
                if not eof:
                    break
                reader.feed_eof()
            else:
                reader.feed(piece)
            if head is None:
                head = reader.read_head()
            while head is not None and (part := reader.read_body()):
                body += part
        assert head is not None
        if eof:
            assert reader.read_body() is None
        results.append((head, body, reader))
    (whole, body, reader), (bytewise, bytewise_body, _) = results
    assert (whole, body) == (bytewise, bytewise_body)
    return whole, body, reader


def refused(raw: bytes, *, eof: bool = False) -> str:
    """The ProtocolError's message for `raw`, fed whole."""
    reader = ResponseReader()
    reader.feed(raw)
    if eof:
        reader.feed_eof()
    with pytest.raises(ProtocolError) as error:
        if reader.read_head() is not None:
            while reader.read_body() is not None:
                pass
    return str(error.value)


def test_a_content_length_body_is_read_to_its_length_and_the_connection_is_reusable() -> None:
    head, body, reader = read(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5\r\n\r\nhello"
    )
    assert (head.status, head.reason, head.http_version) == (200, b"OK", b"HTTP/1.1")
    assert head.headers == [(b"Content-Type", b"application/json"), (b"Content-Length", b"5")]
    assert body == b"hello"
    assert reader.ended and reader.reusable
    assert reader.read_body() is None


def test_a_chunked_body_with_extensions_and_trailers() -> None:
    raw = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;name=value\r\nhello\r\n1A\r\n" + b"x" * 26 + b"\r\n0\r\nExpires: never\r\n\r\n"
    )
    _, body, reader = read(raw)
    assert body == b"hello" + b"x" * 26
    assert reader.ended and reader.reusable


def test_bare_line_feeds_are_read_as_line_ends() -> None:
    _, body, reader = read(b"HTTP/1.1 200 OK\nTransfer-Encoding: chunked\n\n3\nabc\n0\n\n")
    assert body == b"abc" and reader.reusable


def test_a_body_without_length_runs_until_the_connection_closes() -> None:
    _, body, reader = read(b"HTTP/1.1 200 OK\r\n\r\nall of it", eof=True)
    assert body == b"all of it"
    assert reader.ended and not reader.reusable


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 200 OK\r\nConnection: keep-alive, Close\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n",
        # Both framings: read as chunked, then the connection is not trusted again.
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        # Bytes after the response that nobody asked for.
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\nHTTP/1.1 200 OK\r\n",
    ],
    ids=["connection-close", "http-1.0", "both-framings", "bytes-after"],
)
def test_responses_that_end_the_connection(raw: bytes) -> None:
    _, body, reader = read(raw)
    assert body == b""
    assert reader.ended and not reader.reusable


def test_interim_responses_are_skipped() -> None:
    head, body, _ = read(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
        b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\nno"
    )
    assert (head.status, body) == (404, b"no")


@pytest.mark.parametrize("status", [204, 304])
def test_statuses_without_a_body(status: int) -> None:
    # A length they may carry describes the resource, not a body that follows.
    _, body, reader = read(b"HTTP/1.1 %d X\r\nContent-Length: 10\r\n\r\n" % status)
    assert body == b"" and reader.reusable


def test_a_head_request_has_no_body() -> None:
    _, body, reader = read(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", head_request=True)
    assert body == b"" and reader.reusable


def test_values_of_a_header_are_split_and_gathered() -> None:
    head, _, _ = read(b"HTTP/1.1 200 OK\r\nVary: a, b\r\nvary: c\r\nContent-Length: 0\r\n\r\n")
    assert head.values(b"vary") == [b"a", b"b", b"c"]


@pytest.mark.parametrize(
    ("raw", "eof", "message"),
    [
        (b"", True, "closed the connection without a response"),
        (b"HTTP/1.1 200 OK\r\nContent-", True, "before a complete response head"),
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", False, "not an HTTP/1.x status line"),
        (b"HTTP/2 200\r\n\r\n", False, "not an HTTP/1.x status line"),
        (b"HTTP/1.1 20 OK\r\n\r\n", False, "not an HTTP/1.x status line"),
        (b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", False, "invalid header line"),
        (b"HTTP/1.1 200 OK\r\nName : v\r\n\r\n", False, "invalid header line"),
        (b"HTTP/1.1 200 OK\r\nA: b\r\n folded\r\n\r\n", False, "invalid header line"),
        (b"HTTP/1.1 200 OK\r\nA: b\x00c\r\n\r\n", False, "invalid value for header"),
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", False, "switched protocols"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", False, "invalid Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n", False, "invalid Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 19 + b"\r\n\r\n", False, "invalid"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", False, "'gzip, chunked'"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nshort", True, "4 bytes short"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", False, "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n", False, "longer"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", True, "in a chunk"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5", True, "chunked body"),
    ],
    ids=[
        "nothing",
        "head-cut",
        "not-http",
        "http2",
        "status",
        "no-colon",
        "space-before-colon",
        "folded",
        "nul",
        "upgrade",
        "negative-length",
        "two-lengths",
        "huge-length",
        "transfer-coding",
        "body-cut",
        "chunk-size",
        "chunk-too-long",
        "chunk-cut",
        "size-line-cut",
    ],
)
def test_malformed_responses_are_refused(raw: bytes, eof: bool, message: str) -> None:
    assert message in refused(raw, eof=eof)


def test_every_unbounded_part_has_a_bound() -> None:
    assert "longer than 65536" in refused(b"HTTP/1.1 200 OK\r\nA: " + b"a" * 70_000)
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert "longer than 1024" in refused(chunked + b"1;" + b"e" * 2000)
    trailers = chunked + b"0\r\n" + b"T: x\r\n" * 3000 + b"\r\n"
    assert "trailers longer than 16384" in refused(trailers)


def test_a_huge_chunk_is_streamed_not_held() -> None:
    reader = ResponseReader()
    reader.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFF\r\n")
    assert reader.read_head() is not None
    assert reader.read_body() == b""
    reader.feed(b"x" * 100)
    assert reader.read_body() == b"x" * 100


def test_read_body_before_the_head_is_a_programming_error() -> None:
    with pytest.raises(RuntimeError):
        ResponseReader().read_body()


def test_a_request_is_encoded_with_its_headers_and_body() -> None:
    data = encode_request(
        "GET", b"/api/v1/configmaps?watch=1", [(b"Host", b"api:6443"), (b"Accept", b" */* ")]
    )
    assert (
        data == b"GET /api/v1/configmaps?watch=1 HTTP/1.1\r\nHost: api:6443\r\nAccept: */*\r\n\r\n"
    )
    assert encode_request("POST", b"/x", [], b"{}").endswith(b"\r\n\r\n{}")


@pytest.mark.parametrize(
    ("method", "target", "headers", "message"),
    [
        ("GET /x HTTP/1.1\r\n", b"/", [], "invalid HTTP method"),
        ("GET", b"/a b", [], "invalid request target"),
        ("GET", b"http://elsewhere/", [], "invalid request target"),
        ("GET", b"/", [(b"Bad Name", b"v")], "invalid header name"),
        ("GET", b"/", [(b"Authorization", b"Bearer x\r\nInjected: 1")], "Authorization"),
    ],
    ids=["method", "space-in-target", "absolute-target", "header-name", "header-injection"],
)
def test_a_request_that_would_not_be_one_request_is_refused(
    method: str, target: bytes, headers: list[tuple[bytes, bytes]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        encode_request(method, target, headers)


# -- properties over generated responses ------------------------------------------------

_BODIES = st.binary(max_size=300)


@st.composite
def framed_responses(draw: st.DrawFn) -> tuple[bytes, bytes, bool]:
    """A valid response, its body, and whether it leaves the connection reusable."""
    body = draw(_BODIES)
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    headers = b"".join(
        b"X-%d: %s\r\n" % (i, value)
        for i, value in enumerate(
            draw(st.lists(st.binary(max_size=20).filter(_visible), max_size=4))
        )
    )
    if framing == "length":
        return (
            b"HTTP/1.1 200 OK\r\n%sContent-Length: %d\r\n\r\n%s" % (headers, len(body), body),
            body,
            True,
        )
    if framing == "close":
        return b"HTTP/1.1 200 OK\r\n%s\r\n%s" % (headers, body), body, False
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=5)))
    chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True) if b > a]
    encoded = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for chunk in chunks)
    return (
        b"HTTP/1.1 200 OK\r\n%sTransfer-Encoding: chunked\r\n\r\n%s0\r\n\r\n" % (headers, encoded),
        body,
        True,
    )


def _visible(value: bytes) -> bool:
    return all(0x21 <= byte <= 0x7E for byte in value)


def _read_in_pieces(raw: bytes, cuts: list[int]) -> tuple[bytes, bool]:
    """The body of `raw` fed in the pieces `cuts` makes, then the end of the
    stream; and whether the connection was reusable before that end."""
    reader = ResponseReader()
    body = b""
    head = None
    for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True):
        reader.feed(raw[a:b])
        head = head or reader.read_head()
        while head is not None and (part := reader.read_body()):
            body += part
    reusable = reader.reusable
    reader.feed_eof()
    head = head or reader.read_head()
    while (part := reader.read_body()) is not None:
        body += part
    return body, reusable


def _outcome(raw: bytes, cuts: list[int]) -> tuple[bytes, bool] | str:
    try:
        return _read_in_pieces(raw, cuts)
    except ProtocolError as error:
        return str(error)


@settings(max_examples=300, deadline=None)
@given(framed_responses(), st.lists(st.integers(0, 1000), max_size=8))
def test_a_response_reads_the_same_however_it_is_cut(
    response: tuple[bytes, bytes, bool], cuts: list[int]
) -> None:
    raw, body, reusable = response
    assert _read_in_pieces(raw, sorted(min(cut, len(raw)) for cut in cuts)) == (body, reusable)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=400), st.lists(st.integers(0, 400), max_size=4))
def test_any_bytes_give_one_outcome_however_they_are_cut(raw: bytes, cuts: list[int]) -> None:
    """A body and reuse verdict, or a ProtocolError; the same whole or in pieces."""
    raw = b"HTTP/1.1 200 OK\r\n" + raw
    whole = _outcome(raw, [])
    pieces = _outcome(raw, sorted(min(cut, len(raw)) for cut in cuts))
    assert type(whole) is type(pieces)
    if not isinstance(whole, str):
        assert whole == pieces
