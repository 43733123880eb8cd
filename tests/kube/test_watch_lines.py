"""A WATCH body as lines of JSON: split wherever the chunks fall, bounded in length
(jobsignal/kube/api.py, `LineSplitter` and `KubeApi.watch`)."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Sequence

import httpx
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from jobsignal.kube.api import (
    MAX_WATCH_LINE_BYTES,
    ApiUnavailable,
    BadResponse,
    KubeApi,
    LineSplitter,
)


def split_all(chunks: Sequence[bytes], limit: int = 1 << 20) -> list[bytes]:
    splitter = LineSplitter(limit)
    lines = [line for chunk in chunks for line in splitter.feed(chunk)]
    return lines + splitter.finish()


def cut(data: bytes, cuts: Sequence[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@given(
    lines=st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=12),
    cuts=st.lists(st.integers(min_value=0), max_size=20),
    terminated=st.booleans(),
)
def test_lines_come_out_as_sent_however_the_chunks_fall(
    lines: list[bytes], cuts: list[int], terminated: bool
) -> None:
    data = b"\n".join(lines) + (b"\n" if terminated and lines else b"")
    expected = list(lines)
    if not terminated and expected and expected[-1] == b"":
        expected.pop()  # an empty last line without its newline is nothing
    assert split_all(cut(data, cuts)) == expected


def test_a_line_over_the_limit_is_malformed_wherever_it_ends() -> None:
    with pytest.raises(BadResponse, match="over 10 bytes"):
        split_all([b"x" * 11], limit=10)  # not ended yet, already too long
    with pytest.raises(BadResponse, match="over 10 bytes"):
        split_all([b"x" * 6, b"x" * 6], limit=10)  # too long across chunks
    with pytest.raises(BadResponse, match="over 10 bytes"):
        split_all([b"x" * 8, b"xxx\nok\n"], limit=10)  # too long only once it ends
    assert split_all([b"x" * 8, b"xx\n" + b"y" * 10 + b"\n"], limit=10) == [b"x" * 10, b"y" * 10]


def event_line(name: str, version: int) -> bytes:
    configmap = {"metadata": {"name": name, "resourceVersion": str(version)}, "data": {}}
    return json.dumps({"type": "MODIFIED", "object": configmap}).encode() + b"\n"


def watch_api(body: AsyncIterator[bytes], read_timeout: float = 30) -> KubeApi:
    def respond(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body)

    client = httpx.AsyncClient(transport=httpx.MockTransport(respond), base_url="http://api")
    return KubeApi(client, None, read_timeout=read_timeout)


async def chunks_of(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        await trio.lowlevel.checkpoint()
        yield part


async def watched(api: KubeApi) -> list[str]:
    names = []
    async with api.watch("ns", {}) as events:
        async for event in events:
            names.append(event["object"]["metadata"]["name"])
    return names


async def test_events_split_across_chunks_and_sharing_them_are_all_read() -> None:
    stream = event_line("a", 1) + event_line("b", 2) + b"\r\n\n" + event_line("c", 3)
    middle = len(event_line("a", 1)) + 7
    parts = (stream[:5], stream[5:middle], stream[middle:-1], stream[-1:])
    assert await watched(watch_api(chunks_of(*parts))) == ["a", "b", "c"]


async def test_an_event_without_its_last_newline_still_counts() -> None:
    assert await watched(watch_api(chunks_of(event_line("a", 1)[:-1]))) == ["a"]


async def test_invalid_utf8_reaches_the_store_as_replacement_characters() -> None:
    line = b'{"type": "ADDED", "object": {"metadata": {"name": "a\xff"}}}\n'
    assert await watched(watch_api(chunks_of(line))) == ["a\ufffd"]


async def test_an_endless_line_ends_the_watch_as_malformed_input() -> None:
    sent = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal sent
        while True:
            await trio.lowlevel.checkpoint()
            sent += 1 << 16
            yield b"x" * (1 << 16)

    with pytest.raises(BadResponse, match=f"over {MAX_WATCH_LINE_BYTES} bytes"):
        await watched(watch_api(endless()))
    assert sent <= MAX_WATCH_LINE_BYTES + (1 << 16)  # read no further than the limit


async def test_an_event_must_arrive_within_the_read_timeout_even_in_pieces(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A server that trickles one event a byte at a time, slower than the read
    timeout allows for the whole event, is as dead as a silent one."""
    line = event_line("a", 1)

    async def trickle() -> AsyncIterator[bytes]:
        for byte in line:
            await trio.sleep(1)
            yield bytes([byte])

    started = trio.current_time()
    with pytest.raises(ApiUnavailable, match="silent for 10s"):
        await watched(watch_api(trickle(), read_timeout=10))
    assert trio.current_time() - started == pytest.approx(10)
