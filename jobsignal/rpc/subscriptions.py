"""Who is subscribed: a read-only, paged view of the live subscription streams.

The operator's view behind the metrics port's `/debug/subscriptions` and
its page (`/`), and `jobsignal clients` (docs/architecture.md section 7,
"Who is subscribed"). Nothing is kept for it beyond a few fields each stream
updates anyway: a page is read, when asked, from the sessions
(`rpc.session.Session`: role, RPC, when it opened, what it sent), their
queues (`fanout.subscriber.Subscriber`: what waits) and their connections
(`rpc.activity.ConnectionActivity`: the peer). A page holds at most
`MAX_LIMIT` rows and is built alone: never the whole set at once.

Pages follow the order in which the streams opened. A page's `continue`
token names its last stream, and the next page starts after it, whatever
opened or ended meanwhile: a stream live for the whole walk is listed
exactly once, one that opened during it at most once, one that ended is
gone. The token is the stream's serial number; clients treat it as opaque.

Client ids are capabilities (a Subscribe with someone's id replaces their
stream), so a row carries only `short_id`: the first 8 hex digits of the
id's SHA-256. Ids are random UUIDs the server issued, so the digits give
nothing away, and an operator can still match a full id from a client's log.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

from jobsignal.rpc.session import Session, Sessions
from jobsignal.store.model import JobKey

# Rows per page: by default, and at most (a larger `limit` is cut to this). A
# row is under 700 bytes of JSON (roles, peers and job keys have length bounds).
DEFAULT_LIMIT = 100
MAX_LIMIT = 500
SHORT_ID_DIGITS = 8
# A continue token: a serial number, so decimal digits (a 64-bit one at most).
MAX_TOKEN_DIGITS = 19


def short_id(client_id: str) -> str:
    """What a listing shows of a client id: 8 hex digits of its SHA-256."""
    digest = hashlib.sha256(client_id.encode("utf-8", "surrogatepass")).hexdigest()
    return digest[:SHORT_ID_DIGITS]


class BadPageRequest(ValueError):
    """A page's query the server cannot answer (HTTP 400, with this text)."""


@dataclass(frozen=True)
class PageRequest:
    """Which page: up to `limit` streams, those opened after the one numbered
    `after` (0: from the first)."""

    limit: int = DEFAULT_LIMIT
    after: int = 0

    @classmethod
    def parse(cls, query: str) -> PageRequest:
        """From a URL's query: `limit=N` (1 or more; above MAX_LIMIT, MAX_LIMIT) and
        `continue=TOKEN` from the previous page. Other parameters are ignored."""
        try:
            fields = dict(reversed(parse_qsl(query, max_num_fields=16)))  # the first of each
        except ValueError:
            raise BadPageRequest("too many query parameters") from None
        limit, token = fields.get("limit", ""), fields.get("continue", "")
        if limit and not (limit.isascii() and limit.isdigit() and len(limit) <= 6 and int(limit)):
            raise BadPageRequest(f"limit must be a whole number from 1 (got {limit[:20]!r})")
        if token and not (token.isascii() and token.isdigit() and len(token) <= MAX_TOKEN_DIGITS):
            raise BadPageRequest("continue must be a token from a previous page")
        return cls(min(int(limit), MAX_LIMIT) if limit else DEFAULT_LIMIT, int(token or 0))

    def query(self, after: int | None = None) -> str:
        """This request as a URL query, or the one for the page after `after`."""
        after = self.after if after is None else after
        return f"limit={self.limit}" + (f"&continue={after}" if after else "")


@dataclass(frozen=True, slots=True)
class SubscriptionRow:
    """One live subscription stream, as the operator sees it."""

    id: str  # short_id of its client id
    role: str
    rpc: str  # the full method name's last part, e.g. SubscribeJobSummarySignal
    peer: str  # "address:port" of its connection
    connected_at: float  # Unix seconds
    connected_seconds: float
    messages_sent: int
    messages_queued: int
    bytes_queued: int
    # The job of the last message sent: None for a List snapshot batch (several
    # jobs) or when nothing was sent yet (then `last_message_seconds` is None too).
    last_job: JobKey | None
    last_message_seconds: float | None

    def as_json(self) -> dict[str, Any]:
        last: dict[str, Any] | None = None
        if self.last_message_seconds is not None:
            job = self.last_job
            last = {
                "namespace": None if job is None else job.namespace,
                "jobId": None if job is None else job.job_id,
                "ageSeconds": round(self.last_message_seconds, 3),
            }
        return {
            "id": self.id,
            "role": self.role,
            "rpc": self.rpc,
            "peer": self.peer,
            "connectedAt": rfc3339(self.connected_at),
            "connectedSeconds": round(self.connected_seconds, 3),
            "messagesSent": self.messages_sent,
            "messagesQueued": self.messages_queued,
            "bytesQueued": self.bytes_queued,
            "lastMessage": last,
        }


@dataclass(frozen=True)
class SubscriptionPage:
    """One page of the live subscriptions, oldest first."""

    request: PageRequest
    rows: list[SubscriptionRow]
    total: int  # live subscriptions in all, on every page
    next_after: int | None  # where the next page starts; None: this is the last
    at: float  # Unix seconds when it was read

    @property
    def continue_token(self) -> str | None:
        return None if self.next_after is None else str(self.next_after)

    def as_json(self) -> dict[str, Any]:
        return {
            "kind": "SubscriptionList",
            "time": rfc3339(self.at),
            "total": self.total,
            "limit": self.request.limit,
            "continue": self.continue_token,
            "items": [row.as_json() for row in self.rows],
        }


def rfc3339(unix_seconds: float) -> str:
    """UTC, to the millisecond: 2026-05-01T10:00:00.123Z."""
    whole = int(unix_seconds)
    millis = int((unix_seconds - whole) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"


def _last_job(key: Hashable) -> JobKey | None:
    return key if isinstance(key, JobKey) else None


def _row(session: Session, now: float, wall_now: float) -> SubscriptionRow:
    request, subscriber = session.request, session.subscriber
    connected = now - session.opened_at
    sent_at = session.last_sent_at
    return SubscriptionRow(
        id=short_id(request.client_id),
        role=request.role,
        rpc=request.kind.value,
        peer=request.activity.peer,
        connected_at=wall_now - connected,
        connected_seconds=connected,
        messages_sent=session.messages_sent,
        messages_queued=subscriber.pending,
        bytes_queued=subscriber.pending_bytes,
        last_job=_last_job(session.last_key) if sent_at is not None else None,
        last_message_seconds=None if sent_at is None else now - sent_at,
    )


def subscriptions_page(
    sessions: Sessions, request: PageRequest, *, now: float, wall_now: float
) -> SubscriptionPage:
    """The page `request` asks for, read now (`now` on trio's clock, `wall_now` the
    same moment in Unix seconds). Synchronous: no stream changes while it runs."""
    rows: list[SubscriptionRow] = []
    last = None
    more = False
    for session in sessions.live_after(request.after):
        if len(rows) == request.limit:
            more = True
            break
        rows.append(_row(session, now, wall_now))
        last = session.serial
    return SubscriptionPage(request, rows, len(sessions), last if more else None, wall_now)
