"""Compressed requests (docs/architecture.md section 7, "Request bodies").

A client may compress any message it sends: its grpc-encoding header names
the algorithm, each message's prefix flags whether that message is
compressed. The server reads gzip and deflate on every service, never
inflates a message past the request size limit, and refuses the rest with
the statuses grpc-go's and gRPC core's servers give. Raw HTTP/2 peers on
127.0.0.1 in virtual time; real clients that compress are in
tests/rpc/test_interop.py (grpcio) and tests/interop (grpc-go, grpc-js).
"""

from __future__ import annotations

import gzip
import tracemalloc
import zlib
from collections.abc import Callable

import pytest
import trio.testing
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from jobsignal._proto.job import ClientInfo
from jobsignal.rpc import compression
from jobsignal.rpc.codec import MESSAGE_PREFIX
from tests.support.grpc_server import open_jobsignal_server
from tests.support.h2_client import grpc_frame

from .test_hostile_h2 import raw_peer
from .test_odd_requests import (
    HEALTH_CHECK,
    HEALTH_WATCH,
    INTERNAL,
    OK,
    REFLECTION,
    REGISTER,
    UNIMPLEMENTED,
    answer,
    call,
)

RESOURCE_EXHAUSTED = "8"
LIMIT = 4096  # the default --max-request-bytes
COMPRESSORS: dict[str, Callable[[bytes], bytes]] = {"gzip": gzip.compress, "deflate": zlib.compress}
# A ServerReflectionRequest asking for the list of services (field 7, empty).
LIST_SERVICES = b"\x3a\x00"

pytestmark = pytest.mark.usefixtures("nothing_logged_at_error")


def compressed(encoding: str, message: bytes) -> bytes:
    return grpc_frame(COMPRESSORS[encoding](message), compressed=True)


def messages(data: bytes) -> list[bytes]:
    """The gRPC messages of a response's DATA, in order."""
    found = []
    while data:
        _, length = MESSAGE_PREFIX.unpack(data[:5])
        found.append(data[5 : 5 + length])
        data = data[5 + length :]
    return found


@pytest.mark.parametrize("encoding", COMPRESSORS)
async def test_compressed_requests_are_served_by_every_service(
    io_clock: trio.testing.MockClock, encoding: str
) -> None:
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await peer.handshake()
        register = bytes(ClientInfo(role="CCAgent"))
        await call(peer, 1, REGISTER, compressed(encoding, register), grpc_encoding=encoding)
        await call(peer, 3, HEALTH_CHECK, compressed(encoding, b""), grpc_encoding=encoding)
        # A stream of two requests: the first compressed, the second not.
        both = compressed(encoding, LIST_SERVICES) + grpc_frame(LIST_SERVICES)
        await call(peer, 5, REFLECTION, both, grpc_encoding=encoding)
        for stream_id in (1, 3, 5):
            assert await answer(peer, stream_id) == (OK, "")
        assert len(server.registry) == 1
        listed = messages(b"".join(peer.data_frames(5)))
        assert len(listed) == 2 and all(b"job.Job" in answer for answer in listed)


# A small message that compresses, and one that inflates far past the limit
# (1 MiB of zeros is about 1 KiB of gzip: under the limit as it arrives).
SMALL = b"x" * 100
BOMB = bytes(1 << 20)

BAD_COMPRESSED = {
    "no-encoding": (None, compressed("gzip", SMALL), INTERNAL, "request message is flagged"),
    "identity": ("identity", compressed("gzip", SMALL), INTERNAL, "request message is flagged"),
    "unknown": (
        "zstd",
        compressed("gzip", SMALL),
        UNIMPLEMENTED,
        "grpc-encoding 'zstd' is not supported; this server reads identity, deflate, gzip",
    ),
    "corrupt": (
        "gzip",
        grpc_frame(b"\x1f\x8b" + b"junk" * 4, compressed=True),
        INTERNAL,
        "request message is not valid gzip:",
    ),
    "cut-short": (
        "gzip",
        grpc_frame(gzip.compress(SMALL)[:-6], compressed=True),
        INTERNAL,
        "request message is not valid gzip: it is cut short",
    ),
    "bytes-after": (
        "deflate",
        grpc_frame(zlib.compress(SMALL) + b"!!", compressed=True),
        INTERNAL,
        "request message is not valid deflate: bytes follow its end",
    ),
    "bomb": (
        "gzip",
        compressed("gzip", BOMB),
        RESOURCE_EXHAUSTED,
        f"request decompresses to more than the limit of {LIMIT} bytes",
    ),
}


@pytest.mark.parametrize("path", [HEALTH_CHECK, HEALTH_WATCH, REFLECTION, REGISTER])
@pytest.mark.parametrize("case", BAD_COMPRESSED)
async def test_a_bad_compressed_request_ends_its_stream_with_a_precise_status(
    io_clock: trio.testing.MockClock, path: str, case: str
) -> None:
    encoding, body, code, message = BAD_COMPRESSED[case]
    headers = {} if encoding is None else {"grpc_encoding": encoding}
    async with open_jobsignal_server() as server, raw_peer(server.port) as peer:
        await peer.handshake()
        await call(peer, 1, path, body, **headers)
        answered = await answer(peer, 1)
        assert answered[0] == code and answered[1].startswith(message), answered
        await peer.assert_serves_a_request(3)


@pytest.mark.parametrize("encoding", COMPRESSORS)
def test_a_message_inflates_up_to_the_limit_and_not_a_byte_more(encoding: str) -> None:
    at_limit = bytes(range(256)) * (LIMIT // 256)
    assert compression.decompress(COMPRESSORS[encoding](at_limit), encoding, LIMIT) == at_limit
    with pytest.raises(GRPCError) as refused:
        compression.decompress(COMPRESSORS[encoding](at_limit + b"!"), encoding, LIMIT)
    assert refused.value.status is Status.RESOURCE_EXHAUSTED


def test_a_bomb_is_refused_without_inflating_it() -> None:
    """64 MiB of zeros in 64 KiB of gzip: refused having held zlib's state (its
    32 KiB window and tables: about 110 KB traced), not the 64 MiB."""
    bomb = gzip.compress(bytes(64 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(GRPCError) as refused:
            compression.decompress(bomb, "gzip", LIMIT)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert refused.value.status is Status.RESOURCE_EXHAUSTED
    assert peak < 1 << 20, peak


def test_an_encoding_named_in_a_refusal_is_cut_short() -> None:
    with pytest.raises(GRPCError) as refused:
        compression.check_encoding("x" * 10_000)
    assert refused.value.status is Status.UNIMPLEMENTED
    assert refused.value.message is not None and len(refused.value.message) < 200
