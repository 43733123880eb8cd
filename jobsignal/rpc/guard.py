"""What one HTTP/2 peer may make the server do: the per-connection abuse budgets.

Pure bookkeeping with time passed in (trio's clock in production, so every
rule is testable in virtual time). The protocol in `rpc.connections` hands
every byte a peer sends to `ConnectionBudget.charge_input` before h2 sees it:
frames are counted from their 9-byte headers on the wire, so frames h2
answers by itself without an event (DATA on a stream it already closed, say)
count too. It returns the rule the peer broke, if any; the protocol then
sends GOAWAY ENHANCE_YOUR_CALM.

- Stream resets (RST_STREAM from the client): a token bucket, so a client may
  cancel its calls, even many at once, but not open-and-reset streams at a
  rate (the Rapid Reset attack, CVE-2023-44487). It belongs to the client's
  address, shared by all its connections (`ResetBudgets`): neither parallel
  connections nor reconnecting multiply it.
- Every other frame but HEADERS and CONTINUATION (SETTINGS, PING,
  WINDOW_UPDATE, PRIORITY, RST_STREAM, GOAWAY, unknown types, and DATA: a
  job.Job request is one small DATA frame, so a client's requests, already
  bounded by the per-address rate limits, cost one token each, and DATA sent
  on a stream h2 already closed costs the same as any other): a token bucket
  that also earns two tokens for every DATA or HEADERS frame the server
  sends, because a client legitimately answers the data it receives with
  WINDOW_UPDATEs (one for the stream, one for the connection) and grpc-go
  pings with them (BDP estimation).

These are what grpc-go, gRPC core, nginx and Envoy bound too; the defaults
are far above what any real client sends (see docs/architecture.md
section 7, "Hostile input and fault boundaries").
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from jobsignal.config import LayerSettings, from_setting

RAPID_RESET = "rapid_reset"
CONTROL_FLOOD = "control_flood"

# Tokens a sent DATA or HEADERS frame earns the peer: a WINDOW_UPDATE for the
# stream and one for the connection.
CREDIT_PER_FRAME_SENT = 2.0

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER_SIZE = 9
HEADERS, RST_STREAM, CONTINUATION = 0x1, 0x3, 0x9
# Frame types that open requests: HEADERS and CONTINUATION (bounded by h2's
# header limits and the stream budgets). Every other type costs a token.
_REQUEST_FRAMES = frozenset({HEADERS, CONTINUATION})


@dataclass(frozen=True)
class ProtocolLimits(LayerSettings):
    """Per-connection HTTP/2 limits; each is a setting (see config.py)."""

    # Seconds a new connection has to send the HTTP/2 preface and SETTINGS.
    handshake_timeout: float = from_setting(lambda c: c.handshake_timeout)
    # Sustained RST_STREAM frames per second; bursts of twice as many.
    max_resets_per_second: float = from_setting(lambda c: c.max_stream_resets_per_second)
    # Sustained control frames per second (see the module docstring); bursts
    # of twice as many.
    max_control_frames_per_second: float = from_setting(lambda c: c.max_control_frames_per_second)
    # Bytes of a connection's input handled per event-loop turn: one peer's
    # burst cannot hold the loop, the rest waits for the next turn.
    read_bytes_per_turn: int = from_setting(lambda c: c.read_bytes_per_turn)
    # Seconds the server may be unable to write to a peer (its socket buffer
    # full: the peer does not read) before the connection is closed. While
    # blocked the server also stops reading from that peer, so the answers
    # it would owe (PING and SETTINGS ACKs) cannot pile up.
    write_stall_timeout: float = from_setting(lambda c: c.write_stall_timeout)


class TokenBucket:
    """`rate` tokens a second up to `burst`; starts full."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._updated = now

    def take(self, now: float, tokens: float = 1.0) -> bool:
        """Spend `tokens` if there are enough; False (and nothing spent) if not."""
        self._tokens = min(self.burst, self._tokens + (now - self._updated) * self.rate)
        self._updated = now
        if self._tokens < tokens:
            return False
        self._tokens -= tokens
        return True

    def give(self, tokens: float) -> None:
        self._tokens = min(self.burst, self._tokens + tokens)

    def full(self, now: float) -> bool:
        """Whether it would hold its whole burst at `now` (spending nothing)."""
        return self._tokens + (now - self._updated) * self.rate >= self.burst


def _reset_bucket(limits: ProtocolLimits, now: float) -> TokenBucket:
    return TokenBucket(limits.max_resets_per_second, 2 * limits.max_resets_per_second, now)


class ResetBudgets:
    """The RST_STREAM budget of each client address, shared by its connections.

    A bucket outlives its address's connections until it is full again, so
    closing and reopening connections does not refill it. Once more than
    `FORGET_ABOVE` addresses are known, the full buckets of addresses with no
    open connection are forgotten: the table holds the addresses that are
    connected or reset streams in the last seconds, not every address ever
    seen.
    """

    FORGET_ABOVE = 1024

    def __init__(self, limits: ProtocolLimits) -> None:
        self._limits = limits
        self._buckets: dict[str, TokenBucket] = {}

    def __len__(self) -> int:
        return len(self._buckets)

    def of(self, address: str, now: float, connected: Container[str] = ()) -> TokenBucket:
        """The bucket of `address`; `connected`: the addresses with open connections."""
        bucket = self._buckets.get(address)
        if bucket is None:
            if len(self._buckets) >= self.FORGET_ABOVE:
                self._buckets = {
                    known: kept
                    for known, kept in self._buckets.items()
                    if known in connected or not kept.full(now)
                }
            bucket = self._buckets[address] = _reset_bucket(self._limits, now)
        return bucket


class ConnectionBudget:
    """The budgets of one connection, charged from the frames on the wire; `resets`
    is its address's stream-reset bucket (`ResetBudgets.of`), else one of its own."""

    def __init__(
        self, limits: ProtocolLimits, now: float, resets: TokenBucket | None = None
    ) -> None:
        self.resets = _reset_bucket(limits, now) if resets is None else resets
        self.control = TokenBucket(
            limits.max_control_frames_per_second, 2 * limits.max_control_frames_per_second, now
        )
        self._preface_left = len(PREFACE)  # the client preface comes before any frame
        self._header = bytearray()  # a frame header split across reads
        self._payload_left = 0  # bytes of the current frame still to skip

    def frames_sent(self, count: int = 1) -> None:
        """The server sent DATA or HEADERS frames: the peer may answer them."""
        self.control.give(CREDIT_PER_FRAME_SENT * count)

    def charge_input(self, data: bytes, now: float) -> str | None:
        """Account for the frames that start in `data`; the rule broken, or None.
        The whole input is scanned even after a rule is broken, so that the next
        read starts in step."""
        end = len(data)
        position = min(self._preface_left, end)
        self._preface_left -= position
        broken: str | None = None
        if self._payload_left:  # the rest of a frame that began in an earlier read
            skipped = min(self._payload_left, end - position)
            self._payload_left -= skipped
            position += skipped
        if self._header:  # a frame header split across reads
            wanted = FRAME_HEADER_SIZE - len(self._header)
            self._header += data[position : position + wanted]
            if len(self._header) < FRAME_HEADER_SIZE:
                return None
            position += wanted + int.from_bytes(self._header[:3], "big")
            broken = self._charge_frame(self._header[3], now)
            self._header.clear()
        # Whole headers, read in place: the usual case, every frame in this read.
        while position + FRAME_HEADER_SIZE <= end:
            broken = broken or self._charge_frame(data[position + 3], now)
            position += FRAME_HEADER_SIZE + int.from_bytes(data[position : position + 3], "big")
        if position > end:
            self._payload_left = position - end
        else:
            self._header += data[position:]
        return broken

    def _charge_frame(self, frame_type: int, now: float) -> str | None:
        if frame_type == RST_STREAM and not self.resets.take(now):
            return RAPID_RESET
        if frame_type not in _REQUEST_FRAMES and not self.control.take(now):
            return CONTROL_FLOOD
        return None
