"""A LIST page's body is read within a byte bound (jobsignal/kube/api.py, `KubeApi.list_page`).

An API server (or whatever answers in its place) that sends without end, or a
small gzip body that inflates without end, makes the watcher hold at most the
bound; the watcher then asks for smaller pages (tests/kube/test_watcher.py).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterator

import httpx
import pytest
import trio

from jobsignal.kube.api import ApiUnavailable, KubeApi, PageTooLarge

BOUND = 64 * 1024
CHUNK = 4096


class EndlessBody:
    """A response body that never ends, counting the chunks it was asked for."""

    def __init__(self) -> None:
        self.sent = 0

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            await trio.lowlevel.checkpoint()
            self.sent += 1
            yield b"x" * CHUNK


def api_answering(response: httpx.Response) -> KubeApi:
    client = httpx.AsyncClient(
        transport=httpx.MockTransport(lambda request: response), base_url="http://api"
    )
    return KubeApi(client, None, read_timeout=30, max_page_bytes=BOUND)


def page_of(size: int) -> bytes:
    """A ConfigMapList of exactly `size` bytes."""
    empty = json.dumps({"metadata": {"resourceVersion": "7"}, "items": [], "pad": ""}).encode()
    return empty.replace(b'"pad": ""', b'"pad": "' + b"p" * (size - len(empty)) + b'"')


async def test_an_endless_page_is_too_large_once_past_the_bound() -> None:
    body = EndlessBody()
    api = api_answering(httpx.Response(200, content=body.chunks()))
    with pytest.raises(PageTooLarge, match=f"up to 500 ConfigMaps is over {BOUND} bytes"):
        await api.list_page("ns", {"limit": "500"})
    assert body.sent == BOUND // CHUNK + 1  # read up to the bound, and no further


@pytest.mark.parametrize(("size", "fits"), [(BOUND, True), (BOUND + 1, False)])
async def test_a_page_of_exactly_the_bound_is_read(size: int, fits: bool) -> None:
    assert len(page_of(size)) == size
    api = api_answering(httpx.Response(200, content=page_of(size)))
    if fits:
        page = await api.list_page("ns", {"limit": "500"})
        assert page["metadata"] == {"resourceVersion": "7"}
    else:
        with pytest.raises(PageTooLarge):
            await api.list_page("ns", {"limit": "500"})


async def test_a_small_gzip_body_that_inflates_past_the_bound_is_too_large() -> None:
    compressed = gzip.compress(page_of(BOUND * 16))
    assert len(compressed) < BOUND // 8
    api = api_answering(
        httpx.Response(200, content=compressed, headers={"Content-Encoding": "gzip"})
    )
    with pytest.raises(PageTooLarge):
        await api.list_page("ns", {"limit": "500"})


async def test_an_error_with_an_endless_body_is_read_for_its_message_only() -> None:
    body = EndlessBody()
    api = api_answering(httpx.Response(503, content=body.chunks()))
    with pytest.raises(ApiUnavailable, match="HTTP 503"):
        await api.list_page("ns", {"limit": "500"})
    assert body.sent <= 64 * 1024 // CHUNK + 1
