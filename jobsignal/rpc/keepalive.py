"""Server keepalive: when to PING a quiet peer, and when to give it up for gone.

Two jobs, one PING (docs/architecture.md section 3, "Server keepalive"):

- The idle rule counts a heartbeat (the client's own PING, or its ACK of the
  server's keepalive PING) as activity. A client with default gRPC options
  never pings, so the server asks: a connection with no heartbeat for
  `interval` seconds (below the idle timeout) gets a PING, and a live client's
  ACK keeps its quiet subscriptions open however long the cluster is quiet.
- A peer whose host died, or whose network path broke, sends nothing and never
  closes its socket: if nothing at all has been read `timeout` seconds after
  the PING, the connection is closed and its subscriptions released.

A client that pings on its own is never pinged. One that sends other frames
but no PING is pinged once per `interval`: only a heartbeat keeps a quiet
stream open, and the server's PING is how a well-behaved client gives one.

`PeerLiveness` is the rule alone, with the time passed in (trio's clock, in
`rpc.connections`), so it is tested without sockets.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from jobsignal.config import LayerSettings, from_setting


@dataclass(frozen=True)
class KeepalivePolicy(LayerSettings):
    """Server keepalive: each field is a setting (jobsignal/config.py)."""

    interval: float = from_setting(lambda c: c.keepalive_time)
    timeout: float = from_setting(lambda c: c.keepalive_timeout)


class Liveness(enum.Enum):
    WAIT = "wait"  # heard from recently: check again later
    PING = "ping"  # quiet for the interval: send a PING, check again after the timeout
    GONE = "gone"  # nothing since the PING: close the connection


class PeerLiveness:
    """What one connection has heard from its peer, and what the keepalive rule says."""

    __slots__ = (
        "_heard",
        "_heard_when_pinged",
        "_ping_due_from",
        "ping_outstanding",
        "pings_sent",
        "policy",
    )

    def __init__(self, policy: KeepalivePolicy, now: float) -> None:
        self.policy = policy
        # The later of the last heartbeat and the last PING sent: the next PING is
        # due `interval` after it.
        self._ping_due_from = now
        # Input counted, not only timed: an ACK read at the very instant of the
        # PING (the same virtual time) is still news.
        self._heard = 0
        self._heard_when_pinged: int | None = None
        # A PING sent and not ACKed yet: only its ACK is a heartbeat.
        self.ping_outstanding = False
        self.pings_sent = 0

    def heard(self) -> None:
        """Input was read from the peer: it is there (whatever the input was)."""
        self._heard += 1

    def heartbeat(self, now: float) -> None:
        """The peer pinged, or ACKed the server's PING."""
        self._heard += 1
        self._ping_due_from = now
        self.ping_outstanding = False

    def not_listening(self, now: float) -> None:
        """The server is not reading from the peer (its input is held, or it does
        not read): a PING's ACK could not be heard, so none is sent or awaited."""
        self.heartbeat(now)

    def check(self, now: float) -> tuple[Liveness, float]:
        """What to do at `now`, and in how many seconds to check again."""
        policy = self.policy
        if self._heard_when_pinged is not None:
            if self._heard == self._heard_when_pinged:
                gone_at = self._ping_due_from + policy.timeout  # (the PING's time)
                if now >= gone_at:
                    return Liveness.GONE, 0.0
                return Liveness.WAIT, gone_at - now
            self._heard_when_pinged = None
        ping_due = self._ping_due_from + policy.interval
        if now < ping_due:
            return Liveness.WAIT, ping_due - now
        self._heard_when_pinged = self._heard
        self._ping_due_from = now
        self.ping_outstanding = True
        self.pings_sent += 1
        # Back when the answer must have come, or sooner when the next PING would be
        # due first (an interval shorter than the timeout).
        return Liveness.PING, min(policy.timeout, policy.interval)
