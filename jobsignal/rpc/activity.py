"""Per-connection activity: client heartbeats (HTTP/2 PINGs) and the ping-flood rule.

A client's PING on a connection counts as a heartbeat for every subscription
on that connection (DESIGN.md section 3). Pings arriving faster than the
allowed interval are strikes; past the allowed strikes the connection is
closed with GOAWAY ENHANCE_YOUR_CALM "too_many_pings", as gRPC servers do.
Strikes are forgiven whenever the server has sent data since the last ping,
because clients legitimately ping more often while data flows (BDP probes).
Time comes from trio's clock, which trio-asyncio also gives the asyncio loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import trio


@dataclass(frozen=True)
class PingPolicy:
    min_interval: float = 4.0
    max_strikes: int = 2


class ConnectionActivity:
    def __init__(self, policy: PingPolicy, peer: str, ip: str = "") -> None:
        self.policy = policy
        self.peer = peer  # "address:port", for logs
        self.ip = ip or peer  # the client address that limits are counted per
        self.heartbeat_listeners: set[Callable[[], None]] = set()
        self.pings_received = 0
        self.strikes = 0
        self._last_ping_at: float | None = None
        self._sent_since_ping = False

    def note_sent(self) -> None:
        """The server wrote messages on this connection."""
        self._sent_since_ping = True

    def ping_received(self) -> bool:
        """Record a client PING; False when the client is flooding."""
        now = trio.current_time()
        self.pings_received += 1
        if self._sent_since_ping:
            self.strikes = 0
        elif self._last_ping_at is not None and now - self._last_ping_at < self.policy.min_interval:
            self.strikes += 1
        self._last_ping_at = now
        self._sent_since_ping = False
        if self.strikes > self.policy.max_strikes:
            return False
        for listener in list(self.heartbeat_listeners):
            listener()
        return True
