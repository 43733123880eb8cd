"""Server keepalive: when to PING a quiet peer, and when to give it up for gone.

A peer whose host died, or whose network path broke, sends nothing and never
closes its socket; its subscriptions would stay registered until the idle
rule, or forever on a connection that never had a stream. So, as grpc-go's
server keepalive does, a connection from which nothing has been read for
`interval` seconds gets a PING, and if nothing has been read `timeout`
seconds after that (its ACK is input like any other), the connection is
closed (docs/architecture.md section 3, "Server pings for dead peers").
A peer that talks is never pinged: anything it sends proves it is there.

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

    __slots__ = ("_heard", "_heard_at", "_heard_when_pinged", "pings_sent", "policy")

    def __init__(self, policy: KeepalivePolicy, now: float) -> None:
        self.policy = policy
        self._heard_at = now
        # Input counted, not only timed: an ACK read at the very instant of the
        # PING (the same virtual time) is still news.
        self._heard = 0
        self._heard_when_pinged: int | None = None
        self.pings_sent = 0

    def heard(self, now: float) -> None:
        """Input was read from the peer."""
        self._heard_at = now
        self._heard += 1

    def check(self, now: float) -> tuple[Liveness, float]:
        """What to do at `now`, and in how many seconds to check again."""
        if self._heard_when_pinged is not None:
            if self._heard == self._heard_when_pinged:
                return Liveness.GONE, 0.0
            self._heard_when_pinged = None
        quiet_until = self._heard_at + self.policy.interval
        if now < quiet_until:
            return Liveness.WAIT, quiet_until - now
        self._heard_when_pinged = self._heard
        self.pings_sent += 1
        return Liveness.PING, self.policy.timeout
