"""Limits against abuse and accidents: connection counts and request rates.

Rates are token buckets per client address, refilled on trio's clock (so
they are tested in virtual time). Buckets that are full again are forgotten,
which keeps the table as small as the set of recently busy addresses.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import trio

from jobsignal.config import LayerSettings, from_setting


@dataclass(frozen=True)
class Limits(LayerSettings):
    """Connection counts and per-address request rates: each field is a setting
    (jobsignal/config.py)."""

    max_connections: int = from_setting(lambda c: c.max_connections)
    max_connections_per_ip: int = from_setting(lambda c: c.max_connections_per_ip)
    max_streams_per_connection: int = from_setting(lambda c: c.max_streams_per_connection)
    register_rate: float = from_setting(lambda c: c.register_rate)
    register_burst: int = from_setting(lambda c: c.register_burst)
    subscribe_rate: float = from_setting(lambda c: c.subscribe_rate)
    subscribe_burst: int = from_setting(lambda c: c.subscribe_burst)


class RateLimiter:
    """At most `rate` calls per second per key, with bursts up to `burst`."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = burst
        # key -> (tokens, time of last update)
        self._buckets: dict[str, tuple[float, float]] = {}
        self.refused = 0

    def allow(self, key: str) -> bool:
        now = trio.current_time()
        tokens, last = self._buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            self.refused += 1
            return False
        self._buckets[key] = (tokens - 1.0, now)
        if len(self._buckets) > 1024:
            self._forget_full(now)
        return True

    def _forget_full(self, now: float) -> None:
        for key, (tokens, last) in list(self._buckets.items()):
            if tokens + (now - last) * self.rate >= self.burst:
                del self._buckets[key]

    def __len__(self) -> int:
        return len(self._buckets)


def peer_ip(peername: object) -> str:
    """The client address in a transport's "peername", the key of the per-address limits."""
    return str(peername[0]) if isinstance(peername, tuple) else str(peername)


class ConnectionCounter:
    """Open connections (or `what` it counts) in total and per client address, against
    a limit for each."""

    def __init__(self, max_total: int, max_per_ip: int, what: str = "connections") -> None:
        self.max_total = max_total
        self.max_per_ip = max_per_ip
        self.what = what
        self.total = 0
        self.per_ip: Counter[str] = Counter()
        self.refused = 0

    def refusal(self, ip: str) -> str | None:
        """Why a new connection from `ip` must be refused, or None to accept it."""
        if self.total >= self.max_total:
            return f"too many {self.what} to this server (limit {self.max_total})"
        if self.per_ip[ip] >= self.max_per_ip:
            return f"too many {self.what} from {ip} (limit {self.max_per_ip} per address)"
        return None

    def opened(self, ip: str) -> None:
        self.total += 1
        self.per_ip[ip] += 1

    def closed(self, ip: str) -> None:
        self.total -= 1
        self.per_ip[ip] -= 1
        if self.per_ip[ip] <= 0:
            del self.per_ip[ip]


# Handshakes in progress at once, in total and from one address. A handshake
# waits on the peer, not on the server's CPU, so these bound what silent
# peers hold without slowing honest ones; a client refused here retries.
MAX_TLS_HANDSHAKES = 256
MAX_TLS_HANDSHAKES_PER_IP = 64


def tls_handshake_counter() -> ConnectionCounter:
    """Handshakes in progress on one server (`total`), and connections closed because
    too many were (`refused`)."""
    return ConnectionCounter(
        MAX_TLS_HANDSHAKES, MAX_TLS_HANDSHAKES_PER_IP, what="TLS handshakes in progress"
    )
