"""Random HTTP/2 input for fuzz tests: plausible frames, some of them wrong.

`random_frames` builds what one hostile connection sends after its preface:
mostly well-formed frames on streams that exist, now and then a frame on
stream 0 or on a stream never opened, odd SETTINGS, windows at their limits,
gRPC messages with wrong prefixes, headers a gRPC client would not send,
requests compressed well and badly.
Seeded (`random.Random`), so a failure is reproduced by its seed. The tests
(tests/rpc/test_h2_fuzz.py) check what the server does with it, not what it
answers: no connection but the hostile one may suffer.
"""

from __future__ import annotations

import contextlib
import gzip
import random
import struct
import zlib
from collections.abc import Callable

import hpack
from hyperframe import frame as h2frame

from tests.support.h2_client import client_info, grpc_frame

PATHS = (
    "/job.Job/Register",
    "/job.Job/SubscribeJobSummarySignal",
    "/job.Job/SubscribeJobSummarySignalList",
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/no.Such/Method",
    "/",
)
ROLES = ("CCAgent", "FdAgent", "DefaultUser1", "nobody", "")
LARGEST_WINDOW = 2**31 - 1
COMPRESSORS: dict[str, Callable[[bytes], bytes]] = {"gzip": gzip.compress, "deflate": zlib.compress}


class FrameMaker:
    """The frames of one connection, with its HPACK state and the streams it opened."""

    def __init__(self, rng: random.Random, authority: str) -> None:
        self.rng = rng
        # Compression is drawn from a generator of its own, seeded from `rng`'s
        # state without drawing from it: every seed's frames stay what they were
        # before compressed requests were read (only headers and bodies change).
        self.compression = random.Random(hash(rng.getstate()[1]))
        self.encodings: dict[int, str] = {}  # the grpc-encoding each stream's headers named
        self.authority = authority
        self.encoder = hpack.Encoder()
        self.opened: list[int] = []  # every stream opened so far
        self.sending: list[int] = []  # those the peer has not ended or reset

    def frames(self, count: int, *, wrong: float) -> bytes:
        """`count` frames; each is built to break a rule with probability `wrong`."""
        return b"".join(self._frame(self.rng.random() < wrong) for _ in range(count))

    def _frame(self, wrong: bool) -> bytes:
        rng = self.rng
        kind = rng.choices(
            ("headers", "data", "reset", "window", "settings", "ping", "priority", "other"),
            weights=(20, 25, 8, 12, 5, 6, 2, 2),
        )[0]
        frame: h2frame.Frame
        if kind != "headers" and not self.sending and not wrong:
            kind = "headers"  # a stream to send on first
        if kind == "headers":
            stream = self._stream(new=not wrong or rng.random() < 0.5, wrong=wrong)
            block = self._header_block(stream, wrong)
            frame = h2frame.HeadersFrame(stream, block, flags=["END_HEADERS"])
            if rng.random() < 0.15:
                frame.flags.add("END_STREAM")
        elif kind == "data":
            payload = client_info(rng.choice(ROLES), rng.choice(("", "x" * 36)))
            body = grpc_frame(payload)
            if wrong:
                body = rng.choice(
                    (
                        body[: rng.randrange(len(body))],  # cut
                        b"\x01" + body[1:],  # compressed
                        grpc_frame(b"", length=rng.choice((2**31, 5_000, 7))),  # lying length
                        rng.randbytes(rng.randrange(200)),
                    )
                )
            stream = self._stream(new=False, wrong=wrong)
            if not wrong and self.compression.random() < 0.5:
                body = self._compressed(payload, self.encodings.get(stream))
            frame = h2frame.DataFrame(stream, body)
            if rng.random() < 0.5:
                frame.flags.add("END_STREAM")
        elif kind == "reset":
            frame = h2frame.RstStreamFrame(self._stream(new=False, wrong=wrong))
            frame.error_code = rng.choice((0, 1, 8, 2**32 - 1))
        elif kind == "window":
            stream = rng.choice((0, self._stream(new=False, wrong=wrong)))
            increment = rng.choice((1, 1_000, 65_535, 2**20))
            frame = h2frame.WindowUpdateFrame(stream, window_increment=increment)
            if wrong:  # zero, or past the largest window (both are errors)
                frame.window_increment = rng.choice((0, LARGEST_WINDOW))
        elif kind == "settings":
            frame = h2frame.SettingsFrame(0)
            code = rng.choice((1, 3, 4, 5, 6, 0x7A))  # 0x7A: unknown, to be ignored
            value = rng.choice((0, 1, 100, 16_384, 65_535, 2**20, 2**24 - 1, LARGEST_WINDOW))
            if wrong:
                value = rng.choice((2**31, 2**24, 2**32 - 1))
            frame.settings = {code: value}
        elif kind == "ping":
            frame = h2frame.PingFrame(0, opaque_data=rng.randbytes(8))
        elif kind == "priority":
            stream = self._stream(new=False, wrong=wrong)
            frame = h2frame.PriorityFrame(stream, depends_on=rng.choice((0, stream + 2)))
        else:  # a frame a gRPC client never sends
            frame = rng.choice(
                (
                    h2frame.GoAwayFrame(0, last_stream_id=0, error_code=0),
                    h2frame.ContinuationFrame(self._stream(new=False, wrong=True), b""),
                )
            )
        if "END_STREAM" in frame.flags or kind == "reset":
            with contextlib.suppress(ValueError):
                self.sending.remove(frame.stream_id)
        data = frame.serialize()
        if wrong and kind in ("headers", "data", "reset", "priority") and rng.random() < 0.3:
            # A stream id the frame may not carry: 0, even (server-initiated) or reused.
            stream_id = rng.choice((0, 2, 1))
            data = data[:5] + struct.pack(">I", stream_id) + data[9:]
        return data

    def _compressed(self, payload: bytes, encoding: str | None) -> bytes:
        """`payload` as a compressed gRPC message: mostly in the `encoding` its stream
        named, else in gzip or deflate, now and then a bomb (64 KiB of zeros in
        gzip, over the request limit once inflated)."""
        draw = self.compression.random()
        if draw < 0.15:
            return grpc_frame(gzip.compress(bytes(64 * 1024)), compressed=True)
        if draw < 0.3 or encoding not in COMPRESSORS:
            encoding = self.compression.choice(sorted(COMPRESSORS))
        return grpc_frame(COMPRESSORS[encoding](payload), compressed=True)

    def _stream(self, *, new: bool, wrong: bool) -> int:
        """A new stream, one the peer still sends on, or (`wrong`) any other."""
        if new or not (self.sending or (wrong and self.opened)):
            self.opened.append(self.opened[-1] + 2 if self.opened else 1)
            self.sending.append(self.opened[-1])
            return self.opened[-1]
        if wrong:
            return self.rng.choice((*self.opened, self.opened[-1] + 100))  # ended, or never opened
        return self.rng.choice(self.sending)

    def _header_block(self, stream: int, wrong: bool) -> bytes:
        rng = self.rng
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", rng.choice(PATHS)),
            (":authority", self.authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        if rng.random() < 0.3:
            headers.append(
                ("grpc-timeout", rng.choice(("0n", "1u", "5m", "10S", "x", "99999999H")))
            )
        if self.compression.random() < 0.5:
            encoding = self.compression.choice(("gzip", "deflate", "gzip", "identity", "zstd"))
            headers.append(("grpc-encoding", encoding))
            self.encodings[stream] = encoding
        if wrong:
            match rng.randrange(5):
                case 0:
                    headers = [h for h in headers if h[0] != ":path"]
                case 1:
                    headers.append(("connection", "keep-alive"))  # forbidden in HTTP/2
                case 2:
                    headers[4] = ("content-type", "text/plain")
                case 3:
                    headers.append(("grpc-encoding", "gzip"))
                case _:
                    headers.append(("x-big", "a" * rng.randrange(20_000)))
        return bytes(self.encoder.encode(headers))
