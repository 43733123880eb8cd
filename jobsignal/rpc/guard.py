"""What one HTTP/2 peer may make the server do: the per-connection abuse budgets.

Pure bookkeeping with time passed in (trio's clock in production, so every
rule is testable in virtual time). The protocol in `rpc.connections` feeds
each h2 event it receives to `ConnectionBudget.charge`, which names the rule
the peer broke, if any; the protocol then sends GOAWAY ENHANCE_YOUR_CALM.

- Stream resets (RST_STREAM from the client): a token bucket, so a client may
  cancel its calls, even many at once, but not open-and-reset streams at a
  rate (the Rapid Reset attack, CVE-2023-44487).
- Control frames (SETTINGS, PING, PING ACK, WINDOW_UPDATE, PRIORITY,
  RST_STREAM, unknown frame types, DATA frames with no payload that do not
  end the stream): a token bucket that also earns two tokens for every DATA
  or HEADERS frame the server sends, because a client legitimately answers
  the data it receives with WINDOW_UPDATEs (one for the stream, one for the
  connection) and grpc-go pings with them (BDP estimation).

These are what grpc-go, gRPC core, nginx and Envoy bound too; the defaults
are far above what any real client sends (see docs/architecture.md
section 7, "Hostile input and fault boundaries").
"""

from __future__ import annotations

from dataclasses import dataclass

from h2.events import (
    DataReceived,
    Event,
    PingAckReceived,
    PingReceived,
    PriorityUpdated,
    RemoteSettingsChanged,
    SettingsAcknowledged,
    StreamReset,
    UnknownFrameReceived,
    WindowUpdated,
)

RAPID_RESET = "rapid_reset"
CONTROL_FLOOD = "control_flood"

# Tokens a sent DATA or HEADERS frame earns the peer: a WINDOW_UPDATE for the
# stream and one for the connection.
CREDIT_PER_FRAME_SENT = 2.0

_CONTROL_EVENTS = (
    RemoteSettingsChanged,
    SettingsAcknowledged,
    PingReceived,
    PingAckReceived,
    WindowUpdated,
    PriorityUpdated,
    StreamReset,
    UnknownFrameReceived,
)


@dataclass(frozen=True)
class ProtocolLimits:
    """Per-connection HTTP/2 limits; each is a setting (see config.py)."""

    # Seconds a new connection has to send the HTTP/2 preface and SETTINGS.
    handshake_timeout: float = 5.0
    # Sustained RST_STREAM frames per second; bursts of twice as many.
    max_resets_per_second: float = 100.0
    # Sustained control frames per second (see the module docstring); bursts
    # of twice as many.
    max_control_frames_per_second: float = 500.0
    # Bytes of a connection's input handled per event-loop turn: one peer's
    # burst cannot hold the loop, the rest waits for the next turn.
    read_bytes_per_turn: int = 16 * 1024
    # Seconds the server may be unable to write to a peer (its socket buffer
    # full: the peer does not read) before the connection is closed. While
    # blocked the server also stops reading from that peer, so the answers
    # it would owe (PING and SETTINGS ACKs) cannot pile up.
    write_stall_timeout: float = 30.0


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


class ConnectionBudget:
    """The budgets of one connection."""

    def __init__(self, limits: ProtocolLimits, now: float) -> None:
        self.resets = TokenBucket(
            limits.max_resets_per_second, 2 * limits.max_resets_per_second, now
        )
        self.control = TokenBucket(
            limits.max_control_frames_per_second, 2 * limits.max_control_frames_per_second, now
        )

    def frames_sent(self, count: int = 1) -> None:
        """The server sent DATA or HEADERS frames: the peer may answer them."""
        self.control.give(CREDIT_PER_FRAME_SENT * count)

    def charge(self, event: Event, now: float) -> str | None:
        """Account for one received event; the rule it breaks, or None."""
        resets_a_stream = isinstance(event, StreamReset) and event.remote_reset
        if resets_a_stream and not self.resets.take(now):
            return RAPID_RESET
        if _is_control(event) and not self.control.take(now):
            return CONTROL_FLOOD
        return None


def _is_control(event: Event) -> bool:
    if isinstance(event, DataReceived):
        # An empty DATA frame that does not end its stream carries nothing.
        return not event.data and event.stream_ended is None
    return isinstance(event, _CONTROL_EVENTS)
