"""The counting transport: DATA and HEADERS frames the server writes, counted from the bytes."""

from __future__ import annotations

from typing import Any

import pytest

from jobsignal.rpc.sent_frames import FrameCountingTransport
from tests.support.h2_client import h2_pair


class Socket:
    """What the counting transport passes writes on to."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.lists: list[int] = []  # the number of parts of each writelines

    def write(self, data: bytes) -> None:
        self.written += data

    def writelines(self, parts: list[bytes]) -> None:
        self.lists.append(len(parts))
        for data in parts:
            self.written += data

    def is_closing(self) -> bool:
        return False


def counting() -> tuple[FrameCountingTransport, Socket, list[int]]:
    socket = Socket()
    inner: Any = socket
    transport = FrameCountingTransport(inner)
    counts: list[int] = []
    transport.frames_sent = counts.append
    return transport, socket, counts


def server_output() -> tuple[bytes, int]:
    """A server's output after the handshake: SETTINGS and its ACK, a PING ACK, response
    headers and trailers (a block over one frame: HEADERS and CONTINUATION), DATA
    frames of several sizes, a WINDOW_UPDATE, RST_STREAM and GOAWAY; and how many of
    those frames are DATA or HEADERS."""
    server, client = h2_pair()
    request = [(":method", "POST"), (":scheme", "http"), (":path", "/p"), (":authority", "h")]
    client.send_headers(1, request, end_stream=True)
    client.send_headers(3, request, end_stream=True)
    client.ping(b"12345678")
    server.receive_data(client.data_to_send())
    server.send_headers(1, [(":status", "200")])
    for size in (0, 1, 1_000, 16_384):
        server.send_data(1, b"x" * size)
    server.increment_flow_control_window(1000)
    server.send_headers(1, [("grpc-status", "0"), ("grpc-message", "y" * 20_000)], end_stream=True)
    server.reset_stream(3)
    server.close_connection()
    # HEADERS (2, the second continued), DATA (4).
    return server.data_to_send(), 6


def test_each_write_of_whole_frames_counts_its_data_and_headers_frames() -> None:
    output, expected = server_output()
    transport, socket, counts = counting()
    transport.write(output)
    assert counts == [expected]
    assert socket.written == output  # passed on as it is


def test_a_list_of_frames_and_views_is_counted_and_passed_on_as_one_list() -> None:
    output, expected = server_output()
    transport, socket, counts = counting()
    view = memoryview(output)
    parts = [view[start : start + 700] for start in range(0, len(output), 700)]
    transport.writelines(parts)
    assert counts == [expected]
    assert socket.lists == [len(parts)]  # one sendmsg where asyncio has it, no copies
    assert socket.written == output


@pytest.mark.parametrize("piece", [1, 5, 9, 10, 4_000])
def test_frames_split_across_writes_are_counted_once_each(piece: int) -> None:
    output, expected = server_output()
    transport, socket, counts = counting()
    view = memoryview(output)
    for start in range(0, len(output), piece):
        transport.write(view[start : start + piece])
    assert sum(counts) == expected
    assert 0 not in counts  # a write with no frame's start in it calls nothing
    assert socket.written == output


def test_writes_without_data_or_headers_count_nothing() -> None:
    transport, socket, counts = counting()
    ping_ack = b"\x00\x00\x08\x06\x01\x00\x00\x00\x00" + b"12345678"
    transport.write(ping_ack)
    transport.writelines([ping_ack, ping_ack])
    assert counts == [] and socket.written == ping_ack * 3 and socket.lists == [2]
    assert not transport.is_closing()
