"""Framing a batch as gRPC messages (`rpc.writer.frame`)."""

from __future__ import annotations

from jobsignal.rpc.writer import FRAME_ONCE_BYTES, frame


def test_a_batch_is_framed_as_grpc_messages() -> None:
    assert frame([b"ab", b""]) == b"\x00\x00\x00\x00\x02ab" + b"\x00\x00\x00\x00\x00"


def test_a_large_message_alone_is_framed_once_for_every_stream_it_goes_to() -> None:
    big, other = b"x" * FRAME_ONCE_BYTES, b"y" * (FRAME_ONCE_BYTES + 1)
    framed = frame([big])
    assert framed == b"\x00" + FRAME_ONCE_BYTES.to_bytes(4, "big") + big
    assert frame([big]) is framed  # the next stream's batch: no copy
    assert frame([other]) == b"\x00" + len(other).to_bytes(4, "big") + other
    again = frame([big])
    assert again == framed and again is not framed  # framed anew after another one
    assert frame([big, big]) == framed * 2  # not alone: framed as any batch
