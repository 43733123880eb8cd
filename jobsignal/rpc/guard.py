"""What one HTTP/2 peer may make the server do: the abuse budgets of a connection and its address.

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
  address, shared by all its connections (`AddressBudgets`): neither parallel
  connections nor reconnecting multiply it. As Envoy's "premature resets",
  it counts only resets of streams opened in about the last second or two
  (`YoungStreams`): a client process that exits with hundreds of long-lived
  subscriptions cancels them all at once, and that is not the attack.
- Every other frame but HEADERS and CONTINUATION (SETTINGS, PING,
  WINDOW_UPDATE, PRIORITY, RST_STREAM, GOAWAY, unknown types, and DATA: a
  job.Job request is one small DATA frame, so a client's requests, already
  bounded by the per-address rate limits, cost one token each, and DATA sent
  on a stream h2 already closed costs the same as any other): a token bucket
  that also earns two tokens for every DATA or HEADERS frame the server
  sends, because a client legitimately answers the data it receives with
  WINDOW_UPDATEs (one for the stream, one for the connection) and grpc-go
  pings with them (BDP estimation).
- The same frames once more, for the address: those that are neither paid
  by the credit the connection's received data earned nor within its own
  small allowance (`FREE_CONTROL_FRAMES` at once, for its handshake, then
  `FREE_CONTROL_FRAMES_PER_SECOND`: an idle client's keepalive PING, an
  occasional request) are metered by a pacer its address's connections
  share (`AddressPacer`). Over its rate, nobody is cut off: the connection's
  input waits (`ConnectionBudget.address_delay`) until the address's share
  comes round again. A peer spreading a flood over many connections, each
  under its own budget, is slowed to the address's rate; reconnecting gains
  it nothing but 10 frames per TCP and HTTP/2 handshake; and the clients
  behind one NAT address, whose frames answer the data they receive, make
  their handshakes or come now and then, go on as before.

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
# Control frames of each connection the address's pacer does not meter, besides
# those its credit pays for: a handshake's at once (SETTINGS, the ACK of the
# server's, a WINDOW_UPDATE, the first requests, a PING) with room to spare,
# then one a second (keepalive PINGs, an occasional request).
FREE_CONTROL_FRAMES = 10
FREE_CONTROL_FRAMES_PER_SECOND = 1.0

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER_SIZE = 9
HEADERS, RST_STREAM, CONTINUATION = 0x1, 0x3, 0x9
# A reset of a stream younger than this (up to twice this) counts against the
# address's reset budget; an older stream's is a client's ordinary cancel.
PREMATURE_RESET_SECONDS = 1.0
# The stream id in a frame header (the top bit is reserved). HEADERS and
# CONTINUATION open requests (bounded by h2's header limits and the stream
# budgets); every other frame type costs a control token.
_STREAM_ID_BITS = 0x7FFF_FFFF


@dataclass(frozen=True)
class ProtocolLimits(LayerSettings):
    """Per-connection HTTP/2 limits; each is a setting (see config.py)."""

    # Seconds a new connection has to send the HTTP/2 preface and SETTINGS.
    handshake_timeout: float = from_setting(lambda c: c.handshake_timeout)
    # Sustained RST_STREAM frames per second; bursts of twice as many.
    max_resets_per_second: float = from_setting(lambda c: c.max_stream_resets_per_second)
    # Sustained control frames per second (see the module docstring); bursts
    # of twice as many. The first is a connection's, the second its address's.
    max_control_frames_per_second: float = from_setting(lambda c: c.max_control_frames_per_second)
    max_control_frames_per_second_per_ip: float = from_setting(
        lambda c: c.max_control_frames_per_second_per_ip
    )
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


def _bucket(rate: float, now: float) -> TokenBucket:
    """`rate` a second, bursts of twice as many: the budgets' shape."""
    return TokenBucket(rate, 2 * rate, now)


class AddressPacer:
    """`rate` frames a second on average, bursts of `burst`, for every connection of
    an address together: how long each one's frames must wait for their turn.

    A frame's turn is reserved when it is counted (the generic cell rate
    algorithm: `_due` is when the frames counted so far are paid for), so a
    waiting connection is woken once, when its turn has come, not to try again.
    """

    __slots__ = ("_due", "_rate", "_tolerance")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self._rate = rate
        self._tolerance = burst / rate
        self._due = now

    def delay(self, frames: int, now: float) -> float:
        """Count `frames`; the seconds they must wait (0.0 within the burst)."""
        self._due = max(self._due, now) + frames / self._rate
        return max(0.0, self._due - self._tolerance - now)

    def idle(self, now: float) -> bool:
        """Whether its whole burst is available at `now`."""
        return self._due <= now


class AddressBudget:
    """What every connection from one client address shares: its stream resets,
    and the pacer of its control frames (see the module docstring)."""

    __slots__ = ("control", "resets")

    def __init__(self, limits: ProtocolLimits, now: float) -> None:
        self.resets = _bucket(limits.max_resets_per_second, now)
        rate = limits.max_control_frames_per_second_per_ip
        self.control = AddressPacer(rate, 2 * rate, now)

    def idle(self, now: float) -> bool:
        return self.resets.full(now) and self.control.idle(now)


class AddressBudgets:
    """The `AddressBudget` of each client address.

    A budget outlives its address's connections until it is idle again, so
    closing and reopening connections does not refill it. Once more than
    `FORGET_ABOVE` addresses are known, the idle budgets of addresses with no
    open connection are forgotten: the table holds the addresses that are
    connected or spent their budgets in the last seconds, not every address
    ever seen.
    """

    FORGET_ABOVE = 1024

    def __init__(self, limits: ProtocolLimits) -> None:
        self._limits = limits
        self._budgets: dict[str, AddressBudget] = {}

    def __len__(self) -> int:
        return len(self._budgets)

    def of(self, address: str, now: float, connected: Container[str] = ()) -> AddressBudget:
        """The budget of `address`; `connected`: the addresses with open connections."""
        budget = self._budgets.get(address)
        if budget is None:
            if len(self._budgets) >= self.FORGET_ABOVE:
                self._budgets = {
                    known: kept
                    for known, kept in self._budgets.items()
                    if known in connected or not kept.idle(now)
                }
            budget = self._budgets[address] = AddressBudget(self._limits, now)
        return budget


def _stream_id(data: bytes | bytearray, at: int) -> int:
    """The stream id of the frame whose header starts at `data[at]`."""
    return int.from_bytes(data[at + 5 : at + 9], "big") & _STREAM_ID_BITS


class YoungStreams:
    """Which of a connection's streams were opened recently, in constant space.

    Client stream ids only grow (RFC 9113, 5.1.1), so the streams opened
    before a moment are exactly those up to the highest id seen by then. Time
    is cut into epochs of `PREMATURE_RESET_SECONDS`: a stream opened in this
    epoch or the one before is young (under two epochs old); one opened
    before that is at least an epoch old. An id never opened counts as young.
    """

    __slots__ = ("_epoch_start", "_newest", "_previous", "_settled")

    def __init__(self, now: float) -> None:
        self._epoch_start = now
        self._newest = 0  # the highest id opened so far
        self._previous = 0  # the highest id opened before this epoch
        self._settled = 0  # the highest id opened before the epoch before: old streams

    def opened(self, stream_id: int, now: float) -> None:
        self._roll(now)
        self._newest = max(self._newest, stream_id)

    def young(self, stream_id: int, now: float) -> bool:
        self._roll(now)
        return stream_id > self._settled

    def _roll(self, now: float) -> None:
        epochs = int((now - self._epoch_start) // PREMATURE_RESET_SECONDS)
        if epochs <= 0:
            return
        self._epoch_start += epochs * PREMATURE_RESET_SECONDS
        self._settled = self._previous if epochs == 1 else self._newest
        self._previous = self._newest


class ConnectionBudget:
    """The budgets of one connection, charged from the frames on the wire; `address`
    is what it shares with its address's other connections (`AddressBudgets.of`),
    else a budget of its own."""

    def __init__(
        self, limits: ProtocolLimits, now: float, address: AddressBudget | None = None
    ) -> None:
        self.address = AddressBudget(limits, now) if address is None else address
        self.control = _bucket(limits.max_control_frames_per_second, now)
        # What the data sent has earned the peer, kept apart from the rate: the
        # frames it pays for are answers, which the address's pacer lets by.
        self._credit = 0.0  # (at most the connection's burst)
        self._allowance = TokenBucket(FREE_CONTROL_FRAMES_PER_SECOND, FREE_CONTROL_FRAMES, now)
        self._unpaid = 0  # control frames counted but not yet reported to the address
        self._preface_left = len(PREFACE)  # the client preface comes before any frame
        self._header = bytearray()  # a frame header split across reads
        self._payload_left = 0  # bytes of the current frame still to skip
        self._young = YoungStreams(now)

    def frames_sent(self, count: int = 1) -> None:
        """The server sent DATA or HEADERS frames: the peer may answer them."""
        credit = CREDIT_PER_FRAME_SENT * count
        self.control.give(credit)
        self._credit = min(self.control.burst, self._credit + credit)

    def address_delay(self, now: float) -> float:
        """The seconds the input charged since the last call must wait for the
        address's pacer (0.0 nearly always): the frames it held that neither
        its credit nor its allowance paid for take their turn."""
        unpaid, self._unpaid = self._unpaid, 0
        return self.address.control.delay(unpaid, now) if unpaid else 0.0

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
            broken = self._charge_frame(self._header, 0, now)
            self._header.clear()
        # Whole headers, read in place: the usual case, every frame in this read.
        while position + FRAME_HEADER_SIZE <= end:
            broken = broken or self._charge_frame(data, position, now)
            position += FRAME_HEADER_SIZE + int.from_bytes(data[position : position + 3], "big")
        if position > end:
            self._payload_left = position - end
        else:
            self._header += data[position:]
        return broken

    def _charge_frame(self, data: bytes | bytearray, at: int, now: float) -> str | None:
        """Charge the frame whose header starts at `data[at]`."""
        frame_type = data[at + 3]
        if frame_type == RST_STREAM:
            young = self._young.young(_stream_id(data, at), now)
            if young and not self.address.resets.take(now):
                return RAPID_RESET
        elif frame_type == HEADERS:
            self._young.opened(_stream_id(data, at), now)
            return None
        elif frame_type == CONTINUATION:
            return None
        if not self.control.take(now):
            return CONTROL_FLOOD
        if self._credit >= 1.0:
            self._credit -= 1.0
        elif not self._allowance.take(now):
            self._unpaid += 1
        return None
