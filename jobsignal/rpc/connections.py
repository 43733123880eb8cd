"""HTTP/2 connections as jobsignal sees them: the fault boundary of each peer.

grpclib's protocol feeds every byte a peer sends to h2 and every h2 event to
its own processor, with no hooks and no limits. The server's protocol factory
wraps it in `ObservedH2Protocol`, which owns what one connection may do:

- client PINGs, and ACKs of the server's keepalive PINGs, are heartbeats for
  the idle rule, and ping strikes are
  forgiven by every DATA or HEADERS frame the server sends (`rpc.activity`,
  counted as they are written: `rpc.sent_frames`);
- the abuse budgets of `rpc.guard` (Rapid Reset, control-frame floods) end
  the connection with GOAWAY ENHANCE_YOUR_CALM;
- a handshake timeout for peers that never send the preface and SETTINGS;
- server keepalive: a PING to a peer quiet for `--keepalive-time`, and the
  connection closed when nothing comes back (`rpc.keepalive`);
- the maximum connection age: GOAWAY, PING, GOAWAY as grpc-go does, then
  streams refused, and with a grace, the subscriptions ended with UNAVAILABLE
  and the connection closed (`rpc.max_age`);
- at most `read_bytes_per_turn` of input per event-loop turn, so one peer's
  burst cannot hold the loop;
- a peer that does not read: the server stops reading from it (its PINGs and
  SETTINGS cannot queue answers without bound) and closes it after
  `write_stall_timeout`;
- the stream limit is advertised in SETTINGS and extra streams are refused one
  by one with REFUSED_STREAM (h2 itself only ends a connection that goes far
  past it); a request without `:path` is answered with a status;
- protocol errors are answered with the GOAWAY h2 prepared, flushed before
  the close, and logged (rate-limited); any unexpected error while handling
  a peer's input ends only that connection.

Every reach into grpclib and h2 internals goes through `rpc._grpclib`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpclib.server
import trio
from grpclib.protocol import Connection, H2Protocol
from h2.errors import ErrorCodes
from h2.events import (
    Event,
    PingAckReceived,
    PingReceived,
    RemoteSettingsChanged,
    RequestReceived,
    StreamReset,
    WindowUpdated,
)
from h2.exceptions import ProtocolError, StreamClosedError
from hyperframe.frame import GoAwayFrame

from jobsignal.logs import RateLimitedLog
from jobsignal.rpc import _grpclib
from jobsignal.rpc.activity import ConnectionActivity, PingPolicy
from jobsignal.rpc.guard import AddressBudgets, ConnectionBudget, ProtocolLimits
from jobsignal.rpc.keepalive import KeepalivePolicy, Liveness, PeerLiveness
from jobsignal.rpc.limits import ConnectionCounter, Limits, peer_ip, tls_handshake_counter
from jobsignal.rpc.max_age import (
    DRAIN_POLL,
    FINAL_WRITE_TIMEOUT,
    GOAWAY_PING,
    GOAWAY_PING_TIMEOUT,
    MAX_STREAM_ID,
    Aging,
    MaxAgePolicy,
    Stage,
)
from jobsignal.rpc.output import ConnectionOutput, LateFlusher, TurnFlusher
from jobsignal.rpc.sent_frames import FrameCountingTransport
from jobsignal.util.text import quote

log = logging.getLogger(__name__)
fault_log = RateLimitedLog(log)

TOO_MANY_PINGS = "too_many_pings"
HANDSHAKE_TIMEOUT = "handshake_timeout"
WRITE_STALLED = "write_stalled"
KEEPALIVE_TIMEOUT = "keepalive_timeout"
# The opaque data of the server's keepalive PINGs (any 8 bytes do; nothing checks them).
KEEPALIVE_PING = b"jobsignl"
PROTOCOL_ERROR = "protocol_error"
MAX_AGE = "max_age"
INTERNAL_ERROR = "internal_error"
DEADLINE_EXCEEDED = 4
RESOURCE_EXHAUSTED = 8
UNAVAILABLE = 14
INTERNAL = 13
# What the streams still open when a connection's maximum age and grace ran out are told.
MAX_AGE_ENDED = "the connection reached its maximum age and its grace period ran out; reconnect"
# A call with less time than this (its grpc-timeout) is answered DEADLINE_EXCEEDED
# before grpclib sees it: grpclib starts the deadline when the call's task runs
# and, finding none of it left, answered UNKNOWN and logged a traceback at ERROR.
SHORTEST_DEADLINE = 0.001
# Seconds a refused connection may take to send the request it is refused on.
REFUSED_CONNECTION_LINGER = 5.0
# Refused connections lingering at once: with --max-connections, they bound the
# file descriptors the gRPC port holds (file_limit.py).
MAX_LINGERING_REFUSALS = 64
# Events after which a stream waiting for window may go on (a tuple: isinstance
# with `A | B` builds the union anew on every event).
WINDOW_OPENING_EVENTS = (WindowUpdated, RemoteSettingsChanged)


def hard_stream_limit(advertised: int) -> int:
    """Concurrent streams at which h2 ends the connection: a peer that goes this
    far past the advertised limit ignores SETTINGS; below it, extra streams
    (for example sent before the peer saw our SETTINGS) are refused one by one."""
    return max(2 * advertised, advertised + 100)


class ConnectionTable:
    """The live connections of one server, keyed by grpclib's Connection."""

    def __init__(
        self,
        ping_policy: PingPolicy,
        limits: Limits | None = None,
        protocol_limits: ProtocolLimits | None = None,
        keepalive: KeepalivePolicy | None = None,
        max_age: MaxAgePolicy | None = None,
    ) -> None:
        self.ping_policy = ping_policy
        self.keepalive = keepalive or KeepalivePolicy()
        self.max_age = max_age or MaxAgePolicy()
        # Ends the subscriptions of one connection whose maximum age and grace ran
        # out, each with its status (the server sets it: `rpc.server`).
        self.end_subscriptions: Callable[[ConnectionActivity], None] = _no_subscriptions
        self.limits = limits or Limits()
        self.protocol_limits = protocol_limits or ProtocolLimits()
        self.counter = ConnectionCounter(
            self.limits.max_connections, self.limits.max_connections_per_ip
        )
        # Every connection from one address shares its budget of stream resets
        # and the pacer of its control frames.
        self.address_budgets = AddressBudgets(self.protocol_limits)
        self.flusher = TurnFlusher()
        self.late_flusher = LateFlusher()
        self._protocols: dict[Connection, ObservedH2Protocol] = {}
        # Every connection with an open transport, refused ones included: the
        # server closes all of them when it stops, or their sockets would leak.
        self._open: set[ObservedH2Protocol] = set()
        self._none_open: trio.Event | None = None  # set when the last transport closes
        self.closing = False
        # Connections the server closed on a peer's misbehaviour or silence, by reason.
        self.closed_by_server: Counter[str] = Counter()
        self.streams_refused = 0
        # TLS connections still in their handshake (not yet counted above).
        self.tls_handshakes = tls_handshake_counter()
        # Refused connections waiting to answer their first request (at most
        # MAX_LINGERING_REFUSALS; past that, refused ones are closed at once).
        self.lingering_refusals = 0
        # Times a connection's input waited for its address's control-frame pacer.
        self.input_held = 0

    @property
    def ping_floods(self) -> int:
        return self.closed_by_server[TOO_MANY_PINGS]

    def __len__(self) -> int:
        return len(self._protocols)

    def add(self, protocol: ObservedH2Protocol) -> None:
        self._protocols[protocol.connection] = protocol

    def discard(self, protocol: ObservedH2Protocol) -> None:
        self._protocols.pop(protocol.connection, None)

    def protocols(self) -> list[ObservedH2Protocol]:
        return list(self._protocols.values())

    def protocol_of(self, stream: grpclib.server.Stream[Any, Any]) -> ObservedH2Protocol:
        return self._protocols[_grpclib.connection_of(stream)]

    def activity_of(self, stream: grpclib.server.Stream[Any, Any]) -> ConnectionActivity:
        return self.protocol_of(stream).activity

    def close_if_unused(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        """Close the stream's connection once no other stream uses it.

        Checked on the next loop turn, after grpclib has released the ending
        stream, so the check sees only the streams that are still live.
        """
        protocol = self._protocols.get(_grpclib.connection_of(stream))
        if protocol is not None:
            asyncio.get_running_loop().call_soon(protocol.goaway_if_unused)

    def close_if_draining(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        """Close the stream's connection once no other stream uses it, if it has had
        its maximum-age GOAWAY (no new stream can come)."""
        protocol = self._protocols.get(_grpclib.connection_of(stream))
        if protocol is not None and protocol.draining:
            asyncio.get_running_loop().call_soon(protocol.goaway_if_unused)

    @property
    def open_transports(self) -> int:
        """Connections whose transport is not closed yet (refused ones included)."""
        return len(self._open)

    def opened(self, protocol: ObservedH2Protocol) -> None:
        self._open.add(protocol)

    def lost(self, protocol: ObservedH2Protocol) -> None:
        self._open.discard(protocol)
        if not self._open and self._none_open is not None:
            # asyncio's callbacks run on trio's thread (trio-asyncio): a trio Event is safe.
            self._none_open.set()

    async def wait_transports_closed(self) -> None:
        """Until every connection's transport is closed (asyncio ran the closes)."""
        if self._open:
            self._none_open = trio.Event()
            await self._none_open.wait()

    def close_all(self) -> None:
        """GOAWAY every connection, refused ones too; one that connects after this
        is closed at once (asyncio may still hand over a socket it accepted)."""
        self.closing = True
        for protocol in list(self._open):
            protocol.goaway(ErrorCodes.NO_ERROR, b"shutdown")

    def abort_all(self) -> None:
        """Drop every connection still open, with whatever it has not read."""
        for protocol in list(self._open):
            protocol.abort()


def _no_subscriptions(activity: ConnectionActivity) -> None:
    """A table without a server to end subscriptions (tests of the connections alone)."""


def _describe(error: ProtocolError) -> str:
    """What a peer did wrong, for the log (h2's text of a frame on a stream closed
    by END_STREAM is the stream id alone)."""
    if isinstance(error, StreamClosedError):
        return f"a frame on stream {error.stream_id}, which it had ended"
    return quote(str(error))


class ObservedH2Protocol(H2Protocol):
    # Few attribute names, grpclib's included: from 29 of them (30 before Python
    # 3.13) CPython gives every instance a dict of its own, 1.3 KB per connection.
    # Derive what can be derived.
    activity: ConnectionActivity
    output: ConnectionOutput

    def __init__(self, base: H2Protocol, table: ConnectionTable) -> None:
        super().__init__(base.handler, base.config, base.h2_config)
        self._table = table
        self._linger: asyncio.TimerHandle | None = None
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._keepalive_timer: asyncio.TimerHandle | None = None
        # Input charged to the budgets and waiting for the address's pacer.
        self._held: bytes | None = None
        self._hold_timer: asyncio.TimerHandle | None = None
        self._input = bytearray()
        self._draining = False
        self._write_blocked = False
        self._reading_paused = False
        self._counted = False  # admitted: in the counter and the table until lost
        self._aging: Aging | None = None  # with --max-connection-age

    @property
    def socket_transport(self) -> asyncio.Transport:
        """The transport of the connection's socket (under grpclib's counting one)."""
        transport: asyncio.Transport = self._transport
        return transport

    @property
    def _limits(self) -> ProtocolLimits:
        return self._table.protocol_limits

    # -- lifecycle -------------------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        # grpclib writes every frame of the connection through this one, which
        # counts the DATA and HEADERS frames for the activity and the budget
        # (made below, before the first write that holds either).
        counting = FrameCountingTransport(transport)
        super().connection_made(counting)
        self._h2 = _grpclib.h2_connection_of(self)
        self._transport = transport
        self._table.opened(self)
        if self._table.closing:
            self.abort()
            return
        peer = transport.get_extra_info("peername")
        ip = peer_ip(peer)
        described = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.activity = ConnectionActivity(self._table.ping_policy, described, ip)
        self.output = ConnectionOutput(
            self.connection, self._table.flusher, self._table.late_flusher
        )
        now = trio.current_time()
        table = self._table
        shared = table.address_budgets.of(ip, now, connected=table.counter.per_ip)
        self.budget = ConnectionBudget(self._limits, now, shared)
        self.liveness = PeerLiveness(table.keepalive, now)
        activity, budget = self.activity, self.budget

        def frames_sent(count: int) -> None:
            # Not a method: grpclib's finished streams keep the transport, which
            # must not keep this protocol alive.
            activity.note_sent()
            budget.frames_sent(count)

        counting.frames_sent = frames_sent
        loop = asyncio.get_running_loop()
        self._handshake_timer = loop.call_later(
            self._limits.handshake_timeout, self._handshake_expired
        )
        self._keepalive_timer = loop.call_later(table.keepalive.interval, self._check_liveness)
        advertised = self._table.limits.max_streams_per_connection
        _grpclib.advertise_stream_limit(self._h2, advertised, hard_stream_limit(advertised))
        _grpclib.keep_encoder_table_empty(self._h2)
        self.connection.flush()
        refusal = self._table.counter.refusal(ip)
        if refusal is not None:
            self._table.counter.refused += 1
            fault_log.warning("refused", "refusing connection from %s: %s", described, refusal)
            if self._table.lingering_refusals >= MAX_LINGERING_REFUSALS:
                # A flood past the limits: the refused must not hold descriptors
                # without bound (the gRPC port would stop accepting: rpc.loop_faults).
                self.abort()
                return
            # Answer the first request with a status the client can read, then go.
            self._table.lingering_refusals += 1
            _grpclib.set_event_handler(
                self.processor, RequestReceived, functools.partial(self._refuse_request, refusal)
            )
            self._linger = loop.call_later(
                REFUSED_CONNECTION_LINGER, self.goaway, ErrorCodes.NO_ERROR, b"refused"
            )
            return
        self._table.counter.opened(ip)
        self._counted = True
        _grpclib.set_event_handler(self.processor, PingReceived, self._ping_received)
        _grpclib.set_event_handler(self.processor, PingAckReceived, self._ping_ack_received)
        _grpclib.set_event_handler(self.processor, RequestReceived, self._request_received)
        _grpclib.set_event_handler(self.processor, StreamReset, self._stream_reset)
        self._table.add(self)
        self._start_aging(loop)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._linger is not None:  # a refused connection, lingering until now
            self._table.lingering_refusals -= 1
        # Timers would keep this protocol alive.
        timers = (
            self._linger,
            self._handshake_timer,
            self._stall_timer,
            self._hold_timer,
            self._keepalive_timer,
        )
        for timer in timers:
            if timer is not None:
                timer.cancel()
        self._linger = self._handshake_timer = self._stall_timer = self._hold_timer = None
        self._keepalive_timer = None
        if self._aging is not None:
            self._aging.cancel()
        self._held = None
        self._input.clear()
        self._table.lost(self)
        if self._counted:
            self._table.counter.closed(self.activity.ip)
            self._table.discard(self)
            self.output.release_closed()
        super().connection_lost(exc)

    # -- input -----------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self._input += data
        if not self._draining:
            self._drain_input()

    def _drain_input(self) -> None:
        """Handle one turn's share of the input; the rest waits for the next turn.

        A share whose control frames must wait for the address's pacer is held
        (reading paused, nothing of it handled) until their turn comes."""
        self._draining = False
        self._hold_timer = None
        if self.connection.is_closing():
            self._held = None
            self._input.clear()
            return
        try:
            if self._held is not None:
                held, self._held = self._held, None
                self._handle_input(held)
            else:
                self._take_share()
        except Exception:
            self._table.closed_by_server[INTERNAL_ERROR] += 1
            fault_log.error(
                INTERNAL_ERROR,
                "unexpected error handling input from %s; closing that connection",
                self.activity.peer,
                exc_info=True,
            )
            self.goaway(ErrorCodes.INTERNAL_ERROR, b"internal error")
        if self._held is None and self._input and not self.connection.is_closing():
            self._draining = True
            asyncio.get_running_loop().call_soon(self._drain_input)
        self._update_reading()

    def _take_share(self) -> None:
        """Charge the next share of the input to the budgets, then handle it, or
        hold it for the address's pacer."""
        share = self._limits.read_bytes_per_turn
        chunk = bytes(self._input[:share])
        del self._input[:share]
        now = trio.current_time()
        self.liveness.heard()
        broken = self.budget.charge_input(chunk, now)
        if broken is not None:
            self._enhance_your_calm(broken)
            return
        delay = self.budget.address_delay(now)
        if delay > 0.0:
            if self._handshake_timer is not None:
                # Only frames after the preface are counted, so the preface and a
                # frame (SETTINGS, or h2 will say otherwise) have come: the wait is
                # the pacer's, not the peer's.
                self._handshake_timer.cancel()
                self._handshake_timer = None
            self._table.input_held += 1
            self._held = chunk
            self._draining = True
            self._hold_timer = asyncio.get_running_loop().call_later(delay, self._drain_input)
            return
        self._handle_input(chunk)

    def _handle_input(self, chunk: bytes) -> None:
        """Hand input the budgets have passed to h2 and grpclib."""
        # Most input of a live connection is the PING and WINDOW_UPDATE a client
        # answers each message with: handled without h2's general path, the ACK
        # left for the connection's next write (rpc/output.py, LateFlusher).
        events = _grpclib.receive_pings_and_window_updates(self._h2, chunk)
        if events is not None:
            self._handle_events(events, flush=self.output.flush_late)
            return
        try:
            events = self.connection.feed(chunk)
        except ProtocolError as error:
            self._table.closed_by_server[PROTOCOL_ERROR] += 1
            fault_log.warning(
                PROTOCOL_ERROR,
                "HTTP/2 protocol error from %s: %s; closing that connection",
                self.activity.peer,
                _describe(error),
            )
            # h2 has queued the GOAWAY that names the error: send it, then close.
            self.connection.flush()
            self.processor.close(reason=f"protocol error: {error}")
            return
        self.connection.flush()
        self._handle_events(events, flush=self.connection.flush)

    def _handle_events(self, events: list[Event], flush: Callable[[], None]) -> None:
        window_may_have_opened = False
        for event in events:
            if isinstance(event, RemoteSettingsChanged):
                _grpclib.keep_encoder_table_empty(self._h2)
                if self._handshake_timer is not None:
                    self._handshake_timer.cancel()
                    self._handshake_timer = None
            window_may_have_opened |= isinstance(event, WINDOW_OPENING_EVENTS)
            self._process(event)
            if self.connection.is_closing():
                return
        if window_may_have_opened:
            self.output.pump()
        flush()

    def _process(self, event: Event) -> None:
        _grpclib.process_event(self.processor, event)

    # -- output ----------------------------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        self._write_blocked = True
        self._update_reading()
        if self._stall_timer is None:
            # The output's loop, not asyncio's lookup: a write from `publish` (a
            # trio task outside any asyncio context) can fill the socket and land here.
            self._stall_timer = self.output.loop.call_later(
                self._limits.write_stall_timeout, self._write_stalled
            )

    def resume_writing(self) -> None:
        super().resume_writing()
        self._write_blocked = False
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        self._update_reading()
        self.output.pump()

    def _update_reading(self) -> None:
        """Read from the peer only while it reads from us and its input is handled."""
        pause = self._write_blocked or self._draining
        if pause == self._reading_paused or self.connection.is_closing():
            return
        self._reading_paused = pause
        if pause:
            self._transport.pause_reading()
        else:
            self._transport.resume_reading()

    # -- events ----------------------------------------------------------------------------------

    def _request_received(self, event: RequestReceived) -> None:
        if self._aging is not None and self._aging.refusing:
            # Past the last stream its GOAWAY named: the client retries it elsewhere.
            self._table.streams_refused += 1
            with contextlib.suppress(ProtocolError):
                self._h2.reset_stream(event.stream_id, ErrorCodes.REFUSED_STREAM)
            return
        if _grpclib.live_streams(self.processor) >= self._table.limits.max_streams_per_connection:
            # Over the limit advertised in SETTINGS: refuse this stream alone
            # (clients retry a refused stream transparently).
            self._table.streams_refused += 1
            with contextlib.suppress(ProtocolError):  # reset or gone already (`_answer`)
                self._h2.reset_stream(event.stream_id, ErrorCodes.REFUSED_STREAM)
            return
        names = {n.decode() if isinstance(n, bytes) else n for n, _ in event.headers or []}
        if ":path" not in names:
            self._answer(event.stream_id, "400", INTERNAL, "malformed request: no :path")
            return
        timeout = _grpclib.grpc_timeout(event.headers or [])
        if timeout is not None and timeout < SHORTEST_DEADLINE:
            self._answer(event.stream_id, "200", DEADLINE_EXCEEDED, "deadline exceeded at arrival")
            return
        _grpclib.accept_request(self.processor, event)

    def _stream_reset(self, event: StreamReset) -> None:
        _grpclib.reset_stream(self.processor, event)
        self.output.release_closed()  # a message it was finishing will never go
        if self.draining:  # perhaps its last stream
            asyncio.get_running_loop().call_soon(self.goaway_if_unused)

    def _refuse_request(self, refusal: str, event: RequestReceived) -> None:
        self._answer(event.stream_id, "200", RESOURCE_EXHAUSTED, refusal)
        self.goaway(ErrorCodes.NO_ERROR, b"too_many_connections")

    def _answer(self, stream_id: int, http_status: str, grpc_status: int, message: str) -> None:
        """End a stream with a gRPC status, without passing it to grpclib."""
        # What the peer sent in the same read may leave no one to answer: a reset
        # of the stream (h2 says it is closed, or, once a later stream made h2
        # forget it, tries to open it anew and finds its id too low or the peer's
        # stream limit reached), or a GOAWAY (the connection is closed).
        with contextlib.suppress(ProtocolError):
            self._send_status(stream_id, http_status, grpc_status, message)

    def _send_status(
        self, stream_id: int, http_status: str, grpc_status: int, message: str
    ) -> None:
        self._h2.send_headers(
            stream_id,
            [
                (":status", http_status),
                ("content-type", "application/grpc+proto"),
                ("grpc-status", str(grpc_status)),
                ("grpc-message", _grpclib.encode_message(message)),
            ],
            end_stream=True,
        )

    def _ping_received(self, event: PingReceived) -> None:
        # h2 has already queued the PING ACK; only the heartbeat is ours.
        if not self.activity.ping_received():
            self._count_close(TOO_MANY_PINGS, "too many pings")
            self.goaway(ErrorCodes.ENHANCE_YOUR_CALM, TOO_MANY_PINGS.encode())
            return
        self.liveness.heartbeat(trio.current_time())

    def _ping_ack_received(self, event: PingAckReceived) -> None:
        # Only the answer to the server's own outstanding PING is a heartbeat: an
        # unasked-for ACK would be a PING that escapes the ping-flood rule.
        if event.ping_data == KEEPALIVE_PING and self.liveness.ping_outstanding:
            self.liveness.heartbeat(trio.current_time())
            self.activity.ping_acked()
        elif event.ping_data == GOAWAY_PING:
            self._last_goaway()

    # -- closing ---------------------------------------------------------------------------------

    def _count_close(self, rule: str, why: str, *args: object) -> None:
        """Count a close under `rule` and log it ("closing connection from <peer>: why"),
        rate-limited per rule."""
        self._table.closed_by_server[rule] += 1
        fault_log.warning(rule, "closing connection from %s: " + why, self.activity.peer, *args)

    def _enhance_your_calm(self, rule: str) -> None:
        self._count_close(rule, "%s", rule)
        self.goaway(ErrorCodes.ENHANCE_YOUR_CALM, rule.encode())

    def _handshake_expired(self) -> None:
        self._handshake_timer = None
        self._count_close(
            HANDSHAKE_TIMEOUT,
            "no HTTP/2 preface and SETTINGS within %gs",
            self._limits.handshake_timeout,
        )
        self.goaway(ErrorCodes.PROTOCOL_ERROR, HANDSHAKE_TIMEOUT.encode())

    def _check_liveness(self) -> None:
        self._keepalive_timer = None
        if self.connection.is_closing():
            return
        now = trio.current_time()
        if self._reading_paused:
            # The server is the one not listening (input held for the pacer, or a
            # peer that does not read, which the write-stall timeout judges).
            self.liveness.not_listening(now)
        verdict, delay = self.liveness.check(now)
        if verdict is Liveness.GONE:
            self._count_close(
                KEEPALIVE_TIMEOUT,
                "nothing read within %gs of a keepalive PING",
                self.liveness.policy.timeout,
            )
            # The peer is gone: nothing buffered for it will be read.
            self.abort()
            return
        if verdict is Liveness.PING:
            self._h2.ping(KEEPALIVE_PING)
            self.connection.flush()
        self._keepalive_timer = asyncio.get_running_loop().call_later(delay, self._check_liveness)

    def _write_stalled(self) -> None:
        self._stall_timer = None
        self._count_close(
            WRITE_STALLED, "it has not read for %gs", self._limits.write_stall_timeout
        )
        # Nothing more can be written to it: drop what is buffered.
        self.abort()

    def abort(self) -> None:
        """Close the transport now, dropping what the peer has not read."""
        self._transport.abort()

    def goaway_if_unused(self) -> None:
        if not self.processor.streams:
            aged = self._aging is not None and self._aging.stage is not Stage.YOUNG
            self.goaway(ErrorCodes.NO_ERROR, MAX_AGE.encode() if aged else b"idle")

    def goaway(self, code: ErrorCodes, debug: bytes) -> None:
        """Send GOAWAY and close the transport (after buffered data is written)."""
        if self.connection.is_closing():
            return
        # Never a higher last stream id than a maximum-age GOAWAY already named.
        last = None if self._aging is None else self._aging.last_stream_id
        self._h2.close_connection(error_code=code, additional_data=debug, last_stream_id=last)
        self.connection.flush()
        self.processor.close(reason=f"GOAWAY {code.name} {debug.decode()}")

    # -- maximum connection age (rpc/max_age.py) ------------------------------------------------

    @property
    def draining(self) -> bool:
        """It has had its maximum-age GOAWAYs: it closes once its last stream ends."""
        return self._aging is not None and self._aging.refusing

    def _start_aging(self, loop: asyncio.AbstractEventLoop) -> None:
        age = self._table.max_age.jittered_age()
        if age is not None:
            self._aging = Aging(loop.call_later(age, self._max_age_reached))

    def _max_age_reached(self) -> None:
        """First GOAWAY (no stream refused) and its PING; the grace starts now."""
        aging = self._aging
        assert aging is not None
        aging.timer = None
        if self.connection.is_closing():
            return
        self._table.closed_by_server[MAX_AGE] += 1
        fault_log.log(
            logging.INFO,
            MAX_AGE,
            "connection from %s reached its maximum age: GOAWAY, new calls go to a new connection",
            self.activity.peer,
        )
        self._write_goaway(MAX_STREAM_ID)
        self._h2.ping(GOAWAY_PING)
        self.connection.flush()
        aging.stage = Stage.PINGED
        loop = asyncio.get_running_loop()
        aging.set_timer(loop.call_later(GOAWAY_PING_TIMEOUT, self._last_goaway))
        grace = self._table.max_age.grace
        if grace is not None:
            aging.grace_timer = loop.call_later(grace, self._max_age_grace_over)

    def _last_goaway(self) -> None:
        """The second GOAWAY, naming the last stream taken: later ones are refused."""
        aging = self._aging
        if aging is None or aging.stage is not Stage.PINGED or self.connection.is_closing():
            return
        aging.stage = Stage.DRAINING
        aging.last_stream_id = self._h2.highest_inbound_stream_id
        self._write_goaway(aging.last_stream_id)
        aging.set_timer(None)
        self._close_when_unused()

    def _write_goaway(self, last_stream_id: int) -> None:
        """A GOAWAY NO_ERROR "max_age" that leaves the connection open: h2 has only the
        final one (`close_connection`, after which it sends nothing more), so the frame
        is written to the transport, after what h2 holds."""
        self.connection.flush()
        frame = GoAwayFrame(0, last_stream_id=last_stream_id, additional_data=MAX_AGE.encode())
        self._transport.write(frame.serialize())

    def _close_when_unused(self) -> None:
        """Close the draining connection once its last stream has ended."""
        aging = self._aging
        assert aging is not None
        aging.timer = None
        if self.connection.is_closing():
            return
        if not self.processor.streams:
            self.goaway(ErrorCodes.NO_ERROR, MAX_AGE.encode())
            return
        delay = FINAL_WRITE_TIMEOUT if aging.stage is Stage.ENDING else DRAIN_POLL
        callback = self._max_age_close if aging.stage is Stage.ENDING else self._close_when_unused
        aging.set_timer(asyncio.get_running_loop().call_later(delay, callback))

    def _max_age_grace_over(self) -> None:
        """End the connection's subscriptions (UNAVAILABLE, their handlers close it
        once the last status is written), and its other streams a moment later."""
        aging = self._aging
        assert aging is not None
        aging.grace_timer = None
        if self.connection.is_closing():
            return
        self._last_goaway()  # if the PING's ACK has not come yet
        if self.connection.is_closing():  # it had no stream left
            return
        aging.stage = Stage.ENDING
        self._table.end_subscriptions(self.activity)
        self._close_when_unused()

    def _max_age_close(self) -> None:
        """The grace and the final write are over: the connection closes. A stream
        still open that has not answered yet (a call whose request is still coming)
        gets UNAVAILABLE first; one that has (a health Watch, a subscription whose
        peer does not read) ends as the connection closes: UNAVAILABLE on the
        client's side, after the GOAWAY that says max_age, as with grpc-go."""
        assert self._aging is not None
        self._aging.timer = None
        for stream_id in list(self.processor.streams):
            # (Refused by h2, and nothing sent, where the response has begun.)
            self._answer(stream_id, "200", UNAVAILABLE, MAX_AGE_ENDED)
        self.goaway(ErrorCodes.NO_ERROR, MAX_AGE.encode())


class JobsignalServer(grpclib.server.Server):
    """grpclib's Server, with connections observed through `ConnectionTable`: its
    listeners (`rpc._grpclib.start_server`) pass each protocol grpclib makes
    through `observe`."""

    def __init__(self, *args: Any, connections: ConnectionTable, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connections = connections

    def observe(self, protocol: H2Protocol) -> ObservedH2Protocol:
        return ObservedH2Protocol(protocol, self.connections)
